"""The CUDA fixtures on a machine with a real GPU: the stand-in's interface, backed by the device.

CI has no GPU, so the tests that take ``fakecuda`` or ``device`` run the CUDA branches under the
stand-in of tests/fakecuda.py. Where torch sees a real CUDA device, the same tests run on it
instead (``REAL_CUDA``), with a :class:`RealCuda` in place of the stand-in:

* ``count()`` windows count the calling thread's host syncs through torch's sync debug mode
  (:func:`embcache.syncs.count_syncs`). A copy from pageable host memory is a sync there, so
  it shows in ``syncs``; ``h2d`` is not observable and stays empty.
* ``pinned_bytes()`` is the pinned memory in use: what torch's pinned allocator still holds once
  its cache of free blocks is emptied (:func:`pinned_in_use`); ``is_pinned`` asks the tensor.
* What only the stand-in records (the streams a stream was told to wait for, the calls that
  empty torch's caches) is ``STAND_IN_ONLY``: such assertions are skipped on a real GPU, where
  tests/test_gpu_real.py checks the behaviour itself (a race between streams, memory given back).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from embcache.syncs import SyncCount, count_syncs

REAL_CUDA = torch.cuda.is_available()  # read at import, before any stand-in patches torch.cuda


@dataclass
class _RealWindow:
    record: SyncCount
    h2d: list[str] = field(default_factory=list)  # not observable on a real device

    @property
    def syncs(self) -> list[str]:
        return list(self.record.where)


class RealCuda:
    """The stand-in's test interface on a real device (see the module docstring)."""

    stand_in = False

    @contextlib.contextmanager
    def count(self) -> Iterator[_RealWindow]:
        with count_syncs() as record:
            yield _RealWindow(record)

    def counts(self, kind: str | None = None, thread: int | None = None) -> Counter[str]:
        raise NotImplementedError("only the stand-in records events by kind (see STAND_IN_ONLY)")

    @property
    def default_stream(self) -> Any:
        return torch.cuda.default_stream()

    def pinned_bytes(self) -> int:
        return pinned_in_use()

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() > 0 and t.is_pinned()


def pinned_in_use() -> int:
    """Bytes of pinned host memory in use: torch's pinned allocator's blocks after it gave back the free ones.

    Its ``active_bytes`` counter is no measure of this: on the H200 (torch 2.11) it read 40 MB with no
    block allocated at all (``allocated_bytes.current`` 0, ``active_bytes.freed`` negative).
    """
    torch.cuda.synchronize()  # a block is free once the copies that used it are done
    torch._C._host_emptyCache()  # free blocks go back to the system; those in use stay
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


STAND_IN_ONLY = "what the stand-in records (streams waited for, cache-emptying calls); tests/test_gpu_real.py " \
                "checks the behaviour on a real GPU"


def on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` is on the CUDA device (the stand-in's tensors report ``cuda:0`` too)."""
    return t.device.type == "cuda"
