"""Store size under a stream of ever-new IDs, with and without a TTL (``TableConfig.ttl_steps``).

Command: ``.venv/bin/python bench/bench_expiry.py`` (10M distinct IDs per run, two runs; about
20-40 minutes on 2 busy cores). ``--quick``: 1M IDs (a few minutes).

Method: one table (dim 16, row-wise AdaGrad) in a real EmbeddingCache on RocksDB, HBM and DDR
tiers of 65,536 rows each (on the CPU). Each step looks up ``--batch`` IDs never seen before and
applies a gradient to them (a training step on a stream of new IDs: every row gets trained and
stored). Two runs over the same stream: without a TTL, and with ``ttl_steps`` = ``--ttl-ids``
(the clock moves one step per ID looked up, so a row expires once that many newer IDs were
looked up) and the background sweeper every ``--interval`` seconds. Every ``--sample-ids`` IDs
the run records the rows in the store (exact: ``Store.count``), the entries of the side
namespace of touches, and the store's bytes on disk.

Reported: the store's rows and bytes over the stream for both runs (the plot), the plateau (the
TTL run's largest row count in the second half of the stream, against ``ttl_ids`` plus the IDs
one sweep interval lets in), the sweep throughput (rows deleted per second of sweeping), and the
lookup latency of the steps during which a sweep ran, against the steps when none ran (same run)
and against the run without a TTL.

Writes ``bench/results/expiry.json`` (with the machine, versions and git commit), ``expiry.md``
and ``expiry.png``; ``expiry-quick.*`` with ``--quick``; ``--out DIR`` writes them to DIR.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._common import machine_info, markdown_table, write_json  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.optim import state_width  # noqa: E402
from embcache.tier import resident_row_bytes  # noqa: E402

DIM, OPT = 16, "rowwise_adagrad"
MEMORY_ROWS = 65_536  # per tier
N_IDS, QUICK_IDS = 10_000_000, 1_000_000
TTL_IDS, QUICK_TTL_IDS = 2_000_000, 200_000
BATCH = 8192


def run(path: str, n_ids: int, batch: int, ttl: int, interval: float, sample_ids: int) -> dict[str, Any]:
    """Stream ``n_ids`` new IDs through a cache (``ttl`` 0: no expiry); samples of the store's size, latencies."""
    rb = resident_row_bytes(DIM, torch.float32, state_width(OPT, DIM), "cpu")
    cfg = CacheConfig(path=path, store="rocksdb", hbm_bytes=MEMORY_ROWS * rb, ddr_bytes=MEMORY_ROWS * rb,
                      device="cpu", expiry_interval=interval)
    table = TableConfig(name="t", dim=DIM, optimizer=OPT, lr=0.05, ttl_steps=ttl)
    samples: list[dict[str, float]] = []
    lookup_ms: list[float] = []
    sweeping: list[bool] = []
    grads = torch.full((batch, DIM), 0.01)
    t_start = time.perf_counter()
    with EmbeddingCache(cfg, [table]) as cache:
        store = cache._store  # the bench reads the store's own counts
        assert store is not None
        busy = cache._sweeper._sweeping  # held while a sweep runs
        next_sample = sample_ids
        for start in range(0, n_ids, batch):
            keys = torch.arange(start, min(start + batch, n_ids))
            during = busy.locked()
            t0 = time.perf_counter()
            cache.lookup("t", keys)
            lookup_ms.append((time.perf_counter() - t0) * 1e3)
            sweeping.append(during or busy.locked())
            cache.apply_gradients("t", keys, grads[:keys.numel()])
            done = start + keys.numel()
            if done >= next_sample or done == n_ids:
                next_sample += sample_ids
                samples.append({"ids": done, "seconds": time.perf_counter() - t_start,
                                "store_rows": store.count("t"),
                                "touch_rows": store.count("~touch/t") if ttl else 0,
                                "disk_bytes": store.disk_usage_bytes()})
                s = samples[-1]
                print(f"  ttl={ttl:,} ids={done:,}: {s['store_rows']:,} rows, {s['disk_bytes'] / 2**20:,.0f} MiB, "
                      f"{s['seconds']:.0f} s", flush=True)
        expiry = cache.stats()["t"]["expiry"]
    lat = np.asarray(lookup_ms)
    mask = np.asarray(sweeping)
    return {"ttl_steps": ttl, "samples": samples, "expiry": expiry, "seconds": time.perf_counter() - t_start,
            "ids_per_s": n_ids / (time.perf_counter() - t_start),
            "lookup_ms": _quantiles(lat), "lookup_ms_sweeping": _quantiles(lat[mask]),
            "lookup_ms_idle": _quantiles(lat[~mask]), "steps_sweeping": int(mask.sum()), "steps": int(mask.size)}


