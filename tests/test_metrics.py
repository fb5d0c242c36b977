"""Prometheus metrics of a cache, scraped over HTTP from 127.0.0.1."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import urllib.request
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from embcache import TableConfig
from embcache.metrics import LatencyHistogram, register_metrics


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_match_stats_over_http(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=3, ddr_rows=5, mrc_sample_rate=1.0)
    registry = CollectorRegistry()
    register_metrics(cache, registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_port
        for step in range(20):
            keys = torch.arange(step, step + 12) % 17
            cache.lookup("t", keys)
            cache.apply_gradients("t", keys, torch.randn(12, 8))
        stats = cache.stats()["t"]
        m = scrape(port)
        assert m[("embcache_lookups_total", (("table", "t"),))] == stats["lookups"] == 240
        for tier in ("hbm", "ddr", "ssd"):
            labels = (("table", "t"), ("tier", tier))
            assert m[("embcache_tier_hits_total", labels)] == stats[tier]["hits"]
            assert m[("embcache_tier_busy_seconds_total", labels)] >= 0
        for tier in ("hbm", "ddr"):
            labels = (("table", "t"), ("tier", tier))
            assert m[("embcache_tier_resident_rows", labels)] == stats[tier]["resident_rows"]
            assert m[("embcache_tier_capacity_bytes", labels)] == stats[tier]["capacity_bytes"]
            assert m[("embcache_tier_demotions_total", labels)] == stats[tier]["demotions"]
        assert m[("embcache_ssd_write_bytes_total", (("table", "t"),))] == stats["ssd"]["write_bytes"] > 0
        assert m[("embcache_rows_created_total", (("table", "t"),))] == stats["ssd"]["created_rows"] > 0
        hits = sum(m[("embcache_tier_hits_total", (("table", "t"), ("tier", t)))] for t in ("hbm", "ddr", "ssd"))
        assert hits + m[("embcache_tier_misses_total", (("table", "t"), ("tier", "ssd")))] == 240
        cache._tables["t"].mrc.drain()
        m = scrape(port)
        mrc = {dict(labels)["capacity_factor"]: v for (name, labels), v in m.items()
               if name == "embcache_mrc_hit_ratio" and dict(labels)["tier"] == "ddr"}
        assert set(mrc) == {"0.25", "0.5", "1", "2", "4"} and all(0 <= v <= 1 for v in mrc.values())
        assert mrc["4"] >= mrc["0.25"]
        # a fraction of the keys, named as a ratio ("rate" would read as per second)
        assert m[("embcache_mrc_sampling_ratio", (("table", "t"),))] == stats["mrc"]["sample_rate"] == 1.0
        assert not any("sample_rate" in name for name, _ in m)
        cache.begin_pass({"t": torch.arange(4)})
        cache.lookup("t", torch.tensor([100, 101]))
        m = scrape(port)
        t = (("table", "t"),)
        assert m[("embcache_pass_active", t)] == 1 and m[("embcache_pass_keyset_rows", t)] == 4
        assert m[("embcache_pass_outside_keyset_lookups_total", t)] == 2
        assert sum(m[("embcache_tier_pinned_rows", (("table", "t"), ("tier", x)))] for x in ("hbm", "ddr")) == 4
        cache.end_pass()
        cache.prefetch({"t": torch.arange(30, 34)}).result(timeout=30)
        m = scrape(port)
        assert m[("embcache_pass_active", t)] == 0
        assert m[("embcache_prefetch_staged_rows_total", t)] == cache.stats()["t"]["prefetch"]["staged_rows"] > 0
        cache.close()
        assert not any(name.startswith("embcache_") for name, _ in scrape(port))  # a closed cache exports nothing
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_register_metrics_on_the_default_registry_over_http(make_cache: Any) -> None:
    """register_metrics(cache) with no registry exports on prometheus_client's global REGISTRY, which
    start_http_server serves by default; unregistering takes the cache's series away again."""
    cache = make_cache(tables=[TableConfig(name="default_reg", dim=8, optimizer="adagrad", lr=0.1, seed=3)])
    cache.lookup("default_reg", torch.arange(30))
    collector = register_metrics(cache)
    try:
        server, thread = start_http_server(0, addr="127.0.0.1")
        try:
            port = server.server_port
            m = scrape(port)
            stats = cache.stats()["default_reg"]
            t = (("table", "default_reg"),)
            assert m[("embcache_lookups_total", t)] == stats["lookups"] == 30
            assert m[("embcache_rows_created_total", t)] == stats["ssd"]["created_rows"] == 30
            for tier in ("hbm", "ddr"):
                labels = (("table", "default_reg"), ("tier", tier))
                assert m[("embcache_tier_resident_rows", labels)] == stats[tier]["resident_rows"]
            assert any(name.startswith("python_") or name.startswith("process_") for name, _ in m)  # the defaults
            cache.lookup("default_reg", torch.arange(30))
            assert scrape(port)[("embcache_lookups_total", t)] == 60  # read at scrape time
            REGISTRY.unregister(collector)
            assert not any(dict(labels).get("table") == "default_reg" for _, labels in scrape(port))
        finally:
            server.shutdown()
            thread.join(timeout=5)
    finally:
        with contextlib.suppress(KeyError):  # not unregistered above: leave the global registry clean
            REGISTRY.unregister(collector)


