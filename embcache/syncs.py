"""Count the host syncs a block of code makes on a real CUDA device.

A host sync (``.item()``, ``nonzero``, a blocking device-to-host copy, a copy from pageable
memory, ``synchronize``) makes the CPU wait for the GPU's queue to drain, so the CPU can no longer
run ahead of the GPU. torch reports most of them in its sync debug mode
(``torch.cuda.set_sync_debug_mode("warn")``) as a warning from the Python line that caused them;
:func:`count_syncs` turns that mode on for a block, collects the warnings of the calling thread
(background threads sync on their own time) and restores the mode and the warning filters after.

    with count_syncs() as syncs:
        cache.lookup("t", keys)
    print(len(syncs), syncs.where)   # e.g. 1 ['.../engine/lookup.py:212']

Without CUDA it counts nothing (``available`` is False). torch's own caveat applies: "not all
synchronizing operations will trigger warning", so the count is a floor.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SyncCount", "count_syncs"]

_MESSAGE = "called a synchronizing CUDA operation"
_LOCK = threading.Lock()  # one counting window at a time: the debug mode is process-wide


@dataclass
class SyncCount:
    """The syncs one :func:`count_syncs` window saw: where each was called from (``file:line``)."""

    where: list[str] = field(default_factory=list)
    available: bool = True  # False without CUDA: nothing could be counted

    def __len__(self) -> int:
        return len(self.where)


@contextlib.contextmanager
def count_syncs(all_threads: bool = False) -> Iterator[SyncCount]:
    """Count the host syncs made inside the block, by this thread (or by every thread).

    One window at a time in a process (torch's debug mode is process-wide): a window opened
    inside another, or on another thread meanwhile, waits for the first to close.

    Args:
        all_threads: count syncs made by other threads during the block too (the cache's
            prefetch worker, say); by default only the calling thread's.
    """
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "set_sync_debug_mode"):
        yield SyncCount(available=False)
        return
    record = SyncCount()
    me = threading.get_ident()
    with _LOCK, warnings.catch_warnings():
        previous_show = warnings.showwarning

        def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:
            if _MESSAGE in str(message):
                if all_threads or threading.get_ident() == me:
                    record.where.append(f"{filename}:{lineno}")
                return
            previous_show(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=".*" + _MESSAGE)
        warnings.showwarning = show
        previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield record
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
