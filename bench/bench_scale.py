"""Scale benchmark: does the per-row cost of lookup + update stay flat as the table grows?

Run from the repository root::

    .venv/bin/python bench/bench_scale.py            # 1M, 10M and 100M rows (~8 GB on disk, ~15 min)
    .venv/bin/python bench/bench_scale.py --quick    # 1M and 10M rows (< 2 min)

For each table size N, the RocksDB store is filled with N rows (dim 16, row-wise AdaGrad, written
straight through the store in 1M-row batches, then compacted: right after a bulk load RocksDB
reads are several times slower until compaction catches up), then a cache with HBM = 1% and DDR = 10% of N
rows serves a seeded Zipf(1.05) trace over the N keys in batches of 8,192: lookup, then
apply_gradients of the same keys (a training step). Tiers scale with N, so the hit ratios stay
about the same and any growth of the per-row cost comes from the index, the policy or the store
as they grow. Warm-up (half the trace) is discarded; the timed half is cut in segments and the
median segment is reported, with the hit ratio per tier and the time per row and per tier.

Writes ``bench/results/scale.json``, ``scale.md`` and ``scale.png`` (per-row cost vs rows).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.workloads import zipf_ranks  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.optim import state_width  # noqa: E402
from embcache.stores import open_store  # noqa: E402
from embcache.tier import resident_row_bytes  # noqa: E402

DIM = 16
TABLE = "t"
BATCH = 8192
TARGET_GROWTH = 1.5  # per-row cost at the largest size over the smallest: "flat" means close to 1


def keys_of(ranks: np.ndarray) -> np.ndarray:
    """Sparse int64 ids for dense ranks (an odd-multiplier bijection)."""
    return (ranks.astype(np.int64) * np.int64(-7046029254386353131)) ^ np.int64(0x5BD1E995)


def fill_store(path: str, n_rows: int, record_bytes: int) -> float:
    """Write ``n_rows`` rows (keys of ranks 0..n-1) straight into a RocksDB store; seconds taken."""
    cfg = TableConfig(name=TABLE, dim=DIM, optimizer="rowwise_adagrad")
    t0 = time.perf_counter()
    store = open_store("rocksdb", os.path.join(path, "store"))
    try:
        store.open_table(TABLE, record_bytes)
        store.put_meta("tables", json.dumps([cfg.to_dict()]).encode())
        rng = np.random.default_rng(1)
        step = 1 << 20
        with tqdm(total=n_rows, desc=f"filling {n_rows:,} rows", unit="rows", unit_scale=True) as bar:
            for start in range(0, n_rows, step):
                n = min(step, n_rows - start)
                w = rng.standard_normal((n, DIM), dtype=np.float32) * 0.01
                rec = np.concatenate([w.view(np.uint8), np.zeros((n, 4), dtype=np.uint8)], axis=1)
                store.put_many(TABLE, keys_of(np.arange(start, start + n)), np.ascontiguousarray(rec))
                bar.update(n)
        store.flush()
        store.compact()  # a bulk load leaves L0 files behind; measure the store in its steady state
    finally:
        store.close()
    return time.perf_counter() - t0


def run_size(n_rows: int, accesses: int, segments: int, work: str) -> dict[str, Any]:
    """Fill, then time lookup + update over a Zipf trace with tiers at 1% / 10% of ``n_rows``."""
    path = os.path.join(work, f"n{n_rows}")
    shutil.rmtree(path, ignore_errors=True)
    width = state_width("rowwise_adagrad", DIM)
    fill_s = fill_store(path, n_rows, DIM * 4 + 4 * width)
    rb = resident_row_bytes(DIM, torch.float32, width)
    hbm_rows, ddr_rows = max(n_rows // 100, 1), max(n_rows // 10, 1)
    trace = keys_of(zipf_ranks(accesses, n_rows, 1.05, np.random.default_rng(7)))
    batches = [torch.from_numpy(trace[i:i + BATCH]) for i in range(0, len(trace) - BATCH + 1, BATCH)]
    grads = torch.full((BATCH, DIM), 1e-3)
    cfg = CacheConfig(hbm_bytes=hbm_rows * rb, ddr_bytes=ddr_rows * rb, path=path, device="cpu")
    out = torch.empty(BATCH, DIM)
    with EmbeddingCache(cfg, [TableConfig(name=TABLE, dim=DIM, optimizer="rowwise_adagrad")]) as cache:
        warm, timed = batches[:len(batches) // 2], batches[len(batches) // 2:]
        for b in tqdm(warm, desc=f"warm-up {n_rows:,}", unit="batch", leave=False):
            cache.lookup(TABLE, b, out=out)
            cache.apply_gradients(TABLE, b, grads)
        per = max(len(timed) // segments, 1)
        seg_s, before = [], cache.stats()[TABLE]
        for i in range(0, per * segments, per):
            t0 = time.perf_counter()
            for b in timed[i:i + per]:
                cache.lookup(TABLE, b, out=out)
                cache.apply_gradients(TABLE, b, grads)
            seg_s.append(time.perf_counter() - t0)
        after = cache.stats()[TABLE]
    looked = after["lookups"] - before["lookups"]
    hits = {t: (after[t]["hits"] - before[t]["hits"]) / looked for t in ("hbm", "ddr", "ssd")}
    hits["created"] = (after["ssd"]["created"] - before["ssd"]["created"]) / looked
    med = statistics.median(seg_s)
    du = subprocess.run(["du", "-sb", path], capture_output=True, text=True).stdout.split()[0]
    shutil.rmtree(path, ignore_errors=True)
    return {"rows": n_rows, "hbm_rows": hbm_rows, "ddr_rows": ddr_rows, "fill_seconds": fill_s,
            "store_bytes": int(du), "timed_rows": per * BATCH, "segment_seconds": seg_s,
            "ns_per_row": med / (per * BATCH) * 1e9, "rows_per_s": per * BATCH / med, "hit_ratio": hits,
            "tier_seconds_per_row_ns": {t: (after[t]["seconds"] - before[t]["seconds"]) / looked * 1e9
                                        for t in ("hbm", "ddr", "ssd")}}


def machine() -> dict[str, Any]:
    """Where and with what this ran."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=_ROOT).stdout.strip()
    return {"cpus": os.cpu_count(), "torch": torch.__version__, "numpy": np.__version__, "git_commit": commit,
            "python": sys.version.split()[0], "torch_threads": torch.get_num_threads()}


