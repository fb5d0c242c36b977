"""Batch leases held by the server for remote clients (``EmbeddingCache.prefetch_batch`` over gRPC).

A lease stages one batch's rows in the background and pins them until the client releases it.
The client is another process that may crash or lose the network without a word, so every lease
has a time-to-live: a client renews its leases (one ``RenewLeases`` call per shard for all of them,
every third of the TTL) and a lease that goes a whole TTL without a renewal is cancelled here,
its staging stopped and its rows unpinned. A crashed client thus pins rows for at most its TTL
(30 s by default, at most ``--max-lease-seconds``), plus one tick of the reaper (0.1 s).

Why a TTL and not the lifetime of a call: the server is a synchronous gRPC server, which runs
each call on a thread of its pool for as long as the call lives. A lease held by an open call
would hold a pool thread for as long as the batch trains; a ``LookAhead`` of depth 2 holds three
leases, so three clients would take the whole default pool of 8 threads, and the next call of any
client would wait. A call's end also says little about a client whose host vanished without
closing its connection: gRPC notices only when its keepalive gives up. With a TTL a held lease
costs no thread at all: it is an entry in a dict, checked by one reaper thread; a renewal is a
short call (or a bounded long poll, see :meth:`LeaseTable.renew`), and a client that is briefly
cut off keeps its pins as long as a renewal gets through within the TTL.

How staging ended must still reach the client after it released a lease whose staging was
still running (:class:`~embcache.LookAhead` raises staging errors at the next batch boundary), so
a released lease stays here, without pins, while the client renews it, and for 5 s after a reply
reported its final state (a reply racing it, a release against a renewal, still finds it).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..cache import EmbeddingCache
from ..keyset import Keyset
from ..prefetch import PrefetchFuture
from ..rpc.codec import prefetch_results
from ..rpc.errors import status_of
from ..rpc.v1 import embcache_pb2 as pb

__all__ = ["DEFAULT_TTL_SECONDS", "MAX_WAIT_SECONDS", "MIN_TTL_SECONDS", "LeaseTable"]

log = logging.getLogger("embcache.server")

#: Time-to-live of a lease whose request asks for none (ttl_seconds 0).
DEFAULT_TTL_SECONDS = 30.0
#: The shortest time-to-live granted (shorter requests get this).
MIN_TTL_SECONDS = 0.5
#: The longest a RenewLeases call waits for staging to end.
MAX_WAIT_SECONDS = 10.0
_REAPER_TICK_SECONDS = 0.1
_REPORTED_KEEP_SECONDS = 5.0  # a released lease is kept this long after a reply reported its final state
_State = pb.LeaseStatus.State


@dataclass
class _Lease:
    future: PrefetchFuture
    ttl: float
    expires: float
    released: bool = False


class LeaseTable:
    """The batch leases of one :class:`~embcache.EmbeddingCache`, by id, with a reaper for expired ones.

    Args:
        cache: the cache whose ``prefetch_batch`` stages and pins the rows.
        max_ttl: the longest time-to-live granted, seconds (requests above get this).
        default_ttl: the time-to-live of a request that asks for none (at most ``max_ttl``).
        clock: monotonic seconds (tests pass a fake one; the reaper thread then runs only when
            ``reaper=True``).
        reaper: start the thread that cancels expired leases every 0.1 s (tests may call
            :meth:`expire` themselves instead).

    Raises:
        ValueError: ``max_ttl`` below the minimum TTL (0.5 s) or not finite.
    """

    def __init__(self, cache: EmbeddingCache, max_ttl: float = 600.0, default_ttl: float = DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic, reaper: bool = True) -> None:
        if not math.isfinite(max_ttl) or max_ttl < MIN_TTL_SECONDS:
            raise ValueError(f"max_ttl must be a finite number of seconds >= {MIN_TTL_SECONDS}, got {max_ttl}")
        self._cache = cache
        self.max_ttl = float(max_ttl)
        self.default_ttl = min(float(default_ttl), self.max_ttl)
        self._clock = clock
        self._cond = threading.Condition()
        self._leases: dict[str, _Lease] = {}
        self._interrupted = False
        self.expired_total = 0  # leases cancelled because their TTL ran out (for logs and tests)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        if reaper:
            self._reaper = threading.Thread(target=self._reap, name="embcache-lease-reaper", daemon=True)
            self._reaper.start()

    def __len__(self) -> int:
        """Leases held here (released ones whose outcome is not reported yet included)."""
        with self._cond:
            return len(self._leases)

    def grant(self, ttl: float) -> float:
        """The time-to-live granted for a requested ``ttl`` (0, negative or NaN: the default)."""
        if not ttl > 0:
            return self.default_ttl
        return min(max(float(ttl), MIN_TTL_SECONDS), self.max_ttl)

    def open(self, keysets: Mapping[str, Keyset], ttl: float) -> tuple[str, float]:
        """Start staging ``keysets`` under a new lease; returns ``(lease id, TTL granted)``.

        Raises:
            The errors of ``EmbeddingCache.prefetch_batch`` (UnknownTableError, InvalidKeysError,
            CacheClosedError); nothing is held then.
        """
        future = self._cache.prefetch_batch(keysets)
        granted = self.grant(ttl)
        lease_id = uuid.uuid4().hex
        with self._cond:
            self._leases[lease_id] = _Lease(future, granted, self._clock() + granted)
        future.add_done_callback(self._wake)
        return lease_id, granted

    def _wake(self, _: object) -> None:
        with self._cond:
            self._cond.notify_all()

    def renew(self, lease_ids: Sequence[str], wait: float = 0.0) -> list[pb.LeaseStatus]:
        """Extend each listed lease by its TTL; their states, in order (UNKNOWN for ids not held).

        With ``wait`` > 0 (seconds, at most 10), returns once a listed lease that is staging
        ends, or after ``wait``: one call tells a client when staging ends, without a call held
        per lease. Released leases whose final state this reply reports are forgotten 5 s later
        (unless renewed again).
        """
        wait = min(wait, MAX_WAIT_SECONDS) if wait > 0 else 0.0
        with self._cond:
            now = self._clock()
            held = [self._leases.get(i) for i in lease_ids]
            for lease in held:
                if lease is not None:
                    lease.expires = now + lease.ttl
            staging = [lease.future for lease in held if lease is not None and not lease.future.done()]
            if wait and staging:
                deadline = time.monotonic() + wait
                while not self._interrupted and all(not f.done() for f in staging):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            return self._report(lease_ids)

    def release(self, lease_ids: Sequence[str], cancel: bool = False) -> list[pb.LeaseStatus]:
        """Unpin the listed leases' rows (``cancel``: also stop their staging); their states after it, in order.

        Idempotent. A released lease whose staging still runs stays (without pins) until a reply
        reports how its staging ended.
        """
        with self._cond:
            todo = []
            for i in lease_ids:
                lease = self._leases.get(i)
                if lease is not None and (not lease.released or cancel):
                    lease.released = True
                    todo.append(lease.future)
        for future in todo:  # outside our lock: unpinning takes the tables' locks
            if cancel:
                future.cancel()
            else:
                future.release()
        with self._cond:
            return self._report(lease_ids)

    def _report(self, lease_ids: Sequence[str]) -> list[pb.LeaseStatus]:
        """States of the listed leases; released ones in a final state expire 5 s later (called with the lock)."""
        out = []
        now = self._clock()
        for i in lease_ids:
            lease = self._leases.get(i)
            status = _status(i, lease)
            if lease is not None and lease.released and status.state != _State.STAGING:
                lease.expires = min(lease.expires, now + _REPORTED_KEEP_SECONDS)
            out.append(status)
        return out

    def expire(self) -> int:
        """Cancel the leases whose TTL ran out (their rows unpinned) and forget them; returns how many held pins."""
        now = self._clock()
        with self._cond:
            gone = [(i, lease) for i, lease in self._leases.items() if lease.expires <= now]
            for i, _ in gone:
                del self._leases[i]
        pinned = [(i, lease) for i, lease in gone if not lease.released]
        for i, lease in pinned:
            lease.future.cancel()
            log.info("batch lease %s expired after %.1f s without a renewal: staging stopped, rows unpinned",
                     i, lease.ttl)
        self.expired_total += len(pinned)
        return len(pinned)

    def _reap(self) -> None:
        while not self._stop.wait(_REAPER_TICK_SECONDS):
            try:
                self.expire()
            except Exception:  # never let the reaper die: pins would stay forever
                log.exception("expiring batch leases failed; trying again")

    def interrupt(self) -> None:
        """Wake every waiting :meth:`renew` and make later ones return at once (the server is stopping)."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the reaper and cancel every lease (their rows unpinned). Idempotent."""
        self.interrupt()
        self._stop.set()
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join()
        with self._cond:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            lease.future.cancel()


def _status(lease_id: str, lease: _Lease | None) -> pb.LeaseStatus:
    if lease is None:
        return pb.LeaseStatus(lease_id=lease_id, state=_State.UNKNOWN)
    future = lease.future
    if not future.done():
        return pb.LeaseStatus(lease_id=lease_id, state=_State.STAGING)
    if future.cancelled():
        return pb.LeaseStatus(lease_id=lease_id, state=_State.CANCELLED)
    error = future.exception()
    if error is not None:
        return pb.LeaseStatus(lease_id=lease_id, state=_State.FAILED, error_type=status_of(error)[1],
                              error_message=str(error))
    return pb.LeaseStatus(lease_id=lease_id, state=_State.DONE, tables=prefetch_results(future.result()))
