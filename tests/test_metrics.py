"""Prometheus metrics of a cache, scraped over HTTP from 127.0.0.1."""

from __future__ import annotations

import urllib.request
from typing import Any

import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from embcache.metrics import register_metrics


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
        assert m[("embcache_rows_created_total", (("table", "t"),))] == stats["ssd"]["created"] > 0
        hits = sum(m[("embcache_tier_hits_total", (("table", "t"), ("tier", t)))] for t in ("hbm", "ddr", "ssd"))
        assert hits + m[("embcache_rows_created_total", (("table", "t"),))] == 240
        cache._tables["t"].mrc.drain()
        m = scrape(port)
        mrc = {dict(labels)["capacity_factor"]: v for (name, labels), v in m.items()
               if name == "embcache_mrc_hit_ratio" and dict(labels)["tier"] == "ddr"}
        assert set(mrc) == {"0.25", "0.5", "1", "2", "4"} and all(0 <= v <= 1 for v in mrc.values())
        assert mrc["4"] >= mrc["0.25"]
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
