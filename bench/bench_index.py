"""Find throughput of the key -> slot indexes: NumbaIndex, TorchIndex (CPU) and a Python dict.

Run from the repository root::

    .venv/bin/python bench/bench_index.py

Setup: an index of capacity 1M (2**20) holding the 1M most popular of 10M ids (the steady state
of a frequency-based cache), queried with batches of 65,536 keys drawn Zipf(alpha=1.05) over the
10M ids (hot ids scattered over the id space by a random permutation, as in
``bench/workloads.py``): ~91% of lookups hit. Also reported for each index:

- find on uniform-random batches over the 10M ids (~90% misses, no locality: the worst case);
- erase and insert rates: a batch of 65,536 resident keys erased and inserted back (at capacity);
- a CPU tier's whole lookup, ``find`` then ``index_select`` of the found float32 rows (dim 128),
  as a fraction of ``index_select`` alone on the same slots (the brief asks >= 0.8).

Prints a Markdown table and writes ``bench/results/index.json``. A rate is batch size over the
best (minimum) time of one batch across the repetitions, after a warm-up; the machine is shared,
and the minimum is the least disturbed by other processes (medians are in the JSON as well).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from workloads import zipf_ranks  # noqa: E402

from embcache.index import NumbaIndex, TorchIndex  # noqa: E402


class DictIndex:
    """The baseline: a Python dict, converting through lists (what a naive cache would do)."""

    def __init__(self) -> None:
        self.d: dict[int, int] = {}

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        get = self.d.get
        return torch.tensor([get(k, -1) for k in keys.tolist()], dtype=torch.int64)

    def insert(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        self.d.update(zip(keys.tolist(), slots.tolist(), strict=True))

    def erase(self, keys: torch.Tensor) -> None:
        pop = self.d.pop
        for k in keys.tolist():
            pop(k)


def timings(fn: Callable[[int], Any], reps: int, warmup: int = 3) -> list[float]:
    """Wall times of ``fn(i)`` for ``i`` in ``range(reps)``, after ``warmup`` untimed calls."""
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--capacity", type=int, default=1 << 20)
    ap.add_argument("--ids", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "index.json"))
    args = ap.parse_args()
    cap, batch, n_batches = args.capacity, args.batch, 16

    rng = np.random.default_rng(0)
    rank_to_key = rng.permutation(args.ids).astype(np.int64)
    zipf = torch.from_numpy(rank_to_key[zipf_ranks(n_batches * batch, args.ids, args.alpha, rng)])
    zipf_batches = zipf.view(n_batches, batch)
    uniform_batches = torch.from_numpy(rng.integers(0, args.ids, (n_batches, batch), dtype=np.int64))
    resident = torch.from_numpy(rank_to_key[:cap])  # the hottest ids
    slots = torch.from_numpy(rng.permutation(cap).astype(np.int64))
    # The right answers, by direct addressing over the id space: for checks and for timing
    # index_select alone on exactly the rows the lookup reads.
    slot_of_id = torch.full((args.ids,), -1, dtype=torch.int64)
    slot_of_id[resident] = slots
    expect = slot_of_id[zipf_batches]
    expect_uniform = slot_of_id[uniform_batches]
    hit_ratio = float((expect >= 0).double().mean())
    weights = torch.randn(cap, args.dim)
    rows_of = expect.clamp_min(0)

    t_select = timings(lambda i: weights.index_select(0, rows_of[i % n_batches]), args.reps)

    makers: dict[str, Callable[[], Any]] = {
        "NumbaIndex": lambda: NumbaIndex(cap),
        "TorchIndex (cpu)": lambda: TorchIndex(cap, "cpu"),
        "dict": DictIndex,
    }
    rows: list[dict[str, Any]] = []
    for name, make in makers.items():
        index = make()
        index.insert(resident, slots)
        reps = args.reps if name != "dict" else max(3, args.reps // 8)
        for i in range(n_batches):  # every batch answered right before anything is timed
            assert torch.equal(index.find(zipf_batches[i]), expect[i]), name
            assert torch.equal(index.find(uniform_batches[i]), expect_uniform[i]), name

        t_zipf = timings(lambda i, ix=index: ix.find(zipf_batches[i % n_batches]), reps)
        t_uni = timings(lambda i, ix=index: ix.find(uniform_batches[i % n_batches]), reps)

        def lookup(i: int, ix: Any = index) -> torch.Tensor:
            found = ix.find(zipf_batches[i % n_batches])
            return weights.index_select(0, found.clamp_min(0))

        t_lookup = timings(lookup, reps)
        # index_select alone again, right after this index's lookups, so that both see the same
        # machine state (other processes, caches, numba's worker threads).
        t_sel = timings(lambda i: weights.index_select(0, rows_of[i % n_batches]), reps)
        t_select += t_sel

        def churn_once(i: int, ix: Any = index) -> tuple[float, float]:
            # Erase one batch of resident keys and insert them back: the index stays at
            # capacity, as a full tier's does under eviction.
            j = (i * batch) % (cap - batch + 1)
            keys, where = resident[j:j + batch], slots[j:j + batch]
            t0 = time.perf_counter()
            ix.erase(keys)
            t1 = time.perf_counter()
            ix.insert(keys, where)
            return t1 - t0, time.perf_counter() - t1

        pairs = [churn_once(i) for i in range(reps + 1)][1:]
        t_era, t_ins = [p[0] for p in pairs], [p[1] for p in pairs]
        assert torch.equal(index.find(zipf_batches[0]), expect[0]), name
        rows.append({
            "index": name,
            "find_zipf_keys_per_s": batch / min(t_zipf),
            "find_uniform_keys_per_s": batch / min(t_uni),
            "erase_keys_per_s": batch / min(t_era),
            "insert_keys_per_s": batch / min(t_ins),
            "lookup_rows_per_s": batch / min(t_lookup),
            "index_select_rows_per_s": batch / min(t_sel),
            "lookup_vs_index_select": min(t_sel) / min(t_lookup),
            "median": {
                "find_zipf_keys_per_s": batch / statistics.median(t_zipf),
                "find_uniform_keys_per_s": batch / statistics.median(t_uni),
                "erase_keys_per_s": batch / statistics.median(t_era),
                "insert_keys_per_s": batch / statistics.median(t_ins),
                "lookup_rows_per_s": batch / statistics.median(t_lookup),
                "index_select_rows_per_s": batch / statistics.median(t_sel),
            },
        })
        del index

    result = {
        "command": ".venv/bin/python bench/bench_index.py",
        "capacity": cap,
        "ids": args.ids,
        "batch": batch,
        "alpha": args.alpha,
        "zipf_hit_ratio": hit_ratio,
        "dim": args.dim,
        "reps": args.reps,
        "index_select_rows_per_s": batch / min(t_select),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    def m(x: float) -> str:
        return f"{x / 1e6:.1f}M"

    print(f"capacity {cap:,} holding the {cap:,} hottest of {args.ids:,} ids; batch {batch:,}; Zipf alpha "
          f"{args.alpha} (hit ratio {hit_ratio:.3f}); {torch.get_num_threads()} torch threads, "
          f"{os.cpu_count()} cpus; best of {args.reps}\n")
    print("| index | find zipf (keys/s) | find uniform (keys/s) | erase (keys/s) | insert (keys/s) "
          f"| find + index_select dim {args.dim} (rows/s) | index_select alone (rows/s) | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['index']} | {m(r['find_zipf_keys_per_s'])} | {m(r['find_uniform_keys_per_s'])} "
              f"| {m(r['erase_keys_per_s'])} | {m(r['insert_keys_per_s'])} | {m(r['lookup_rows_per_s'])} "
              f"| {m(r['index_select_rows_per_s'])} | {r['lookup_vs_index_select']:.2f} |")
    print(f"\nwritten to {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
