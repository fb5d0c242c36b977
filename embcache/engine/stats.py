"""A table's counters, and the plain-dict report :meth:`EmbeddingCache.stats` gives of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..metrics import LatencyHistogram

if TYPE_CHECKING:
    from .table import TableEngine

__all__ = ["ExpiryStats", "SsdStats", "TableStats", "TierStats", "table_report"]


@dataclass
class TierStats:
    hits: int = 0
    promotions: int = 0
    demotions: int = 0
    write_backs: int = 0
    seconds: float = 0.0


@dataclass
class SsdStats:
    hits: int = 0
    created: int = 0  # key occurrences of keys the store did not hold (the ssd tier's misses)
    created_rows: int = 0  # rows the initializer made: one per distinct such key of a batch
    reads: int = 0
    read_rows: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_rows: int = 0
    write_bytes: int = 0
    seconds: float = 0.0
    read_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    write_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass
class ExpiryStats:
    """Rows removed by expiry (``TableConfig.ttl_steps`` / ``ttl_seconds``) and by ``delete``."""

    expired_hbm: int = 0  # resident rows expired from HBM (their stored copies deleted too)
    expired_ddr: int = 0  # resident rows expired from DDR
    expired_store: int = 0  # keys expired from the store (not resident; by their stored touch)
    deleted: int = 0  # rows that existed and were removed by delete()
    adopted_rows: int = 0  # stored rows given a touch of now (stored before expiry was on)
    sweeps: int = 0
    walks: int = 0  # sweeps that walked every stored touch (after a restart, or the due buckets overflowed)
    sweep_seconds: float = 0.0
    last_sweep_seconds: float = 0.0
    errors: int = 0  # sweeps that failed (the store failed; the next one tries again)


@dataclass
class TableStats:
    lookups: int = 0
    updates: int = 0
    assigns: int = 0
    placement_errors: int = 0
    outside_keyset: int = 0
    prefetch_rows: int = 0
    prefetch_seconds: float = 0.0
    passes: int = 0
    pass_wait_seconds: float = 0.0
    unadmitted_lookups: int = 0  # key occurrences looked up before their key was admitted
    dropped_updates: int = 0  # rows of keys not admitted yet whose gradients were dropped
    admitted_rows: int = 0  # keys admitted (their count reached admit_after)
    policy_switches: int = 0  # times the tuner changed the policy's setting
    hbm: TierStats = field(default_factory=TierStats)
    ddr: TierStats = field(default_factory=TierStats)
    ssd: SsdStats = field(default_factory=SsdStats)
    expiry: ExpiryStats = field(default_factory=ExpiryStats)


def table_report(t: TableEngine, running_prefetch_seconds: float) -> dict[str, Any]:
    """One table's entry of :meth:`EmbeddingCache.stats` (the caller holds the table's lock).

    Each tier's ``misses`` are the key occurrences that reached it and were not served there
    (a failed lookup counts neither its lookups nor any tier's hits, so these never go down).
    """
    s = t.stats
    misses = {"hbm": s.lookups - s.hbm.hits, "ddr": s.ssd.hits + s.ssd.created}
    tiers: dict[str, Any] = {}
    for tier, ts in ((t.hbm, s.hbm), (t.ddr, s.ddr)):
        tiers[tier.tier.value] = {
            "hits": ts.hits, "misses": misses[tier.tier.value],
            "resident_rows": len(tier), "resident_bytes": len(tier) * tier.row_bytes,
            "capacity_rows": tier.capacity, "capacity_bytes": tier.capacity * tier.row_bytes,
            "promotions": ts.promotions, "demotions": ts.demotions, "write_backs": ts.write_backs,
            "pinned_rows": tier.pinned_count(), "seconds": ts.seconds,
        }
    ssd = {"hits": s.ssd.hits, "misses": s.ssd.created, **vars(s.ssd)}
    ssd["read_latency"] = s.ssd.read_latency.snapshot()
    ssd["write_latency"] = s.ssd.write_latency.snapshot()
    return {"lookups": s.lookups, "updates": s.updates, "assigns": s.assigns,
            "placement_errors": s.placement_errors, **tiers, "ssd": ssd,
            "pass": {"active": t.pass_keyset is not None,
                     "keyset_rows": len(t.pass_keyset) if t.pass_keyset is not None else 0,
                     "pinned_rows": int(t.pass_pinned.numel()),
                     "outside_keyset": s.outside_keyset,
                     "started": s.passes, "wait_seconds": s.pass_wait_seconds},
            "prefetch": {"staged_rows": s.prefetch_rows, "seconds": s.prefetch_seconds,
                         "running_seconds": running_prefetch_seconds},
            "admission": {"unadmitted_lookups": s.unadmitted_lookups,
                          "dropped_updates": s.dropped_updates, "admitted_rows": s.admitted_rows},
            "expiry": {"ttl_steps": t.cfg.ttl_steps, "ttl_seconds": t.cfg.ttl_seconds, **vars(s.expiry)},
            "mrc": {"sample_rate": t.mrc.rate, **t.mrc.hit_ratios()} if t.mrc is not None else None,
            "policy": {"name": t.policy.name, "halflife": t.clock.halflife, "tuned": t.mrc is not None
                       and t.mrc.tuner is not None, "setting": t.setting.to_dict() if t.setting else None,
                       "switches": s.policy_switches}}
