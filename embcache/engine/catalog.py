"""The catalog of tables: definitions kept in the store, conflicts, and each table's share of memory."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from ..config import CacheConfig, TableConfig
from ..errors import ConfigError, TableConflictError
from ..optim import state_width
from ..stores import Store
from ..tier import resident_row_bytes
from .rows import META_TABLES

__all__ = ["check_new", "merged_definitions", "save_definitions", "tier_rows"]


def merged_definitions(store: Store, given: Sequence[TableConfig]) -> list[TableConfig]:
    """The stored definitions updated by ``given`` (sorted by name).

    Raises:
        ConfigError: a name given twice. TableConflictError: ``given`` conflicts with a stored
        definition in layout (dim, optimizer, dtype, initializer).
    """
    names = [t.name for t in given]
    if len(set(names)) != len(names):
        raise ConfigError(f"table names must be unique, got {names}")
    raw = store.get_meta(META_TABLES)
    stored = {d["name"]: TableConfig.from_dict(d) for d in json.loads(raw)} if raw else {}
    merged = dict(stored)
    for cfg in given:
        old = stored.get(cfg.name)
        if old is not None and old.layout_conflicts(cfg):
            diffs = ", ".join(f"{f}: stored {getattr(old, f)!r}, given {getattr(cfg, f)!r}"
                              for f in old.layout_conflicts(cfg))
            raise TableConflictError(f"table {cfg.name!r} conflicts with its stored definition ({diffs})")
        merged[cfg.name] = cfg
    return [merged[n] for n in sorted(merged)]


def check_new(existing: TableConfig | None, cfg: TableConfig) -> bool:
    """Whether ``cfg`` is new (True) or equal to ``existing`` (False).

    Raises:
        TableConflictError: a table of that name exists with another definition.
    """
    if existing is None:
        return True
    if existing == cfg:
        return False
    diffs = ", ".join(f"{f.name}: existing {getattr(existing, f.name)!r}, given {getattr(cfg, f.name)!r}"
                      for f in dataclasses.fields(cfg) if getattr(existing, f.name) != getattr(cfg, f.name))
    raise TableConflictError(f"table {cfg.name!r} exists with another definition ({diffs})")


def save_definitions(store: Store, configs: Sequence[TableConfig]) -> None:
    """Store the definitions of ``configs`` (the tables are there when the store is reopened)."""
    store.put_meta(META_TABLES, json.dumps([c.to_dict() for c in sorted(configs, key=lambda c: c.name)]).encode())


def tier_rows(config: CacheConfig, cfg: TableConfig, configs: Sequence[TableConfig]) -> tuple[int, int]:
    """HBM and DDR rows of ``cfg`` when the tiers' bytes are divided among ``configs`` by memory_share."""
    shares = sum(c.memory_share for c in configs) or 1.0
    width = state_width(cfg.optimizer, cfg.dim)
    frac = cfg.memory_share / shares
    # the hot tier's key index is the device's (the GPU's takes more bytes per row than the host's)
    hbm_row = resident_row_bytes(cfg.dim, cfg.torch_dtype, width, config.torch_device)
    ddr_row = resident_row_bytes(cfg.dim, cfg.torch_dtype, width, "cpu")
    return int(config.resolved_hbm_bytes() * frac) // hbm_row, int(config.resolved_ddr_bytes() * frac) // ddr_row
