"""Merging the shards' answers into the answer of one cache: statistics, staging results, pass sizes.

Each shard answers for the keys it owns; what :class:`~embcache.Client` returns has the shape
:class:`~embcache.EmbeddingCache` returns, summed over shards (:func:`merge_stats`,
:func:`combine_prefetch`, :func:`combine_begin_pass`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..rpc.v1 import embcache_pb2 as pb

__all__ = ["combine_begin_pass", "combine_prefetch", "merge_stats"]


def merge_stats(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum per-shard stats (same dict shape); flags are OR-ed, miss-ratio estimates averaged by lookups;
    the policy in force is the busiest shard's (each shard tunes its own), with every shard's setting
    under ``"shards"``."""
    out: dict[str, Any] = {}
    for table in sorted({t for s in shards for t in s}):
        parts = [s[table] for s in shards if table in s]
        merged = _merge_values([{k: v for k, v in p.items() if k not in ("mrc", "policy")} for p in parts])
        mrcs = [(float(p.get("lookups", 0)), p["mrc"]) for p in parts if p.get("mrc")]
        if mrcs:
            total = sum(w for w, _ in mrcs)
            merged["mrc"] = _weighted([(w / total if total else 1 / len(mrcs), m) for w, m in mrcs])
        elif parts and "mrc" in parts[0]:
            merged["mrc"] = None
        policies = [(float(p.get("lookups", 0)), p["policy"]) for p in parts if p.get("policy")]
        if policies:  # each shard tunes its own: the busiest one's setting, switches summed, every shard's listed
            busiest = max(policies, key=lambda wp: wp[0])[1]
            merged["policy"] = {**busiest, "tuned": any(p["tuned"] for _, p in policies),
                                "switches": sum(p["switches"] for _, p in policies),
                                "shards": [p["setting"] for _, p in policies]}
        out[table] = merged
    return out


# Figures that are not summed over shards: settings (the same on every shard), the oldest version
# served (the fleet serves at least it), the longest of what each shard measured alone.
_COMBINE: dict[str, Any] = {"ttl_steps": max, "ttl_seconds": max, "version": min, "directory": lambda v: v[0],
                            "age_seconds": max, "last_switch_seconds": max, "last_sweep_seconds": max}


def _merge_values(values: list[Any], key: str | None = None) -> Any:
    values = [v for v in values if v is not None] or [None]  # a shard without a value (None) adds nothing
    first = values[0]
    if isinstance(first, dict):
        keys = [k for v in values if isinstance(v, dict) for k in v]
        return {k: _merge_values([v[k] for v in values if isinstance(v, dict) and k in v], k)
                for k in dict.fromkeys(keys)}
    if key in _COMBINE and first is not None:
        return _COMBINE[key](values)
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, (int, float)):
        return sum(values)
    return first


def _weighted(items: list[tuple[float, Any]]) -> Any:
    first = items[0][1]
    if isinstance(first, dict):
        return {k: _weighted([(w, m[k]) for w, m in items if k in m]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return float(sum(w * v for w, v in items))
    return first


def combine_prefetch(finals: Iterable[pb.PrefetchResponse | pb.LeaseStatus],
                     tables: Sequence[str] = ()) -> dict[str, dict[str, float]]:
    """Staging results of several shards, summed (seconds: the longest; shards stage in parallel).

    ``finals``: each shard's last prefetch reply, or its batch lease's final status; ``tables``
    are in the result even when no shard reported them.
    """
    out: dict[str, dict[str, float]] = {t: {"staged_rows": 0, "leased_rows": 0, "seconds": 0.0} for t in tables}
    for final in finals:
        for r in final.tables:
            acc = out.setdefault(r.table, {"staged_rows": 0, "leased_rows": 0, "seconds": 0.0})
            acc["staged_rows"] += r.staged_rows
            acc["leased_rows"] += r.leased_rows
            acc["seconds"] = max(acc["seconds"], r.seconds)
    return out


def combine_begin_pass(replies: Iterable[pb.BeginPassResponse]) -> dict[str, dict[str, int]]:
    """``{table: {"keyset_rows", "pinned_rows"}}`` of the shards' BeginPass replies, summed."""
    out: dict[str, dict[str, int]] = {}
    for reply in replies:
        for r in reply.tables:
            acc = out.setdefault(r.table, {"keyset_rows": 0, "pinned_rows": 0})
            acc["keyset_rows"] += r.keyset_rows
            acc["pinned_rows"] += r.pinned_rows
    return out
