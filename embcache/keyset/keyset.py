"""The :class:`Keyset` type: the unique keys of one table in a pass, with their access counts.

Also what the other modules of :mod:`embcache.keyset` share: :func:`as_keysets` (keys or
keysets to keysets), :func:`merge_all` (many partial keysets into one), the error
:class:`KeysetFileError` and the path type.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..errors import InvalidKeysError
from ..keys import as_key_tensor

__all__ = ["EMPTY_KEYSET", "Keyset", "KeysetFileError", "PathLike", "as_keysets", "host_keys", "merge_all"]

#: A file path argument.
PathLike = Union[str, "os.PathLike[str]"]


class KeysetFileError(InvalidKeysError):
    """A keyset file, or a data-set file keys are read from, is missing, damaged or not what was expected."""


@dataclass(frozen=True)
class Keyset:
    """Unique keys of one table with access counts.

    Args:
        keys: int64 [n], unique, ascending; moved to the host if given on another device.
        counts: int64 [n], >= 1, accesses of each key in the pass; moved to the host likewise.
    """

    keys: torch.Tensor
    counts: torch.Tensor

    def __post_init__(self) -> None:
        # A keyset is host data (the store and the pinning code read it there); keys built on a
        # GPU would mix devices in contains() on every lookup and fail .numpy() in prefetch.
        for name in ("keys", "counts"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                object.__setattr__(self, name, value.cpu())
        if self.keys.dtype != torch.int64 or self.keys.dim() != 1:
            raise InvalidKeysError(f"keyset keys must be int64 [n], got {self.keys.dtype} {tuple(self.keys.shape)}")
        if self.counts.shape != self.keys.shape:
            raise InvalidKeysError(f"keyset counts must match keys: {tuple(self.counts.shape)} vs "
                                   f"{tuple(self.keys.shape)}")

    @staticmethod
    def from_keys(keys: Any) -> Keyset:
        """The keyset of a key stream (int64 [n], duplicates counted)."""
        k = host_keys(keys)
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
        if keys.numel() == 0:
            return self
        return _summed(keys, torch.cat([self.counts, other.counts]))

    @property
    def accesses(self) -> int:
        """Total accesses the keyset counts (the sum of ``counts``)."""
        return int(self.counts.sum()) if self.counts.numel() else 0

    def validate(self) -> None:
        """Check the invariants a computed keyset has: keys strictly ascending, counts >= 1.

        Raises:
            InvalidKeysError: keys are not strictly ascending (unsorted or duplicated) or a count is < 1.
        """
        if self.keys.numel() > 1 and not bool((self.keys[1:] > self.keys[:-1]).all()):
            raise InvalidKeysError("keyset keys must be unique and ascending")
        if self.counts.dtype != torch.int64:
            raise InvalidKeysError(f"keyset counts must be int64, got {self.counts.dtype}")
        if self.counts.numel() and int(self.counts.min()) < 1:
            raise InvalidKeysError("keyset counts must be >= 1")



def host_keys(keys: Any) -> torch.Tensor:
    """``keys`` (a tensor, array or sequence of integers, any shape) as a flat int64 tensor on the host."""
    return as_key_tensor(keys, flatten=True).to("cpu")


def _summed(keys: torch.Tensor, counts: torch.Tensor) -> Keyset:
    """The keyset of keys with counts that may repeat keys (one unique over them, their counts added)."""
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    return Keyset(uniq, torch.zeros(uniq.numel(), dtype=torch.int64).index_add_(0, inverse, counts))


def as_keysets(keysets: Mapping[str, Any]) -> dict[str, Keyset]:
    """Normalize ``{table: Keyset or keys}`` to ``{table: Keyset}`` (raw keys are counted)."""
    if not isinstance(keysets, Mapping):
        raise InvalidKeysError(f"keysets must be a mapping of table name to keys, got {type(keysets).__name__}")
    return {name: ks if isinstance(ks, Keyset) else Keyset.from_keys(ks) for name, ks in keysets.items()}


#: The keyset of no keys.
EMPTY_KEYSET = Keyset(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


def merge_all(parts: Sequence[Keyset]) -> Keyset:
    """One keyset of many partial keysets (one unique over all of them, counts added)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return EMPTY_KEYSET
    if len(parts) == 1:
        return parts[0]
    return _summed(torch.cat([p.keys for p in parts]), torch.cat([p.counts for p in parts]))
