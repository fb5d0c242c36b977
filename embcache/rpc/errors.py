"""One table from embcache errors to gRPC status codes, and back.

The server turns a typed error into a status code plus the trailing metadata entry
``embcache-error-type: <class name>``; the client turns that back into the same type, so code
written against the embedded :class:`~embcache.EmbeddingCache` catches the same exceptions.
Statuses that have no library error (the server unreachable, a deadline, authentication) become
the :class:`RemoteError` subclasses below.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from .. import errors as _errors
from ..errors import (
    BatchTooLargeError,
    CacheClosedError,
    CheckpointExistsError,
    ConfigError,
    EmbcacheError,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    MigratingError,
    NonFiniteGradientError,
    PassStateError,
    ReadOnlyError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    TableConflictError,
    UnknownTableError,
    WrongShardError,
)

__all__ = [
    "ERROR_STATUS",
    "ERROR_TYPE_KEY",
    "INCARNATION_KEY",
    "MAP_VERSION_KEY",
    "NOT_APPLIED_KEY",
    "SHARD_MAP_KEY",
    "DataLossError",
    "DeadlineExceededError",
    "PermissionDeniedError",
    "RemoteError",
    "ShardRestartedError",
    "StreamCancelledError",
    "StreamIdleError",
    "TLSMismatchError",
    "UnauthenticatedError",
    "UnavailableError",
    "error_from_name",
    "error_from_rpc",
    "not_applied",
    "status_of",
    "trailer",
]

#: Trailing metadata key naming the embcache error type of a failed call.
ERROR_TYPE_KEY = "embcache-error-type"
#: Trailing metadata key set ("1") when the request was refused before it had any effect.
NOT_APPLIED_KEY = "embcache-not-applied"
#: Metadata key: the shard map version a client routed a request by (request), and the server's
#: map as JSON in a WrongShardError refusal (trailing).
MAP_VERSION_KEY = "embcache-map-version"
SHARD_MAP_KEY = "embcache-shard-map"
#: Trailing metadata key of a failed call: the answering server process's incarnation (hex).
INCARNATION_KEY = "embcache-incarnation"


class RemoteError(EmbcacheError, RuntimeError):
    """A call to an embcache server failed with a status that has no library error type.

    Attributes:
        code: the gRPC status code.
        address: the server (``host:port``) that answered, when known.
    """

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN, address: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.address = address


class UnavailableError(RemoteError):
    """The server could not be reached, or is shutting down (UNAVAILABLE), after the allowed retries.

    For a write (apply_gradients, assign) this means the update may or may not have been
    applied, unless the server said it was refused before it ran (then it was not).
    """


class TLSMismatchError(UnavailableError):
    """The client and a server do not agree on TLS: one speaks plaintext and the other TLS, the
    server's certificate does not verify against the client's CA (or does not name the server),
    or the server wants a client certificate the client did not present. Raised by the
    :class:`~embcache.Client` constructor, whose calls could otherwise only time out."""


class DeadlineExceededError(RemoteError):
    """The call's deadline passed before the server answered (DEADLINE_EXCEEDED)."""


class StreamIdleError(DeadlineExceededError):
    """The server cut a client stream that sent no message for its ``--stream-idle-seconds``.

    Raised in the server (its status and metrics say DEADLINE_EXCEEDED); the client of a cut
    stream sees the call cancelled.
    """


class StreamCancelledError(RemoteError):
    """A client cancelled a request stream (or its deadline passed) before it ended: nothing of it was applied.

    Raised in the server (status CANCELLED), where gRPC reports such a stream's end like a normal one.
    """


class UnauthenticatedError(RemoteError):
    """The server requires a bearer token (or a client certificate) and got none or a wrong one."""


class PermissionDeniedError(RemoteError):
    """The credentials are valid but not allowed this call (e.g. a read-only token writing)."""


class ShardRestartedError(EmbcacheError, RuntimeError):
    """A shard restarted (a new server process on its path) and dropped state this client relied on.

    Raised for a pass or a batch lease that the earlier process held: its pins are gone.

    Attributes:
        address: the shard's address.
        before, after: the incarnations (process ids drawn at start) that held the state and that answer now.
    """

    def __init__(self, message: str, address: str = "", before: int = 0, after: int = 0) -> None:
        super().__init__(message)
        self.address = address
        self.before = before
        self.after = after


class DataLossError(ShardRestartedError):
    """Writes this client had acknowledged from a shard may be lost: the process that acknowledged them
    died before making them durable (kill -9, power loss, OOM) and a new one serves the shard's path.

    Raised by ``Client.flush()`` and ``Client.checkpoint()`` instead of returning: the other shards
    were flushed (or checkpointed) all the same. The receipts it reports are forgotten once raised,
    so a later flush speaks only of writes after it; retrain or restore from a checkpoint.

    Attributes:
        address: the shard's address (the first one, when several lost writes; see ``losses``).
        lost_writes: acknowledged write requests (calls to apply_gradients/assign, per shard) that
            may be lost, over every shard.
        since: unix time at which the oldest of them was acknowledged.
        losses: ``[(address, incarnation, lost_writes, since)]`` per shard and process.
    """

    def __init__(self, message: str, losses: list[tuple[str, int, int, float]]) -> None:
        super().__init__(message, losses[0][0] if losses else "", losses[0][1] if losses else 0)
        self.losses = losses
        self.lost_writes = sum(n for _, _, n, _ in losses)
        self.since = min((t for _, _, _, t in losses), default=0.0)


