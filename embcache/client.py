"""embcache.Client: the methods of EmbeddingCache, served by one embcache-server or a fleet of shards.

    from embcache import Client
    with Client(["10.0.0.1:50051", "10.0.0.2:50051"], timeout=30) as cache:
        rows = cache.lookup("user", keys)               # float32 [n, dim] on the CPU
        cache.apply_gradients("user", keys, grads)

Keys are spread over the shards by a consistent hash (a 64-bit mix of the key placed on a ring
of virtual nodes per shard: adding a shard moves about 1/N of the keys). A call sends one
request per shard carrying every table (``lookup_many`` and ``apply_gradients_many`` cost one
round trip per step), all shards in parallel. Batches beyond the message size limit are split:
lookups into several requests; writes, and the keysets of ``prefetch``, ``begin_pass`` and
``prefetch_batch``, into a client stream that the server merges and serves as one request (atomic
per table and shard).

Batch leases (``prefetch_batch``, and so :class:`~embcache.LookAhead` over a client): each shard
holds its part of a lease by id with a time-to-live (``lease_ttl``, default 30 s), which one
background thread of this client renews (one call per shard for all leases, every third of the
TTL, or a bounded wait while staging runs). ``release()`` and ``cancel()`` unpin at once; if this
process dies, the servers unpin the rows when the TTL runs out (see ``embcache.server.leases`` for
why a TTL rather than a call held per lease).

Deadlines: every call has one (``timeout``, or ``long_timeout`` for passes, flush and
checkpoint); by default a call waits for a shard that is down or restarting until its deadline
(``wait_for_ready``), which never sends a request twice. Retries: a call that fails with
UNAVAILABLE (or CANCELLED by a server stopping as it arrived) is retried with exponential backoff,
within its deadline, only when it is idempotent: ``lookup`` (idempotent for the values it returns,
though the retried attempt counts its accesses again in the server's statistics and placement),
``tables``, ``create_table``, ``flush``, ``stats``, ``resident_keys``, and the release and renewal
of leases. Writes (``apply_gradients``, ``assign``), checkpoints, pass calls (``prefetch``,
``begin_pass``, ``end_pass``) and ``prefetch_batch`` are never resent, unless the server said it
refused them before they had any effect (UNAVAILABLE with ``embcache-not-applied: 1``: a server
draining at shutdown); then they are resent like the idempotent calls. Only the failed shards'
calls are resent; each resend is logged (logger ``embcache.client``, INFO).

Restarts: every write reply carries a receipt (the server process's random incarnation and the
write's number there); :meth:`Client.flush` and :meth:`Client.checkpoint` settle the receipts
held since the last flush and raise :class:`DataLossError` when a shard's restart lost writes it
had acknowledged (:mod:`embcache.receipts`); a pass or staging lease dropped by a restart raises
:class:`ShardRestartedError`.

Shards from DNS (``"dns:///name:port"``) are resolved when the client is made; ``expected_shards``
makes it wait until the name gives that many, and :meth:`Client.refresh_shards` resolves again.

Errors: the server's typed errors come back as the same :mod:`embcache.errors` types; failures
without one are :class:`~embcache.rpc.errors.RemoteError` subclasses (UnavailableError,
DeadlineExceededError, UnauthenticatedError, PermissionDeniedError). Input that is wrong
whatever the server (key dtype, gradient shape, NaN) is refused here before anything is sent,
so a multi-shard write never half-applies bad input; a shard failing for another reason (down,
disk full) can leave the other shards' part applied.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from .config import TableConfig
from .errors import (
    CacheClosedError,
    ConfigError,
    EmbcacheError,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    NonFiniteGradientError,
    PassStateError,
    UnknownTableError,
    WrongShardError,
)
from .keys import as_key_tensor
from .keyset import Keyset, as_keysets
from .optim import state_width
from .prefetch import PrefetchFuture
from .receipts import Receipts, loss_error
from .reshard import ReshardReport
from .reshard import reshard as _reshard
from .ring import HashRing, ShardMap
from .rpc import codec, wire
from .rpc.errors import (
    ERROR_TYPE_KEY,
    MAP_VERSION_KEY,
    SHARD_MAP_KEY,
    DataLossError,
    DeadlineExceededError,
    PermissionDeniedError,
    RemoteError,
    ShardRestartedError,
    TLSMismatchError,
    UnauthenticatedError,
    UnavailableError,
    error_from_name,
    error_from_rpc,
    not_applied,
    trailer,
)
from .rpc.v1 import embcache_pb2 as pb
from .rpc.v1 import embcache_pb2_grpc as pb_grpc
from .tier import resident_row_bytes
from .types import memory_tier

__all__ = [
    "Client",
    "DataLossError",
    "DeadlineExceededError",
    "HashRing",
    "PermissionDeniedError",
    "RemoteError",
    "RemoteFuture",
    "RemoteLease",
    "ShardRestartedError",
    "TLSMismatchError",
    "UnauthenticatedError",
    "UnavailableError",
]

log = logging.getLogger("embcache.client")
R = TypeVar("R")
_MAX_REROUTES = 8  # a call routed again after this many map changes in a row gives up (WrongShardError)


class _Done:
    """A finished call in the shape of a grpc future: ``result()`` returns the reply or raises its error."""

    def __init__(self, outcome: Any) -> None:
        self._outcome = outcome

    def result(self) -> Any:
        if isinstance(self._outcome, grpc.RpcError):
            raise self._outcome
        return self._outcome


class RemoteFuture(Future):  # type: ignore[type-arg]
    """A background job on the servers (prefetch staging, end-of-pass write-back); ``cancel()`` stops it."""

    def __init__(self) -> None:
        super().__init__()
        self._calls: list[Any] = []

    def cancel(self) -> bool:
        """Cancel the calls (the servers stop staging and release its rows); True unless already finished."""
        for call in self._calls:
            call.cancel()
        return super().cancel()


@dataclass
class _Shard:
    name: str
    address: str
    channel: grpc.Channel
    stub: pb_grpc.EmbeddingCacheServiceStub
    raw: dict[str, Any]  # the hot calls with bytes in and out (encoded by embcache.rpc.wire)


def _identity(data: bytes) -> bytes:
    return data


_SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].full_name


def _raw_calls(channel: grpc.Channel) -> dict[str, Any]:
    """Lookup (bytes both ways), ApplyGradients and Assign (bytes out): no copies through generated classes."""
    return {
        "Lookup": channel.unary_unary(f"/{_SERVICE}/Lookup", request_serializer=_identity,
                                      response_deserializer=_identity),
        "ApplyGradients": channel.unary_unary(f"/{_SERVICE}/ApplyGradients", request_serializer=_identity,
                                              response_deserializer=pb.ApplyGradientsResponse.FromString),
        "Assign": channel.unary_unary(f"/{_SERVICE}/Assign", request_serializer=_identity,
                                      response_deserializer=pb.AssignResponse.FromString),
    }


@dataclass(frozen=True)
class _Topology:
    """The shards and the ring that maps keys onto them, from one shard map; replaced as a whole when it changes."""

    shards: list[_Shard]
    ring: HashRing
    map: ShardMap  # version 0: the client's own list (a fleet never resharded)


@dataclass
class _Part:
    """One table's slice in one request: keys[start:end] of the shard's positions."""

    table: str
    positions: np.ndarray | None  # positions in the caller's batch; None: the whole batch, in order
    keys: np.ndarray
    values: np.ndarray | None


_KEYSET_ROW_BYTES = 16  # a keyset key on the wire: the key and its count (int64 each)


def _absolute(part: _Part, subset: np.ndarray | None) -> _Part:
    """``part`` of a sub-batch (the caller's positions ``subset``) with positions in the caller's batch."""
    if subset is None:
        return part
    return _Part(part.table, subset if part.positions is None else subset[part.positions], part.keys, part.values)


def _take(keys_values: tuple[np.ndarray, np.ndarray | None],
          positions: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Keys (and values) at ``positions`` (None: all)."""
    keys, values = keys_values
    if positions is None:
        return keys, values
    return keys[positions], None if values is None else values[positions]


def _table_keyset(part: _Part) -> pb.TableKeyset:
    assert part.values is not None
    return pb.TableKeyset(table=part.table, keys=codec.encode_tensor(part.keys),
                          counts=codec.encode_tensor(part.values))


def _combine_prefetch(finals: Sequence[Any], tables: Sequence[str] = ()) -> dict[str, dict[str, float]]:
    """Staging results of several shards, summed (seconds: the longest; shards stage in parallel)."""
    out: dict[str, dict[str, float]] = {t: {"staged_rows": 0, "leased_rows": 0, "seconds": 0.0} for t in tables}
    for final in finals:
        for r in final.tables:
            acc = out.setdefault(r.table, {"staged_rows": 0, "leased_rows": 0, "seconds": 0.0})
            acc["staged_rows"] += r.staged_rows
            acc["leased_rows"] += r.leased_rows
            acc["seconds"] = max(acc["seconds"], r.seconds)
    return out


_TLS_CHECK_SECONDS = 1.0  # a shard's channel not ready this long after the client is made: TLS is checked
_LeaseState = pb.LeaseStatus.State
_LEASE_WAIT_SECONDS = 2.0  # the longest a renewal waits on a server for staging to end
_LEASE_RETRY_SECONDS = 0.5  # after a failed renewal


@dataclass
class _LeasePart:
    """A lease on one shard; ``status`` is its final state (not STAGING) once a reply reported it."""

    shard: _Shard
    lease_id: str
    ttl: float
    incarnation: int = 0  # the server process that granted it
    status: pb.LeaseStatus | None = None  # the first final state reported; never changed after
    restarted_to: int = 0  # a renewal was answered by another process (the server restarted): its incarnation
    gone: bool = False  # the server reported it unknown or cancelled: nothing left to renew or release
    failing_since: float | None = None  # renewals of it have failed since then

    @property
    def held(self) -> bool:
        """The server may still hold this lease's pins."""
        return not self.gone


class RemoteLease(PrefetchFuture):
    """A batch lease held on the shards (:meth:`Client.prefetch_batch`); a :class:`~embcache.prefetch.PrefetchFuture`.

    ``result()`` gives ``{table: {"staged_rows", "leased_rows", "seconds"}}`` summed over shards
    once every shard has staged its keys; a shard's staging error is raised there with its
    :mod:`embcache.errors` type. A lease a server no longer knows (it expired there: no renewal
    reached it within its TTL; or the server restarted) ends the future with
    :class:`UnavailableError`: its rows may not have stayed pinned.

    ``release()`` unpins the rows on every shard (done when it returns) and keeps the result
    coming; ``cancel()`` also stops the staging. Neither raises: a shard that cannot be reached
    unpins the rows by itself when the lease's TTL runs out.
    """

    def __init__(self, keeper: _LeaseKeeper, parts: list[_LeasePart], tables: list[str]) -> None:
        super().__init__(lambda _: None)
        self._keeper = keeper
        self._parts = parts
        self._tables = tables
        self._released = False  # changed under the keeper's lock

    @property
    def servers(self) -> list[str]:
        """Addresses of the shards holding a part of this lease."""
        return [p.shard.address for p in self._parts]

    def release(self) -> None:
        """Unpin this lease's rows on every shard (idempotent); the result still arrives."""
        self._stop.set()
        self._keeper.release(self, cancel=False)

    def cancel(self) -> bool:
        """Stop the staging on every shard and unpin its rows; True unless the future had already finished."""
        self._stop.set()
        stopped = Future.cancel(self)
        self._keeper.release(self, cancel=True)
        return stopped

    def _outcome(self) -> tuple[bool, Any, BaseException | None]:
        """``(ended, result, error)`` from the parts' reported states (called with the keeper's lock)."""
        statuses = [p.status for p in self._parts]
        if any(st is None for st in statuses):
            return False, None, None
        by_state: dict[int, tuple[_LeasePart, pb.LeaseStatus]] = {}
        for p, st in zip(self._parts, statuses, strict=True):
            assert st is not None
            by_state.setdefault(st.state, (p, st))
        error: BaseException | None = None
        if _LeaseState.FAILED in by_state:  # the staging error says most
            p, st = by_state[_LeaseState.FAILED]
            error = error_from_name(st.error_type, st.error_message, p.shard.address)
        elif _LeaseState.UNKNOWN in by_state and by_state[_LeaseState.UNKNOWN][0].restarted_to:
            p, _ = by_state[_LeaseState.UNKNOWN]
            error = ShardRestartedError(f"batch lease {p.lease_id} was dropped by a restart of server "
                                        f"{p.shard.address} (process {p.incarnation:016x} -> "
                                        f"{p.restarted_to:016x}); its rows did not stay pinned",
                                        p.shard.address, p.incarnation, p.restarted_to)
        elif _LeaseState.UNKNOWN in by_state:
            p, _ = by_state[_LeaseState.UNKNOWN]
            error = UnavailableError(f"batch lease {p.lease_id} is gone from server {p.shard.address} (no renewal "
                                     f"reached it within its {p.ttl:g} s TTL, or the server restarted); its rows "
                                     f"may not have stayed pinned", grpc.StatusCode.UNAVAILABLE, p.shard.address)
        elif _LeaseState.CANCELLED in by_state:
            error = CancelledError()
        return True, _combine_prefetch(statuses, self._tables), error

    def _end(self, result: Any, error: BaseException | None) -> None:
        if isinstance(error, CancelledError):  # cancelled by a server stopping, as a closing cache cancels
            Future.cancel(self)
        else:
            self._finish(result, error)


class _LeaseKeeper:
    """Renews a client's batch leases and learns how their staging ended, from one background thread.

    Each round sends one ``RenewLeases`` per shard that holds leases of this client: at once for
    a shard where some lease is staging (the server answers once one ends, or after at most 2 s),
    else every third of the shortest TTL there. The thread runs only while leases are live.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._leases: list[RemoteLease] = []
        self._releasing: list[RemoteLease] = []  # leases whose release is being sent
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, lease: RemoteLease) -> None:
        """Keep ``lease`` renewed until it has ended and been released.

        Raises:
            CacheClosedError: the client was closed (the lease is cancelled).
        """
        if not lease._parts:  # no shard owns a key of it: nothing is held
            lease._end(_combine_prefetch([], lease._tables), None)
            return
        with self._cond:
            closed = self._closed
            if not closed:
                self._leases.append(lease)
        if closed:
            lease.cancel()
            raise CacheClosedError("the client is closed; create a new Client to continue")
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="embcache-client-leases", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _due(self, next_renew: dict[str, float], retry_at: dict[str, float]
             ) -> tuple[dict[str, tuple[_Shard, list[_LeasePart], bool]], float]:
        """Per shard due now: its parts to renew and whether one is staging; and the time until the next is due.

        A shard is due when its renewal is (``next_renew``), or at once while a lease there is
        staging, unless its last call failed (then from ``retry_at``).
        """
        now = time.monotonic()
        per: dict[str, tuple[_Shard, list[_LeasePart], bool]] = {}
        for lease in self._leases:
            for part in lease._parts:
                # pinned parts are renewed; released ones only until their outcome is known
                if part.status is None or (not lease._released and part.held):
                    shard, parts, staging = per.get(part.shard.name, (part.shard, [], False))
                    parts.append(part)
                    per[part.shard.name] = (shard, parts, staging or part.status is None)
        when = {name: min(next_renew.get(name, 0.0), retry_at.get(name, 0.0)) if staging
                else next_renew.get(name, 0.0) for name, (_, _, staging) in per.items()}
        due = {name: entry for name, entry in per.items() if when[name] <= now}
        return due, min((when[name] - now for name in per if name not in due), default=60.0)

    def _run(self) -> None:
        next_renew: dict[str, float] = {}
        retry_at: dict[str, float] = {}
        while True:
            with self._cond:
                self._leases = [le for le in self._leases if not (le.done() and (le._released or le.cancelled()))]
                if self._closed or not self._leases:
                    self._thread = None
                    return
                due, later = self._due(next_renew, retry_at)
                if not due:
                    self._cond.wait(max(later, 0.01))
                    continue
            self._renew(due, next_renew, retry_at)

    def _renew(self, due: dict[str, tuple[_Shard, list[_LeasePart], bool]], next_renew: dict[str, float],
               retry_at: dict[str, float]) -> None:
        client = self._client
        calls = []
        for name, (shard, parts, staging) in due.items():
            ttl = min(p.ttl for p in parts)
            wait = min(ttl / 4, _LEASE_WAIT_SECONDS) if staging else 0.0
            req = pb.RenewLeasesRequest(lease_ids=[p.lease_id for p in parts], wait_seconds=wait)
            call = shard.stub.RenewLeases.future(req, timeout=wait + max(ttl / 3, 1.0), metadata=client._metadata,
                                                 wait_for_ready=False)
            calls.append((name, shard, parts, ttl, call))
        for name, shard, parts, ttl, call in calls:
            try:
                reply = call.result()
            except grpc.RpcError as err:
                now = time.monotonic()
                next_renew[name] = retry_at[name] = now + _LEASE_RETRY_SECONDS
                # past its TTL without a renewal the server has dropped it: stop asking
                gone = []
                first = any(p.failing_since is None for p in parts)
                for p in parts:
                    p.failing_since = p.failing_since if p.failing_since is not None else now
                    if now - p.failing_since > p.ttl:
                        gone.append(p)
                log.log(logging.INFO if first or gone else logging.DEBUG,  # once per outage, not every 0.5 s
                        "renewing %d batch lease(s) on %s failed (%s: %s)%s", len(parts), shard.address,
                        err.code().name, err.details(), f"; {len(gone)} given up" if gone else "; trying again")
                if gone:
                    self._apply(gone, [pb.LeaseStatus(lease_id=p.lease_id, state=_LeaseState.UNKNOWN) for p in gone])
                continue
            for p in parts:
                p.failing_since = None
                if reply.incarnation and p.incarnation and reply.incarnation != p.incarnation:
                    p.restarted_to = reply.incarnation
            retry_at.pop(name, None)
            next_renew[name] = time.monotonic() + ttl / 3
            self._apply(parts, list(reply.leases))

    def _apply(self, parts: list[_LeasePart], statuses: list[pb.LeaseStatus]) -> None:
        """Record the final states the servers reported, and end the leases whose every part has one."""
        ended = []
        with self._cond:
            for part, st in zip(parts, statuses, strict=False):
                if st.lease_id != part.lease_id or st.state == _LeaseState.STAGING:
                    continue
                if part.status is None:
                    part.status = st
                if st.state in (_LeaseState.UNKNOWN, _LeaseState.CANCELLED):
                    part.gone = True
            owners = {id(le): le for le in self._leases}
            owners.update({id(le): le for le in self._releasing})
            for lease in owners.values():
                if not lease.done():
                    done, result, error = lease._outcome()
                    if done:
                        ended.append((lease, result, error))
            self._cond.notify_all()
        for lease, result, error in ended:  # outside the lock: callbacks may call back into the client
            lease._end(result, error)
        if ended:
            with self._cond:
                self._cond.notify_all()  # the thread forgets the released ones now

    def release(self, lease: RemoteLease, cancel: bool) -> None:
        """Send ReleaseLeases for ``lease`` to its shards; never raises (a failure is logged)."""
        with self._cond:
            if lease._released and not cancel:
                return
            lease._released = True
            parts = [p for p in lease._parts if p.held]
            self._releasing.append(lease)
        try:
            by_shard: dict[str, tuple[_Shard, list[_LeasePart]]] = {}
            for p in parts:
                by_shard.setdefault(p.shard.name, (p.shard, []))[1].append(p)
            calls = [(shard, "ReleaseLeases",
                      pb.ReleaseLeasesRequest(lease_ids=[p.lease_id for p in ps], cancel=cancel))
                     for shard, ps in by_shard.values()]
            try:
                outcomes = self._client._fanout_outcomes(calls, idempotent=True) if calls else []
            except EmbcacheError as exc:  # the client is closed
                outcomes = [exc] * len(calls)
            for (shard, ps), outcome in zip(by_shard.values(), outcomes, strict=True):
                if isinstance(outcome, pb.ReleaseLeasesResponse):
                    self._apply(ps, list(outcome.leases))
                    continue
                why = error_from_rpc(outcome, shard.address) if isinstance(outcome, grpc.RpcError) else outcome
                log.warning("releasing batch lease(s) %s on %s failed: %s; the server unpins their rows when "
                            "their TTL (%g s) runs out", [p.lease_id for p in ps], shard.address, why,
                            min(p.ttl for p in ps))
            self._apply([], [])  # a lease with no part left to hear from ends now
        finally:
            with self._cond:
                self._releasing.remove(lease)
                self._cond.notify_all()

    def close(self) -> None:
        """Cancel every live lease on its shards (best effort) and stop the thread; later leases are refused."""
        with self._cond:
            self._closed = True
            live = [le for le in self._leases if not le._released or not le.done()]
            self._cond.notify_all()
        for lease in live:
            lease.cancel()


def _migrating(err: grpc.RpcError) -> bool:
    """The server refused a write to rows a reshard is moving (not applied: resend after the migration)."""
    return trailer(err, ERROR_TYPE_KEY) == "MigratingError"


def _wrong_shard(outcome: Any) -> str:
    """The server's shard map (JSON) when ``outcome`` is a WrongShardError refusal ("{}" if it sent none), else ""."""
    if not isinstance(outcome, grpc.RpcError) or trailer(outcome, ERROR_TYPE_KEY) != "WrongShardError":
        return ""
    return trailer(outcome, SHARD_MAP_KEY) or "{}"


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` or ``[v6]:port`` address; None for other target forms."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    return host.strip("[]"), int(port)


def _handshake(address: tuple[str, int], context: ssl.SSLContext, server_name: str | None,
               timeout: float) -> tuple[str, str]:
    """A TLS handshake with ``address``: ``(outcome, detail)``, outcome one of "ok", "alert" (a TLS peer
    refused it), "verify" (its certificate failed the check), "plain" (no TLS answer), "unreachable"."""
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        return "unreachable", str(exc)
    try:
        with context.wrap_socket(sock, server_hostname=server_name) as tls:
            if context.verify_mode == ssl.CERT_REQUIRED:  # TLS 1.3 reports a missing client certificate now
                tls.settimeout(min(timeout, 0.5))
                try:
                    if not tls.recv(1):
                        return "alert", "the server closed the connection after the handshake"
                except ssl.SSLError as exc:
                    return "alert", exc.reason or str(exc)
                except OSError:  # nothing to read: the server waits for the client, as it should
                    pass
            return "ok", ""
    except ssl.SSLCertVerificationError as exc:
        return "verify", exc.verify_message or str(exc)
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        return ("alert" if "ALERT" in reason.upper() else "plain"), reason
    except TimeoutError:  # no answer at all (a stalled server): nothing to say about TLS
        return "unreachable", "no answer"
    except OSError as exc:  # closed or reset on the first bytes of a ClientHello: not a TLS server
        return "plain", str(exc)
    finally:
        sock.close()


def tls_problem(address: str, tls: bool, ca: bytes | None = None, server_name: str | None = None,
                has_client_cert: bool = False, timeout: float = 2.0) -> str | None:
    """What is wrong with TLS between this client and the server at ``address``, in words; None if nothing.

    Made with Python's own TLS handshakes to the address, so it tells a plaintext server from a
    TLS one, a certificate that does not verify against ``ca`` (or name ``server_name``), and a
    server that wants a client certificate. None too when the server cannot be reached at all.

    Args:
        address: ``host:port``.
        tls: whether the client dials with TLS.
        ca: the PEM the client verifies servers with (TLS only).
        server_name: the name the certificate must carry (default: the host).
        has_client_cert: whether the client presents a certificate (mutual TLS).
    """
    where = _host_port(address)
    if where is None:
        return None
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
    probe.set_alpn_protocols(["h2"])
    outcome, detail = _handshake(where, probe, None, timeout)
    if outcome == "unreachable":
        return None
    speaks_tls = outcome in ("ok", "alert")
    if not tls:
        return (f"the server at {address} speaks TLS and this client plaintext: pass tls_ca (with tls_cert and "
                f"tls_key for mutual TLS)") if speaks_tls else None
    if not speaks_tls:
        return (f"this client speaks TLS and the server at {address} does not (plaintext: {detail}); leave out "
                f"tls_ca/tls_cert, or start the server with --tls-cert/--tls-key")
    if ca is None:
        return None
    verify = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    verify.set_alpn_protocols(["h2"])
    try:
        verify.load_verify_locations(cadata=ca.decode(errors="replace"))
    except (ssl.SSLError, ValueError):
        return f"tls_ca holds no usable PEM certificate, so the server at {address} cannot be verified"
    outcome, detail = _handshake(where, verify, server_name or where[0], timeout)
    if outcome == "verify":
        return (f"TLS handshake with {address} failed: the server's certificate does not verify against tls_ca "
                f"for the name {server_name or where[0]!r} ({detail}); check tls_ca, or pass tls_server_name")
    if outcome == "alert" and not has_client_cert:
        return (f"TLS handshake with {address} failed: the server wants a client certificate (mutual TLS; "
                f"{detail}): pass tls_cert and tls_key")
    if outcome == "alert":
        return f"TLS handshake with {address} failed: the server refused it ({detail}); check tls_cert and tls_key"
    return None


def _read_pem(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def _as_keys(keys: Any, max_batch_keys: int) -> np.ndarray:
    """int64 [n] numpy keys, checked like EmbeddingCache checks them."""
    return as_key_tensor(keys, max_batch_keys).cpu().numpy()


def _as_values(what: str, values: Any, n: int, dim: int,
               error: type[InvalidGradientError] | type[InvalidRowsError]) -> np.ndarray:
    """float32 [n, dim] numpy values, checked like EmbeddingCache checks them."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if not isinstance(values, torch.Tensor):
        raise error(f"{what} must be a float tensor of shape [{n}, {dim}], got {type(values).__name__}")
    if not values.dtype.is_floating_point:
        raise error(f"{what} must be floating point (float32 preferred), got dtype {values.dtype}")
    if tuple(values.shape) != (n, dim):
        raise error(f"{what} must have shape [{n}, {dim}] (one row per key, dim {dim}), got {tuple(values.shape)}")
    return values.detach().to("cpu", torch.float32).contiguous().numpy()


def _finite(values: np.ndarray) -> bool:
    # torch's sum is about twice as fast as numpy's here; a sum that overflows is checked element-wise
    return bool(torch.isfinite(torch.from_numpy(values).sum())) or bool(np.isfinite(values).all())


def _merge_stats(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum per-shard stats (same dict shape); flags are OR-ed, miss-ratio estimates averaged by lookups."""
    out: dict[str, Any] = {}
    for table in sorted({t for s in shards for t in s}):
        parts = [s[table] for s in shards if table in s]
        merged = _merge_values([{k: v for k, v in p.items() if k != "mrc"} for p in parts])
        mrcs = [(float(p.get("lookups", 0)), p["mrc"]) for p in parts if p.get("mrc")]
        if mrcs:
            total = sum(w for w, _ in mrcs)
            merged["mrc"] = _weighted([(w / total if total else 1 / len(mrcs), m) for w, m in mrcs])
        elif parts and "mrc" in parts[0]:
            merged["mrc"] = None
        out[table] = merged
    return out


def _merge_values(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        keys = [k for v in values for k in v]
        return {k: _merge_values([v[k] for v in values if k in v]) for k in dict.fromkeys(keys)}
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, (int, float)):
        return sum(values)
    return first


def _weighted(items: list[tuple[float, Any]]) -> Any:
    first = items[0][1]
    if isinstance(first, dict):
        return {k: _weighted([(w, m[k]) for w, m in items if k in m]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return float(sum(w * v for w, v in items))
    return first


#: A name resolver with getaddrinfo's shape:
#: ``resolver(host, port, type=socket.SOCK_STREAM)`` -> ``[(family, type, proto, canonname, sockaddr), ...]``.
Resolver = Callable[..., Sequence[tuple[Any, ...]]]


def resolve_shards(target: str, resolver: Resolver = socket.getaddrinfo) -> dict[str, str]:
    """The shards behind a DNS name, e.g. a Kubernetes headless Service: ``{shard name: "host:port"}``.

    Args:
        target: ``"dns:///name:port"`` (or ``"name:port"``). Every address the name resolves to
            is a shard, named by its reverse-DNS name: for a StatefulSet behind a headless
            Service that is the pod's stable ``embcache-0.embcache.<ns>.svc.cluster.local``, so
            a shard keeps its place on the hash ring when its pod comes back with another IP.
            An address without a reverse name is named by its IP; addresses that would share a
            name (several ports of one host) are named by their ``ip:port``.
        resolver: a callable with the shape of :func:`socket.getaddrinfo` (the default), called
            as ``resolver(host, port, type=socket.SOCK_STREAM)``; each result's sockaddr gives the
            address (its port too, so a resolver may return SRV-style ports).

    Raises:
        ValueError: no port, or the name does not resolve.
    """
    hostport = target.removeprefix("dns:///")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected 'dns:///name:port', got {target!r}")
    try:
        infos = resolver(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{host!r} does not resolve: {exc}") from None
    if not infos:
        raise ValueError(f"{host!r} does not resolve: no addresses")
    named: list[tuple[str, str]] = []
    for ip, p in sorted({(str(info[4][0]), int(info[4][1])) for info in infos}):
        try:
            name = socket.gethostbyaddr(ip)[0]
        except OSError:
            name = ip
        named.append((name, f"[{ip}]:{p}" if ":" in ip else f"{ip}:{p}"))
    counts = {n: sum(1 for m, _ in named if m == n) for n, _ in named}
    return {name if counts[name] == 1 else address: address for name, address in named}


class Client:
    """The methods of :class:`~embcache.EmbeddingCache`, served by ``embcache-server`` shards.

    Args:
        servers: ``"host:port"``, a list of them, or ``{shard name: "host:port"}``. Names place
            the shards on the hash ring (for a list, the address is the name): keep them stable
            when a shard moves, or its keys move with it. ``"dns:///name:port"`` takes every
            address a DNS name resolves to (a Kubernetes headless Service), each named by its
            reverse-DNS name (:func:`resolve_shards`).
        timeout: deadline of a data call in seconds, retries included (default 60).
        long_timeout: deadline of pass, flush and checkpoint calls (default 3600).
        connect_timeout: how long the constructor waits for every shard (default 30).
        retries: resends of an idempotent call after UNAVAILABLE (default 5; backoff from
            ``backoff`` seconds, doubling, at most ``max_backoff``, with jitter).
        wait_for_ready: a call to a shard that is down waits (until its deadline) for it to come
            back instead of failing at once (default True).
        token: bearer token sent as ``authorization: Bearer <token>``.
        tls_ca: PEM (bytes, or a file path) of the CA that signed the servers' certificates;
            setting it (or ``tls_cert``) switches to TLS.
        tls_cert, tls_key: client certificate and key (PEM bytes or paths) for mutual TLS.
        tls_server_name: name to check the server certificates against, when it differs from the host.
        max_message_bytes: largest message this client sends or receives (default 64 MiB; the
            servers' own limits are honoured too).
        vnodes: virtual nodes per shard on the ring (default 256).
        resolver: for a ``dns:///`` target, the name resolver, with the shape of
            :func:`socket.getaddrinfo` (the default; see :func:`resolve_shards`).
        expected_shards: for a ``dns:///`` target, the number of shards the name must resolve to:
            the constructor resolves again (every 0.2 s, up to ``connect_timeout``) until it does,
            and :meth:`refresh_shards` keeps the current shards while it does not. Without it
            the shards are whatever the name gives at that moment, and the key-to-shard map
            with them. For a list or mapping, a different count is a ValueError.
        lease_ttl: time-to-live of the batch leases of :meth:`prefetch_batch`, seconds (default
            30; the servers cap it at their ``--max-lease-seconds``): the client renews them
            every third of it; if this process dies, the servers unpin their rows after it.

    DNS targets are resolved when the client is made, not on every call; :meth:`refresh_shards`
    resolves again (e.g. after a shard was added) and moves keys to the new map.

    Raises:
        UnavailableError, DeadlineExceededError: a shard could not be reached within ``connect_timeout``,
            or a ``dns:///`` name did not resolve to ``expected_shards`` addresses in that time.
        TLSMismatchError: (an UnavailableError) a shard's channel does not come up because of TLS:
            the server speaks TLS and the client plaintext or the other way round, its certificate
            does not verify against ``tls_ca`` (or name ``tls_server_name``), or it wants a client
            certificate. Checked when a channel is not ready one second after the client is made.
        UnauthenticatedError, PermissionDeniedError: the servers refused the credentials.
        ValueError: a malformed target, a name that does not resolve, a list of the wrong length,
            or ``lease_ttl`` not positive.

    Not offered (``EmbeddingCache`` has them): ``config``, because a fleet has no one
    :class:`~embcache.CacheConfig`: every shard has its own path, tier sizes and device (see
    :meth:`shard_stats` for their capacities, :meth:`capacity_rows` for the totals); and
    ``restore``, because a checkpoint is restored where its store lives: run
    ``EmbeddingCache.restore(shard_checkpoint, CacheConfig(path=...))`` on each shard's
    machine and start ``embcache-server --path`` there (a client cannot move a store); and
    ``export_rows``, ``import_rows`` and ``delete_rows``, with which a server moves rows between
    shards while resharding: a fleet moves its rows with :meth:`reshard`.
    """

    def __init__(self, servers: str | Sequence[str] | Mapping[str, str], *, timeout: float = 60.0,
                 long_timeout: float = 3600.0, connect_timeout: float = 30.0, retries: int = 5,
                 backoff: float = 0.05, max_backoff: float = 2.0, wait_for_ready: bool = True,
                 token: str | None = None, tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None, tls_server_name: str | None = None,
                 max_message_bytes: int = 64 << 20, vnodes: int = 256, resolver: Resolver = socket.getaddrinfo,
                 expected_shards: int | None = None, lease_ttl: float = 30.0) -> None:
        if expected_shards is not None and expected_shards < 1:
            raise ValueError(f"expected_shards must be >= 1, got {expected_shards}")
        if not 0 < lease_ttl < float("inf"):
            raise ValueError(f"lease_ttl must be a positive number of seconds, got {lease_ttl}")
        self._dns_target = servers if isinstance(servers, str) and servers.startswith("dns:///") else None
        self._resolver, self._expected_shards = resolver, expected_shards
        if self._dns_target is not None:
            servers = self._resolve(time.monotonic() + connect_timeout)
        elif isinstance(servers, str):
            servers = [servers]
        named = dict(servers) if isinstance(servers, Mapping) else {a: a for a in servers}
        if not named or len(named) != len(servers):
            raise ValueError(f"servers must be one or more distinct addresses, got {servers!r}")
        if expected_shards is not None and len(named) != expected_shards:
            raise ValueError(f"expected {expected_shards} shards, got {len(named)}: {list(named)}")
        self._timeout, self._long_timeout = timeout, long_timeout
        self._retries, self._backoff, self._max_backoff = retries, backoff, max_backoff
        self._wait = wait_for_ready
        self._auth: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._options: list[tuple[str, Any]] = [("grpc.max_send_message_length", max_message_bytes),
                                                ("grpc.max_receive_message_length", max_message_bytes)]
        self._creds = None
        self._tls = (_read_pem(tls_ca), tls_server_name, tls_cert is not None)
        if tls_ca is not None or tls_cert is not None:
            self._creds = grpc.ssl_channel_credentials(root_certificates=self._tls[0],
                                                       private_key=_read_pem(tls_key),
                                                       certificate_chain=_read_pem(tls_cert))
            if tls_server_name:
                self._options.append(("grpc.ssl_target_name_override", tls_server_name))
        self._vnodes = vnodes
        first = ShardMap(0, dict(named), vnodes)
        self._topo = _Topology([self._connect(name, address) for name, address in named.items()], first.ring, first)
        self._retired: list[_Shard] = []  # shards a refresh removed: closed with the client
        self._lock = threading.Lock()
        self._tables: dict[str, TableConfig] = {}
        self._max_message = max_message_bytes
        self._max_batch_keys = 1 << 24
        self._reject_nonfinite = True
        self._closed = False
        self._lease_ttl = float(lease_ttl)
        self._leases = _LeaseKeeper(self)
        self._receipts = Receipts()  # acknowledged writes per shard, until a flush shows them durable
        self._pass_incarnations: dict[str, int] = {}  # shard name -> the process that holds this client's pass
        deadline = time.monotonic() + connect_timeout
        try:
            if self._wait:  # (without wait_for_ready a call to such a shard fails at once: checked below)
                self._check_tls(min(_TLS_CHECK_SECONDS, connect_timeout))
            self._refresh_tables(timeout=max(deadline - time.monotonic(), 0.001))
            if self._topo.map.version == 0 and len(self._topo.shards) > 1:  # one shard: nothing to disagree about
                self._install_map(max(deadline - time.monotonic(), 0.001))
        except (UnavailableError, DeadlineExceededError) as exc:
            self.close()
            if isinstance(exc, TLSMismatchError):
                raise
            problem = next(filter(None, (self._tls_problem(s.address) for s in self._topo.shards)), None)
            if problem is not None:
                raise TLSMismatchError(problem, grpc.StatusCode.UNAVAILABLE) from exc
            raise
        except BaseException:
            self.close()
            raise

    def _install_map(self, timeout: float) -> None:
        """Make this client's shard list the fleet's map (version 1) on servers that hold none.

        From then on the servers refuse requests routed by any other list, so two clients that
        resolved the fleet differently can never write one key on two shards. A server that
        already holds a map (another client's, installed meanwhile) keeps it; this client then
        routes by the newest map the servers hold.

        Raises:
            ConfigError: the servers hold maps that contradict each other.
        """
        first = ShardMap(1, dict(self._topo.map.shards), self._vnodes)
        calls = [(s, "SetShardMap", pb.SetShardMapRequest(name=s.name, current=first.to_json()))
                 for s in self._topo.shards]
        outcomes = self._fanout_outcomes(calls, idempotent=True, timeout=timeout)
        held = []
        for (shard, _, _), o in zip(calls, outcomes, strict=True):
            if isinstance(o, grpc.RpcError):
                if o.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED):
                    return  # a read-only token (it writes nothing), or a server older than shard maps
                if trailer(o, ERROR_TYPE_KEY) != "ConfigError":  # ConfigError: it holds another map (read below)
                    raise error_from_rpc(o, shard.address) from None
                o = self._fanout([(shard, "GetShardMap", pb.GetShardMapRequest())], idempotent=True,
                                 timeout=timeout)[0]
            held.append(ShardMap.from_json(o.current) if o.current else first)
        newest = max(held, key=lambda m: m.version)
        if newest == first:
            self._adopt(first)
            return
        if self._adopt(newest):
            self._refresh_tables(timeout=timeout)
        if any(m.version == newest.version and m != newest for m in held):
            raise ConfigError(f"the servers hold different shard maps of version {newest.version}: "
                              f"{sorted({m.to_json() for m in held if m.version == newest.version})}")

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """Every call's metadata: the token, and the shard map version the call is routed by."""
        version = self._topo.map.version
        return (*self._auth, (MAP_VERSION_KEY, str(version))) if version else self._auth

    @property
    def shard_map(self) -> ShardMap:
        """The shard map this client routes by (version 0: its own shard list, before any reshard)."""
        return self._topo.map

    def _adopt(self, shard_map: str | ShardMap) -> bool:
        """Route by ``shard_map`` (JSON or a map) from now on if it is newer than this client's; True if adopted.

        Shards still present keep their channels; new ones are connected; removed ones stop getting
        calls (their channels close with the client).
        """
        new = ShardMap.from_json(shard_map) if isinstance(shard_map, str) else shard_map
        with self._lock:
            old = self._topo
            if new.version <= old.map.version:
                return False
            # a shard this client knows keeps its channel (and the address this client reaches it at)
            kept = {s.name: s for s in [*old.shards, *self._retired]}
            if len(new.shards) == 1 and len(old.shards) == 1 and next(iter(new.shards)) not in kept:
                # the one server this client reached holds a one-shard map naming it otherwise (the
                # address it was first reached at): it is that shard
                only = old.shards[0]
                kept[next(iter(new.shards))] = _Shard(next(iter(new.shards)), only.address, only.channel, only.stub,
                                                      only.raw)
            shards = [kept.pop(n) if n in kept else self._connect(n, a) for n, a in new.shards.items()]
            self._retired = [s for s in kept.values()]
            self._topo = _Topology(shards, new.ring, new)
        log.info("routing by shard map version %d: %s", new.version, sorted(new.shards.values()))
        return True

    def _tls_problem(self, address: str) -> str | None:
        ca, server_name, has_cert = self._tls
        return tls_problem(address, self._creds is not None, ca, server_name, has_cert)

    def _check_tls(self, wait: float) -> None:
        """Raise TLSMismatchError for a shard whose channel is not ready after ``wait`` s because of TLS.

        A channel whose TLS handshake fails never becomes ready, and a call waiting for it (the
        default ``wait_for_ready``) would only time out: a shard not ready this soon is asked
        with Python's own handshakes what is wrong (:func:`tls_problem`), which also says
        nothing for a shard that is only down or starting (the calls then wait as before).
        """
        futures = [(s, grpc.channel_ready_future(s.channel)) for s in self._topo.shards]
        end = time.monotonic() + wait
        try:
            for shard, ready in futures:
                try:
                    ready.result(timeout=max(end - time.monotonic(), 0.0))
                except grpc.FutureTimeoutError:
                    problem = self._tls_problem(shard.address)
                    if problem is not None:
                        raise TLSMismatchError(problem, grpc.StatusCode.UNAVAILABLE, shard.address) from None
        finally:
            for _, ready in futures:
                ready.cancel()

    def _connect(self, name: str, address: str) -> _Shard:
        channel = (grpc.secure_channel(address, self._creds, options=self._options) if self._creds is not None
                   else grpc.insecure_channel(address, options=self._options))
        return _Shard(name, address, channel, pb_grpc.EmbeddingCacheServiceStub(channel), _raw_calls(channel))

    def _resolve(self, deadline: float) -> dict[str, str]:
        """Resolve the dns:/// target, again every 0.2 s until it gives ``expected_shards`` addresses."""
        assert self._dns_target is not None
        while True:
            shards = resolve_shards(self._dns_target, self._resolver)
            if self._expected_shards is None or len(shards) == self._expected_shards:
                return shards
            if time.monotonic() + 0.2 >= deadline:
                raise UnavailableError(f"{self._dns_target} resolves to {len(shards)} addresses "
                                       f"({sorted(shards.values())}), expected {self._expected_shards}",
                                       grpc.StatusCode.UNAVAILABLE)
            time.sleep(0.2)

    def refresh_shards(self, progress: bool = False) -> bool:
        """Resolve the ``dns:///`` target again and reshard the fleet onto the shards it gives now.

        When the name gives another set of shards than the fleet's map, this runs
        :meth:`reshard` onto it: every row whose owner changes moves, with its optimizer state
        and frequency, before the new map takes effect (see :mod:`embcache.reshard`); other
        clients are redirected to the new map by the servers.

        Returns:
            True when the shards changed.

        Raises:
            ValueError: the client was not made from a ``dns:///`` target, or the name does not resolve.
            UnavailableError: the name does not resolve to ``expected_shards`` addresses now
                (the current shards are kept), or a shard failed during the migration (call
                again to resume it).
        """
        self._check_open()
        if self._dns_target is None:
            raise ValueError("refresh_shards() needs a client made from a 'dns:///name:port' target")
        named = self._resolve(time.monotonic())
        if set(self._topo.map.shards) == set(named):
            return False
        log.info("shards of %s changed: %s -> %s: resharding", self._dns_target,
                 sorted(self._topo.map.shards.values()), sorted(named.values()))
        self.reshard(named, progress=progress)
        return True

    def reshard(self, servers: Sequence[str] | Mapping[str, str], progress: bool = True) -> ReshardReport:
        """Move the fleet onto ``servers`` (add or remove shards), migrating every row whose owner changes.

        Training may go on meanwhile, in this process and others: writes to the rows being
        moved wait (they are refused and resent) until the new map is committed, everything
        else is served; clients still on the old map are redirected. Resumable: after a crash of
        any party, call it again with the same list. See :mod:`embcache.reshard`.

        Args:
            servers: the new shard list (``"host:port"`` list, or ``{name: "host:port"}``).
            progress: a progress bar of the rows copied (stderr).

        Raises:
            ConfigError, UnavailableError, DeadlineExceededError, StoreError (see :func:`embcache.reshard.reshard`).
        """
        self._check_open()
        return _reshard(self, servers, progress=progress)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Cancel the batch leases still held, then close the channels (the servers keep running). Idempotent."""
        if not self._closed:
            self._leases.close()
        self._closed = True
        for shard in [*self._topo.shards, *self._retired]:
            shard.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def device(self) -> torch.device:
        """Where returned rows live: the CPU."""
        return torch.device("cpu")

    @property
    def servers(self) -> dict[str, str]:
        """Shard name -> address."""
        return {s.name: s.address for s in self._topo.shards}

    def shard_of(self, keys: Any) -> np.ndarray:
        """Index (into :attr:`servers`) of the shard that owns each key: int64 [n]."""
        return self._topo.ring.owners(_as_keys(keys, self._max_batch_keys))

    # ------------------------------------------------------------------ calls, retries, deadlines
    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the client is closed; create a new Client to continue")

    def _start(self, shard: _Shard, method: str, request: Any, deadline: float) -> Any:
        rpc = shard.raw[method] if isinstance(request, bytes) else getattr(shard.stub, method)
        body = iter(request) if isinstance(request, list) else request
        return rpc.future(body, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata,
                          wait_for_ready=self._wait)

    def _call(self, shard: _Shard, method: str, request: Any, deadline: float) -> Any:
        """A blocking call; returns the reply or the RpcError it failed with."""
        rpc = shard.raw[method] if isinstance(request, bytes) else getattr(shard.stub, method)
        body = iter(request) if isinstance(request, list) else request
        try:
            return rpc(body, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata,
                       wait_for_ready=self._wait)
        except grpc.RpcError as err:
            return err

    def _sleep_backoff(self, attempt: int, deadline: float) -> bool:
        delay = min(self._max_backoff, self._backoff * 2 ** attempt) * (0.5 + random.random() / 2)
        if time.monotonic() + delay >= deadline:
            return False
        time.sleep(delay)
        return True

    def _fanout(self, calls: list[tuple[_Shard, str, Any]], idempotent: bool,
                timeout: float | None = None) -> list[Any]:
        """Run unary (or client-streaming: a list of requests) calls on shards in parallel; results in order.

        Raises:
            The embcache error of the first call that failed for good.
        """
        outcomes = self._fanout_outcomes(calls, idempotent, timeout, stop_on_failure=True)
        failure = self._failure(calls, outcomes, idempotent)
        if failure is not None:
            raise failure from None
        return outcomes

    def _failure(self, calls: list[tuple[_Shard, str, Any]], outcomes: list[Any],
                 idempotent: bool) -> EmbcacheError | None:
        """The embcache error of the failed call that says most, or None when every call succeeded.

        A failure for good says more than one that was still being resent when time or retries ran out.
        """
        errors = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, grpc.RpcError)]
        if not errors:
            return None
        i, err = next(((i, e) for i, e in errors if not self._resendable(e, idempotent)), errors[0])
        return error_from_rpc(err, calls[i][0].address)

    def _resendable(self, err: grpc.RpcError, idempotent: bool) -> bool:
        """Whether a failed call is safe to send again.

        UNAVAILABLE: not reached, or refused; CANCELLED (by this client only when it is closed): a
        server that stopped as the call arrived. Safe only when the call is idempotent, or when the
        server said it had no effect (UNAVAILABLE marked not applied: a draining server).
        """
        code = err.code()
        return not self._closed and (
            (idempotent and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED))
            or (code == grpc.StatusCode.UNAVAILABLE and not_applied(err)))

    def _log_resend(self, shard: _Shard, method: str, attempt: int, why: grpc.RpcError) -> None:
        log.info("resending %s to %s (retry %d of %d) after %s%s: %s", method, shard.address, attempt + 1,
                 self._retries, why.code().name, " (not applied)" if not_applied(why) else "", why.details())

    def _fanout_outcomes(self, calls: list[tuple[_Shard, str, Any]], idempotent: bool, timeout: float | None = None,
                         stop_on_failure: bool = False) -> list[Any]:
        """Run calls as :meth:`_fanout` does, resending what is safe; each call's reply or its final ``RpcError``.

        With ``stop_on_failure``, a call failing for good ends the resending of the others (the
        caller raises); otherwise every call is resent while it is safe and time and retries allow.
        """
        self._check_open()
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        attempt = 0
        while True:
            if len(todo) == 1:  # one call: a blocking call skips the future's hand-off between threads
                futures = [(todo[0], _Done(self._call(*calls[todo[0]], deadline)))]
            else:
                futures = [(i, self._start(*calls[i], deadline)) for i in todo]
            retry: dict[int, grpc.RpcError] = {}
            failed = False
            for i, fut in futures:
                try:
                    results[i] = fut.result()
                except grpc.RpcError as err:
                    results[i] = err
                    # a migration's refusal is resent until the deadline, whatever the retries
                    if self._resendable(err, idempotent) and (attempt < self._retries or _migrating(err)):
                        retry[i] = err
                    else:
                        failed = True
            if retry and not (failed and stop_on_failure) and self._sleep_backoff(attempt, deadline):
                for i, why in retry.items():
                    self._log_resend(calls[i][0], calls[i][1], attempt, why)
                todo, attempt = list(retry), attempt + 1
                continue
            return results

    def _stream(self, shard: _Shard, method: str, request: Any, deadline: float) -> Any:
        """Start a server-streaming call (a list of requests: a bidirectional stream of them)."""
        body = iter(request) if isinstance(request, list) else request
        return getattr(shard.stub, method)(body, timeout=max(deadline - time.monotonic(), 0.001),
                                           metadata=self._metadata, wait_for_ready=self._wait)

    def _open_streams(self, calls: list[tuple[_Shard, str, Any]], timeout: float,
                      firsts: list[Any] | None = None) -> list[Any]:
        """Start server-streaming calls and read each one's first message (errors raise here; ``firsts`` gets them).

        A call the server refused before it had any effect (UNAVAILABLE marked not applied, as a
        draining server refuses) is started again, with backoff, within ``retries`` and the
        deadline; any other failure cancels every stream and raises.
        """
        self._check_open()
        deadline = time.monotonic() + timeout
        streams = [self._stream(*call, deadline) for call in calls]
        try:
            for i, (shard, method, request) in enumerate(calls):
                attempt = 0
                while True:
                    try:
                        first = next(streams[i])
                        if firsts is not None:
                            firsts.append(first)
                        break
                    except grpc.RpcError as err:
                        if (attempt < self._retries and self._resendable(err, idempotent=False)
                                and self._sleep_backoff(attempt, deadline)):
                            self._log_resend(shard, method, attempt, err)
                            attempt += 1
                            streams[i] = self._stream(shard, method, request, deadline)
                            continue
                        raise error_from_rpc(err, shard.address) from None
        except BaseException:
            for other in streams:
                other.cancel()
            raise
        return streams

    def _finish_streams(self, streams: list[Any], calls: list[tuple[_Shard, str, Any]],
                        combine: Callable[[list[Any]], Any]) -> RemoteFuture:
        """A future resolved, on a background thread, from each stream's second message."""
        fut = RemoteFuture()
        fut._calls = streams
        fut.set_running_or_notify_cancel()

        def wait() -> None:
            finals = []
            try:
                for (shard, _, _), call in zip(calls, streams, strict=True):
                    try:
                        finals.append(next(call))
                    except grpc.RpcError as err:
                        if err.code() == grpc.StatusCode.CANCELLED and fut.cancelled():
                            return
                        raise error_from_rpc(err, shard.address) from None
                if not fut.cancelled():
                    fut.set_result(combine(finals))
            except BaseException as exc:
                if not fut.cancelled():
                    fut.set_exception(exc)

        threading.Thread(target=wait, name="embcache-client-wait", daemon=True).start()
        return fut

    def _rerouting(self, fn: Callable[[], R]) -> R:
        """Run a keyset call (its undo on failure is its own); again, by the new map, when a shard refused it
        as routed by another (WrongShardError: nothing applied there)."""
        deadline = time.monotonic() + self._timeout
        for attempt in range(_MAX_REROUTES):
            try:
                return fn()
            except WrongShardError as exc:
                shard_map = getattr(exc, "shard_map", "")
                adopted = bool(shard_map) and self._adopt(shard_map)
                if not adopted and not self._sleep_backoff(attempt, deadline):  # the shard is behind: wait
                    raise
        return fn()

    # ------------------------------------------------------------------ tables
    def _refresh_tables(self, timeout: float | None = None) -> dict[str, TableConfig]:
        replies = self._fanout([(s, "ListTables", pb.ListTablesRequest()) for s in self._topo.shards], idempotent=True,
                               timeout=timeout)
        tables: dict[str, TableConfig] = {}
        for reply in replies:
            for t in reply.tables:
                tables.setdefault(t.name, codec.table_from_proto(t))
        info = [r.server for r in replies]
        maps = [ShardMap.from_json(i.shard_map) for i in info if i.shard_map]
        if maps and self._adopt(max(maps, key=lambda m: m.version)):
            return self._refresh_tables(timeout)  # the tables of the shards of the new map
        with self._lock:
            self._tables = tables
            self._max_batch_keys = min(i.max_batch_keys for i in info) or self._max_batch_keys
            self._reject_nonfinite = any(i.reject_nonfinite for i in info)
            limits = [v for i in info for v in (i.max_receive_message_bytes, i.max_send_message_bytes) if v]
            self._max_message = min([self._max_message, *limits])
        return dict(tables)

    def _dims(self, names: Sequence[str]) -> dict[str, int]:
        """Dims of the named tables (the list is fetched again when a name is new to this client)."""
        self._check_open()
        with self._lock:
            known = dict(self._tables)
        if any(n not in known for n in names):
            known = self._refresh_tables()
        for n in names:
            if n not in known:
                raise UnknownTableError(f"unknown table {n!r}; tables: {sorted(known)}")
        return {n: known[n].dim for n in names}

    def tables(self) -> dict[str, TableConfig]:
        """The tables the servers serve, by name (fetched now)."""
        self._check_open()
        return self._refresh_tables()

    def create_table(self, cfg: TableConfig) -> bool:
        """Add a table on every shard; idempotent for an equal definition.

        Returns:
            True if some shard created it, False if every shard had an equal one.

        Raises:
            TableConflictError: a table of that name exists with another definition.
            PassStateError: rows are pinned on a shard. ConfigError: ``cfg`` is not a TableConfig.
        """
        if not isinstance(cfg, TableConfig):
            raise ConfigError(f"create_table takes a TableConfig, got {type(cfg).__name__}")
        req = pb.CreateTableRequest(table=codec.table_to_proto(cfg))
        replies = self._fanout([(s, "CreateTable", req) for s in self._topo.shards], idempotent=True)
        with self._lock:
            self._tables[cfg.name] = cfg
        return any(r.created for r in replies)

    # ------------------------------------------------------------------ request building
    @staticmethod
    def _parts_by_shard(batch: Mapping[str, tuple[np.ndarray, np.ndarray | None]],
                        topo: _Topology) -> list[list[_Part]]:
        """Split each table's keys (and values) over the shards."""
        per_shard: list[list[_Part]] = [[] for _ in topo.shards]
        for table, (keys, values) in batch.items():
            if len(topo.shards) == 1:
                per_shard[0].append(_Part(table, None, keys, values))
                continue
            for i, pos in enumerate(topo.ring.split(keys)):
                if pos.size:
                    per_shard[i].append(_Part(table, pos, keys[pos], None if values is None else values[pos]))
        return per_shard

    def _chunks(self, parts: list[_Part], row_bytes: Mapping[str, int]) -> list[list[_Part]]:
        """Group parts into requests of at most the message limit, cutting a table's part where needed."""
        budget = wire.payload_budget(self._max_message)
        chunks: list[list[_Part]] = [[]]
        room = budget
        for part in parts:
            start, n, per_row = 0, part.keys.shape[0], row_bytes[part.table]
            while start < n:
                take = min(n - start, max(room // per_row, 0))
                if take == 0:
                    chunks.append([])
                    room = budget
                    take = min(n - start, max(budget // per_row, 1))
                end = start + take
                whole = start == 0 and end == n
                chunks[-1].append(part if whole else _Part(
                    part.table, (part.positions if part.positions is not None else np.arange(n))[start:end],
                    part.keys[start:end], None if part.values is None else part.values[start:end]))
                room -= take * per_row
                start = end
        return [c for c in chunks if c]

    # ------------------------------------------------------------------ lookups
    def lookup(self, table: str, keys: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``keys``: float32 [n, dim] on the CPU.

        Args:
            table: table name.
            keys: int64 [n] (any integer dtype; tensor, numpy array or sequence); duplicates allowed.
            out: optional float32 [n, dim] CPU tensor to write into.

        Raises:
            UnknownTableError, InvalidKeysError, BatchTooLargeError, InvalidRowsError (bad ``out``),
            StoreError, UnavailableError, DeadlineExceededError.
        """
        return self._lookup({table: keys}, {table: out} if out is not None else {})[table]

    def lookup_many(self, keys: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Rows of several tables in one round trip per shard: ``{table: keys [n]} -> {table: float32 [n, dim]}``.

        Raises:
            The errors of :meth:`lookup`.
        """
        return self._lookup(keys, {})

    def _lookup(self, keys: Mapping[str, Any], outs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dims = self._dims(list(keys))
        batch = {t: (_as_keys(k, self._max_batch_keys), None) for t, k in keys.items()}
        filled: dict[str, torch.Tensor] = {}
        for t, (k, _) in batch.items():
            out = outs.get(t)
            if out is not None:
                n, dim = k.shape[0], dims[t]
                if out.shape != (n, dim) or out.dtype != torch.float32 or out.device.type != "cpu":
                    raise InvalidRowsError(f"out must be float32 [{n}, {dim}] on cpu")
                filled[t] = out
        row_bytes = {t: 4 * d + 8 for t, d in dims.items()}

        def send(calls: list[tuple[_Shard, str, Any]], layouts: list[list[_Part]], replies: list[Any]) -> None:
            for reply, chunk, (shard, _, _) in zip(replies, layouts, calls, strict=True):
                self._fill(reply, chunk, shard, batch, dims, filled)

        self._routed(batch, row_bytes, "Lookup", idempotent=True,
                     encode=lambda chunk: wire.encode_lookup_request([(p.table, p.keys) for p in chunk]),
                     stream=None, done=send)
        return {t: filled[t] if t in filled else torch.empty(0, dims[t], dtype=torch.float32) for t in batch}

    @staticmethod
    def _fill(reply: bytes, chunk: list[_Part], shard: _Shard, batch: Mapping[str, tuple[np.ndarray, Any]],
              dims: Mapping[str, int], filled: dict[str, torch.Tensor]) -> None:
        """Copy one Lookup reply's rows into the output tensors (the whole batch's reply becomes the output)."""
        tables = wire.parse_lookup_response(reply)
        if len(tables) != len(chunk):
            raise RemoteError(f"server {shard.address} answered {len(tables)} tables for {len(chunk)}")
        for part, rows_msg in zip(chunk, tables, strict=True):
            rows = codec.decode_tensor(rows_msg.rows, f"rows of table {part.table!r} from {shard.address}",
                                       InvalidRowsError, ("float32",), 2)
            n, dim = batch[part.table][0].shape[0], dims[part.table]
            if rows.shape != (part.keys.shape[0], dim):
                raise RemoteError(f"server {shard.address} sent rows {rows.shape} for "
                                  f"{part.keys.shape[0]} keys of dim {dim}")
            out = filled.get(part.table)
            if out is None and part.positions is None:  # the whole batch in one reply: its rows, in place
                filled[part.table] = wire.as_tensor(reply, rows)
                continue
            if out is None:
                out = filled[part.table] = torch.empty(n, dim, dtype=torch.float32)
            if part.positions is None:
                out.numpy()[:] = rows
            else:
                out.numpy()[part.positions] = rows

    def _routed(self, batch: Mapping[str, tuple[np.ndarray, np.ndarray | None]], row_bytes: Mapping[str, int],
                method: str, idempotent: bool, encode: Callable[[list[_Part]], Any],
                stream: Callable[[list[_Part]], Any] | None,
                done: Callable[[list[tuple[_Shard, str, Any]], list[list[_Part]], list[Any]], None]) -> None:
        """Send a keyed batch to the shards that own its keys, routing again what a shard refused by its map.

        Each shard's part is cut into requests within the message limit: ``encode(chunk)`` makes a
        unary request; with ``stream``, a part of several chunks goes as one client stream of
        ``stream(chunk)`` messages (applied by the server as one request). ``done(calls, layouts,
        replies)`` gets the calls that succeeded, with the parts each carried (positions in the
        caller's batch). A shard that refuses a request because it serves another shard map
        (WrongShardError, nothing applied) hands its map back: the client adopts it and sends
        those keys again, to their owners under it (a shard behind the client's map is waited
        for). Other failures raise, after ``done`` saw what succeeded.

        Raises:
            The embcache error of the first call that failed for good; WrongShardError after
            ``_MAX_REROUTES`` map changes in a row.
        """
        todo: dict[str, np.ndarray | None] = {t: None for t in batch}  # positions still to send (None: all)
        deadline = time.monotonic() + self._timeout
        reroutes = waits = 0
        while True:
            topo = self._topo
            sub = {t: _take(batch[t], pos) for t, pos in todo.items()}
            calls: list[tuple[_Shard, str, Any]] = []
            layouts: list[list[_Part]] = []
            for shard, parts in zip(topo.shards, self._parts_by_shard(sub, topo), strict=True):
                parts = [_absolute(p, todo[p.table]) for p in parts if p.keys.size]
                chunks = self._chunks(parts, row_bytes)
                if stream is not None and len(chunks) > 1:
                    calls.append((shard, f"{method}Stream", [stream(c) for c in chunks]))
                    layouts.append([p for c in chunks for p in c])
                    continue
                for chunk in chunks:
                    calls.append((shard, method, encode(chunk)))
                    layouts.append(chunk)
            if not calls:
                return
            outcomes = self._fanout_outcomes(calls, idempotent, stop_on_failure=True)
            ok = [i for i, o in enumerate(outcomes) if not isinstance(o, grpc.RpcError)]
            done([calls[i] for i in ok], [layouts[i] for i in ok], [outcomes[i] for i in ok])
            # refused by its map, or held back by a migration: nothing applied, so sent again by the newest map
            again = [i for i, o in enumerate(outcomes) if _wrong_shard(o) or (isinstance(o, grpc.RpcError)
                                                                               and _migrating(o))]
            failed = [i for i, o in enumerate(outcomes) if isinstance(o, grpc.RpcError) and i not in again]
            failure = self._failure([calls[i] for i in failed], [outcomes[i] for i in failed], idempotent)
            if failure is not None:
                raise failure from None
            if not again:
                return
            left: dict[str, list[np.ndarray]] = {}
            for i in again:
                for p in layouts[i]:
                    pos = p.positions if p.positions is not None else np.arange(batch[p.table][0].shape[0])
                    left.setdefault(p.table, []).append(pos)
            todo = {t: np.sort(np.concatenate(ps)) for t, ps in left.items()}
            maps = [ShardMap.from_json(m) for i in again if (m := _wrong_shard(outcomes[i])) not in ("", "{}")]
            if maps and self._adopt(max(maps, key=lambda m: m.version)):
                reroutes += 1
                if reroutes <= _MAX_REROUTES:
                    continue
            elif self._sleep_backoff(min(waits, 6), deadline):  # a shard behind this map, or a migration: wait
                waits += 1
                continue
            i = again[0]
            raise error_from_rpc(outcomes[i], calls[i][0].address)

    # ------------------------------------------------------------------ writes
    def apply_gradients(self, table: str, keys: Any, grads: Any) -> None:
        """Apply the table's optimizer to the rows of ``keys``; gradients of duplicate keys are summed.

        Never resent after a failure that may have reached the server (not idempotent).

        Args:
            table: table name.
            keys: int64 [n] (duplicates allowed).
            grads: floating [n, dim] (any device; sent as float32).

        Raises:
            UnknownTableError, InvalidKeysError, InvalidGradientError, NonFiniteGradientError,
            BatchTooLargeError, StoreError, UnavailableError (may or may not be applied),
            DeadlineExceededError.
        """
        self.apply_gradients_many({table: (keys, grads)})

    def apply_gradients_many(self, updates: Mapping[str, tuple[Any, Any]]) -> None:
        """Apply gradients to several tables in one round trip per shard: ``{table: (keys [n], grads [n, dim])}``.

        Every table's input is checked before anything is sent.

        Raises:
            The errors of :meth:`apply_gradients`.
        """
        batch = self._values_batch(updates, "gradients", InvalidGradientError)
        if self._reject_nonfinite:
            for t, (_, g) in batch.items():
                if not _finite(g):
                    raise NonFiniteGradientError(f"gradients of table {t!r} contain NaN or inf; nothing was applied")
        self._write("ApplyGradients", batch, pb.ApplyGradientsRequest)

    def assign(self, table: str, keys: Any, rows: Any) -> None:
        """Overwrite the rows of ``keys`` and reset their optimizer state; the last duplicate wins.

        Raises:
            UnknownTableError, InvalidKeysError, InvalidRowsError, BatchTooLargeError, StoreError,
            UnavailableError (may or may not be applied), DeadlineExceededError.
        """
        batch = self._values_batch({table: (keys, rows)}, "rows", InvalidRowsError)
        if not _finite(batch[table][1]):
            raise InvalidRowsError("rows contain NaN or inf; nothing was assigned")
        self._write("Assign", batch, pb.AssignRequest)

    def _values_batch(self, updates: Mapping[str, tuple[Any, Any]], what: str,
                      error: type[InvalidGradientError] | type[InvalidRowsError]) -> dict[str, tuple[np.ndarray, Any]]:
        dims = self._dims(list(updates))
        batch: dict[str, tuple[np.ndarray, Any]] = {}
        for t, (k, v) in updates.items():
            keys = _as_keys(k, self._max_batch_keys)
            batch[t] = (keys, _as_values(what, v, keys.shape[0], dims[t], error))
        return batch

    def _write(self, method: str, batch: Mapping[str, tuple[np.ndarray, Any]], request_type: Any) -> None:
        row_bytes = {t: 4 * v.shape[1] + 8 for t, (_, v) in batch.items()}

        def receipts(calls: list[tuple[_Shard, str, Any]], layouts: list[list[_Part]], replies: list[Any]) -> None:
            for (shard, _, _), reply in zip(calls, replies, strict=True):  # applied there: keep the receipt
                self._receipts.add(shard.name, reply.receipt.incarnation, reply.receipt.seq)

        self._routed(batch, row_bytes, method, idempotent=False,
                     encode=lambda chunk: wire.encode_values_request(
                         [(p.table, p.keys, p.values) for p in chunk]),  # type: ignore[misc]
                     stream=lambda chunk: request_type(tables=[
                         pb.TableValues(table=p.table, keys=codec.encode_tensor(p.keys),
                                        values=codec.encode_tensor(p.values))  # type: ignore[arg-type]
                         for p in chunk]),
                     done=receipts)

    # ------------------------------------------------------------------ passes
    def _keyset_calls(self, keysets: Mapping[str, Any], method: str, make: Callable[[list[pb.TableKeyset]], Any],
                      every_shard: bool = True) -> list[tuple[_Shard, str, Any]]:
        """One call per shard carrying its part of each keyset.

        A shard's part that fits in one message goes in the unary ``method`` (empty tables
        included, so every shard sees every table); a larger one is cut into chunks of at most
        the message limit (16 bytes per key: the key and its count) and sent over
        ``method + "Stream"``, which the server merges into one request. ``every_shard=False``
        leaves out the shards that own no key.
        """
        ks = as_keysets(keysets)
        self._dims(list(ks))
        topo = self._topo
        per_shard: list[list[_Part]] = [[] for _ in topo.shards]
        for table, keyset in ks.items():
            keys, counts = keyset.keys.numpy(), keyset.counts.numpy()
            if len(topo.shards) == 1:
                per_shard[0].append(_Part(table, None, keys, counts))
                continue
            for i, pos in enumerate(topo.ring.split(keys)):  # ascending positions: each part stays ascending
                per_shard[i].append(_Part(table, pos, keys[pos], counts[pos]))
        budget = wire.payload_budget(self._max_message)
        calls: list[tuple[_Shard, str, Any]] = []
        for shard, parts in zip(topo.shards, per_shard, strict=True):
            n = sum(p.keys.shape[0] for p in parts)
            if n == 0 and not every_shard:
                continue
            if n * _KEYSET_ROW_BYTES <= budget:
                calls.append((shard, method, make([_table_keyset(p) for p in parts])))
                continue
            chunks = self._chunks([p for p in parts if p.keys.size], {t: _KEYSET_ROW_BYTES for t in ks})
            chunks[0] += [p for p in parts if not p.keys.size]
            calls.append((shard, f"{method}Stream", [make([_table_keyset(p) for p in chunk]) for chunk in chunks]))
        return calls

    def prefetch(self, keysets: Mapping[str, Keyset | Any]) -> RemoteFuture:
        """Stage the rows of the next pass on every shard in the background.

        Returns once every shard has started staging (bad input raises here); the future's
        result is ``{table: {"staged_rows", "leased_rows", "seconds"}}`` summed over shards.
        ``cancel()`` stops the staging and releases its rows. The next :meth:`begin_pass`
        adopts what was staged. A shard's keyset above the message limit is sent in chunks
        (``PrefetchStream``) and staged as one prefetch. A shard that refuses the call before it
        had any effect (a draining server) is asked again, within ``retries`` and the deadline.

        Raises:
            UnknownTableError, InvalidKeysError, UnavailableError, DeadlineExceededError.
        """
        def start() -> RemoteFuture:
            calls = self._keyset_calls(keysets, "Prefetch", lambda p: pb.PrefetchRequest(keysets=p, wait=True))
            streams = self._open_streams(calls, self._long_timeout)
            return self._finish_streams(streams, calls, _combine_prefetch)
        return self._rerouting(start)

    def begin_pass(self, keysets: Mapping[str, Keyset | Any]) -> dict[str, dict[str, int]]:
        """Make a pass's keyset resident and pinned on every shard (each gets the keys it owns).

        A shard's keyset above the message limit is sent in chunks (``BeginPassStream``) and begun
        as one pass. A shard that refuses the call before it had any effect (a draining server)
        is asked again, within ``retries`` and the deadline. If some shard still refuses, the
        shards that began are ended again, so no pass is left half begun.

        Returns:
            ``{table: {"keyset_rows": n, "pinned_rows": m}}`` summed over shards.

        Raises:
            PassStateError, UnknownTableError, InvalidKeysError, StoreError, UnavailableError.
        """
        return self._rerouting(lambda: self._begin_pass(keysets))

    def _begin_pass(self, keysets: Mapping[str, Keyset | Any]) -> dict[str, dict[str, int]]:
        calls = self._keyset_calls(keysets, "BeginPass", lambda p: pb.BeginPassRequest(keysets=p))
        outcomes = self._fanout_outcomes(calls, idempotent=False, timeout=self._long_timeout)
        failure = self._failure(calls, outcomes, idempotent=False)
        if failure is not None:
            for (shard, _, _), o in zip(calls, outcomes, strict=True):
                if isinstance(o, grpc.RpcError):
                    continue
                try:  # undo: best effort, the original error is what the caller needs
                    self._open_streams([(shard, "EndPass", pb.EndPassRequest(wait=False))], self._timeout)
                except EmbcacheError:
                    pass
            raise failure
        with self._lock:
            self._pass_incarnations = {shard.name: reply.incarnation for (shard, _, _), reply in
                                       zip(calls, outcomes, strict=True)}
        out: dict[str, dict[str, int]] = {}
        for reply in outcomes:
            for r in reply.tables:
                acc = out.setdefault(r.table, {"keyset_rows": 0, "pinned_rows": 0})
                acc["keyset_rows"] += r.keyset_rows
                acc["pinned_rows"] += r.pinned_rows
        return out

    def end_pass(self) -> RemoteFuture:
        """Unpin the pass's rows on every shard (done when this returns); write-back goes on in the background.

        A shard that refuses the call before it had any effect (a draining server) is asked
        again, within ``retries`` and the deadline.

        Returns:
            A future of the number of rows written back, summed over shards.

        Raises:
            PassStateError: no pass is active. ShardRestartedError: a shard restarted since
                :meth:`begin_pass` and its new process holds no pass (the rows it had pinned were
                unpinned by the restart; acknowledged writes are accounted for by :meth:`flush`).
            UnavailableError, DeadlineExceededError.
        """
        calls = [(s, "EndPass", pb.EndPassRequest(wait=True)) for s in self._topo.shards]
        with self._lock:
            began, self._pass_incarnations = self._pass_incarnations, {}
        firsts: list[Any] = []
        try:
            streams = self._open_streams(calls, self._long_timeout, firsts)
        except PassStateError as exc:
            address, now = getattr(exc, "address", ""), getattr(exc, "incarnation", 0)
            shard = next((s for s in self._topo.shards if s.address == address), None)
            before = began.get(shard.name, 0) if shard is not None else 0
            if before and now and now != before:
                raise ShardRestartedError(f"end_pass: server {address} restarted since begin_pass (process "
                                          f"{before:016x} -> {now:016x}) and its new process holds no pass",
                                          address, before, now) from exc
            raise
        for (shard, _, _), first in zip(calls, firsts, strict=True):
            before = began.get(shard.name, 0)
            if before and first.incarnation and first.incarnation != before:
                raise ShardRestartedError(f"end_pass: server {shard.address} restarted since begin_pass (process "
                                          f"{before:016x} -> {first.incarnation:016x}); the pass it ended there "
                                          f"was another's", shard.address, before, first.incarnation)
        return self._finish_streams(streams, calls, lambda finals: sum(int(f.written_rows) for f in finals))

    # ------------------------------------------------------------------ batch leases
    def prefetch_batch(self, keysets: Mapping[str, Keyset | Any]) -> RemoteLease:
        """Stage the rows of one upcoming batch on the shards that own them, and lease them until ``release()``.

        As :meth:`EmbeddingCache.prefetch_batch`: each shard stages its keys in the background
        and pins them until the returned future's ``release()`` or ``cancel()``, so
        :class:`~embcache.LookAhead` runs over a client unchanged. The servers hold the lease by
        id with a time-to-live (``lease_ttl``); this client renews its leases from one background
        thread (one call per shard every third of the TTL, or a bounded wait while staging runs),
        so a crashed or cut-off client pins rows at most for the TTL. Release every lease (as
        ``LookAhead`` does): a lease neither released nor cancelled stays pinned while the client
        lives. A shard's keys above the message limit go in chunks (``PrefetchBatchStream``).

        Returns:
            A :class:`RemoteLease` (a :class:`~embcache.prefetch.PrefetchFuture`); its result is
            ``{table: {"staged_rows", "leased_rows", "seconds"}}`` summed over shards.

        Raises:
            UnknownTableError, InvalidKeysError, UnavailableError, DeadlineExceededError (the
            shards that had granted the lease are told to cancel it).
        """
        return self._rerouting(lambda: self._prefetch_batch(keysets))

    def _prefetch_batch(self, keysets: Mapping[str, Keyset | Any]) -> RemoteLease:
        ks = as_keysets(keysets)
        calls = self._keyset_calls(ks, "PrefetchBatch", lambda p: pb.PrefetchBatchRequest(
            keysets=p, ttl_seconds=self._lease_ttl), every_shard=False)
        outcomes = self._fanout_outcomes(calls, idempotent=False) if calls else []
        parts = [_LeasePart(shard, o.lease_id, o.ttl_seconds or self._lease_ttl, o.incarnation)
                 for (shard, _, _), o in zip(calls, outcomes, strict=True) if not isinstance(o, grpc.RpcError)]
        lease = RemoteLease(self._leases, parts, list(ks))
        failure = self._failure(calls, outcomes, idempotent=False)
        if failure is not None:
            lease.cancel()
            raise failure
        self._leases.add(lease)
        return lease

    # ------------------------------------------------------------------ durability and inspection
    def _settling(self, method: str, shards: Sequence[_Shard], make: Callable[[_Shard, list[int]], Any],
                  idempotent: bool) -> list[Any]:
        """Send a Flush or Checkpoint per shard, carrying the incarnations it holds receipts of; settle them.

        Raises:
            DataLossError: a shard cannot prove durable some write it acknowledged (the call
                succeeded everywhere else, or another shard's failure is named in the message).
            The embcache error of the first call that failed for good otherwise.
        """
        sent = [self._receipts.pending(s.name) for s in shards]
        # receipts of shards that left the fleet: the shards that took their rows hold their ledgers
        with self._lock:
            gone = [s for s in self._retired if s.name not in {c.name for c in shards}]
        orphans = {s.name: (s, p) for s in gone if (p := self._receipts.pending(s.name))}
        asked = sorted({inc for _, p in orphans.values() for inc in p})
        calls = [(s, method, make(s, sorted({*p, *asked}))) for s, p in zip(shards, sent, strict=True)]
        outcomes = self._fanout_outcomes(calls, idempotent, timeout=self._long_timeout)
        losses = []
        best: dict[int, int] = {}  # an orphan incarnation: the highest durable sequence any shard knows of it
        for (shard, _, _), pending, reply in zip(calls, sent, outcomes, strict=True):
            if isinstance(reply, grpc.RpcError):
                continue
            answers = [(d.incarnation, d.durable_seq, d.known) for d in reply.durable]
            losses += self._receipts.settle(shard.name, shard.address, pending, answers)
            for inc, seq, known in answers:
                if known and inc in asked:
                    best[inc] = max(seq, best.get(inc, 0))
        failure = self._failure(calls, outcomes, idempotent)
        if failure is None:  # every shard answered: what none of them knows cannot be proven durable
            for name, (shard, pending) in orphans.items():
                losses += self._receipts.settle(name, shard.address, pending,
                                                [(inc, best.get(inc, 0), inc in best) for inc in pending])
        if losses:
            raise loss_error(losses, method.lower(), failure)
        if failure is not None:
            raise failure from None
        return outcomes

    def flush(self) -> None:
        """Make every acknowledged update durable on every shard (survives kill -9), or say which may be lost.

        Each shard is asked, with the flush, about the server processes that acknowledged this
        client's writes since its last flush: a shard whose process crashed and restarted since
        (kill -9, OOM, power loss) cannot prove those writes durable, and this raises
        :class:`DataLossError` naming it and counting them instead of returning. The writes of a
        shard that left the fleet by a reshard are answered for by the shards that took its rows
        (the reshard flushed it and handed its record to them). A clean restart
        (SIGTERM) flushes first and loses nothing. A loss is reported once.

        Raises:
            DataLossError, StoreError, UnavailableError, DeadlineExceededError.
        """
        self._settling("Flush", self._topo.shards, lambda _, incs: pb.FlushRequest(incarnations=incs),
                       idempotent=True)

    def checkpoint(self, directory: str | os.PathLike[str]) -> list[str]:
        """Checkpoint every shard: ``directory`` (one shard) or ``directory/shard-<i>``, under each server's root.

        Args:
            directory: a name relative to the servers' checkpoint root (``--checkpoint-root``).

        Returns:
            The absolute paths the servers wrote, per shard.

        Raises:
            DataLossError: as :meth:`flush` (the checkpoints were written; they lack those writes).
            CheckpointExistsError, PermissionDeniedError (outside the root), StoreError, UnavailableError.
        """
        directory = os.fspath(directory)
        shards = self._topo.shards
        names = [directory] if len(shards) == 1 else [os.path.join(directory, f"shard-{i}")
                                                      for i in range(len(shards))]
        where = dict(zip((s.name for s in shards), names, strict=True))
        replies = self._settling("Checkpoint", shards, lambda s, incs: pb.CheckpointRequest(
            directory=where[s.name], incarnations=incs), idempotent=False)
        return [r.directory for r in replies]

    def stats(self) -> dict[str, dict[str, Any]]:
        """``EmbeddingCache.stats()`` summed over shards (same shape; miss-ratio estimates averaged by lookups)."""
        replies = self._fanout([(s, "Stats", pb.StatsRequest()) for s in self._topo.shards], idempotent=True)
        return _merge_stats([json.loads(r.json) for r in replies])

    def shard_stats(self) -> list[dict[str, dict[str, Any]]]:
        """``stats()`` of each shard, in :attr:`servers` order."""
        replies = self._fanout([(s, "Stats", pb.StatsRequest()) for s in self._topo.shards], idempotent=True)
        return [json.loads(r.json) for r in replies]

    def row_bytes(self, table: str) -> int:
        """Bytes of memory one resident row of ``table`` costs (weights, optimizer state, bookkeeping, key index).

        Computed from the table's definition by the formula every server of this version uses
        (``EmbeddingCache.row_bytes``), e.g. to size passes with ``embcache.keyset.split_passes``.

        Raises:
            UnknownTableError.
        """
        self._dims([table])
        with self._lock:
            cfg = self._tables[table]
        return resident_row_bytes(cfg.dim, cfg.torch_dtype, state_width(cfg.optimizer, cfg.dim))

    def capacity_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` each memory tier can hold, summed over shards: ``{"hbm": n, "ddr": m}``.

        Raises:
            UnknownTableError, UnavailableError, DeadlineExceededError.
        """
        self._dims([table])
        per = [s.get(table) for s in self.shard_stats()]
        if any(p is None for p in per):
            raise UnknownTableError(f"table {table!r} is missing on a shard; create it through this client")
        return {tier: sum(int(p[tier]["capacity_rows"]) for p in per if p is not None) for tier in ("hbm", "ddr")}

    def resident_keys(self, table: str, tier: str) -> torch.Tensor:
        """Keys (int64, CPU) of ``table`` resident in ``tier`` ("hbm" or "ddr") on any shard, for inspection.

        The shards' keys concatenated in :attr:`servers` order (each shard's in no particular
        order); each shard streams them in chunks below the message limit.

        Raises:
            ConfigError: ``tier`` is not "hbm" or "ddr". UnknownTableError, UnavailableError.
        """
        memory_tier(tier)
        self._dims([table])
        shards = self._topo.shards
        calls = [(s, "ResidentKeys", pb.ResidentKeysRequest(table=table, tier=tier)) for s in shards]
        deadline = time.monotonic() + self._timeout
        out: list[np.ndarray] = []
        for shard, call in [(s, self._stream(s, m, r, deadline)) for s, m, r in calls]:
            try:
                out += [codec.decode_tensor(m.keys, f"resident keys from {shard.address}", InvalidKeysError,
                                            ("int64",), 1) for m in call]
            except grpc.RpcError as err:
                raise error_from_rpc(err, shard.address) from None
        return torch.from_numpy(np.concatenate(out).astype(np.int64) if out else np.empty(0, dtype=np.int64))

