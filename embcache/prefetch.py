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
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from .cache import EmbeddingCache

__all__ = ["LookAhead", "PrefetchFuture"]

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


class LookAhead(Generic[T]):
    """Iterate over ``batches`` while the rows of the next ``depth`` batches are staged and leased.

    Args:
        cache: an :class:`~embcache.EmbeddingCache`.
        batches: the loader (any iterable).
        keys_of: ``fn(batch) -> {table: keys}``, the keys the batch will look up.
        depth: batches staged ahead (>= 1).
        wait: before yielding a batch, wait until its rows are staged (its lookups then never
            read the store twice); by default a batch whose staging is late goes ahead and its
            lookups read what is missing themselves.

    A batch's lease is released when the next batch is requested (the loop has looked it up and
    applied its gradients), when the loop stops early, or when the iterator is closed; leases of
    batches never reached are cancelled. Nothing stays pinned after the loop.

    Raises:
        ValueError: ``depth`` < 1.
        The staging error of a batch, when that batch is reached.
    """

    def __init__(self, cache: EmbeddingCache, batches: Iterable[T],
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
                    if self._wait or lease.done():
                        lease.result()  # raises the staging error, if any

                    yield batch
                finally:
                    lease.release()
        finally:
            for _, lease in window:
                lease.cancel()