# The one table: error type -> status code. The most specific type wins (looked up along the MRO).
ERROR_STATUS: dict[type[BaseException], grpc.StatusCode] = {
    UnknownTableError: grpc.StatusCode.NOT_FOUND,
    InvalidKeysError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidRowsError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidGradientError: grpc.StatusCode.INVALID_ARGUMENT,
    NonFiniteGradientError: grpc.StatusCode.INVALID_ARGUMENT,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    BatchTooLargeError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StoreFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TableConflictError: grpc.StatusCode.ALREADY_EXISTS,
    CheckpointExistsError: grpc.StatusCode.ALREADY_EXISTS,
    PassStateError: grpc.StatusCode.FAILED_PRECONDITION,
    CacheClosedError: grpc.StatusCode.UNAVAILABLE,
    MigratingError: grpc.StatusCode.UNAVAILABLE,
    WrongShardError: grpc.StatusCode.FAILED_PRECONDITION,
    ReadOnlyError: grpc.StatusCode.FAILED_PRECONDITION,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,  # (StreamIdleError, raised in the server)
    StreamCancelledError: grpc.StatusCode.CANCELLED,  # (raised in the server)
    StoreLockedError: grpc.StatusCode.FAILED_PRECONDITION,
    StoreError: grpc.StatusCode.INTERNAL,
    EmbcacheError: grpc.StatusCode.INTERNAL,
}

# Status codes without an embcache type name (e.g. from gRPC itself) -> the client's error type.
_BY_CODE: dict[grpc.StatusCode, type[EmbcacheError]] = {
    grpc.StatusCode.NOT_FOUND: UnknownTableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BatchTooLargeError,  # over the server's message size limit
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}

_REMOTE_TYPES: dict[str, type[EmbcacheError]] = {
    t.__name__: t for t in (RemoteError, UnavailableError, DeadlineExceededError, UnauthenticatedError,
                            PermissionDeniedError, TLSMismatchError, StreamIdleError, StreamCancelledError)
}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and error type name of ``exc`` (INTERNAL and its class name when unmapped)."""
    for cls in type(exc).__mro__:
        code = ERROR_STATUS.get(cls)
        if code is not None:
            return code, type(exc).__name__
    return grpc.StatusCode.INTERNAL, type(exc).__name__


def _error_type(name: str) -> type[EmbcacheError] | None:
    cls = getattr(_errors, name, None) if name in _errors.__all__ else _REMOTE_TYPES.get(name)
    return cls if isinstance(cls, type) and issubclass(cls, EmbcacheError) else None


def _metadata(pairs: Iterable[Any] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in pairs or ():
        key, value = item[0], item[1]
        out[str(key)] = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return out


def error_from_rpc(err: grpc.RpcError, address: str = "") -> EmbcacheError:
    """The embcache error a failed call stands for: the type the server named, else one chosen by status code."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    meta = _metadata(err.trailing_metadata() if hasattr(err, "trailing_metadata") else None)
    cls = _error_type(meta.get(ERROR_TYPE_KEY, "")) or _BY_CODE.get(code, RemoteError)
    where = f" (server {address})" if address else ""
    if issubclass(cls, RemoteError):
        return cls(f"{code.name}: {details}{where}", code, address)
    exc = cls(details)
    exc.address = address  # type: ignore[attr-defined]  # which shard refused, for the curious
    exc.incarnation = _incarnation(meta)  # type: ignore[attr-defined]  # which of its processes
    exc.shard_map = meta.get(SHARD_MAP_KEY, "")  # type: ignore[attr-defined]  # a WrongShardError's map
    return exc


def _incarnation(meta: dict[str, str]) -> int:
    try:
        return int(meta.get(INCARNATION_KEY, "0"), 16)
    except ValueError:
        return 0


def error_from_name(name: str, message: str, address: str = "") -> EmbcacheError:
    """The embcache error a server reported by type name and message outside a status (e.g. a lease's staging).

    An unknown name becomes a :class:`RemoteError` whose message keeps the name.
    """
    cls = _error_type(name)
    where = f" (server {address})" if address else ""
    if cls is None:
        return RemoteError(f"{name or 'error'}: {message}{where}", grpc.StatusCode.UNKNOWN, address)
    if issubclass(cls, RemoteError):
        return cls(f"{message}{where}", grpc.StatusCode.UNKNOWN, address)
    exc = cls(message)
    exc.address = address  # type: ignore[attr-defined]
    return exc


def trailer(err: grpc.RpcError, key: str) -> str:
    """The value of trailing metadata ``key`` of a failed call ("" when absent)."""
    return _metadata(err.trailing_metadata() if hasattr(err, "trailing_metadata") else None).get(key, "")


def not_applied(err: grpc.RpcError) -> bool:
    """True when the server marked the failed call as refused before it had any effect (safe to resend)."""
    return trailer(err, NOT_APPLIED_KEY) == "1"
