"""Request decoding for the servicer: the tables, keys, values and keysets of a request or a request stream.

Each function turns protocol messages (or :mod:`embcache.rpc.wire` views of the hot calls'
request bytes) into tensors and keysets through :mod:`embcache.rpc.codec`, refusing malformed
ones with the library's typed errors; a stream's chunks are collected into one request here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import EmbcacheError, InvalidKeysError
from ..keyset import Keyset
from ..rpc import codec, wire
from ..rpc.v1 import embcache_pb2 as pb

__all__ = ["collect_chunks", "collect_keysets", "keys_of", "keysets_of", "unique_tables", "values_of"]


def unique_tables(items: Iterable[Any], what: str) -> None:
    """Refuse a request that names a table twice.

    Raises:
        InvalidKeysError: a table appears more than once.
    """
    names = [i.table for i in items]
    if len(set(names)) != len(names):
        raise InvalidKeysError(f"{what}: a table appears more than once in one request: {names}")


def values_of(tv: pb.TableValues | wire.TableKeysView, what: str, error: type[EmbcacheError]) -> torch.Tensor:
    """The 2-d float values (gradients, rows) of one table's entry; ``error`` for missing or impossible ones."""
    return torch.from_numpy(codec.decode_tensor(tv.values, f"{what} of table {tv.table!r}", error,
                                                codec.FLOAT_DTYPES, 2, tv.HasField("values")))


def keys_of(item: Any) -> torch.Tensor:
    """The keys of one table's entry (anything with ``table`` and ``keys`` fields).

    Raises:
        InvalidKeysError: missing or malformed keys.
    """
    return codec.decode_keys(item.keys, f"keys of table {item.table!r}", item.HasField("keys"))


def collect_chunks(requests: Iterable[Any], what: str,
             error: type[EmbcacheError]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate the chunks of a write stream per table (in arrival order): ``{table: (keys, values)}``.

    Raises:
        InvalidKeysError, or ``error``: a malformed chunk, or chunks of one table of different widths.
    """
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for req in requests:
        unique_tables(req.tables, f"{what} chunk")
        for tv in req.tables:
            keys, values = keys_of(tv), values_of(tv, what, error)
            ks, vs = parts.setdefault(tv.table, ([], []))
            if vs and values.shape[1:] != vs[0].shape[1:]:
                raise error(f"{what} of table {tv.table!r}: chunks have different widths "
                            f"({vs[0].shape[1]} and {values.shape[1]})")
            ks.append(keys.numpy())
            vs.append(values.numpy())
    out = {}
    for name, (ks, vs) in parts.items():
        dtype = np.result_type(*vs)
        out[name] = (torch.from_numpy(np.concatenate(ks)), torch.from_numpy(np.concatenate(vs).astype(dtype)))
    return out


def keysets_of(items: Sequence[pb.TableKeyset], what: str) -> dict[str, Keyset]:
    """The keysets of one request, by table.

    Raises:
        InvalidKeysError: a table named twice, or a malformed keyset.
    """
    unique_tables(items, what)
    return {k.table: codec.decode_keyset(k) for k in items}


def collect_keysets(requests: Iterable[Any], what: str) -> tuple[dict[str, Keyset], Any]:
    """Merge the keysets of a keyset stream's chunks per table; returns them and the first chunk (its options).

    Raises:
        InvalidKeysError: a malformed chunk, or a stream without any.
    """
    parts: dict[str, list[Keyset]] = {}
    first = None
    for req in requests:
        first = req if first is None else first
        for name, keyset in keysets_of(req.keysets, f"{what} chunk").items():
            parts.setdefault(name, []).append(keyset)
    if first is None:
        raise InvalidKeysError(f"{what}: the stream held no request")
    return {name: codec.merge_keysets(ks) for name, ks in parts.items()}, first
