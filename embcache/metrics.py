"""Prometheus collectors for an :class:`~embcache.EmbeddingCache`.

The collector reads :meth:`EmbeddingCache.stats` at scrape time, so it costs nothing between
scrapes. Counters end in ``_total`` (the client library appends it), sizes are in bytes,
times in seconds; labels are ``table`` and ``tier`` (``hbm``, ``ddr``, ``ssd``), a bounded set.
Hit ratios are left to recording rules (``rate(hits) / rate(lookups)``), not exported as gauges.

    from prometheus_client import start_http_server
    register_metrics(cache)          # default registry
    start_http_server(9400, addr="127.0.0.1")
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CacheCollector", "register_metrics"]

_TIER_COUNTERS = (
    ("hits", "Key occurrences served by the tier (ssd: read from the store)"),
    ("promotions", "Rows that entered the tier from a lower tier"),
    ("demotions", "Rows that left the tier for a lower tier"),
    ("write_backs", "Dirty rows written to the store when they left the tier"),
)
_TIER_GAUGES = (
    ("resident_rows", "Rows resident in the tier"),
    ("resident_bytes", "Bytes of rows resident in the tier"),
    ("capacity_rows", "Rows the tier can hold"),
    ("capacity_bytes", "Bytes the tier can hold"),
)
_SSD_COUNTERS = (
    ("created", "embcache_rows_created", "Rows created by the initializer on first touch"),
    ("reads", "embcache_ssd_read_ops", "Batched read operations on the store"),
    ("read_rows", "embcache_ssd_read_rows", "Rows read from the store"),
    ("read_bytes", "embcache_ssd_read_bytes", "Bytes read from the store"),
    ("writes", "embcache_ssd_write_ops", "Batched write operations on the store"),
    ("write_rows", "embcache_ssd_write_rows", "Rows written to the store"),
    ("write_bytes", "embcache_ssd_write_bytes", "Bytes written to the store"),
)


class CacheCollector(Collector):
    """Exports a cache's stats as Prometheus metrics (``embcache_*``).

    Args:
        cache: anything with a ``stats()`` method shaped like EmbeddingCache's, and ``closed``.
    """

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def describe(self) -> list[Metric]:
        """No metrics up front (they depend on the tables), so registration never calls collect()."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Build the metric families from one ``stats()`` snapshot."""
        if getattr(self._cache, "closed", False):
            return
        stats = self._cache.stats()
        per_table = [
            ("lookups", "embcache_lookups", "Key occurrences looked up"),
            ("updates", "embcache_updated_keys", "Key occurrences in apply_gradients calls"),
            ("assigns", "embcache_assigned_keys", "Key occurrences in assign calls"),
        ]
        for field, name, doc in per_table:
            fam = CounterMetricFamily(name, doc, labels=["table"])
            for table, s in stats.items():
                fam.add_metric([table], s[field])
            yield fam
        for field, doc in _TIER_COUNTERS:
            fam = CounterMetricFamily(f"embcache_tier_{field}", doc, labels=["table", "tier"])
            for table, s in stats.items():
                for tier in ("hbm", "ddr", "ssd"):
                    if field in s[tier]:
                        fam.add_metric([table, tier], s[tier][field])
            yield fam
        for field, doc in _TIER_GAUGES:
            gauge = GaugeMetricFamily(f"embcache_tier_{field}", doc, labels=["table", "tier"])
            for table, s in stats.items():
                for tier in ("hbm", "ddr"):
                    gauge.add_metric([table, tier], s[tier][field])
            yield gauge
        seconds = CounterMetricFamily("embcache_tier_busy_seconds", "Time spent serving from the tier",
                                      labels=["table", "tier"])
        for table, s in stats.items():
            for tier in ("hbm", "ddr", "ssd"):
                seconds.add_metric([table, tier], s[tier]["seconds"])
        yield seconds
        for field, name, doc in _SSD_COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["table"])
            for table, s in stats.items():
                fam.add_metric([table], s["ssd"][field])
            yield fam
        yield from _pass_metrics(stats)


def _pass_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """Pins, the current pass and background staging, per table (and tier for pins)."""
    pinned = GaugeMetricFamily("embcache_tier_pinned_rows", "Rows held in the tier by a pass, prefetch or lease",
                               labels=["table", "tier"])
    active = GaugeMetricFamily("embcache_pass_active", "1 while a pass is active", labels=["table"])
    keyset = GaugeMetricFamily("embcache_pass_keyset_rows", "Unique keys in the current pass's keyset",
                               labels=["table"])
    pass_pinned = GaugeMetricFamily("embcache_pass_pinned_rows", "Keyset rows the current pass keeps in memory",
                                    labels=["table"])
    outside = CounterMetricFamily("embcache_pass_outside_keyset_lookups",
                                  "Key occurrences looked up below HBM during a pass that are not in its keyset",
                                  labels=["table"])
    staged = CounterMetricFamily("embcache_prefetch_staged_rows", "Rows staged into memory by prefetches",
                                 labels=["table"])
    seconds = CounterMetricFamily("embcache_prefetch_busy_seconds", "Time the prefetch worker spent staging",
                                  labels=["table"])
    for table, s in stats.items():
        for tier in ("hbm", "ddr"):
            pinned.add_metric([table, tier], s[tier].get("pinned_rows", 0))
        p = s.get("pass", {})
        active.add_metric([table], float(bool(p.get("active", False))))
        keyset.add_metric([table], p.get("keyset_rows", 0))
        pass_pinned.add_metric([table], p.get("pinned_rows", 0))
        outside.add_metric([table], p.get("outside_keyset", 0))
        f = s.get("prefetch", {})
        staged.add_metric([table], f.get("staged_rows", 0))
        seconds.add_metric([table], f.get("seconds", 0.0))
    yield from (pinned, active, keyset, pass_pinned, outside, staged, seconds)
    mrc = GaugeMetricFamily(
        "embcache_mrc_hit_ratio",
        "Estimated hit ratio at capacity_factor x the tier's capacity (online shadow caches, embcache.mrc); "
        "tier=hbm: HBM alone, tier=ddr: HBM or DDR (not from the SSD) with both tiers scaled",
        labels=["table", "tier", "capacity_factor"])
    rate = GaugeMetricFamily("embcache_mrc_sample_rate", "Share of keys the miss-ratio estimator samples",
                             labels=["table"])
    for table, s in stats.items():
        m = s.get("mrc")
        if not m:
            continue
        rate.add_metric([table], m["sample_rate"])
        for tier in ("hbm", "ddr"):
            for factor, ratio in m[tier].items():
                if ratio == ratio:  # NaN until something was sampled: leave the series out
                    mrc.add_metric([table, tier, factor], ratio)
    yield from (mrc, rate)


def register_metrics(cache: Any, registry: CollectorRegistry | None = None) -> CacheCollector:
    """Register a :class:`CacheCollector` for ``cache`` on ``registry`` (default: the global one)."""
    collector = CacheCollector(cache)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