def test_misses_complete_the_hits_and_the_store_disk_is_reported(make_cache: Any) -> None:
    """hits + misses of a tier = occurrences that reached it; ssd misses = rows created; statvfs of the store."""
    cache = make_cache(hbm_rows=4, ddr_rows=8)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        keys = (torch.rand(40, generator=gen) ** 3 * 60).long()  # skewed: some keys hot
        cache.lookup("t", keys)
        cache.apply_gradients("t", keys, torch.ones(40, 8))
    registry = CollectorRegistry()
    register_metrics(cache, registry)
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    stats = cache.stats()["t"]

    def get(name: str, tier: str) -> float:
        return m[(f"embcache_tier_{name}_total", (("table", "t"), ("tier", tier)))]

    assert get("hits", "hbm") + get("misses", "hbm") == stats["lookups"] == 1200
    assert get("hits", "ddr") + get("misses", "ddr") == get("misses", "hbm")
    assert get("hits", "ssd") + get("misses", "ssd") == get("misses", "ddr")
    assert get("misses", "ssd") == stats["ssd"]["created"] > 0
    # rows_created counts rows, one per distinct new key of a lookup; the ssd misses count occurrences
    created = m[("embcache_rows_created_total", (("table", "t"),))]
    assert 0 < created == stats["ssd"]["created_rows"] < get("misses", "ssd")
    assert min(get("hits", t) for t in ("hbm", "ddr", "ssd")) > 0  # every tier served some
    for tier in ("hbm", "ddr", "ssd"):  # the export is stats()'s own figure
        assert get("misses", tier) == stats[tier]["misses"] > 0, tier

    vfs = os.statvfs(cache.config.path)
    assert m[("embcache_store_filesystem_size_bytes", ())] == vfs.f_blocks * vfs.f_frsize
    assert 0 < m[("embcache_store_filesystem_avail_bytes", ())] <= m[("embcache_store_filesystem_size_bytes", ())]


def test_rows_created_counts_rows_not_occurrences(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=0, ddr_rows=0)  # nothing cached: a key not written is made again each lookup
    cache.lookup("t", torch.tensor([5, 5, 5, 6]))
    cache.lookup("t", torch.tensor([6, 7, 7]))
    registry = CollectorRegistry()
    register_metrics(cache, registry)
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    ssd = cache.stats()["t"]["ssd"]
    assert (ssd["created"], ssd["created_rows"]) == (7, 4)  # occurrences; rows: {5, 6} then {6, 7}
    assert m[("embcache_rows_created_total", (("table", "t"),))] == 4
    assert m[("embcache_tier_misses_total", (("table", "t"), ("tier", "ssd")))] == 7


def test_latency_histogram_buckets() -> None:
    hist = LatencyHistogram((0.001, 0.01, 0.1))
    assert hist.snapshot() == {"le": [0.001, 0.01, 0.1], "counts": [0, 0, 0], "count": 0, "sum": 0.0}
    for seconds in (0.0005, 0.001, 0.002, 0.05, 3.0):  # a bound belongs to its bucket (le)
        hist.observe(seconds)
    snap = hist.snapshot()
    assert snap["counts"] == [2, 3, 4] and snap["count"] == 5 and math.isclose(snap["sum"], 3.0535)
    for bad in ((), (0.1, 0.01), (0.0, 1.0), (1.0, math.inf)):
        with pytest.raises(ValueError, match="increasing"):
            LatencyHistogram(bad)


