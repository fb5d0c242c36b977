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
as they grow.

Warm-up, so that every size is timed in the same state (memory tiers full, as after a long run):

1. *pre-warm*: the keys of the ``HBM + DDR`` most popular ranks are looked up once (lookups
   only, batches of 65,536), least popular first, so the cache holds the hot set with the
   hottest keys in HBM. Without it the tiers never fill at large N: the trace has a fixed
   length (4M accesses), and at 100M rows its warm-up half touches only ~572K distinct keys,
   fewer than the 1M rows of HBM, so nothing was ever demoted to DDR (0.0% DDR hits) and the
   "SSD" share of the timed half (22.7%) was mostly first touches of keys never seen before
   (24% of the timed accesses), i.e. a cache still filling up, not the store's cost at scale.
   At 10M rows the warm-up half touched 445K keys for 1.1M rows of memory, so that point was
   partly affected too (see ``--no-prewarm``);
2. the first half of the trace (lookup + update), discarded.

Timing starts only with HBM full and DDR at least 99% full (checked; the residency is in the
JSON), and the share of timed accesses to ranks outside the ``HBM + DDR`` hottest (what even a
perfect frequency-ordered cache reads from the store) is reported beside the measured SSD share.
The timed half is cut in segments and the median segment is reported, with the hit ratio per
tier and the time per row and per tier.

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

from bench._common import format_ratio, machine_info, write_json  # noqa: E402
from bench.workloads import zipf_ranks  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.optim import state_width  # noqa: E402
from embcache.stores import open_store  # noqa: E402
from embcache.tier import resident_row_bytes  # noqa: E402

DIM = 16
TABLE = "t"
BATCH = 8192
TARGET_GROWTH = 1.5  # per-row cost at the largest size over the smallest: "flat" means close to 1
PREWARM_BATCH = 1 << 16
MIN_FULL = 0.99  # share of each memory tier that must be resident when timing starts


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


def prewarm(cache: EmbeddingCache, memory_rows: int) -> float:
    """Look up the keys of ranks ``memory_rows - 1 .. 0`` once (coldest first); seconds taken."""
    t0 = time.perf_counter()
    ranks = np.arange(memory_rows - 1, -1, -1, dtype=np.int64)
    for start in tqdm(range(0, memory_rows, PREWARM_BATCH), desc=f"pre-warm {memory_rows:,} rows", unit="batch",
                      leave=False):
        cache.lookup(TABLE, torch.from_numpy(keys_of(ranks[start:start + PREWARM_BATCH])))
    return time.perf_counter() - t0


def store_direct(cache: EmbeddingCache, batches: list[np.ndarray], hot_rows: int) -> dict[str, float]:
    """The store's own read cost at this size: ``get_many`` of the keys each timed batch has outside
    the ``hot_rows`` hottest ranks (what a perfect frequency-ordered cache reads from the store),
    batch by batch, through the cache's own store (its block cache warm, as the cache left it).

    Reads the cache's private store: the reference is the same RocksDB instance, not a copy.
    """
    store = cache._store
    assert store is not None
    seconds, rows = 0.0, 0
    for ranks in batches:
        keys = np.unique(keys_of(ranks[ranks >= hot_rows]))
        t0 = time.perf_counter()
        store.get_many(TABLE, keys)
        seconds += time.perf_counter() - t0
        rows += keys.size
    return {"rows": rows, "seconds": seconds, "ns_per_row": seconds / max(rows, 1) * 1e9}


