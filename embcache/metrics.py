"""Prometheus collectors for an :class:`~embcache.EmbeddingCache`.

The collector reads :meth:`EmbeddingCache.stats` at scrape time, so it costs nothing between
scrapes. Names follow Prometheus conventions: counters end in ``_total`` (the client library
appends it), sizes are in ``_bytes``, times in ``_seconds``, ratios in ``_ratio`` (0..1, never
"rate", which reads as per second); labels are ``table``, ``tier`` (``hbm``, ``ddr``, ``ssd``),
``op`` (``read``, ``write``) and ``capacity_factor`` (five values), all bounded sets. The real
tiers' hit ratios are left to recording rules (``deploy/prometheus/rules/embcache-recording.yml``:
a ratio of summed counters aggregates over shards), not exported as gauges; the only ratios
exported are the estimator's (``embcache_mrc_hit_ratio``, ``embcache_mrc_sampling_ratio``),
which have no counters behind them.

Per tier, ``hits + misses`` is the key occurrences that reached the tier: all lookups for
``hbm``, HBM's misses for ``ddr``, DDR's misses for ``ssd`` (whose misses are the occurrences of
keys the store did not hold; ``embcache_rows_created_total`` counts the rows made for them).
So ``embcache_lookups_total`` = hbm hits + ddr hits + ssd hits + ssd misses.
The misses are ``stats()[table][tier]["misses"]``.

    from prometheus_client import start_http_server
    register_metrics(cache)          # default registry
    start_http_server(9400, addr="127.0.0.1")
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["SSD_LATENCY_BUCKETS", "CacheCollector", "LatencyHistogram", "register_metrics"]

# Upper bounds (seconds) of one batched store operation: a warm multi-get of a few rows takes
# ~0.1 ms, a cold one of 65k rows ~1 s on this machine's disk.
SSD_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

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
    ("created_rows", "embcache_rows_created",
     "Rows the initializer made on first touch: one per distinct new key of a lookup (not per occurrence)"),
    ("reads", "embcache_ssd_read_ops", "Batched read operations on the store"),
    ("read_rows", "embcache_ssd_read_rows", "Rows read from the store"),
    ("read_bytes", "embcache_ssd_read_bytes", "Bytes read from the store"),
    ("writes", "embcache_ssd_write_ops", "Batched write operations on the store"),
    ("write_rows", "embcache_ssd_write_rows", "Rows written to the store"),
    ("write_bytes", "embcache_ssd_write_bytes", "Bytes written to the store"),
)

_ADMISSION_COUNTERS = (
    ("unadmitted_lookups", "embcache_admission_unadmitted_lookups",
     "Key occurrences looked up before their key was admitted (TableConfig.admit_after)"),
    ("dropped_updates", "embcache_admission_dropped_updates",
     "Rows of keys not admitted yet whose gradients were dropped"),
    ("admitted_rows", "embcache_admission_admitted_rows", "Keys admitted: their lookups reached admit_after"),
)


class LatencyHistogram:
    """Counts of durations in fixed buckets, kept by the cache and exported as a Prometheus histogram.

    Not thread-safe: the owner updates it under its own lock (the cache: the table's lock).

    Args:
        buckets: increasing upper bounds in seconds (default ``SSD_LATENCY_BUCKETS``); ``+Inf`` is implicit.

    Raises:
        ValueError: if ``buckets`` is empty, not increasing, or not finite and positive.
    """

    def __init__(self, buckets: Sequence[float] = SSD_LATENCY_BUCKETS) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or any(not (math.isfinite(b) and b > 0) for b in bounds) or \
                any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"LatencyHistogram buckets={list(buckets)!r}: must be finite, positive and increasing")
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration.

        Args:
            seconds: the duration; it goes in the first bucket whose bound is >= it (Prometheus' ``le``).
        """
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict copy for ``stats()``: ``{"le": bounds, "counts": cumulative per bound, "count", "sum"}``."""
        cumulative, total = [], 0
        for c in self._counts[:-1]:
            total += c
            cumulative.append(total)
        return {"le": list(self._bounds), "counts": cumulative, "count": total + self._counts[-1], "sum": self._sum}


class CacheCollector(Collector):
    """Exports a cache's stats as Prometheus metrics (``embcache_*``).

    Args:
        cache: anything with a ``stats()`` method shaped like EmbeddingCache's, and ``closed``;
            with a ``config.path`` (a directory), the free space of its filesystem is exported too.
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
            ("placement_errors", "embcache_placement_errors",
             "Lookups whose rows were served but not cached (a write-back failed, e.g. disk full)"),
        ]
        for field, name, doc in per_table:
            fam = CounterMetricFamily(name, doc, labels=["table"])
            for table, s in stats.items():
                fam.add_metric([table], s.get(field, 0))
            yield fam
        yield from _tier_metrics(stats)
        for field, name, doc in _SSD_COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["table"])
            for table, s in stats.items():
                fam.add_metric([table], s["ssd"][field])
            yield fam
        for field, name, doc in _ADMISSION_COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["table"])
            for table, s in stats.items():
                fam.add_metric([table], s.get("admission", {}).get(field, 0))
            yield fam
        yield from _expiry_metrics(stats)
        yield from _ssd_latency(stats)
        yield from _pass_metrics(stats)
        yield from _mrc_metrics(stats)
        yield from _filesystem_metrics(getattr(getattr(self._cache, "config", None), "path", None))


