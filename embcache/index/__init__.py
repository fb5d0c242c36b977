"""Key -> slot index of one memory tier: batched, every operation takes tensors, none loops in Python.

A tier holds up to ``capacity`` rows in preallocated tensors; the index maps int64 keys to slot
numbers in ``[0, capacity)``. Keys may be *any* int64 value (negative, int64 min/max, beyond
2**53), so no key value can mean "empty": an entry is empty when its *slot* is -1.

Both implementations hash with the splitmix64 finalizer (:func:`mix64`, in ``embcache/_bits.py``),
a bijection of the 64-bit patterns: distinct keys never share a full hash, and patterned keys
(consecutive ids, multiples of a large power of two) spread evenly. :func:`unmix64` inverts it,
which lets tests build colliding keys on purpose.

- :mod:`~embcache.index.base`: :class:`KeyIndex`, the interface, with the per-access counting
  (``find_touch``) and row gathering (``find_touch_gather``) every index inherits.
- :mod:`~embcache.index.numba_index`: :class:`NumbaIndex`, open addressing with linear probing
  in numba kernels (CPU, the hot path); its entries hold slots and tags, the keys are the tier's.
- :mod:`~embcache.index.torch_index`: :class:`TorchIndex`, bucketed two-choice hashing in plain
  torch ops (any device, the CUDA path; also the CPU fallback without numba).

:func:`make_index` picks one for a device.

Neither class is thread-safe: the caller serializes access to an index (the cache holds a lock per
table). Concurrent ``find`` calls only read and are safe; nothing may run concurrently with an
``insert``, ``erase`` or ``clear`` of the same index.
"""

from __future__ import annotations

import warnings

import torch

from .._bits import M1 as _M1  # noqa: F401  (the tests recompute mix64 with Python ints)
from .._bits import M2 as _M2  # noqa: F401
from .._bits import mix64, unmix64
from .base import KeyIndex
from .numba_index import _CHUNK, NumbaIndex, numba_available  # noqa: F401  (_CHUNK: the tests size batches by it)
from .torch_index import TorchIndex

__all__ = ["KeyIndex", "NumbaIndex", "TorchIndex", "index_kind", "make_index", "mix64", "numba_available",
           "unmix64"]


def index_kind(device: torch.device | str) -> type[KeyIndex]:
    """The index class :func:`make_index` builds on ``device``: NumbaIndex on CPU when numba
    imports, else TorchIndex."""
    device = torch.device(device)
    return NumbaIndex if device.type == "cpu" and numba_available() else TorchIndex


def make_index(capacity: int, device: torch.device | str, slot_keys: torch.Tensor | None = None) -> KeyIndex:
    """The best index for ``device`` (:func:`index_kind`).

    Args:
        capacity: the most keys it must hold at once (>= 1).
        device: where keys and slots live.
        slot_keys: the tier's int64 [capacity] key of each slot, which a NumbaIndex reads instead
            of keeping keys itself (``None``: it keeps its own).
    """
    device = torch.device(device)
    if index_kind(device) is NumbaIndex:
        try:
            return NumbaIndex(capacity, device, slot_keys=slot_keys)
        except Exception as e:  # numba present but unusable (e.g. its LLVM fails): still work
            warnings.warn(f"NumbaIndex unavailable ({e!r}); using TorchIndex (the tier's memory budget counted "
                          "NumbaIndex's 8 bytes of index per row, TorchIndex takes about 22)",
                          RuntimeWarning, stacklevel=2)
    return TorchIndex(capacity, device)