def render(results: list[dict[str, Any]]) -> str:
    """Markdown table of the sizes."""
    lines = ["| rows | store on disk | HBM / DDR rows | hits HBM / DDR / SSD | ns per row (lookup + update) | "
             "rows/s | vs smallest |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = results[0]["ns_per_row"]
    for r in results:
        h = r["hit_ratio"]
        lines.append(f"| {r['rows']:,} | {r['store_bytes'] / 2**30:.2f} GiB | {r['hbm_rows']:,} / {r['ddr_rows']:,} | "
                     f"{h['hbm']:.1%} / {h['ddr']:.1%} / {h['ssd'] + h['created']:.1%} | {r['ns_per_row']:.0f} | "
                     f"{r['rows_per_s'] / 1e3:.0f}K | {r['ns_per_row'] / base:.2f}x |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Per-row cost (total and per tier) against table size, log x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r["rows"] for r in results]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(rows, [r["ns_per_row"] for r in results], marker="o", label="lookup + update, total")
    for t in ("hbm", "ddr", "ssd"):
        ax.plot(rows, [r["tier_seconds_per_row_ns"][t] for r in results], marker=".", ls="--", label=f"{t} time")
    ax.set_xscale("log")
    ax.set_xlabel("rows in the table (tiers at 1% / 10%)")
    ax.set_ylabel("ns per looked-up row")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("cost per row vs table size (Zipf 1.05, batch 8,192, dim 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1M and 10M rows, shorter traces")
    ap.add_argument("--sizes", default=None, help="comma-separated row counts (default 1M,10M,100M; quick 1M,10M)")
    ap.add_argument("--accesses", type=int, default=None, help="trace length (default 4M; quick 1M)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(float(s)) for s in (args.sizes or ("1e6,1e7" if args.quick else "1e6,1e7,1e8")).split(",")]
    accesses = args.accesses or (1_000_000 if args.quick else 4_000_000)
    work = args.work or tempfile.mkdtemp(prefix="embcache-scale-")
    t0 = time.perf_counter()
    results = []
    try:
        for n in sizes:
            r = run_size(n, accesses, 4 if args.quick else 8, work)
            print(f"{n:,} rows: {r['ns_per_row']:.0f} ns/row, hits {r['hit_ratio']}", flush=True)
            results.append(r)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    growth = results[-1]["ns_per_row"] / results[0]["ns_per_row"]
    table = render(results)
    print(table)
    stem = os.path.join(args.out, "scale-quick" if args.quick else "scale")
    summary = [{"case": f"per-row cost at {results[-1]['rows']:,} rows vs {results[0]['rows']:,}",
                "ratio": growth, "target": TARGET_GROWTH, "lower_is_better": True, "met": growth <= TARGET_GROWTH,
                "reference": f"{results[0]['rows']:,} rows"}]
    with open(stem + ".json", "w") as f:
        command = " ".join(["bench/bench_scale.py", *sys.argv[1:]])
        json.dump({"benchmark": "per-row cost vs table size", "command": command,
                   "machine": machine(), "accesses": accesses, "batch": BATCH, "dim": DIM, "results": results,
                   "summary": summary, "seconds": time.perf_counter() - t0}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    plot(results, stem + ".png")
    print(f"wrote {stem}.json/.md/.png ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