def _tier_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """Hits, misses, movements, occupancy and busy time per table and tier."""
    for field, doc in _TIER_COUNTERS:
        fam = CounterMetricFamily(f"embcache_tier_{field}", doc, labels=["table", "tier"])
        for table, s in stats.items():
            for tier in ("hbm", "ddr", "ssd"):
                if field in s[tier]:
                    fam.add_metric([table, tier], s[tier][field])
        yield fam
    misses = CounterMetricFamily("embcache_tier_misses",
                                 "Key occurrences that reached the tier and were not found there "
                                 "(ssd: rows created on first touch)", labels=["table", "tier"])
    for table, s in stats.items():
        for tier in ("hbm", "ddr", "ssd"):
            misses.add_metric([table, tier], s[tier]["misses"])
    yield misses
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


def _expiry_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """Rows removed by expiry (``TableConfig.ttl_steps`` / ``ttl_seconds``) and by ``delete``, and the sweeps."""
    expired = CounterMetricFamily("embcache_expired_rows",
                                  "Rows expired (not touched within the table's TTL) and deleted, by where they were "
                                  "found: hbm or ddr (resident), ssd (only in the store)", labels=["table", "tier"])
    deleted = CounterMetricFamily("embcache_deleted_rows", "Rows that existed and were removed by delete()",
                                  labels=["table"])
    sweeps = CounterMetricFamily("embcache_expiry_sweeps", "Expiry sweeps of the table", labels=["table"])
    busy = CounterMetricFamily("embcache_expiry_sweep_seconds", "Time spent in expiry sweeps", labels=["table"])
    last = GaugeMetricFamily("embcache_expiry_last_sweep_seconds", "Duration of the table's last expiry sweep",
                             labels=["table"])
    errors = CounterMetricFamily("embcache_expiry_sweep_errors", "Expiry sweeps that failed (the store failed)",
                                 labels=["table"])
    for table, s in stats.items():
        e = s.get("expiry")
        if not e:
            continue
        for tier, field in (("hbm", "expired_hbm"), ("ddr", "expired_ddr"), ("ssd", "expired_store")):
            expired.add_metric([table, tier], e[field])
        deleted.add_metric([table], e["deleted"])
        sweeps.add_metric([table], e["sweeps"])
        busy.add_metric([table], e["sweep_seconds"])
        last.add_metric([table], e["last_sweep_seconds"])
        errors.add_metric([table], e["errors"])
    yield from (fam for fam in (expired, deleted, sweeps, busy, last, errors) if fam.samples)


