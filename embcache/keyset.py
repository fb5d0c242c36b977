"""Keysets: the unique keys of a pass (per table) with their access counts.

A pass's keyset is what :meth:`EmbeddingCache.prefetch` stages and :meth:`EmbeddingCache.begin_pass`
pins. Counts order the keys when not all of them fit in memory: the most frequent go first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import InvalidKeysError

__all__ = ["Keyset", "as_keysets"]


@dataclass(frozen=True)
class Keyset:
    """Unique keys of one table with access counts.

    Args:
        keys: int64 [n], unique, ascending (CPU).
        counts: int64 [n], >= 1, accesses of each key in the pass.
    """

    keys: torch.Tensor
    counts: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.dtype != torch.int64 or self.keys.dim() != 1:
            raise InvalidKeysError(f"keyset keys must be int64 [n], got {self.keys.dtype} {tuple(self.keys.shape)}")
        if self.counts.shape != self.keys.shape:
            raise InvalidKeysError(f"keyset counts must match keys: {tuple(self.counts.shape)} vs "
                                   f"{tuple(self.keys.shape)}")

    @staticmethod
    def from_keys(keys: Any) -> Keyset:
        """The keyset of a key stream (int64 [n], duplicates counted)."""
        k = _as_key_tensor(keys)
        if k.numel() == 0:
            return Keyset(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        uniq, counts = torch.unique(k, sorted=True, return_counts=True)
        return Keyset(uniq, counts.to(torch.int64))

    def __len__(self) -> int:
        return int(self.keys.numel())

    def hottest_first(self) -> torch.Tensor:
        """Keys ordered by count, most frequent first (ties by key, so the order is deterministic)."""
        order = torch.argsort(self.counts, descending=True, stable=True)
        return self.keys[order]

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """Bool [m]: which of ``keys`` (int64 [m], CPU) are in this keyset."""
        if self.keys.numel() == 0:
            return torch.zeros(keys.shape, dtype=torch.bool)
        pos = torch.searchsorted(self.keys, keys).clamp_(max=self.keys.numel() - 1)
        return self.keys[pos] == keys

    def merge(self, other: Keyset) -> Keyset:
        """The keyset of both streams (counts added)."""
        keys = torch.cat([self.keys, other.keys])
        counts = torch.cat([self.counts, other.counts])
        if keys.numel() == 0:
            return self
        uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        summed = torch.zeros(uniq.numel(), dtype=torch.int64).index_add_(0, inverse, counts)
        return Keyset(uniq, summed)


def _as_key_tensor(keys: Any) -> torch.Tensor:
    if isinstance(keys, torch.Tensor):
        t = keys
    else:
        arr = np.asarray(keys)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise InvalidKeysError(f"keys must be integers, got dtype {arr.dtype}")
        t = torch.from_numpy(arr.astype(np.int64, copy=False))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidKeysError(f"keys must be an integer tensor, got dtype {t.dtype}")
    return t.reshape(-1).to("cpu", torch.int64)


def as_keysets(keysets: Mapping[str, Any]) -> dict[str, Keyset]:
    """Normalize ``{table: Keyset or keys}`` to ``{table: Keyset}`` (raw keys are counted)."""
    if not isinstance(keysets, Mapping):
        raise InvalidKeysError(f"keysets must be a mapping of table name to keys, got {type(keysets).__name__}")
    return {name: ks if isinstance(ks, Keyset) else Keyset.from_keys(ks) for name, ks in keysets.items()}