def run_size(n_rows: int, accesses: int, segments: int, work: str, warm: bool = True) -> dict[str, Any]:
    """Fill, then time lookup + update over a Zipf trace with tiers at 1% / 10% of ``n_rows``.

    Args:
        warm: pre-warm the tiers with the hot set first (see the module docstring); False
            reproduces the earlier runs, where at large sizes the tiers were still filling.

    Raises:
        RuntimeError: with ``warm``, a memory tier is less than ``MIN_FULL`` full when timing starts.
    """
    path = os.path.join(work, f"n{n_rows}")
    shutil.rmtree(path, ignore_errors=True)
    width = state_width("rowwise_adagrad", DIM)
    fill_s = fill_store(path, n_rows, DIM * 4 + 4 * width)
    rb = resident_row_bytes(DIM, torch.float32, width, "cpu")
    hbm_rows, ddr_rows = max(n_rows // 100, 1), max(n_rows // 10, 1)
    ranks = zipf_ranks(accesses, n_rows, 1.05, np.random.default_rng(7))
    trace = keys_of(ranks)
    batches = [torch.from_numpy(trace[i:i + BATCH]) for i in range(0, len(trace) - BATCH + 1, BATCH)]
    if len(batches) < 2:
        raise ValueError(f"--accesses {accesses:,}: need at least two batches of {BATCH:,} (one warm-up, one timed)")
    grads = torch.full((BATCH, DIM), 1e-3)
    cfg = CacheConfig(hbm_bytes=hbm_rows * rb, ddr_bytes=ddr_rows * rb, path=path, device="cpu")
    out = torch.empty(BATCH, DIM)
    with EmbeddingCache(cfg, [TableConfig(name=TABLE, dim=DIM, optimizer="rowwise_adagrad")]) as cache:
        cap = cache.capacity_rows(TABLE)
        prewarm_s = prewarm(cache, cap["hbm"] + cap["ddr"]) if warm else 0.0
        warm_b, timed = batches[:len(batches) // 2], batches[len(batches) // 2:]
        for b in tqdm(warm_b, desc=f"warm-up {n_rows:,}", unit="batch", leave=False):
            cache.lookup(TABLE, b, out=out)
            cache.apply_gradients(TABLE, b, grads)
        segments = max(1, min(segments, len(timed)))  # a short trace: fewer segments, none of them empty
        per = len(timed) // segments
        seg_s, before = [], cache.stats()[TABLE]
        resident = {t: before[t]["resident_rows"] for t in ("hbm", "ddr")}
        full = {t: resident[t] / cap[t] if cap[t] else 1.0 for t in ("hbm", "ddr")}
        if warm and min(full.values()) < MIN_FULL:
            raise RuntimeError(f"{n_rows:,} rows: memory tiers not full when timing starts (HBM {full['hbm']:.1%}, "
                               f"DDR {full['ddr']:.1%} of capacity): the benchmark would time a cache still filling")
        for i in tqdm(range(0, per * segments, per), desc=f"timed {n_rows:,}", unit="segment", leave=False):
            t0 = time.perf_counter()
            for b in timed[i:i + per]:
                cache.lookup(TABLE, b, out=out)
                cache.apply_gradients(TABLE, b, grads)
            seg_s.append(time.perf_counter() - t0)
        after = cache.stats()[TABLE]
        first = len(batches) // 2 * BATCH
        timed_ranks = ranks[first:first + per * segments * BATCH]
        direct = store_direct(cache, [timed_ranks[i:i + BATCH] for i in range(0, timed_ranks.size, BATCH)],
                              hbm_rows + ddr_rows)
    looked = after["lookups"] - before["lookups"]
    hits = {t: (after[t]["hits"] - before[t]["hits"]) / looked for t in ("hbm", "ddr", "ssd")}
    hits["created"] = (after["ssd"]["created"] - before["ssd"]["created"]) / looked
    tier_ns = {t: (after[t]["seconds"] - before[t]["seconds"]) / looked * 1e9 for t in ("hbm", "ddr", "ssd")}
    med = statistics.median(seg_s)
    du = subprocess.run(["du", "-sb", path], capture_output=True, text=True).stdout.split()[0]
    shutil.rmtree(path, ignore_errors=True)
    return {"rows": n_rows, "hbm_rows": hbm_rows, "ddr_rows": ddr_rows, "fill_seconds": fill_s,
            "prewarm": warm, "prewarm_seconds": prewarm_s, "resident_at_timing": resident,
            "full_at_timing": full, "store_bytes": int(du), "timed_rows": per * BATCH, "segment_seconds": seg_s,
            "ns_per_row": med / (per * BATCH) * 1e9, "rows_per_s": per * BATCH / med, "hit_ratio": hits,
            "timed_share_outside_hot_set": float((timed_ranks >= hbm_rows + ddr_rows).mean()),
            "distinct_keys_in_trace": int(np.unique(ranks).size),
            "tier_seconds_per_row_ns": tier_ns,
            # the SSD tier's time per row it served, against the store's own get_many of the same kind of keys
            "ssd_ns_per_store_row": tier_ns["ssd"] / max(hits["ssd"] + hits["created"], 1e-12),
            "store_direct": direct}


def _memory_ns(r: dict[str, Any]) -> float:
    """ns per looked-up row spent in the memory tiers (HBM and DDR)."""
    return float(r["tier_seconds_per_row_ns"]["hbm"] + r["tier_seconds_per_row_ns"]["ddr"])


def render(results: list[dict[str, Any]]) -> str:
    """Markdown table of the sizes."""
    lines = ["| rows | store on disk | HBM / DDR rows | resident at timing HBM / DDR | hits HBM / DDR / SSD | "
             "accesses outside the hot set | ns per row (lookup + update) | rows/s | vs smallest | "
             "HBM + DDR ns per row | SSD tier ns per store row | store get_many ns per row (direct) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = results[0]["ns_per_row"]
    for r in results:
        h, f = r["hit_ratio"], r.get("full_at_timing", {})
        lines.append(f"| {r['rows']:,} | {r['store_bytes'] / 2**30:.2f} GiB | {r['hbm_rows']:,} / {r['ddr_rows']:,} | "
                     f"{f.get('hbm', float('nan')):.1%} / {f.get('ddr', float('nan')):.1%} | "
                     f"{h['hbm']:.1%} / {h['ddr']:.1%} / {h['ssd'] + h['created']:.1%} | "
                     f"{r.get('timed_share_outside_hot_set', float('nan')):.1%} | {r['ns_per_row']:.0f} | "
                     f"{r['rows_per_s'] / 1e3:.0f}K | {format_ratio(r['ns_per_row'] / base, TARGET_GROWTH)} | "
                     f"{_memory_ns(r):.0f} | {r.get('ssd_ns_per_store_row', float('nan')):,.0f} | "
                     f"{r.get('store_direct', {}).get('ns_per_row', float('nan')):,.0f} |")
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
    ap.add_argument("--no-prewarm", action="store_true",
                    help="skip the pre-warm (the earlier method: at large sizes the tiers are still filling)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    args = ap.parse_args(argv)
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    info["torch_threads"] = 1
    sizes = [int(float(s)) for s in (args.sizes or ("1e6,1e7" if args.quick else "1e6,1e7,1e8")).split(",")]
    accesses = args.accesses or (1_000_000 if args.quick else 4_000_000)
    work = args.work or tempfile.mkdtemp(prefix="embcache-scale-")
    t0 = time.perf_counter()
    results = []
    try:
        for n in sizes:
            r = run_size(n, accesses, 4 if args.quick else 8, work, warm=not args.no_prewarm)
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
    big, small = results[-1], results[0]
    if "store_direct" in big:
        # what limits the growth: the memory tiers' part, and the store's own read cost (no targets)
        summary += [
            {"case": f"HBM + DDR time per row at {big['rows']:,} rows vs {small['rows']:,}",
             "ratio": _memory_ns(big) / _memory_ns(small), "target": None, "lower_is_better": True, "met": None,
             "reference": f"{small['rows']:,} rows"},
            {"case": f"store get_many per row at {big['rows']:,} rows vs {small['rows']:,} (RocksDB alone)",
             "ratio": big["store_direct"]["ns_per_row"] / small["store_direct"]["ns_per_row"], "target": None,
             "lower_is_better": True, "met": None, "reference": f"{small['rows']:,} rows"},
            {"case": f"SSD tier time per store row vs the store's own get_many, {big['rows']:,} rows",
             "ratio": big["ssd_ns_per_store_row"] / big["store_direct"]["ns_per_row"], "target": None,
             "lower_is_better": True, "met": None, "reference": "RocksDB get_many of the keys outside the hot set"}]
    write_json(stem + ".json", {"benchmark": "per-row cost vs table size", "command": info["command"],
                                "machine": info, "accesses": accesses, "batch": BATCH, "dim": DIM,
                                "prewarm": not args.no_prewarm, "results": results, "summary": summary,
                                "seconds": time.perf_counter() - t0})
    with open(stem + ".md", "w") as f:
        f.write(f"# Per-row cost vs table size\n\nCommand: `{info['command']}` (commit "
                f"{str(info['git_commit'])[:7]}{', dirty tree' if info['git_dirty'] else ''}, {info['started_at']}); "
                f"Zipf(1.05) trace of {accesses:,} accesses, batch {BATCH:,}, dim {DIM}, tiers 1% / 10% of the rows"
                f"{', pre-warmed with the hot set' if not args.no_prewarm else ', no pre-warm'}; median of the timed "
                f"segments. \"Accesses outside the hot set\": timed accesses to keys outside the HBM + DDR most "
                f"popular (what a perfect frequency-ordered cache would read from the store).\n\n{table}\n")
    plot(results, stem + ".png")
    print(f"wrote {stem}.json/.md/.png ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
