"""The checks every entry point applies to its arguments: the cache, the client and the server.

One rule each, so an embedded cache, a remote client and the gRPC service refuse the same input
with the same error: keys (:func:`checked_keys`, built on :func:`embcache.keys.as_key_tensor`),
rows of values (:func:`checked_rows`: gradients or assigned rows), finiteness
(:func:`all_finite`), and a closed cache or client (:func:`check_open`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import CacheClosedError, InvalidGradientError, InvalidKeysError, InvalidRowsError, NonFiniteGradientError
from .keys import as_key_tensor

__all__ = ["all_finite", "check_open", "checked_keys", "checked_rows", "nonfinite_gradients", "unique_keys"]

_CLOSED = {
    "cache": "the cache is closed; open a new EmbeddingCache on the same path to continue",
    "client": "the client is closed; create a new Client to continue",
}


def check_open(closed: bool, what: str = "cache") -> None:
    """Raise :class:`CacheClosedError` when ``closed`` (``what``: "cache" or "client")."""
    if closed:
        raise CacheClosedError(_CLOSED[what])


def checked_keys(keys: Any, max_batch_keys: int | None, device: torch.device | None = None) -> torch.Tensor:
    """int64 [n] keys (a tensor stays on its device; anything else lands on the CPU).

    Args:
        device: where the keys may be besides the CPU (None: the CPU only, others are copied there).

    Raises:
        InvalidKeysError, BatchTooLargeError.
    """
    k = as_key_tensor(keys, max_batch_keys)
    if device is None:
        return k.cpu()
    if k.device.type not in ("cpu", device.type):
        raise InvalidKeysError(f"keys are on {k.device}; allowed: cpu or {device}")
    return k


def unique_keys(keys: torch.Tensor, what: str) -> None:
    """Refuse duplicate keys where each key must come once (``what`` names the call)."""
    if torch.unique(keys).numel() != keys.numel():
        raise InvalidKeysError(f"{what}: keys must be unique")


def checked_rows(what: str, values: Any, n: int, dim: int,
                 error: type[InvalidGradientError] | type[InvalidRowsError],
                 device: torch.device | None = None) -> torch.Tensor:
    """``values`` as a float32 [n, dim] tensor, on its own device (CPU for numpy input).

    Args:
        what: the argument's name in messages ("gradients", "rows").
        error: the error class to raise (InvalidGradientError or InvalidRowsError).
        device: where values may be besides the CPU (None: anywhere).
    """
    if not isinstance(values, torch.Tensor):
        if isinstance(values, np.ndarray):
            values = torch.from_numpy(values)
        else:
            raise error(f"{what} must be a float tensor of shape [{n}, {dim}], got {type(values).__name__}")
    if not values.dtype.is_floating_point:
        raise error(f"{what} must be floating point (float32 preferred), got dtype {values.dtype}")
    if tuple(values.shape) != (n, dim):
        raise error(f"{what} must have shape [{n}, {dim}] (one row per key, dim {dim}), got {tuple(values.shape)}")
    if device is not None and values.device.type not in ("cpu", device.type):
        raise error(f"{what} are on {values.device}; allowed: cpu or {device}")
    return values.detach().to(torch.float32)


def all_finite(values: torch.Tensor | np.ndarray) -> bool:
    """True when no element is NaN or inf (one reduction; the elementwise check only if the sum overflows)."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if bool(torch.isfinite(values.sum())):  # NaN or inf anywhere makes the sum NaN or inf
        return True
    return bool(torch.isfinite(values).all())


def nonfinite_gradients(table: str) -> NonFiniteGradientError:
    """The error for gradients of ``table`` with NaN or inf (raised before anything changed)."""
    return NonFiniteGradientError(f"gradients of table {table!r} contain NaN or inf; nothing was applied "
                                  "(pass reject_nonfinite=False to allow)")
