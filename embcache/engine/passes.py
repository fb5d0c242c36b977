"""Passes and prefetch: background staging of the next pass's keyset, leases, begin_pass/end_pass.

A prefetch job stages a keyset's rows on the cache's one background worker, chunk by chunk: the
store is read without the table's lock (writes meanwhile are logged, and rows written while
being read are read again), then each chunk is placed and pinned under the lock. A pass pins
its keyset until :meth:`Passes.end`, which unpins and writes dirty rows back in the background.
A batch lease (``prefetch_batch``) pins until its future is released.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch

from ..errors import PassStateError
from ..hostmem import trim_heap
from ..keyset import Keyset
from ..prefetch import PrefetchFuture
from ..validate import check_open
from . import durability
from .table import STAGE_CHUNK, TableEngine

__all__ = ["Passes", "all_locked"]

_EMPTY = torch.empty(0, dtype=torch.int64)


@contextmanager
def all_locked(global_lock: threading.RLock, tables: Mapping[str, TableEngine]) -> Iterator[None]:
    """Hold the cache's lock and every table's lock (in name order: no deadlock between holders)."""
    with ExitStack() as stack:
        stack.enter_context(global_lock)
        for name in sorted(tables):
            stack.enter_context(tables[name].lock)
        yield


class Passes:
    """The pass protocol and the background worker of one cache.

    Args:
        tables: the cache's tables (the same dict: tables added later are seen).
        global_lock: the cache's lock (guards this object's fields).
        device: the cache's device (on CUDA the worker runs on a side stream of its own).
    """

    def __init__(self, tables: Mapping[str, TableEngine], global_lock: threading.RLock,
                 device: torch.device) -> None:
        self._tables = tables
        self._lock = global_lock
        self._device = device
        self.closed = False  # set by the cache when it closes
        self._worker: ThreadPoolExecutor | None = None
        self._side_stream: Any = None  # the worker's CUDA stream (made on first use)
        self._prefetches: list[PrefetchFuture] = []  # pass prefetches the next begin_pass adopts
        # unfinished prefetches: when each was submitted (monotonic seconds) and its tables
        self._live: dict[PrefetchFuture, tuple[float, frozenset[str]]] = {}
        self.active = False

    # ------------------------------------------------------------------ the worker
    def _worker_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embcache-prefetch")
            return self._worker

    def _background(self) -> AbstractContextManager[Any]:
        """Context for the worker's jobs: on CUDA, the cache's side stream (ordered with callers
        by the table locks' events), not the stream the worker thread happens to have."""
        if self._device.type != "cuda":
            return contextlib.nullcontext()
        with self._lock:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self._device)
        return torch.cuda.stream(self._side_stream)

    def stop(self) -> None:
        """Cancel staging jobs and wait for the worker (queued write-backs still run)."""
        with self._lock:
            live, worker, self._worker = list(self._live), self._worker, None
        for fut in live:
            fut.cancel()
        if worker is not None:
            worker.shutdown(wait=True)

    def unfinished(self) -> list[PrefetchFuture]:
        """The prefetches not finished yet."""
        with self._lock:
            return list(self._live)

    def pending(self) -> list[PrefetchFuture]:
        """The pass prefetches the next :meth:`begin` adopts."""
        with self._lock:
            return list(self._prefetches)

    def running_seconds(self, now: float) -> dict[str, float]:
        """Per table, the age of its oldest unfinished prefetch (queued or staging)."""
        with self._lock:
            live = list(self._live.values())
        return {name: max((now - t0 for t0, names in live if name in names), default=0.0) for name in self._tables}

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, ks: dict[str, Keyset], lease: bool) -> PrefetchFuture:
        """Stage ``ks`` in the background; a lease (``prefetch_batch``) holds its pins until released,
        a pass prefetch until the next :meth:`begin` adopts them."""
        fut = PrefetchFuture(self._release)

        def job() -> None:
            out: dict[str, dict[str, float]] = {}
            try:
                with self._background():
                    for name, keyset in ks.items():
                        if fut.stopping:
                            break
                        out[name] = self._prefetch_table(self._tables[name], keyset, fut)
            except BaseException as exc:
                fut._finish(error=exc)
            else:
                fut._finish(out)
            finally:
                trim_heap()

        with self._lock:
            self._live[fut] = (time.monotonic(), frozenset(ks))
            if not lease:
                self._prefetches.append(fut)

        def forget(_: object) -> None:
            with self._lock:
                self._live.pop(fut, None)

        fut.add_done_callback(forget)
        self._worker_pool().submit(job)
        return fut

    def _release(self, fut: PrefetchFuture) -> None:
        for t in self._tables.values():
            with t.lock:
                keys = fut.pinned.pop(t.cfg.name, [])
                if keys and not t.closed:
                    t.pin(torch.cat(keys), -1)

    @staticmethod
    def _pin_for(fut: PrefetchFuture, t: TableEngine, keys: torch.Tensor) -> None:
        if keys.numel():
            t.pin(keys, 1)
            fut.pinned.setdefault(t.cfg.name, []).append(keys.clone())

    def _prefetch_table(self, t: TableEngine, ks: Keyset, fut: PrefetchFuture) -> dict[str, float]:
        """Stage one table's keyset in chunks; the store is read without the table's lock."""
        t0 = time.perf_counter()
        order = ks.hottest_first()
        with t.lock:
            t.check_open()  # closed before the job started
            resident = t.resident(order)
            if fut.stopping:
                return {"staged_rows": 0, "leased_rows": 0, "seconds": 0.0}
            self._pin_for(fut, t, order[resident])
            room = t.hbm.capacity + t.ddr.capacity - t.pinned_rows()
            todo = order[~resident][:max(room, 0)]
        leased, staged = int(resident.sum()), 0
        for start in range(0, todo.numel(), STAGE_CHUNK):
            chunk = todo[start:start + STAGE_CHUNK]
            with t.lock:
                if fut.stopping or t.closed:
                    break
                mark = t.rows.watch()
            try:
                read = t.rows.read(chunk)
            finally:
                with t.lock:
                    written = t.rows.unwatch(mark)
            with t.lock:
                if fut.stopping or t.closed:
                    break
                t.rows.count(read)
                weights, state = read.weights, read.state
                resident = t.resident(chunk)  # looked up or updated meanwhile: memory is authoritative
                self._pin_for(fut, t, chunk[resident])
                leased += int(resident.sum())
                keep = ~resident
                if written is not None:  # written while we read: our copy may be stale, read it again
                    stale = torch.isin(chunk, written) & keep
                    if bool(stale.any()):
                        again = t.rows.read_counted(chunk[stale])
                        weights[stale], state[stale] = again.weights, again.state
                keys = chunk[keep]
                n = keys.numel()
                rows = t.stage_meta(keys, None, 0.0, t.clock.now, weights[keep], state[keep])
                # free HBM first, then DDR over unpinned rows, then HBM over unpinned rows
                a = min(n, t.hbm.free)
                b = min(n - a, t.ddr.capacity - t.ddr.pinned_count())
                c = min(n - a - b, t.hbm.capacity - t.hbm.pinned_count() - t.hbm.free)
                if a + b + c == 0:
                    break
                keys_h = torch.cat([keys[:a], keys[a + b:a + b + c]])
                placed = t.arrange(keys_h, keys[a:a + b], pool=rows, pin=True)
                if placed.numel():
                    fut.pinned.setdefault(t.cfg.name, []).append(placed)
                staged += placed.numel()
        seconds = time.perf_counter() - t0
        with t.lock:
            t.stats.prefetch_rows += staged
            t.stats.prefetch_seconds += seconds
        return {"staged_rows": staged, "leased_rows": leased, "seconds": seconds}

    # ------------------------------------------------------------------ passes
    def begin(self, ks: dict[str, Keyset]) -> dict[str, dict[str, int]]:
        """:meth:`EmbeddingCache.begin_pass` on checked keysets."""
        with self._lock:
            if self.active:
                raise PassStateError("a pass is already active; call end_pass() before begin_pass()")
            pending, self._prefetches = self._prefetches, []
        error: BaseException | None = None
        wait_from = time.perf_counter()
        for f in pending:
            try:
                f.result()
            except CancelledError:
                pass
            except BaseException as exc:
                error = error or exc
        waited = time.perf_counter() - wait_from
        if error is not None:
            for f in pending:
                f.release()
            raise error
        report: dict[str, dict[str, int]] = {}
        with all_locked(self._lock, self._tables):
            check_open(self.closed)
            if self.active:
                raise PassStateError("a pass is already active; call end_pass() before begin_pass()")
            for f in pending:  # adopt: the pass pins these rows itself below
                f.release()
            try:
                for name, keyset in ks.items():
                    t = self._tables[name]
                    t.stats.passes += 1
                    t.stats.pass_wait_seconds += waited
                    t.pass_keyset = keyset
                    t.pass_pinned = self._begin_table(t, keyset)
                    report[name] = {"keyset_rows": len(keyset), "pinned_rows": int(t.pass_pinned.numel())}
            except BaseException:
                self._unpin_passes()
                raise
            self.active = True
        return report

    def _unpin_passes(self) -> None:
        for t in self._tables.values():
            t.pin(t.pass_pinned, -1)
            t.pass_pinned, t.pass_keyset = _EMPTY, None

    @staticmethod
    def _begin_table(t: TableEngine, ks: Keyset) -> torch.Tensor:
        """Arrange one table for a pass (hottest keys in HBM, the next in DDR) and pin; the keys pinned."""
        order = ks.hottest_first()
        h = max(t.hbm.capacity - t.hbm.pinned_count(), 0)
        d = max(t.ddr.capacity - t.ddr.pinned_count(), 0)
        order = order[:h + d]
        pinned = [_EMPTY]
        try:
            for part, to_hbm in ((order[:h], True), (order[h:], False)):
                for start in range(0, part.numel(), STAGE_CHUNK):
                    chunk = part[start:start + STAGE_CHUNK]
                    pinned.append(t.arrange(chunk if to_hbm else _EMPTY, _EMPTY if to_hbm else chunk,
                                            pin=True, wanted=ks))
        except BaseException:
            t.pin(torch.cat(pinned), -1)
            raise
        return torch.cat(pinned)

    def end(self) -> Future[int]:
        """:meth:`EmbeddingCache.end_pass`."""
        with all_locked(self._lock, self._tables):
            check_open(self.closed)
            if not self.active:
                raise PassStateError("no pass is active; call begin_pass(keysets) first")
            self._unpin_passes()
            self.active = False
        fut: Future[int] = Future()

        def job() -> None:
            try:
                with self._background():
                    written = sum(durability.write_back(t) for t in list(self._tables.values()))
                fut.set_result(written)
            except BaseException as exc:
                fut.set_exception(exc)
            finally:
                trim_heap()

        self._worker_pool().submit(job)
        return fut
