"""Wire codec: tensors as raw little-endian bytes, table definitions, keysets.

Both ends use these helpers; the server's servicer and :class:`embcache.Client` stay free of
byte fiddling. Decoding checks that the byte length matches dtype and shape *before*
``np.frombuffer`` and raises the typed error the caller names, so a malformed request is an
INVALID_ARGUMENT with a message, never a crash or a silent reinterpretation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..config import TableConfig
from ..errors import EmbcacheError, InvalidKeysError
from ..keyset import Keyset
from .v1 import embcache_pb2 as pb
from .wire import RawTensor

__all__ = [
    "FLOAT_DTYPES",
    "KEY_DTYPES",
    "MAX_DIM",
    "decode_keys",
    "decode_keyset",
    "decode_tensor",
    "encode_keyset",
    "encode_tensor",
    "merge_keysets",
    "prefetch_results",
    "table_from_proto",
    "table_to_proto",
]

# Wire dtype names -> little-endian numpy dtypes.
_WIRE: dict[str, np.dtype[Any]] = {
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "float64": np.dtype("<f8"),
}
KEY_DTYPES = ("int64", "int32")
FLOAT_DTYPES = ("float32", "float16", "float64")
_NAME_OF = {v.str: k for k, v in _WIRE.items()}  # keyed by the little-endian form
#: The largest dimension a received tensor may have. A gRPC message is under 2 GiB, so no tensor
#: with data has a larger one; a tensor with a zero dimension has no data to bound the others,
#: and without this a shape like [0, 2**62] passed the byte-length check and broke numpy later.
MAX_DIM = (1 << 31) - 1

# TableConfig fields sent as proto3 optionals (unset on the wire = the dataclass default).
_OPTIONAL_FIELDS = ("optimizer", "lr", "eps", "beta1", "beta2", "weight_decay", "initial_accumulator_value",
                    "initializer", "init_scale", "seed", "dtype", "memory_share", "admit_after", "unadmitted",
                    "ttl_steps", "ttl_seconds", "stochastic_rounding")


def encode_tensor(values: torch.Tensor | np.ndarray) -> pb.Tensor:
    """A :class:`Tensor` message holding ``values`` (int64/int32/float32/float16/float64; bfloat16 is sent as float32).

    Raises:
        TypeError: the dtype has no wire form.
    """
    if isinstance(values, torch.Tensor):
        t = values.detach()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16
            t = t.to(torch.float32)
        arr = t.cpu().contiguous().numpy()
    else:
        arr = np.ascontiguousarray(values)
    name = _NAME_OF.get(arr.dtype.newbyteorder("<").str)
    if name is None:
        raise TypeError(f"dtype {arr.dtype} has no wire form; allowed: {sorted(_WIRE)}")
    wire = _WIRE[name]
    if arr.dtype != wire:  # big-endian host: swap once
        arr = arr.astype(wire)
    return pb.Tensor(dtype=name, shape=arr.shape, data=arr.tobytes())


def decode_tensor(msg: pb.Tensor | RawTensor, what: str, error: type[EmbcacheError], dtypes: Sequence[str],
                  ndim: int, present: bool = True) -> np.ndarray:
    """The array a :class:`Tensor` message holds, after checking dtype, rank and byte length.

    The result shares memory with the message's bytes (read-only; copy it before writing), unless
    the data is not aligned to its dtype in them (then it is a copy).

    Args:
        msg: the message (or its view from :mod:`embcache.rpc.wire`).
        what: what the tensor is, for messages ("keys", "gradients of table 'user'").
        error: the error type to raise (e.g. InvalidKeysError).
        dtypes: allowed wire dtype names.
        ndim: required rank.
        present: False when the field was not set at all.

    Raises:
        ``error``: missing field, disallowed dtype, wrong rank, negative dims or dims above
        :data:`MAX_DIM`, or a byte length that does not match dtype x shape.
    """
    if not present:
        raise error(f"{what}: missing (a Tensor with dtype, shape and data is required)")
    if msg.dtype not in dtypes:
        raise error(f"{what}: dtype {msg.dtype!r} is not allowed; use one of {list(dtypes)} (little-endian)")
    shape = tuple(int(s) for s in msg.shape)
    if len(shape) != ndim:
        raise error(f"{what}: shape {list(shape)} must have {ndim} dimension{'s' if ndim != 1 else ''}")
    if any(s < 0 for s in shape):
        raise error(f"{what}: shape {list(shape)} has a negative dimension")
    if any(s > MAX_DIM for s in shape):
        raise error(f"{what}: shape {list(shape)} is impossible: a dimension is above {MAX_DIM}")
    dt = _WIRE[msg.dtype]
    count = math.prod(shape)
    data = msg.data
    if count * dt.itemsize != len(data):
        raise error(f"{what}: {len(data)} bytes do not hold {msg.dtype} {list(shape)} "
                    f"({count * dt.itemsize} bytes expected)")
    arr = np.frombuffer(data, dtype=dt).reshape(shape)
    if not dt.isnative:  # big-endian host
        arr = arr.astype(dt.newbyteorder("="))
    elif not arr.flags.aligned:  # a sender that does not pad (Tensor.padding): torch and numba want alignment
        arr = arr.copy()
    return arr


def decode_keys(msg: pb.Tensor | RawTensor, what: str, present: bool = True) -> torch.Tensor:
    """Keys as an int64 [n] tensor (a copy: keys are small next to rows, and the copy is writable).

    Raises:
        InvalidKeysError: see :func:`decode_tensor`.
    """
    arr = decode_tensor(msg, what, InvalidKeysError, KEY_DTYPES, 1, present)
    return torch.from_numpy(arr.astype(np.int64))


def encode_keyset(ks: Keyset) -> tuple[pb.Tensor, pb.Tensor]:
    """The keys and counts tensors of a keyset."""
    return encode_tensor(ks.keys), encode_tensor(ks.counts)


def decode_keyset(msg: pb.TableKeyset) -> Keyset:
    """A :class:`~embcache.Keyset` from a :class:`TableKeyset` (keys counted when counts are unset).

    Raises:
        InvalidKeysError: malformed keys or counts, counts not matching keys, keys not unique and
            ascending, or counts below 1.
    """
    keys = decode_keys(msg.keys, f"keyset keys of table {msg.table!r}", msg.HasField("keys"))
    if not msg.HasField("counts"):
        return Keyset.from_keys(keys)
    counts = torch.from_numpy(decode_tensor(msg.counts, f"keyset counts of table {msg.table!r}", InvalidKeysError,
                                            KEY_DTYPES, 1).astype(np.int64))
    if counts.shape != keys.shape:
        raise InvalidKeysError(f"keyset of table {msg.table!r}: {counts.numel()} counts for {keys.numel()} keys")
    if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
        raise InvalidKeysError(f"keyset of table {msg.table!r}: keys with counts must be unique and ascending")
    if counts.numel() and int(counts.min()) < 1:
        raise InvalidKeysError(f"keyset of table {msg.table!r}: counts must be >= 1")
    return Keyset(keys, counts)


def merge_keysets(parts: Sequence[Keyset]) -> Keyset:
    """One keyset from the chunks of a keyset sent in several messages (the ``*Stream`` calls).

    Chunks cut from one ascending keyset, in order, are joined as they are; otherwise (chunks
    overlapping or out of order, or raw keys counted per chunk) keys are merged and the counts
    of a key in several chunks added, vectorized.

    Args:
        parts: the chunks' keysets, each valid on its own (see :func:`decode_keyset`).
    """
    if len(parts) == 1:
        return parts[0]
    keys = torch.cat([p.keys for p in parts]) if parts else torch.empty(0, dtype=torch.int64)
    counts = torch.cat([p.counts for p in parts]) if parts else torch.empty(0, dtype=torch.int64)
    if keys.numel() < 2 or bool((keys[1:] > keys[:-1]).all()):
        return Keyset(keys, counts)
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    return Keyset(uniq, torch.zeros(uniq.numel(), dtype=torch.int64).index_add_(0, inverse, counts))


def prefetch_results(result: Mapping[str, Mapping[str, float]]) -> list[pb.PrefetchTableResult]:
    """The wire form of a staging result, ``{table: {"staged_rows", "leased_rows", "seconds"}}``."""
    return [pb.PrefetchTableResult(table=name, staged_rows=int(r["staged_rows"]), leased_rows=int(r["leased_rows"]),
                                   seconds=float(r["seconds"])) for name, r in result.items()]


def table_to_proto(cfg: TableConfig) -> pb.TableConfig:
    """The wire form of a table definition (every field set, so it round-trips exactly)."""
    msg = pb.TableConfig(name=cfg.name, dim=cfg.dim)
    for name in _OPTIONAL_FIELDS:
        value = getattr(cfg, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def table_from_proto(msg: pb.TableConfig) -> TableConfig:
    """A :class:`~embcache.TableConfig` from its wire form (unset optionals take the defaults).

    Raises:
        ConfigError: a field has a value that is not allowed.
    """
    kwargs: dict[str, Any] = {"name": msg.name, "dim": int(msg.dim)}
    for name in _OPTIONAL_FIELDS:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    return TableConfig(**kwargs)