def _quantiles(ms: np.ndarray) -> dict[str, float | None]:
    if ms.size == 0:
        return {"p50": None, "p99": None, "mean": None}
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean())}


def plot(runs: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """Store rows and bytes on disk against the IDs streamed, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, r in runs.items():
        ids = [s["ids"] / 1e6 for s in r["samples"]]
        axes[0].plot(ids, [s["store_rows"] / 1e6 for s in r["samples"]], marker="o", ms=3, label=name)
        axes[1].plot(ids, [s["disk_bytes"] / 2**30 for s in r["samples"]], marker="o", ms=3, label=name)
    for ax, ylabel in zip(axes, ("rows in the store (M)", "store on disk (GiB)"), strict=True):
        ax.set_xlabel("distinct IDs streamed (M)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(q: dict[str, float | None], key: str) -> str:
    v = q.get(key)
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    """Run both streams, print the table, write the JSON, Markdown and PNG."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_IDS:,} IDs, TTL {QUICK_TTL_IDS:,}")
    ap.add_argument("--ids", type=int, default=None, help=f"distinct IDs per run (default {N_IDS:,})")
    ap.add_argument("--ttl-ids", type=int, default=None, help=f"ttl_steps of the TTL run (default {TTL_IDS:,})")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"new IDs per step (default {BATCH})")
    ap.add_argument("--interval", type=float, default=30.0, help="CacheConfig.expiry_interval, seconds (default 30)")
    ap.add_argument("--sample-ids", type=int, default=None, help="IDs between two samples (default ids / 20)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    args = ap.parse_args(argv)
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    n_ids = args.ids or (QUICK_IDS if args.quick else N_IDS)
    ttl = args.ttl_ids or (QUICK_TTL_IDS if args.quick else TTL_IDS)
    sample_ids = args.sample_ids or max(args.batch, n_ids // 20)
    t_start = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("EMBCACHE_BENCH_TMP")) as tmp:
        for name, t in (("no TTL", 0), (f"ttl_steps={ttl:,}", ttl)):
            print(f"{name}: {n_ids:,} new IDs in batches of {args.batch}", flush=True)
            runs[name] = run(os.path.join(tmp, f"c{t}"), n_ids, args.batch, t, args.interval, sample_ids)
    base, ttl_run = runs["no TTL"], runs[f"ttl_steps={ttl:,}"]
    half = [s["store_rows"] for s in ttl_run["samples"] if s["ids"] > n_ids / 2]
    plateau = max(half) if half else None
    e = ttl_run["expiry"]
    deleted = e["expired_hbm"] + e["expired_ddr"] + e["expired_store"]
    sweep_rate = deleted / e["sweep_seconds"] if e["sweep_seconds"] else None
    # the sweeper waits an interval after each sweep, and a sweep itself takes time: rows pile up for both
    sweep_s = e["sweep_seconds"] / e["sweeps"] if e["sweeps"] else 0.0
    bound = ttl + (args.interval + sweep_s) * ttl_run["ids_per_s"] + 2 * MEMORY_ROWS
    rows = [[name, f"{r['samples'][-1]['store_rows']:,}", f"{r['samples'][-1]['disk_bytes'] / 2**20:,.0f}",
             f"{r['ids_per_s']:,.0f}", _ms(r["lookup_ms"], "p50"), _ms(r["lookup_ms"], "p99"),
             _ms(r["lookup_ms_idle"], "p50"), _ms(r["lookup_ms_sweeping"], "p50"),
             _ms(r["lookup_ms_sweeping"], "p99"), f"{r['steps_sweeping']}/{r['steps']}"]
            for name, r in runs.items()]
    table = markdown_table(["run", "store rows at the end", "store MiB at the end", "IDs/s", "lookup p50 ms",
                            "lookup p99 ms", "p50 no sweep", "p50 during sweep", "p99 during sweep",
                            "steps during a sweep"], rows)
    print("\n" + table)
    print(f"\nplateau (max rows, 2nd half): {plateau:,}; bound ttl + (interval + sweep) x rate + memory = "
          f"{bound:,.0f}; "
          f"swept {deleted:,} rows in {e['sweep_seconds']:.1f} s of {e['sweeps']} sweeps "
          f"({sweep_rate or 0:,.0f} rows/s)")
    summary = [{"case": f"store rows after {n_ids:,} new IDs with ttl_steps={ttl:,} (plateau, 2nd half max)",
                "reference": "the same stream without a TTL",
                "ratio": plateau / base["samples"][-1]["store_rows"] if plateau else None, "target": None, "met": None},
               {"case": "lookup p50 during a sweep", "reference": "lookup p50 of the same run, no sweep running",
                "ratio": (ttl_run["lookup_ms_sweeping"]["p50"] / ttl_run["lookup_ms_idle"]["p50"]
                          if ttl_run["lookup_ms_sweeping"]["p50"] and ttl_run["lookup_ms_idle"]["p50"] else None),
                "target": None, "met": None}]
    stem = os.path.join(args.out, "expiry-quick" if args.quick else "expiry")
    write_json(stem + ".json", {"benchmark": "store size under a stream of new IDs, with and without a TTL",
                                "command": info["command"], "machine": info, "ids": n_ids, "batch": args.batch,
                                "ttl_steps": ttl, "interval_s": args.interval, "dim": DIM, "optimizer": OPT,
                                "memory_rows_per_tier": MEMORY_ROWS, "runs": runs, "plateau_rows": plateau,
                                "plateau_bound_rows": bound, "sweep_rows_per_s": sweep_rate, "summary": summary,
                                "seconds": time.perf_counter() - t_start})
    lines = [f"# Store size under a stream of new IDs{' (quick)' if args.quick else ''}", "",
             f"Command: `{info['command']}` (commit {str(info['git_commit'])[:7]}"
             f"{', dirty tree' if info['git_dirty'] else ''}, {info['started_at']}); {n_ids:,} distinct IDs per "
             f"run, {args.batch} new IDs per step (lookup + apply_gradients), dim {DIM}, {OPT}, RocksDB, HBM and "
             f"DDR tiers of {MEMORY_ROWS:,} rows; the TTL run sweeps every {args.interval:g} s.", "", table, "",
             f"- Plateau: at most {plateau:,} rows in the store over the second half of the stream with "
             f"ttl_steps={ttl:,} (bound: ttl + the IDs of one sweep interval and one sweep + the rows in memory "
             f"= {bound:,.0f}), "
             f"against {base['samples'][-1]['store_rows']:,} without a TTL.",
             f"- Sweeps: {e['sweeps']} deleted {deleted:,} rows in {e['sweep_seconds']:.1f} s: "
             f"{sweep_rate or 0:,.0f} rows/s.",
             "- Lookup latency per step (8,192 new IDs, all read from the store or created): p50 "
             f"{_ms(ttl_run['lookup_ms_idle'], 'p50')} ms with no sweep running, "
             f"{_ms(ttl_run['lookup_ms_sweeping'], 'p50')} ms during a sweep (p99 "
             f"{_ms(ttl_run['lookup_ms_idle'], 'p99')} / {_ms(ttl_run['lookup_ms_sweeping'], 'p99')}); "
             f"without a TTL p50 {_ms(base['lookup_ms'], 'p50')} ms.", ""]
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    plot(runs, stem + ".png", f"Store size over a stream of {n_ids:,} new IDs (batches of {args.batch}), "
                              f"with and without ttl_steps={ttl:,}")
    print(f"wrote {stem}.json/.md/.png ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
