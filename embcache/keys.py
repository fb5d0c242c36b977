"""One check for keys, shared by the embedded cache, the client and keysets.

Keys are int64 (any value, negative and above 2^53 included). Callers may pass a torch tensor,
a numpy array or a sequence of any integer dtype; they get an int64 tensor back or a typed
:class:`~embcache.errors.InvalidKeysError` / :class:`~embcache.errors.BatchTooLargeError`
that says what was wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import BatchTooLargeError, InvalidKeysError

__all__ = ["as_key_tensor"]

_INT64_MAX = np.iinfo(np.int64).max


def as_key_tensor(keys: Any, max_batch_keys: int | None = None, flatten: bool = False) -> torch.Tensor:
    """``keys`` as an int64 tensor (a tensor stays on its device; anything else lands on the CPU).

    Args:
        keys: a tensor, numpy array or sequence of integers.
        max_batch_keys: the most keys allowed (None: no limit).
        flatten: accept any shape and flatten it; otherwise keys must be 1-D.

    Raises:
        InvalidKeysError: not integers (bool, floating and complex dtypes included), uint64 values
            above 2^63 - 1, or not 1-D (without ``flatten``).
        BatchTooLargeError: more than ``max_batch_keys`` keys.
    """
    if isinstance(keys, torch.Tensor):
        if keys.dtype == torch.bool or keys.dtype.is_floating_point or keys.dtype.is_complex:
            raise InvalidKeysError(f"keys must be an integer tensor (int64 preferred), got dtype {keys.dtype}")
        t = keys.detach()
    else:
        if isinstance(keys, np.ndarray):
            arr = keys
        else:
            try:
                arr = np.asarray(keys)
            except (ValueError, TypeError) as exc:
                raise InvalidKeysError(f"keys must be a 1-D int64 tensor, got {type(keys).__name__}") from exc
            if arr.size == 0:
                arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise InvalidKeysError(f"keys must be an integer array, got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and arr.max() > _INT64_MAX:
            raise InvalidKeysError("keys must fit in int64; got uint64 values above 2**63-1")
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if flatten:
        t = t.reshape(-1)
    elif t.dim() != 1:
        raise InvalidKeysError(f"keys must be 1-D, got shape {tuple(t.shape)}")
    if max_batch_keys is not None and t.numel() > max_batch_keys:
        raise BatchTooLargeError(f"batch of {t.numel()} keys exceeds max_batch_keys={max_batch_keys}; split it")
    return t if t.dtype == torch.int64 else t.to(torch.int64)
