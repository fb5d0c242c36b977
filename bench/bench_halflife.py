"""Sweep of the LRFU half-life: HBM hit ratio at 4x, 16x and 64x the tier's rows.

Command: ``.venv/bin/python bench/bench_halflife.py`` (about 8 minutes on 2 cores).
Traces from ``bench/workloads.py`` (the same as ``bench_policy.py``): 200k keys, 500k accesses,
lookups of 256 keys through a real EmbeddingCache with only an HBM tier of 0.1%, 1% and 5% of
the keys. Writes ``bench/results/halflife.json`` and prints a Markdown table. This is how the
default (16x the rows in memory) was chosen.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_policy import WORKLOADS

from embcache import CacheConfig, EmbeddingCache, TableConfig

N_KEYS, N_ACCESSES, BATCH = 200_000, 500_000, 256
FRACTIONS = (0.001, 0.01, 0.05)
MULTIPLIERS = (4, 16, 64)


def hit_ratio(trace: torch.Tensor, rows: int, halflife: float) -> float:
    """HBM hit ratio of ``trace`` through a cache holding ``rows`` rows with the given half-life."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = EmbeddingCache(CacheConfig(hbm_bytes=1 << 16, ddr_bytes=0, path=f"{tmp}/probe", device="cpu"),
                               [TableConfig(name="t", dim=4)])
        row_bytes = probe.row_bytes("t")
        probe.close()
        cfg = CacheConfig(hbm_bytes=rows * row_bytes, ddr_bytes=0, path=f"{tmp}/c", device="cpu", halflife=halflife)
        with EmbeddingCache(cfg, [TableConfig(name="t", dim=4)]) as cache:
            for start in range(0, trace.numel(), BATCH):
                cache.lookup("t", trace[start:start + BATCH])
            s = cache.stats()["t"]
    return float(s["hbm"]["hits"] / s["lookups"])


def main() -> None:
    """Run the sweep, print the table, write the JSON."""
    results: dict[str, dict[str, list[float]]] = {}
    names = ("zipf-1.05", "drifting", "bursty")
    for w in (w for w in WORKLOADS if w.name in names):
        trace = torch.from_numpy(np.ascontiguousarray(w.make(N_ACCESSES, N_KEYS, 0), dtype=np.int64))
        results[w.name] = {}
        for mult in MULTIPLIERS:
            t0 = time.perf_counter()
            ratios = [hit_ratio(trace, int(N_KEYS * f), float(mult * int(N_KEYS * f))) for f in FRACTIONS]
            results[w.name][f"{mult}x"] = ratios
            print(f"{w.name:10s} half-life {mult:2d}x rows: " + "  ".join(f"{r:.4f}" for r in ratios)
                  + f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    print("\n| workload | half-life | " + " | ".join(f"{f:.1%} of keys" for f in FRACTIONS) + " |")
    print("|---|---|" + "---|" * len(FRACTIONS))
    for name, by_mult in results.items():
        for mult, ratios in by_mult.items():
            print(f"| {name} | {mult} | " + " | ".join(f"{r:.4f}" for r in ratios) + " |")
    out = Path(__file__).resolve().parent / "results" / "halflife.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"n_keys": N_KEYS, "n_accesses": N_ACCESSES, "batch": BATCH,
                               "fractions": FRACTIONS, "hit_ratio": results}, indent=2))


if __name__ == "__main__":
    main()
