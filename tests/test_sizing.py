"""The sizing tool: its curves against brute-force replays, its bisection, its command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embcache.tier as tier
from embcache import sim
from embcache.sizing import load_trace, needed_capacity, size_trace, store_record_bytes

from .test_sim import brute_lru, brute_opt

_ROOT = Path(__file__).resolve().parents[1]


def small_trace() -> np.ndarray:
    rng = np.random.default_rng(5)
    ranks = np.minimum(rng.zipf(1.2, 3000), 400) - 1
    return (ranks * 7919 + 13).astype(np.int64)  # sparse keys


def test_opt_and_lru_curves_match_brute_force() -> None:
    trace = small_trace()
    report = size_trace(trace, row_bytes=100, hbm_hit=0.5, memory_hit=0.7, points=8, progress=False)
    assert report.accesses == 3000 and report.distinct_keys == np.unique(trace).size
    for i, cap in enumerate(report.capacities):
        assert report.curves["LRU"][i] == brute_lru(trace.tolist(), cap) / 3000
        assert report.curves["OPT"][i] == brute_opt(trace.tolist(), cap) / 3000
    for name, curve in report.curves.items():
        assert all(o >= c - 1e-12 for o, c in zip(report.curves["OPT"], curve, strict=True)), name  # OPT bounds all


def test_needed_capacity_is_the_smallest_that_reaches_the_target() -> None:
    trace = small_trace()
    for target in (0.3, 0.6, 0.8):
        cap = needed_capacity(lambda c: sim.lru_hits(trace, c), trace.size, np.unique(trace).size, target)
        assert cap is not None
        assert sim.lru_hits(trace, cap) >= target * trace.size
        assert sim.lru_hits(trace, cap - 1) < target * trace.size
    assert needed_capacity(lambda c: sim.lru_hits(trace, c), trace.size, np.unique(trace).size, 0.999) is None


def test_bisection_is_bracketed_by_the_grid_where_lfu_dips() -> None:
    """LFU is no stack algorithm: on this trace 11 rows hit less than 10 (1983 < 1991 of 3000).

    A plain bisection over [0, n_keys] answers 10 rows for a target of 1990 hits, although 11 rows
    miss it. Bracketed by measured capacities (11 misses, 20 reaches), the answer is the smallest
    capacity above the last measured miss: it and every measured capacity above it reach the target.
    """
    trace = small_trace()
    n_keys = np.unique(trace).size

    def hits_at(c: int) -> int:
        return sim.lfu_hits(trace, c)

    assert (hits_at(10), hits_at(11), hits_at(12)) == (1991, 1983, 2002)  # the dip
    target = 1990 / 3000
    assert needed_capacity(hits_at, 3000, n_keys, target) == 10  # unbracketed: inside the dip
    grid = [5, 11, 20, 60]
    cap = needed_capacity(hits_at, 3000, n_keys, target, grid=grid)
    assert cap == 12
    assert all(hits_at(c) >= 1990 for c in [cap, *(g for g in grid if g >= cap), n_keys])
    # size_trace brackets with its own grid: every plotted capacity from the answer on reaches the target
    report = size_trace(trace, row_bytes=100, hbm_hit=0.5, memory_hit=target, points=12, progress=False)
    for name, curve in report.curves.items():
        need = report.needed[name]["memory"]
        assert need is not None, name
        assert all(r >= target for c, r in zip(report.capacities, curve, strict=True) if c >= need), name
    assert hits_at(report.needed["LFU"]["memory"]) >= 1990  # type: ignore[arg-type]


def test_store_bytes_use_the_record_the_cache_writes(tmp_path: Any) -> None:
    """The store's size per row is what a real cache writes per row: weights + optimizer state (+ the key)."""
    import torch

    from embcache import CacheConfig, EmbeddingCache, TableConfig
    from embcache.optim import state_width

    cfg = TableConfig(name="t", dim=12, optimizer="adam", dtype="float16")
    with EmbeddingCache(CacheConfig(hbm_bytes=0, ddr_bytes=1 << 16, path=str(tmp_path / "s"), device="cpu"),
                        [cfg]) as cache:
        keys = torch.arange(40)
        cache.apply_gradients("t", keys, torch.ones(40, 12))
        cache.flush()
        ssd = cache.stats()["t"]["ssd"]
    record = store_record_bytes(cfg.dim, cfg.torch_dtype, state_width(cfg.optimizer, cfg.dim))
    assert ssd["write_rows"] == 40 and ssd["write_bytes"] == 40 * record
    report = size_trace(small_trace(), row_bytes=100, hbm_hit=0.5, memory_hit=0.7, points=4, policies=["LRU"],
                        progress=False, record_bytes=record)
    assert report.store_bytes == report.distinct_keys * (record + 8)
    assert report.to_dict()["store_bytes"] == report.store_bytes


def test_keyset_files_expand_to_their_counts(tmp_path: Any) -> None:
    np.savez(tmp_path / "pass0.npz", keys=np.array([5, 9]), counts=np.array([3, 1]))
    np.save(tmp_path / "t.npy", np.array([1, 2, 1]))
    trace = load_trace([str(tmp_path / "t.npy"), str(tmp_path / "pass0.npz")])
    assert trace[:3].tolist() == [1, 2, 1] and sorted(trace[3:].tolist()) == [5, 5, 5, 9]
    with pytest.raises(ValueError, match="keys"):
        np.savez(tmp_path / "bad.npz", other=np.arange(3))
        load_trace([str(tmp_path / "bad.npz")])
    with pytest.raises(ValueError):
        load_trace([str(tmp_path / "x.csv")])


def test_command_line_writes_tables_plot_and_json(tmp_path: Any) -> None:
    np.save(tmp_path / "trace.npy", small_trace())
    out = subprocess.run(
        [sys.executable, "-m", "embcache", "sizing", str(tmp_path / "trace.npy"), "--dim", "16",
         "--optimizer", "adagrad", "--hbm-hit", "0.5", "--memory-hit", "0.7", "--points", "6",
         "--out", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json")],
        cwd=_ROOT, capture_output=True, text=True, timeout=300, check=True)
    assert "| embcache (lrfu) |" in out.stdout and "HBM bytes" in out.stdout
    report = json.loads((tmp_path / "s.json").read_text())
    # weights, AdaGrad state, bookkeeping, index (tests/test_cache.py checks the last two against what a tier allocates)
    # the HBM tier on a GPU by default (its key index costs more a row than the host's)
    assert report["row_bytes"] == 16 * 4 + 16 * 4 + tier._BOOKKEEPING_BYTES + tier.index_row_bytes("cuda")
    assert report["record_bytes"] == 16 * 4 + 16 * 4  # weights and AdaGrad state in the store
    assert report["store_bytes"] == report["distinct_keys"] * (128 + 8)
    assert "Store (SSD tier)" in out.stdout
    hbm = report["needed"]["embcache (lrfu)"]["hbm"]
    assert sim.lrfu_hits(small_trace(), hbm) >= 0.5 * 3000
    assert (tmp_path / "s.png").stat().st_size > 10_000
