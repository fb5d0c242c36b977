"""Resharding benchmark: rows migrated per second, and training throughput during a migration against before it.

Run from the repository root::

    .venv/bin/python bench/bench_reshard.py            # 400,000 rows, 2 -> 3 -> 2 shards (~3 min)
    .venv/bin/python bench/bench_reshard.py --quick    # 100,000 rows (~1 min), writes reshard-quick.*

Workload: three ``embcache-server`` processes on 127.0.0.1 (RocksDB, tiers of 20% of the rows per
shard), one table of dim 64 with row-wise AdaGrad, every row written once and flushed. A training
thread runs steps of ``lookup`` + ``apply_gradients`` on 4,096 Zipf-distributed keys through an
``embcache.Client`` for the whole run; after a warm-up period the fleet is resharded from 2 to 3
shards (``Client.reshard`` from a second client, as an operator would) and, after a period at 3,
back to 2. Reported, in one run:

* rows migrated per second (rows copied over the first copy's wall time, with training running),
  the rows written during it (copied again once frozen) and how long writes to moving rows waited;
* training steps per second during each migration (from its begin to its commit) against the
  steps per second of the period before it, and the longest gap between two steps (the pause a
  training step saw: its writes to moving rows wait for the commit);
* a plot of the training rate over time with the migrations shaded.

Both the servers and the trainer share this machine's cores with the migration, so the ratio is
that of a machine where the parameter server and the trainer are not separated.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine_info, markdown_table, write_json
from embcache import Client
from embcache.server.local import LocalServer

DIM = 64
BATCH = 4096
SPEC = f"name=t,dim={DIM},optimizer=rowwise_adagrad,lr=0.05,seed=3"


class _Trainer(threading.Thread):
    """Steps of lookup + apply_gradients until stopped; records each step's end time."""

    def __init__(self, client: Client, rows: int) -> None:
        super().__init__(daemon=True)
        self.client, self.rows = client, rows
        self.ends: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = np.random.default_rng(0)
        grads = torch.full((BATCH, DIM), 1e-3)
        try:
            while not self.stop.is_set():
                keys = (rng.zipf(1.1, BATCH) % self.rows).astype(np.int64)
                self.client.lookup("t", keys)
                self.client.apply_gradients("t", keys, grads)
                self.ends.append(time.monotonic())
        except BaseException as exc:
            self.error = exc


def _rate(ends: list[float], t0: float, t1: float) -> float:
    n = sum(1 for t in ends if t0 <= t < t1)
    return n / (t1 - t0) if t1 > t0 else 0.0


