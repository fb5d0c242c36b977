"""When acknowledged writes become durable: the server's flush policy (:class:`Durability`).

The modes (``--flush-every-updates``, ``--flush-interval-seconds``, ``--sync``; the default
flushes on request and at shutdown) are described in ``embcache-server --help``. Every flush
goes through the write ledger, which records how far this process's acknowledged writes are
durable (see :mod:`embcache.server.ledger`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..cache import EmbeddingCache
from ..errors import CacheClosedError, EmbcacheError, StoreError
from .ledger import WriteLedger

__all__ = ["Durability"]

log = logging.getLogger("embcache.server")


class Durability:
    """When acknowledged writes are flushed to the store (see ``embcache-server --help``).

    Every flush goes through the ledger, which records what it made durable (see
    :mod:`embcache.server.ledger`).

    Args:
        cache: the cache to flush.
        ledger: the server's write ledger.
        every_updates: flush in the write request that completes every N-th write request,
            before acknowledging it (0 = off).
        interval_seconds: flush from a background thread every S seconds when something was
            written (0 = off).
        sync: flush in every write request before acknowledging it.
    """

    def __init__(self, cache: EmbeddingCache, ledger: WriteLedger, every_updates: int = 0,
                 interval_seconds: float = 0.0, sync: bool = False) -> None:
        if every_updates < 0 or interval_seconds < 0:
            raise ValueError("flush_every_updates and flush_interval_seconds must be >= 0")
        self._cache = cache
        self.ledger = ledger
        self._every = every_updates
        self._interval = interval_seconds
        self._sync = sync
        self._lock = threading.Lock()
        self._count = 0
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_seconds > 0 and not sync:
            self._thread = threading.Thread(target=self._loop, name="embcache-flush", daemon=True)
            self._thread.start()

    def describe(self) -> str:
        """The mode in words (sent to clients in ServerInfo)."""
        if self._sync:
            return "sync: every write is flushed before it is acknowledged"
        parts = []
        if self._every:
            parts.append(f"flush every {self._every} write requests")
        if self._interval:
            parts.append(f"flush every {self._interval:g} s")
        return ", ".join(parts) or "flush on request (Flush, Checkpoint) and at shutdown"

    def after_write(self) -> None:
        """Account for one applied write request; flush now if the mode says so.

        Raises:
            StoreError: the flush failed (the write is applied in memory, not yet durable).
        """
        if self._sync:
            self.flush()
            return
        due = False
        with self._lock:
            self._dirty = True
            if self._every:
                self._count += 1
                if self._count >= self._every:
                    self._count, due = 0, True
        if due:
            self.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                dirty, self._dirty = self._dirty, False
            if not dirty:
                continue
            try:
                self.flush()
            except CacheClosedError:
                return
            except EmbcacheError as exc:  # the rows stay dirty in memory; the next round retries
                log.warning("periodic flush failed: %s", exc)
                with self._lock:
                    self._dirty = True

    def flush(self) -> None:
        """Flush the cache and record, in the ledger, the writes that made durable.

        Raises:
            CacheClosedError, StoreError: the flush failed (nothing is recorded).
        """
        self._flush_recorded(self._cache.flush)

    def _flush_recorded(self, fn: Callable[[], None]) -> None:
        try:
            self.ledger.flush(fn)
        except EmbcacheError:  # the flush's own (CheckpointExistsError is an OSError too)
            raise
        except OSError as exc:  # the rows are durable; the record of it is not (a full disk)
            raise StoreError(f"the flush succeeded but its record could not be written: {exc}") from exc

    def checkpoint(self, directory: str) -> None:
        """Checkpoint the cache (which flushes first) and record the flush in the ledger.

        Raises:
            CheckpointExistsError, CacheClosedError, StoreError.
        """
        self._flush_recorded(lambda: self._cache.checkpoint(directory))

    def stop(self) -> None:
        """Stop the periodic flusher (the shutdown's own flush follows)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
