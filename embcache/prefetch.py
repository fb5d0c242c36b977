"""Background staging of rows: prefetch futures, batch leases and a look-ahead loader wrapper.

:meth:`EmbeddingCache.prefetch` stages the keyset of the next pass while the current one
trains; :meth:`EmbeddingCache.prefetch_batch` stages the keys of one upcoming batch and holds
them (a *lease*) until released. Both return a :class:`PrefetchFuture`. Staged rows are pinned
(never evicted) until the future is released: by the next ``begin_pass`` for a pass prefetch, by
``release()`` or ``cancel()`` for a lease. :class:`LookAhead` wraps a data loader, leases the
rows of the next ``depth`` batches and releases each lease once its batch is done.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, wait
from typing import Any, Generic, Protocol, TypeVar

import torch

__all__ = ["BatchStager", "LookAhead", "PrefetchFuture"]

T = TypeVar("T")


class PrefetchFuture(Future):  # type: ignore[type-arg]
    """A background staging job; ``result()`` gives ``{table: {"staged_rows", "leased_rows", "seconds"}}``.

    ``cancel()`` stops the staging at the next chunk (it works while the job runs, unlike a plain
    ``concurrent.futures.Future``) and releases the rows it pinned; ``release()`` releases them
    and keeps the result. Errors of the job surface in ``result()`` (and, for a pass prefetch,
    at the next ``begin_pass``).
    """

    def __init__(self, release: Callable[[PrefetchFuture], None]) -> None:
        super().__init__()
        self._stop = threading.Event()
        self._release_fn = release
        # keys pinned per table; changed only under that table's lock
        self.pinned: dict[str, list[torch.Tensor]] = {}

    @property
    def stopping(self) -> bool:
        """True once cancelled or released: the job pins nothing more."""
        return self._stop.is_set()

    def cancel(self) -> bool:
        """Stop staging and release the pinned rows; True unless the job had already finished."""
        self._stop.set()
        stopped = super().cancel()
        self.release()
        return stopped

    def release(self) -> None:
        """Unpin the rows this job staged (idempotent); they stay cached but may be evicted again."""
        self._stop.set()
        self._release_fn(self)

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Complete the future unless it was cancelled meanwhile."""
        if self.cancelled():
            return
        try:
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(result)
        except Exception:  # cancelled between the check and the set: keep the cancellation
            pass


class BatchStager(Protocol):
    """What :class:`LookAhead` needs of a cache: ``prefetch_batch`` (an EmbeddingCache or an embcache.Client)."""

    def prefetch_batch(self, keysets: Mapping[str, Any]) -> PrefetchFuture:
        """Stage and lease the rows of one batch; the lease is held until ``release()`` or ``cancel()``."""
        ...


class LookAhead(Generic[T]):
    """Iterate over ``batches`` while the rows of the next ``depth`` batches are staged and leased.

    Args:
        cache: an :class:`~embcache.EmbeddingCache`, or an :class:`~embcache.Client` (the servers
            hold the leases; see :meth:`~embcache.Client.prefetch_batch`).
        batches: the loader (any iterable).
        keys_of: ``fn(batch) -> {table: keys}``, the keys the batch will look up.
        depth: batches staged ahead (>= 1).
        wait: before yielding a batch, wait until its rows are staged (its lookups then never
            read the store twice); by default a batch whose staging is late goes ahead and its
            lookups read what is missing themselves.

    While the loop works on a batch, that batch's lease and the leases of the next ``depth``
    batches are held (at most ``depth + 1`` batches pinned). A batch's lease is released when
    the next batch is requested (the loop has looked it up and applied its gradients, or skipped
    it), when the loop stops early, or when the iterator is closed; leases of batches never
    reached are cancelled. Nothing stays pinned after the loop.

    Staging errors are never dropped while the loop runs. With ``wait=True``, or when a batch's
    staging has already ended when the batch comes up, its error is raised instead of yielding
    that batch. With ``wait=False`` a batch may be yielded while its staging still runs; once
    that staging ends, its error is raised when the loop asks for a following batch: at the
    first request after the staging failed (the lease is released first, and the next batch is
    not yielded), and at the latest when the batches run out, where the iterator waits for the
    staging jobs it released before it stops. A training loop thus learns of a failing store at a
    batch boundary, after the batch it was working on is done (that batch's lookups read what
    was missing themselves). Errors of staging that ends after the loop was left early (a
    ``break``, an exception, ``close()``) are not raised: the loop is over.

    Raises:
        ValueError: ``depth`` < 1.
        The staging error of a batch (a ``StoreError``, say), as described above.
    """

    def __init__(self, cache: BatchStager, batches: Iterable[T],
                 keys_of: Callable[[T], Mapping[str, Any]], depth: int = 2, wait: bool = False) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._cache = cache
        self._batches = batches
        self._keys_of = keys_of
        self._depth = depth
        self._wait = wait

    def __iter__(self) -> Iterator[T]:
        source = iter(self._batches)
        window: deque[tuple[T, PrefetchFuture]] = deque()
        # released leases whose staging had not ended when their batch was yielded (wait=False)
        unchecked: list[PrefetchFuture] = []

        def fill() -> None:
            while len(window) < self._depth:
                try:
                    batch = next(source)
                except StopIteration:
                    return
                window.append((batch, self._cache.prefetch_batch(self._keys_of(batch))))

        try:
            fill()
            while window:
                batch, lease = window.popleft()
                try:
                    fill()
                    checked = self._wait or lease.done()
                    if checked:
                        lease.result()  # raises the staging error, if any
                    yield batch
                finally:
                    lease.release()
                if not checked:
                    unchecked.append(lease)
                _raise_staging_error(unchecked, block=False)
            _raise_staging_error(unchecked, block=True)
        finally:
            for _, lease in window:
                lease.cancel()


def _raise_staging_error(leases: list[PrefetchFuture], block: bool) -> None:
    """Drop the leases whose staging has ended (with ``block``, after waiting for all) and raise
    the first error among them; cancelled ones (the cache was closed) raise nothing."""
    if block and leases:
        wait(leases)
    done = [lease.done() for lease in leases]  # once: a lease may end between two looks
    ended = [lease for lease, d in zip(leases, done, strict=True) if d]
    leases[:] = [lease for lease, d in zip(leases, done, strict=True) if not d]
    for lease in ended:
        error = None if lease.cancelled() else lease.exception()
        if error is not None:
            raise error