def _longest_gap(ends: list[float], t0: float, t1: float) -> float:
    inside = [t for t in ends if t0 <= t <= t1]
    before = [t for t in ends if t < t0][-1:]
    after = [t for t in ends if t > t1][:1]
    pts = before + inside + after
    return max((b - a for a, b in itertools.pairwise(pts)), default=0.0)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="100,000 rows instead of 400,000")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results directory")
    args = p.parse_args(argv)
    info = machine_info(script=__file__, argv=argv)
    rows = 100_000 if args.quick else 400_000
    period = 6.0 if args.quick else 15.0
    stem = os.path.join(args.out, "reshard-quick" if args.quick else "reshard")
    t_start = time.perf_counter()
    row_bytes = DIM * 4 + 4 + 64
    tier = str(int(rows * row_bytes * 0.2 / 2))
    with tempfile.TemporaryDirectory(prefix="embcache-bench-reshard-") as tmp:
        servers = [LocalServer(Path(tmp) / f"s{i}", tables=[SPEC], workdir=Path(tmp) / f"run{i}",
                               args=["--hbm-bytes", tier, "--ddr-bytes", tier, "--store", "rocksdb"],
                               start_timeout=300) for i in range(3)]
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        a, b, c = (s.address for s in servers)
        try:
            with Client([a, b], timeout=600) as loader:
                print(f"loading {rows:,} rows ...", flush=True)
                for start in range(0, rows, 50_000):
                    keys = np.arange(start, min(start + 50_000, rows))
                    loader.assign("t", keys, torch.randn(keys.size, DIM))
                loader.flush()
            with Client([a, b], timeout=600) as train_client, Client([a, b], timeout=600) as operator:
                trainer = _Trainer(train_client, rows)
                trainer.start()
                phases: list[dict[str, Any]] = []
                time.sleep(period)
                for label, target in (("2 -> 3 shards", [a, b, c]), ("3 -> 2 shards", [a, b])):
                    before0 = time.monotonic() - period
                    t0 = time.monotonic()
                    print(f"resharding {label} ...", flush=True)
                    report = operator.reshard(target, progress=True)
                    t1 = time.monotonic()
                    moved = sum(report.moved_rows.values())
                    phases.append({"reshard": label, "moved_rows": moved, "copy_seconds": report.seconds,
                                   "delta_rows": report.delta_rows, "pause_seconds": report.pause_seconds,
                                   "total_seconds": report.total_seconds, "rows_per_s": report.rows_per_second,
                                   "deleted_rows": report.deleted_rows, "t0": t0, "t1": t1, "before0": before0})
                    time.sleep(period)
                trainer.stop.set()
                trainer.join(600)
                if trainer.error is not None:
                    raise trainer.error
                ends = list(trainer.ends)
                for ph in phases:  # from the whole record: the steps after each window are known now
                    ph["steps_per_s_before"] = _rate(ends, ph["before0"], ph["t0"])
                    ph["steps_per_s_during"] = _rate(ends, ph["t0"], ph["t1"])
                    ph["longest_step_gap_s"] = _longest_gap(ends, ph["t0"], ph["t1"])
        finally:
            for s in servers:
                s.terminate()
            for s in servers:
                s.stop()
    summary, table_rows = [], []
    for ph in phases:
        ratio = ph["steps_per_s_during"] / ph["steps_per_s_before"] if ph["steps_per_s_before"] else 0.0
        summary.append({"case": f"training steps/s during a migration, {ph['reshard']} ({ph['moved_rows']:,} rows, "
                                f"{ph['rows_per_s']:,.0f} rows/s)",
                        "reference": f"the {period:g} s before it ({ph['steps_per_s_before']:.1f} steps/s)",
                        "ratio": ratio, "target": None, "met": None})
        table_rows.append([ph["reshard"], f"{ph['moved_rows']:,}", f"{ph['copy_seconds']:.2f}",
                           f"{ph['rows_per_s']:,.0f}", f"{ph['delta_rows']:,}", f"{ph['pause_seconds']:.2f}",
                           f"{ph['total_seconds']:.2f}",
                           f"{ph['steps_per_s_before']:.1f}", f"{ph['steps_per_s_during']:.1f}", f"{ratio:.2f}",
                           f"{ph['longest_step_gap_s']:.2f}"])
    headers = ["reshard", "rows moved", "copy s", "rows/s", "rows written during the copy, copied again",
               "freeze to last commit s", "total s", "steps/s before", "steps/s during", "during / before",
               "longest step gap s"]
    table = markdown_table(headers, table_rows)
    t_base = ends[0] if ends else 0.0
    doc = {"benchmark": "resharding: rows migrated per second, training throughput during a migration",
           "command": info["command"], "machine": info, "rows": rows, "dim": DIM, "batch": BATCH,
           "phases": phases, "summary": summary, "seconds": time.perf_counter() - t_start,
           "step_ends": [t - t_base for t in ends]}
    write_json(stem + ".json", doc)
    with open(stem + ".md", "w") as f:
        f.write(f"# Resharding while training\n\n`{info['command']}` — {rows:,} rows of dim {DIM} (row-wise "
                f"AdaGrad) on RocksDB shards; a trainer runs lookup + apply_gradients of {BATCH:,} Zipf keys "
                f"throughout; *during* is from the reshard's begin to its commit, *before* the {period:g} s "
                f"preceding it. Everything shares this machine's {os.cpu_count()} cores.\n\n{table}\n")
    _plot(ends, phases, stem + ".png")
    print(table)
    print(f"wrote {stem}.json/.md/.png ({time.perf_counter() - t_start:.0f} s)")
    return 0


def _plot(ends: list[float], phases: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not ends:
        return
    t0 = ends[0]
    times = np.asarray(ends) - t0
    edges = np.arange(0.0, times[-1] + 1.0, 1.0)
    counts, _ = np.histogram(times, bins=edges)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(edges[:-1], counts, drawstyle="steps-post", label="training steps per second")
    for ph in phases:
        ax.axvspan(ph["t0"] - t0, ph["t1"] - t0, alpha=0.2, color="tab:orange")
        ax.text(ph["t0"] - t0, max(counts.max(), 1) * 0.95, f" {ph['reshard']}\n {ph['rows_per_s']:,.0f} rows/s",
                fontsize=8, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("steps / s")
    ax.set_title("Training through embcache.Client while the fleet is resharded (shaded)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
