"""A full version from a plain weight matrix: bring a table trained elsewhere (e.g. a
``torch.nn.EmbeddingBag``) into embcache with :meth:`EmbeddingCache.import_version` or ``embcache import``."""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np
import torch

from ..config import TableConfig
from .format import ExportFormatError, TablePart, Version, check_directory, list_versions, write_version

__all__ = ["from_tensor"]


def from_tensor(directory: str | os.PathLike[str], table: TableConfig, ids: Any, weight: Any,
                state: Any = None) -> Version:
    """Write ``weight`` (one row per id) as a new full version of one table under ``directory``.

    Args:
        directory: the export directory (created if missing); the version is numbered after
            the last one there.
        table: the table's definition (name, dim, optimizer, dtype, ...) the importing cache uses.
        ids: int64 [n], unique: the key of each row (``torch.arange(num_embeddings)`` for a
            plain ``nn.EmbeddingBag``).
        weight: [n, dim] floating (tensor or numpy array), converted to the table's dtype.
        state: optional float32 [n, state_width] optimizer state in embcache's layout.

    Returns:
        The written version's manifest.

    Raises:
        ExportFormatError: shapes or ids are wrong, or ``directory`` is not a directory.
    """
    path = check_directory(directory)
    if not isinstance(table, TableConfig):
        raise ExportFormatError(f"table must be a TableConfig, got {type(table).__name__}")
    keys = np.asarray(ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else ids)
    if keys.ndim != 1 or keys.dtype.kind not in "iu" or (keys.dtype == np.uint64 and keys.size and keys.max() >= 2**63):
        raise ExportFormatError(f"ids must be a 1-D integer array, got {keys.dtype} of shape {keys.shape}")
    keys = keys.astype(np.int64)
    if np.unique(keys).shape[0] != keys.shape[0]:
        raise ExportFormatError("ids must be unique")
    w = torch.as_tensor(weight).detach().cpu()
    if w.shape != (keys.shape[0], table.dim) or not w.is_floating_point():
        raise ExportFormatError(f"weight must be floating [{keys.shape[0]}, {table.dim}], "
                                f"got {w.dtype} {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ExportFormatError("weight holds NaN or inf")
    part = TablePart(config=table.to_dict(), keys=keys, weights=w.to(table.torch_dtype),
                     state=None if state is None else np.asarray(torch.as_tensor(state).cpu(), dtype=np.float32))
    number = (list_versions(path) or [0])[-1] + 1
    return write_version(path, number, "full", {table.name: part}, covers={"chain": uuid.uuid4().hex})
