"""Export benchmark: full and delta export rows/s, import rows/s, and what change tracking costs training.

Run from the repository root::

    .venv/bin/python bench/bench_export.py            # 1,000,000 rows per store (~3 min on 2 cores)
    .venv/bin/python bench/bench_export.py --quick    # 200,000 rows (~40 s), writes export-quick.*

Workload, for RocksDB and LMDB in turn: one table of dim 64 with row-wise AdaGrad, float32, its
rows made by ``embcache.export.from_tensor`` and loaded with ``EmbeddingCache.import_version``
(timed: import rows/s) into a cache whose tiers hold 5% of the rows. Then, timed:

* the first ``export_delta``s: a full version of every row with the optimizer state
  (``with_state=True``), then one of the weights only (into another directory, so full too);
* training steps (lookup + apply_gradients of 4,096 Zipf keys) that change about 1% and 10% of
  the rows, each followed by an ``export_delta``: a delta (rows/s of the rows it holds, and its
  seconds against the full export's);
* change tracking's cost: the same training steps on this cache (tracking on: every store write
  also writes a mark per key) and on a second cache loaded alike but never exported (tracking
  off), alternated (``interleaved_timings``) so both see the same machine load.

Rows/s are rows written into the version over the export's wall time (write-back of dirty rows,
the store flush, reading rows, writing and fsyncing the ``.npz`` files and the manifest).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import interleaved_timings, machine_info, markdown_table, write_json
from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.export import from_tensor
from embcache.tier import resident_row_bytes

DIM = 64
BATCH = 4096
CFG = TableConfig(name="t", dim=DIM, optimizer="rowwise_adagrad", lr=0.05, seed=3)


def _cache(path: str, store: str, rows: int) -> EmbeddingCache:
    row = resident_row_bytes(DIM, torch.float32, 1, "cpu")
    memory = max(rows // 20, BATCH) * row
    return EmbeddingCache(CacheConfig(path=path, store=store, device="cpu", hbm_bytes=memory // 4,
                                      ddr_bytes=memory - memory // 4), [CFG])


def _steps(cache: EmbeddingCache, rng: np.random.Generator, rows: int, n: int) -> set[int]:
    grads = torch.full((BATCH, DIM), 1e-3)
    touched: set[int] = set()
    for _ in range(n):
        keys = (rng.zipf(1.05, BATCH) % rows).astype(np.int64)
        cache.lookup("t", keys)
        cache.apply_gradients("t", keys, grads)
        touched.update(keys.tolist())
    return touched


def _until(cache: EmbeddingCache, rng: np.random.Generator, rows: int, fraction: float) -> int:
    """Training steps until about ``fraction`` of the rows were changed; how many rows."""
    touched: set[int] = set()
    while len(touched) < fraction * rows:
        touched |= _steps(cache, rng, rows, 4)
    return len(touched)


def run_store(store: str, rows: int, work: str) -> dict[str, Any]:
    """One backend's measurements."""
    out: dict[str, Any] = {"store": store, "rows": rows}
    src = os.path.join(work, f"src-{store}")
    weights = torch.randn(rows, DIM) * 0.01
    from_tensor(src, CFG, torch.arange(rows), weights)
    del weights
    cache = _cache(os.path.join(work, f"a-{store}"), store, rows)
    plain = _cache(os.path.join(work, f"b-{store}"), store, rows)
    try:
        t0 = time.perf_counter()
        cache.import_version(src)
        cache.flush()
        out["import_rows_per_s"] = rows / (time.perf_counter() - t0)
        plain.import_version(src)
        plain.flush()
        # (a directory other than the last one exported into gets a full version: state first)
        state = cache.export_delta(os.path.join(work, f"s-{store}"), with_state=True)
        out["full_with_state"] = {"rows": state.rows, "seconds": state.seconds,
                                  "rows_per_s": state.rows / state.seconds}
        full = cache.export_delta(os.path.join(work, f"e-{store}"))
        out["full"] = {"rows": full.rows, "seconds": full.seconds, "rows_per_s": full.rows / full.seconds}
        rng = np.random.default_rng(0)
        out["deltas"] = []
        for fraction in (0.01, 0.10):
            changed = _until(cache, rng, rows, fraction)
            d = cache.export_delta(os.path.join(work, f"e-{store}"))
            assert d.kind == "delta" and d.rows >= changed, (d.kind, d.rows, changed)
            out["deltas"].append({"fraction": fraction, "rows": d.rows, "seconds": d.seconds,
                                  "rows_per_s": d.rows / d.seconds, "over_full": d.seconds / full.seconds})
        rngs = {"tracking on": np.random.default_rng(1), "tracking off": np.random.default_rng(1)}
        times = interleaved_timings({"tracking on": lambda: _steps(cache, rngs["tracking on"], rows, 8),
                                     "tracking off": lambda: _steps(plain, rngs["tracking off"], rows, 8)},
                                    repeats=5)
        out["steps_per_s"] = {k: 8 / statistics.median(v) for k, v in times.items()}
    finally:
        cache.close()
        plain.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="200,000 rows instead of 1,000,000")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results directory")
    args = p.parse_args(argv)
    info = machine_info(script=__file__, argv=argv)
    t_start = time.perf_counter()
    rows = 200_000 if args.quick else 1_000_000
    stem = os.path.join(args.out, "export-quick" if args.quick else "export")
    os.makedirs(args.out, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="embcache-bench-export-") as work:
        for store in ("rocksdb", "lmdb"):
            results.append(run_store(store, rows, work))
            print(f"{store}: done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    summary, table_rows = [], []
    for r in results:
        on, off = r["steps_per_s"]["tracking on"], r["steps_per_s"]["tracking off"]
        for d in r["deltas"]:
            summary.append({"case": f"{r['store']}: delta export of {d['fraction']:.0%} of {rows:,} rows "
                                    f"({d['rows_per_s']:,.0f} rows/s)",
                            "reference": f"the full export ({r['full']['rows_per_s']:,.0f} rows/s), seconds",
                            "ratio": d["over_full"], "target": None, "met": None})
        summary.append({"case": f"{r['store']}: training steps/s with change tracking on ({on:.1f})",
                        "reference": f"tracking off ({off:.1f} steps/s)", "ratio": on / off, "target": None,
                        "met": None})
        table_rows.append([r["store"], f"{r['import_rows_per_s']:,.0f}", f"{r['full']['rows_per_s']:,.0f}",
                           f"{r['full_with_state']['rows_per_s']:,.0f}",
                           *(f"{d['rows']:,} in {d['seconds']:.2f} s = {d['rows_per_s']:,.0f}/s" for d in r["deltas"]),
                           f"{on:.1f} / {off:.1f}"])
    headers = ["store", "import rows/s", "full export rows/s", "full + state rows/s", "delta ~1% (rows/s)",
               "delta ~10% (rows/s)", "steps/s tracking on / off"]
    table = markdown_table(headers, table_rows)
    doc = {"benchmark": "export: full and delta export rows/s, import rows/s, change tracking's cost",
           "command": info["command"], "machine": info, "rows": rows, "dim": DIM, "batch": BATCH,
           "results": results, "summary": summary, "seconds": time.perf_counter() - t_start}
    write_json(stem + ".json", doc)
    with open(stem + ".md", "w") as f:
        f.write(f"# Export throughput\n\n`{info['command']}` — {rows:,} rows of dim {DIM} (row-wise AdaGrad, "
                f"float32), tiers of 5% of the rows; on this machine's {os.cpu_count()} cores.\n\n{table}\n")
    print(table)
    print(f"wrote {stem}.json/.md ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