def test_latency_histograms_in_stats_are_exported(make_cache: Any) -> None:
    """stats()[t]["ssd"]["read_latency"|"write_latency"] (LatencyHistogram snapshots) -> one histogram family."""
    cache = make_cache()
    cache.lookup("t", torch.arange(20))
    read, write = LatencyHistogram((0.01, 1.0)), LatencyHistogram((0.01, 1.0))
    read.observe(0.005)
    read.observe(0.5)
    write.observe(2.0)
    stats = cache.stats()
    stats["t"]["ssd"].update(read_latency=read.snapshot(), write_latency=write.snapshot())

    class Snapshot:  # the real cache's stats with the histograms the timing hooks would add
        closed = False

        def stats(self) -> dict[str, Any]:
            return stats

    registry = CollectorRegistry()
    register_metrics(Snapshot(), registry)
    (family,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                 if f.name == "embcache_ssd_op_duration_seconds"]
    assert family.type == "histogram"
    got = {(s.name, s.labels.get("op"), s.labels.get("le")): s.value for s in family.samples}
    assert got[("embcache_ssd_op_duration_seconds_bucket", "read", "0.01")] == 1
    assert got[("embcache_ssd_op_duration_seconds_bucket", "read", "1")] == 2
    assert got[("embcache_ssd_op_duration_seconds_bucket", "write", "1")] == 0
    assert got[("embcache_ssd_op_duration_seconds_count", "write", None)] == 1
    assert got[("embcache_ssd_op_duration_seconds_sum", "read", None)] == pytest.approx(0.505)


def test_ssd_latency_histogram_of_a_real_cache_over_http(make_cache: Any) -> None:
    """The cache times every batched store operation: per op, the histogram's _count is the op counter.

    Tiny tiers (4 + 8 rows) under a skewed workload of 120 keys push rows to and from the store
    (reads on misses, write-backs on eviction), a prefetch stages rows (reads off the lookup
    path), and flush() writes the dirty rows; the histogram is scraped over HTTP.
    """
    cache = make_cache(hbm_rows=4, ddr_rows=8)
    registry = CollectorRegistry()
    register_metrics(cache, registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(25):
            keys = (torch.rand(40, generator=gen) ** 2 * 120).long()
            cache.lookup("t", keys)
            cache.apply_gradients("t", keys, torch.ones(40, 8))
        cache.prefetch({"t": torch.arange(0, 12)}).result(timeout=30)
        cache.flush()
        m = scrape(server.server_port)
        ssd = cache.stats()["t"]["ssd"]
        # nothing moved meanwhile: the snapshot and the scrape agree (but for the disk's free bytes,
        # which any process writing to the same filesystem changes)
        def cache_figures(scraped: dict[Any, float]) -> dict[Any, float]:
            return {k: v for k, v in scraped.items() if not k[0].startswith("embcache_store_filesystem")}

        assert cache_figures(scrape(server.server_port)) == cache_figures(m)
        t = (("table", "t"),)
        sums = 0.0
        for op, ops in (("read", "reads"), ("write", "writes")):
            labels = (("op", op), ("table", "t"))
            count = m[("embcache_ssd_op_duration_seconds_count", labels)]
            assert count == ssd[ops] == m[(f"embcache_ssd_{op}_ops_total", t)] > 0, op
            assert m[("embcache_ssd_op_duration_seconds_sum", labels)] > 0, op
            buckets = sorted((float(dict(lab)["le"]), v) for (name, lab), v in m.items()
                             if name == "embcache_ssd_op_duration_seconds_bucket" and dict(lab)["op"] == op)
            assert buckets[-1] == (math.inf, count)
            assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets)), buckets  # cumulative
            sums += m[("embcache_ssd_op_duration_seconds_sum", labels)]
        # every timed operation is also store busy time, and nothing else is
        assert sums == pytest.approx(m[("embcache_tier_busy_seconds_total", (("table", "t"), ("tier", "ssd")))],
                                     rel=1e-9)
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_running_prefetch_age_is_exported_when_stats_report_it(make_cache: Any) -> None:
    """stats()[t]["prefetch"]["running_seconds"] -> gauge embcache_prefetch_running_seconds; absent -> no family.

    The counters of staging move only when a prefetch finishes; the age of the running one is what
    shows a stuck prefetch (deploy/README.md, "Metrics"). Whether the cache reports it or not, the
    export follows stats().
    """
    cache = make_cache()
    cache.prefetch({"t": torch.arange(6)}).result(timeout=30)
    stats = cache.stats()

    class Snapshot:  # the real cache's stats, frozen, with or without the field
        closed = False

        def stats(self) -> dict[str, Any]:
            return stats

    def exported() -> dict[str, float]:
        registry = CollectorRegistry()
        register_metrics(Snapshot(), registry)
        return {s.labels["table"]: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
                if f.name == "embcache_prefetch_running_seconds" for s in f.samples}

    reported = "running_seconds" in stats["t"]["prefetch"]
    assert exported() == ({"t": stats["t"]["prefetch"]["running_seconds"]} if reported else {})
    stats["t"]["prefetch"]["running_seconds"] = 42.5
    assert exported() == {"t": 42.5}
    del stats["t"]["prefetch"]["running_seconds"]
    assert exported() == {}
