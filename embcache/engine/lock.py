"""A table's lock, ordered on the GPU as well as on the host."""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["TableLock"]


class TableLock:
    """A table's re-entrant lock, ordered on the GPU as well as on the host.

    The lock orders when GPU work is issued, not when it runs: the background worker (prefetch,
    end-of-pass write-back, on the cache's side stream) and a caller training on a stream of its
    own would otherwise run their kernels on the same rows in any order. On CUDA the outermost
    holder's current stream waits (on the device: no host sync) for an event recorded on the
    previous holder's stream when it left, and records one when it leaves. On the CPU it is a
    plain ``threading.RLock``.
    """

    def __init__(self, device: torch.device) -> None:
        self._lock = threading.RLock()
        self._cuda = device.type == "cuda"
        self._depth = 0  # changed only by the holder
        self._event: Any = None  # torch.cuda.Event recorded by the last holder

    def __enter__(self) -> TableLock:
        self._lock.acquire()
        self._depth += 1
        if self._cuda and self._depth == 1 and self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._cuda and self._depth == 1:
                event = torch.cuda.Event()
                event.record()  # on this holder's current stream
                self._event = event
        finally:
            self._depth -= 1
            self._lock.release()
