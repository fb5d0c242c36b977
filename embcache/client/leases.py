"""Batch leases held on the shards: :class:`RemoteLease`, and the thread that keeps them (:class:`LeaseKeeper`).

:meth:`Client.prefetch_batch <embcache.Client.prefetch_batch>` asks the shards that own a
batch's keys to stage and pin them under a lease id with a time-to-live; the
:class:`RemoteLease` it returns is a :class:`~embcache.prefetch.PrefetchFuture` whose result is
the staging outcome summed over the shards. One background thread per client
(:class:`LeaseKeeper`) renews the live leases (one call per shard for all of them) and learns
how their staging ended; ``release()`` and ``cancel()`` send ReleaseLeases at once. See
:mod:`embcache.server.leases` for why a TTL rather than a call held per lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

import grpc

from ..errors import EmbcacheError
from ..keyset import Keyset, as_keysets
from ..prefetch import PrefetchFuture
from ..rpc.errors import ShardRestartedError, UnavailableError, error_from_name, error_from_rpc
from ..rpc.v1 import embcache_pb2 as pb
from ..validate import check_open
from .merge import combine_prefetch
from .routing import keyset_calls
from .transport import Call, Shard, Transport, log

__all__ = ["LeaseKeeper", "RemoteLease"]

#: A lease's result: ``{table: {"staged_rows", "leased_rows", "seconds"}}`` summed over shards.
Staged = dict[str, dict[str, float]]

_LeaseState = pb.LeaseStatus.State
_LEASE_WAIT_SECONDS = 2.0  # the longest a renewal waits on a server for staging to end
_LEASE_RETRY_SECONDS = 0.5  # after a failed renewal


@dataclass
class LeasePart:
    """A lease on one shard; ``status`` is its final state (not STAGING) once a reply reported it."""

    shard: Shard
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

    def __init__(self, keeper: LeaseKeeper, parts: list[LeasePart], tables: list[str]) -> None:
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

    def _outcome(self) -> tuple[bool, Staged | None, BaseException | None]:
        """``(ended, result, error)`` from the parts' reported states (called with the keeper's lock)."""
        reported = [(p, p.status) for p in self._parts if p.status is not None]
        if len(reported) < len(self._parts):
            return False, None, None
        by_state: dict[int, tuple[LeasePart, pb.LeaseStatus]] = {}
        for p, st in reported:
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
        return True, combine_prefetch([st for _, st in reported], self._tables), error

    def _end(self, result: Staged | None, error: BaseException | None) -> None:
        if isinstance(error, CancelledError):  # cancelled by a server stopping, as a closing cache cancels
            Future.cancel(self)
        else:
            self._finish(result, error)


class LeaseKeeper:
    """Renews a client's batch leases and learns how their staging ended, from one background thread.

    Each round sends one ``RenewLeases`` per shard that holds leases of this client: at once for
    a shard where some lease is staging (the server answers once one ends, or after at most 2 s),
    else every third of the shortest TTL there. The thread runs only while leases are live.

    Args:
        transport: the client's.
        ttl: the time-to-live the client asks for its leases (the servers may grant less).
    """

    def __init__(self, transport: Transport, ttl: float) -> None:
        self._transport = transport
        self._ttl = ttl
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
            lease._end(combine_prefetch([], lease._tables), None)
            return
        with self._cond:
            closed = self._closed
            if not closed:
                self._leases.append(lease)
        if closed:
            lease.cancel()
        check_open(closed, "client")
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="embcache-client-leases", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def grant(self, keysets: Mapping[str, Keyset | Any]) -> RemoteLease:
        """Ask the shards that own keys of ``keysets`` to stage and lease them; the lease, kept renewed.

        Raises:
            UnknownTableError, InvalidKeysError, UnavailableError, DeadlineExceededError (the
            shards that had granted the lease are told to cancel it), CacheClosedError.
        """
        ks = as_keysets(keysets)
        calls: list[Call] = keyset_calls(self._transport, ks, "PrefetchBatch", lambda p: pb.PrefetchBatchRequest(
            keysets=p, ttl_seconds=self._ttl), every_shard=False)
        outcomes = self._transport.fanout_outcomes(calls, idempotent=False) if calls else []
        parts = [LeasePart(shard, o.lease_id, o.ttl_seconds or self._ttl, o.incarnation)
                 for (shard, _, _), o in zip(calls, outcomes, strict=True) if not isinstance(o, grpc.RpcError)]
        lease = RemoteLease(self, parts, list(ks))
        failure = self._transport.failure(calls, outcomes, idempotent=False)
        if failure is not None:
            lease.cancel()
            raise failure
        self.add(lease)
        return lease

    def _due(self, next_renew: dict[str, float], retry_at: dict[str, float]
             ) -> tuple[dict[str, tuple[Shard, list[LeasePart], bool]], float]:
        """Per shard due now: its parts to renew and whether one is staging; and the time until the next is due.

        A shard is due when its renewal is (``next_renew``), or at once while a lease there is
        staging, unless its last call failed (then from ``retry_at``).
        """
        now = time.monotonic()
        per: dict[str, tuple[Shard, list[LeasePart], bool]] = {}
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

    def _renew(self, due: dict[str, tuple[Shard, list[LeasePart], bool]], next_renew: dict[str, float],
               retry_at: dict[str, float]) -> None:
        calls = []
        for name, (shard, parts, staging) in due.items():
            ttl = min(p.ttl for p in parts)
            wait = min(ttl / 4, _LEASE_WAIT_SECONDS) if staging else 0.0
            req = pb.RenewLeasesRequest(lease_ids=[p.lease_id for p in parts], wait_seconds=wait)
            call = shard.stub.RenewLeases.future(req, timeout=wait + max(ttl / 3, 1.0),
                                                 metadata=self._transport.metadata, wait_for_ready=False)
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

    def _apply(self, parts: list[LeasePart], statuses: list[pb.LeaseStatus]) -> None:
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
            by_shard: dict[str, tuple[Shard, list[LeasePart]]] = {}
            for p in parts:
                by_shard.setdefault(p.shard.name, (p.shard, []))[1].append(p)
            calls = [(shard, "ReleaseLeases",
                      pb.ReleaseLeasesRequest(lease_ids=[p.lease_id for p in ps], cancel=cancel))
                     for shard, ps in by_shard.values()]
            try:
                outcomes = self._transport.fanout_outcomes(calls, idempotent=True) if calls else []
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
