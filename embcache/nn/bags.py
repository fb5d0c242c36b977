"""Batches of bags for the modules of :mod:`embcache.nn`: checked, made canonical, uniqued and pooled.

A batch (``input``, ``offsets``, ``per_sample_weights``, as ``torch.nn.EmbeddingBag`` takes it)
is checked as torch checks it and brought to one canonical form, :class:`Bags` (keys, offsets
ending with the end of the last bag, float32 weights); its keys are uniqued (the padding key
left out) and, once their rows are looked up, pooled with torch's own ``embedding_bag`` (or a
gather, for bags of one key). The errors are those of "Errors" in :mod:`embcache.nn`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError, InvalidKeysError
from ..fused import segment_sum

__all__ = [
    "MODES",
    "Bags",
    "FeatureInput",
    "canonical_bags",
    "check_index_tensor",
    "check_mode",
    "check_padding_idx",
    "pool",
    "unique_and_inverse",
    "unpack_feature",
    "with_padding_row",
]

#: Pooling modes of the bag modules (torch's).
MODES: tuple[str, ...] = ("sum", "mean", "max")

_INDEX_DTYPES = (torch.int32, torch.int64)

#: One feature of a collection batch: a 2-D input (fixed-size bags), ``(input, offsets)`` or
#: ``(input, offsets, per_sample_weights)``.
FeatureInput = (
    torch.Tensor
    | tuple[torch.Tensor, torch.Tensor | None]
    | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
)


# ---------------------------------------------------------------------- construction arguments
def check_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`MODES`; ConfigError otherwise."""
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} is not allowed; choose one of {', '.join(repr(m) for m in MODES)}")
    return str(mode)


def check_padding_idx(padding_idx: Any) -> int | None:
    """``padding_idx`` if it is None or an int64 key; ConfigError otherwise."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or not -(2**63) <= padding_idx < 2**63:
        raise ConfigError(f"padding_idx={padding_idx!r}: must be None or an int64 key")
    return padding_idx


# ---------------------------------------------------------------------- batches
def check_index_tensor(what: str, value: Any, prefix: str) -> torch.Tensor:
    """``value`` if it is an int64/int32 tensor; TypeError or InvalidKeysError naming ``prefix + what`` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{prefix}{what} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in _INDEX_DTYPES:
        raise InvalidKeysError(f"{prefix}{what} must be an int64 or int32 tensor, got dtype {value.dtype}")
    return value


@dataclass
class Bags:
    """One batch of bags in canonical form, on the cache's device."""

    keys: torch.Tensor  # int64 [n]: the keys of all bags (keys in no bag dropped)
    offsets: torch.Tensor  # int64 [B + 1]: bag b is keys[offsets[b]:offsets[b + 1]]; offsets[B] == n
    weights: torch.Tensor | None  # float32 [n] per-sample weights
    out_device: torch.device  # where the output goes (the module's device, see embcache.nn's docstring)
    single: bool = False  # every bag holds exactly one key (a [B, 1] input)


