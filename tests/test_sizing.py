"""The sizing tool: its curves against brute-force replays, its bisection, its command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embcache import sim
from embcache.sizing import load_trace, needed_capacity, size_trace

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
    assert report["row_bytes"] == 16 * 4 + 16 * 4 + 42 + 64  # weights, AdaGrad state, bookkeeping, index
    hbm = report["needed"]["embcache (lrfu)"]["hbm"]
    assert sim.lrfu_hits(small_trace(), hbm) >= 0.5 * 3000
    assert (tmp_path / "s.png").stat().st_size > 10_000
