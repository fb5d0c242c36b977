"""Who may call what: the table of token roles (:data:`ROLES`) and the bearer-token check.

With ``--auth-token-file`` (or EMBCACHE_AUTH_TOKEN) every call of the cache service needs
``authorization: Bearer <token>`` (missing or wrong: UNAUTHENTICATED); tokens from
``--auth-readonly-token-file`` may only call the methods of role "read" (others:
PERMISSION_DENIED). Health and reflection stay open for probes. A refused call's latency is
recorded with its status code, like any other call's.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from ..errors import ConfigError
from ..rpc.v1 import embcache_pb2 as pb
from .handlers import SERVICE_NAME, method_handler

if TYPE_CHECKING:
    from .rpcmetrics import RpcMetrics

__all__ = ["READ_METHODS", "ROLES", "WRITE_METHODS", "TokenAuth", "read_tokens", "roles_text"]

_METHOD_PREFIX = f"/{SERVICE_NAME}/"

#: The one table of token roles: every method of the service -> the role a bearer token needs to
#: call it. "read": any token, read-only ones too (the call changes no row, table, pass, pin or
#: file); "write": read-write tokens only. The server's token check, ``embcache-server --help``,
#: the table in docs/operations/server.md (between its ``roles`` markers) and the tests all come from this table.
#: ResidentKeys is a read: it lists keys and changes nothing. The resharding calls (GetShardMap
#: ... CommitShardMap) are writes: only the operator's reshard makes them. ExportDelta and CommitExport
#: are writes: they write dirty rows back and drop change marks.
ROLES: dict[str, str] = {
    "ListTables": "read", "Lookup": "read", "Stats": "read", "ResidentKeys": "read",
    "CreateTable": "write", "ApplyGradients": "write", "ApplyGradientsStream": "write", "Assign": "write",
    "AssignStream": "write", "Delete": "write", "Prefetch": "write", "PrefetchStream": "write", "BeginPass": "write",
    "BeginPassStream": "write", "EndPass": "write", "PrefetchBatch": "write", "PrefetchBatchStream": "write",
    "RenewLeases": "write", "ReleaseLeases": "write", "Flush": "write", "Checkpoint": "write",
    "GetShardMap": "write", "SetShardMap": "write", "ExportRows": "write", "ImportRows": "write",
    "CommitShardMap": "write", "ExportDelta": "write", "CommitExport": "write",
}
_SERVICE_METHODS = {m.name for m in pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].methods}
if set(ROLES) != _SERVICE_METHODS or set(ROLES.values()) != {"read", "write"}:  # a new method needs its role
    raise ImportError(f"ROLES must give every method 'read' or 'write': {sorted(set(ROLES) ^ _SERVICE_METHODS)}")
#: Methods that change rows, tables, passes, pins or files (role "write").
WRITE_METHODS = frozenset(m for m, role in ROLES.items() if role == "write")
#: Methods a read-only token may call (role "read").
READ_METHODS = frozenset(m for m, role in ROLES.items() if role == "read")


def roles_text(markdown: bool = False) -> str:
    """The token roles of :data:`ROLES` in words: for ``--help``, or as a Markdown table (docs/operations/server.md)."""
    rows = [("read", "any token (read-only ones too)", sorted(READ_METHODS)),
            ("write", "read-write tokens only", sorted(WRITE_METHODS))]
    if markdown:
        return "\n".join(["| role | who may call | methods |", "| --- | --- | --- |",
                          *(f"| {role} | {who} | {', '.join(methods)} |" for role, who, methods in rows)])
    lines = ["Token roles (which bearer token may call which method; embcache.server.auth.ROLES):"]
    for role, who, methods in rows:
        lines.append(f"  {role} - {who}:")
        text, width = "", 96
        for m in methods:
            if text and len(text) + len(m) + 2 > width:
                lines.append(f"    {text},")
                text = ""
            text = f"{text}, {m}" if text else m
        lines.append(f"    {text}")
    return "\n".join(lines)


def read_tokens(paths: Sequence[str]) -> set[str]:
    """The tokens in these files (one per line; blank lines skipped).

    Raises:
        ConfigError: a file could not be read, or holds no token: a token file is asked for to
            turn authentication on, and an empty one (say, a Secret mounted before it was
            filled) must not start a server open to anyone.
    """
    tokens: set[str] = set()
    for path in paths:
        try:
            with open(path) as f:
                found = {line.strip() for line in f if line.strip()}
        except OSError as exc:
            raise ConfigError(f"cannot read token file {path!r}: {exc}") from None
        if not found:
            raise ConfigError(f"token file {path!r} holds no token; authentication would be off. Put one token "
                              "per line in it, or drop the flag to run without authentication")
        tokens |= found
    return tokens


def _matches(token: str, tokens: set[str]) -> bool:
    found = False
    for t in tokens:  # compare with every token, in constant time each
        found |= hmac.compare_digest(token.encode(), t.encode())
    return found


class TokenAuth(grpc.ServerInterceptor):
    """Checks ``authorization: Bearer <token>`` on cache calls; health and reflection stay open."""

    def __init__(self, rw: set[str], ro: set[str], metrics: RpcMetrics) -> None:
        self._rw, self._ro, self._metrics = rw, ro, metrics

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """The call's handler when its token may call the method, else one that refuses the call."""
        t0 = time.perf_counter()  # a refused call's latency counts from here: the token check is its work
        method = details.method
        if not method.startswith(_METHOD_PREFIX):
            return continuation(details)
        name = method[len(_METHOD_PREFIX):]
        header = dict(details.invocation_metadata or ()).get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if token and _matches(token, self._rw):
            return continuation(details)
        if token and _matches(token, self._ro):
            if ROLES.get(name) != "write":  # (a name not in the service: gRPC answers UNIMPLEMENTED)
                return continuation(details)
            return self._refuse(continuation(details), name, grpc.StatusCode.PERMISSION_DENIED,
                                f"{name} needs a read-write token; this token may only call "
                                f"{', '.join(sorted(READ_METHODS))}",
                                t0)
        why = "a wrong bearer token" if token else "no bearer token (metadata 'authorization: Bearer <token>')"
        return self._refuse(continuation(details), name, grpc.StatusCode.UNAUTHENTICATED,
                            f"{name} refused: {why}", t0)

    def _refuse(self, handler: grpc.RpcMethodHandler | None, name: str, code: grpc.StatusCode, message: str,
                t0: float) -> grpc.RpcMethodHandler | None:
        """A handler that counts the call, records the time since ``t0`` (its arrival) and aborts with ``code``."""
        def abort(request: Any, context: grpc.ServicerContext) -> Any:
            self._metrics.started(name)
            self._metrics.handled(name, code.name, time.perf_counter() - t0)
            context.abort(code, message)

        if handler is None:
            return None
        return method_handler(handler.request_streaming, handler.response_streaming, abort,
                              request_deserializer=handler.request_deserializer,
                              response_serializer=handler.response_serializer)