def canonical_bags(input: Any, offsets: Any, per_sample_weights: Any, include_last_offset: bool, mode: str,
                   device: torch.device, out_device: torch.device, prefix: str = "") -> Bags:
    """Validate a bag batch as torch.nn.EmbeddingBag would and bring it to canonical form.

    Args:
        input: int64/int32 [n] keys with ``offsets``, or [B, L] fixed-size bags without.
        offsets: int64/int32 [B] starts of the bags ([B + 1] with ``include_last_offset``), or None.
        per_sample_weights: floating, the shape of ``input``, or None (mode "sum" only).
        include_last_offset: ``offsets`` ends with the end of the last bag (torch's meaning).
        mode: one of MODES.
        device: the cache's device.
        out_device: where the pooled output goes.
        prefix: put before error messages (a feature's name).

    Raises:
        TypeError, InvalidKeysError, NotImplementedError: see "Errors" in :mod:`embcache.nn`.
    """
    input = check_index_tensor("input", input, prefix)
    psw = per_sample_weights
    if psw is not None:
        if not isinstance(psw, torch.Tensor):
            raise TypeError(f"{prefix}per_sample_weights must be a torch.Tensor or None, got {type(psw).__name__}")
        if mode != "sum":
            raise NotImplementedError(
                f"{prefix}embedding_bag: per_sample_weights was not None. per_sample_weights is only supported "
                f"for mode='sum' (got mode='{mode}'). Please open a feature request on GitHub.")
        if not psw.dtype.is_floating_point:
            raise InvalidKeysError(f"{prefix}per_sample_weights must be floating point, got dtype {psw.dtype}")
        if psw.shape != input.shape:
            raise InvalidKeysError(f"{prefix}embedding_bag: If per_sample_weights ({psw.shape}) is not None, "
                                   f"then it must have the same shape as the input ({input.shape})")
    if input.dim() == 2:
        if offsets is not None:
            raise InvalidKeysError(f"{prefix}if input is 2D, then offsets has to be None, as input is treated as a "
                                   f"mini-batch of fixed length sequences; got offsets of type {type(offsets)}")
        n_bags, length = input.shape
        keys = input.reshape(-1).to(device, torch.int64)
        canon = torch.arange(n_bags + 1, dtype=torch.int64, device=device) * length
        weights = psw.reshape(-1) if psw is not None else None
    elif input.dim() == 1:
        if offsets is None:
            raise InvalidKeysError(f"{prefix}offsets has to be a 1D Tensor but got None")
        offsets = check_index_tensor("offsets", offsets, prefix)
        if offsets.dim() != 1:
            raise InvalidKeysError(f"{prefix}offsets has to be a 1D Tensor, got shape {tuple(offsets.shape)}")
        n = input.numel()
        if include_last_offset and offsets.numel() == 0:
            raise InvalidKeysError(f"{prefix}include_last_offset: number of offset should be at least 1")
        end = n
        if offsets.numel():
            off = offsets.to(torch.int64)
            # one device sync for all three checks
            first, ascending, last = torch.stack([off[0], (off[1:] >= off[:-1]).all().to(torch.int64),
                                                  off[-1]]).tolist()
            if first != 0:
                raise InvalidKeysError(f"{prefix}offsets[0] has to be 0, i.e., the first sequence in the mini-batch "
                                       f"has to start from position 0. However, got {first}")
            if not ascending:
                raise InvalidKeysError(f"{prefix}offsets must be non-decreasing, got {offsets.tolist()[:32]}")
            if last > n:
                raise InvalidKeysError(f"{prefix}offsets[-1] can not be greater than input's length {n} "
                                       f"but got offsets[-1] of {last}")
            if include_last_offset:
                end = last  # keys after the last offset belong to no bag
            off = off.to(device)
            canon = off if include_last_offset else torch.cat([off, off.new_tensor([n])])
        else:
            end = 0  # no bags: no key is used
            canon = torch.zeros(1, dtype=torch.int64, device=device)
        keys = input[:end].to(device, torch.int64)
        weights = psw[:end] if psw is not None else None
    else:
        raise InvalidKeysError(f"{prefix}input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}")
    if weights is not None:
        weights = weights.to(device, torch.float32)
    return Bags(keys, canon, weights, out_device, single=input.dim() == 2 and input.shape[1] == 1)


def unpack_feature(feature: str, value: Any) -> tuple[Any, Any, Any]:
    """(input, offsets, per_sample_weights) of one feature's batch entry (a :data:`FeatureInput`)."""
    if isinstance(value, torch.Tensor):
        return value, None, None
    if isinstance(value, (tuple, list)) and len(value) in (2, 3):
        return value[0], value[1], value[2] if len(value) == 3 else None
    raise TypeError(f"feature {feature!r}: expected a 2-D tensor, (input, offsets) or "
                    f"(input, offsets, per_sample_weights), got {type(value).__name__}")


# ---------------------------------------------------------------------- unique keys and pooling
def unique_and_inverse(keys: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique keys to look up (int64 [u]) and each key's row among them (int64 [n]).

    Keys equal to ``padding_idx`` are left out and point at row u, a zero row the caller appends.
    """
    if padding_idx is None:
        ukeys, inverse = torch.unique(keys, return_inverse=True)
        return ukeys, inverse
    real = keys != padding_idx
    ukeys, inv = torch.unique(keys[real], return_inverse=True)
    inverse = torch.full_like(keys, ukeys.numel())
    inverse[real] = inv
    return ukeys, inverse


def with_padding_row(rows: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, int | None]:
    """Rows with a zero row appended for the padding key, and that row's index (None without padding)."""
    if padding_idx is None:
        return rows, None
    return torch.cat([rows, rows.new_zeros(1, rows.shape[1])]), rows.shape[0]


def pool(bags: Bags, inverse: torch.Tensor, rows: torch.Tensor, mode: str,
         padding_idx: int | None = None) -> torch.Tensor:
    """Pool the looked-up rows into bags with torch's own embedding_bag; on ``bags.out_device``.

    Bags of one key each (one categorical value per feature, as in DLRM) pool to the key's row
    (times its weight) in every mode: a gather, whose backward is one ``index_add_``, where
    ``embedding_bag``'s backward sorts the keys first.
    """
    weight, pad = with_padding_row(rows, padding_idx)
    if bags.single:
        out = _Gather.apply(weight, inverse)
        if bags.weights is not None:
            out = out * bags.weights.unsqueeze(1)
        return out.to(bags.out_device)
    out = F.embedding_bag(inverse, weight, bags.offsets, mode=mode, per_sample_weights=bags.weights,
                          include_last_offset=True, padding_idx=pad)
    return out.to(bags.out_device)


class _Gather(torch.autograd.Function):
    """``rows[index]`` whose backward sums the gradients of repeated indices (index_add_'s bits, faster)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.n_rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return segment_sum(grad, index, ctx.n_rows), None
