"""The rows of a served version that are not yet in the cache: lookups take them from here.

A serving server switches versions atomically (:class:`~embcache.server.serving.VersionGate`).
Writing a delta's rows into the cache's store and memory tiers takes time (18 ms for 10,000 rows
of dim 64, 1.8 us a row), and lookups held off that long show in their p99. So the switch itself
only deletes the version's deleted keys, creates its new tables and installs an :class:`Overlay`
of its rows, all under the gate; the rows are then written into the cache in small chunks
beside the lookups, and each lookup takes the rows the overlay holds over what the cache
returned. A key the version does not change is the same in both versions, so a lookup still sees
one version throughout; once every row is written, the overlay is dropped.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Overlay"]


class Overlay:
    """Per table, the rows of one version (its changed and new keys), found by key.

    Args:
        tables: per table name, ``(keys, rows)``: unique int64 keys and their rows (a CPU tensor
            ``[n, dim]`` in the table's storage dtype), in the same order. Held, not copied.
    """

    def __init__(self, tables: dict[str, tuple[np.ndarray, torch.Tensor]]) -> None:
        self._tables: dict[str, tuple[np.ndarray, np.ndarray, torch.Tensor]] = {}
        for name, (keys, rows) in tables.items():
            if keys.shape[0] != rows.shape[0]:
                raise ValueError(f"overlay of table {name!r}: {keys.shape[0]} keys for {rows.shape[0]} rows")
            if keys.size:
                order = np.argsort(keys, kind="stable")
                self._tables[name] = (np.ascontiguousarray(keys[order]), order, rows)

    @property
    def rows(self) -> int:
        """How many rows it holds (all tables)."""
        return sum(k.shape[0] for k, _, _ in self._tables.values())

    def patch(self, table: str, keys: torch.Tensor, out: torch.Tensor) -> int:
        """Overwrite the rows of ``out`` (float32 ``[n, dim]`` on the CPU, the cache's answer for
        int64 ``keys``) whose keys the overlay holds for ``table``; how many it overwrote."""
        entry = self._tables.get(table)
        if entry is None or keys.numel() == 0:
            return 0
        sorted_keys, order, rows = entry
        k = keys.cpu().numpy().reshape(-1)
        pos = np.minimum(np.searchsorted(sorted_keys, k), sorted_keys.shape[0] - 1)
        found = np.flatnonzero(sorted_keys[pos] == k)
        if found.size:
            src = torch.from_numpy(order[pos[found]])
            out.index_copy_(0, torch.from_numpy(found), rows.index_select(0, src).to(out.dtype))
        return int(found.size)
