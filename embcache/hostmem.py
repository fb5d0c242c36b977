"""Host memory: huge pages for the big arrays read at random, and handing freed heap back to the OS.

Huge pages. A lookup reads a tier's rows, counters and key-index entries at random places in arrays far
larger than the TLB covers with 4 KiB pages, so on ordinary memory most reads miss the TLB as
well as the caches and wait for a page walk too. On 2 MiB pages they do not. Measured on this
2-core VM (585K rows, Zipf keys, one thread, median of 11 runs):

- key index ``find`` on a 32 MiB table: 10-30% more finds per second;
- gathering 8,192 rows of dim 64 at random: 0.447 -> 0.385 ms (``index_select``: 0.521 -> 0.461 ms);
- the lookup's probe + count + copy pass (its grouped form, before the rolling pipeline of
  ``index/numba_index.py``): 0.82 -> 0.76 ms per 8,192 keys at dim 64, 10.1 -> 9.5 ms per 65,536 keys at
  dim 128.

Linux gives transparent huge pages to memory marked with ``madvise(MADV_HUGEPAGE)`` (the usual
``/sys/kernel/mm/transparent_hugepage/enabled`` setting is ``madvise``). Arrays under 4 MiB, other
systems, and a refused ``madvise`` get ordinary zeroed memory: huge pages are only ever a speed-up.
The memory is private and anonymous: it is zero-filled, committed page by page as it is first
written (a tier's rows cost memory as they fill, not when the tier is made), and returned when the
last array or tensor viewing it is freed.

Heap trimming (:func:`trim_heap`): staging and write-back free large buffers from several
threads; glibc keeps them in per-thread arenas until ``malloc_trim`` hands them back.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import time
from typing import Any

import numpy as np
import torch

__all__ = ["HUGE_PAGE", "host_zeros", "huge_page_zeros", "trim_heap"]

HUGE_PAGE = 1 << 21
_MIN_BYTES = 2 * HUGE_PAGE  # below this a huge page would mostly be padding


def huge_page_zeros(nbytes: int) -> np.ndarray:
    """A zeroed, writable uint8 array of ``nbytes``, 2 MiB-aligned on transparent huge pages where possible."""
    if nbytes < _MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(nbytes, dtype=np.uint8)
    try:
        # Private anonymous memory: zero-filled, freed with the array (shared memory would be
        # shmem, which gets no transparent huge pages by default).
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = (-np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data) % HUGE_PAGE
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except (OSError, ValueError):
        return np.zeros(nbytes, dtype=np.uint8)
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor (any dtype, bfloat16 included) on huge pages where possible."""
    numel = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if numel * itemsize < _MIN_BYTES:  # huge_page_zeros would give plain memory too, but an empty
        return torch.zeros(shape, dtype=dtype)  # byte tensor (stride 0) cannot be viewed as a wider dtype
    raw = torch.from_numpy(huge_page_zeros(numel * itemsize))
    return raw.view(dtype).reshape(shape)


def trim_heap() -> None:
    """Hand freed heap memory back to the OS soon (glibc's ``malloc_trim``; elsewhere nothing).

    Staging and write-back allocate and free chunk buffers from several threads; glibc keeps
    the freed pages in per-thread arenas, so the process's resident memory grew by their sum
    and stayed there (measured in ``bench/bench_big.py``). Called after each background job;
    trims at most once per ``_TRIM_INTERVAL`` seconds, and a request inside the interval is
    served when it ends. Trimming after every job cost a back-to-back pass pipeline a third of
    its speed (HBM 1% / DDR 10%, d64 B8K: 1.3-1.8 s per two-pass segment without trimming,
    1.8-2.7 s with): the next job page-faults the returned memory in again.
    """
    with _TRIM_LOCK:
        if _TRIM_STATE["timer"] is not None:
            return  # a trim is already due
        wait = _TRIM_STATE["last"] + _TRIM_INTERVAL - time.monotonic()
        if wait > 0:
            timer = threading.Timer(wait, _trim_now)
            timer.daemon = True
            _TRIM_STATE["timer"] = timer
            timer.start()
            return
        _TRIM_STATE["last"] = time.monotonic()
    _malloc_trim()


def _trim_now() -> None:
    with _TRIM_LOCK:
        _TRIM_STATE["timer"] = None
        _TRIM_STATE["last"] = time.monotonic()
    _malloc_trim()


def _malloc_trim() -> None:
    trim = _MALLOC_TRIM[0]
    if trim is None:
        try:
            trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            trim = False
        _MALLOC_TRIM[0] = trim
    if trim:
        trim(0)


_MALLOC_TRIM: list[Any] = [None]
_TRIM_INTERVAL = 5.0
_TRIM_LOCK = threading.Lock()
_TRIM_STATE: dict[str, Any] = {"last": -math.inf, "timer": None}