def _ssd_latency(stats: dict[str, Any]) -> Iterator[Metric]:
    """Duration of batched store operations, from ``stats()[t]["ssd"]["read_latency"|"write_latency"]``."""
    fam = HistogramMetricFamily("embcache_ssd_op_duration_seconds", "Duration of one batched store operation",
                                labels=["table", "op"])
    found = False
    for table, s in stats.items():
        for op in ("read", "write"):
            h = s["ssd"].get(f"{op}_latency")
            if not h:
                continue
            found = True
            buckets = [(f"{le:g}", n) for le, n in zip(h["le"], h["counts"], strict=True)] + [("+Inf", h["count"])]
            fam.add_metric([table, op], buckets, h["sum"])
    if found:
        yield fam


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
    # Reported by EmbeddingCache.stats(); left out for a stats() that lacks them (nothing is made up).
    started = CounterMetricFamily("embcache_passes_started", "Passes begun (begin_pass calls)", labels=["table"])
    waited = CounterMetricFamily("embcache_pass_wait_seconds",
                                 "Time begin_pass waited for an unfinished prefetch", labels=["table"])
    # The counters above move only when a prefetch or a wait finishes, so a stuck prefetch shows
    # nowhere in them; its age does. Exported where stats()[t]["prefetch"] has "running_seconds".
    running = GaugeMetricFamily("embcache_prefetch_running_seconds",
                                "Age of the oldest unfinished prefetch of the table (queued or staging), "
                                "0 when none runs", labels=["table"])
    for table, s in stats.items():
        for tier in ("hbm", "ddr"):
            pinned.add_metric([table, tier], s[tier].get("pinned_rows", 0))
        p = s.get("pass", {})
        active.add_metric([table], float(bool(p.get("active", False))))
        keyset.add_metric([table], p.get("keyset_rows", 0))
        pass_pinned.add_metric([table], p.get("pinned_rows", 0))
        outside.add_metric([table], p.get("outside_keyset", 0))
        if "started" in p:
            started.add_metric([table], p["started"])
        if "wait_seconds" in p:
            waited.add_metric([table], p["wait_seconds"])
        f = s.get("prefetch", {})
        staged.add_metric([table], f.get("staged_rows", 0))
        seconds.add_metric([table], f.get("seconds", 0.0))
        if "running_seconds" in f:
            running.add_metric([table], f["running_seconds"])
    yield from (pinned, active, keyset, pass_pinned, outside, staged, seconds)
    yield from (fam for fam in (started, waited, running) if fam.samples)


def _mrc_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """The online miss-ratio curve (:mod:`embcache.mrc`) and the share of keys it samples."""
    mrc = GaugeMetricFamily(
        "embcache_mrc_hit_ratio",
        "Estimated hit ratio at capacity_factor x the tier's capacity (online shadow caches, embcache.mrc); "
        "tier=hbm: HBM alone, tier=ddr: HBM or DDR (not from the SSD) with both tiers scaled",
        labels=["table", "tier", "capacity_factor"])
    sampling = GaugeMetricFamily("embcache_mrc_sampling_ratio",
                                 "Share of keys the miss-ratio estimator samples (0..1; a fraction, not per second)",
                                 labels=["table"])
    for table, s in stats.items():
        m = s.get("mrc")
        if not m:
            continue
        sampling.add_metric([table], m["sample_rate"])
        for tier in ("hbm", "ddr"):
            for factor, ratio in m[tier].items():
                if ratio == ratio:  # NaN until something was sampled: leave the series out
                    mrc.add_metric([table, tier, factor], ratio)
    yield from (mrc, sampling)


def _filesystem_metrics(path: Any) -> Iterator[Metric]:
    """Size and free space of the filesystem that holds the store (for the disk-full alert)."""
    if not isinstance(path, (str, os.PathLike)):
        return
    try:
        st = os.statvfs(path)
    except OSError:  # the path vanished or is unreadable: export nothing rather than fail the scrape
        return
    yield GaugeMetricFamily("embcache_store_filesystem_size_bytes", "Size of the filesystem holding the store",
                            value=st.f_blocks * st.f_frsize)
    # f_bavail: what an unprivileged writer (RocksDB, LMDB) can still use, as node_exporter's avail_bytes.
    yield GaugeMetricFamily("embcache_store_filesystem_avail_bytes",
                            "Bytes the store can still write on its filesystem", value=st.f_bavail * st.f_frsize)


def register_metrics(cache: Any, registry: CollectorRegistry | None = None) -> CacheCollector:
    """Register a :class:`CacheCollector` for ``cache`` on ``registry`` (default: the global one).

    Args:
        cache: an :class:`~embcache.EmbeddingCache` (or anything with the same ``stats()``).
        registry: where to register; None = prometheus_client's global ``REGISTRY``.
    """
    collector = CacheCollector(cache)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
