"""Find throughput of the key -> slot indexes: NumbaIndex, TorchIndex (CPU) and a Python dict.

Run from the repository root::

    .venv/bin/python bench/bench_index.py                 # CPU indexes (+ TorchIndex on CUDA when present)
    .venv/bin/python bench/bench_index.py --quick         # fewer repetitions, 2M ids (writes index-quick.json)
    .venv/bin/python bench/bench_index.py --device cpu    # CPU indexes only (--device cuda: CUDA required)

Setup: an index of capacity 1M (2**20) holding the 1M most popular of 10M ids (the steady state
of a frequency-based cache), queried with batches of 65,536 keys drawn Zipf(alpha=1.05) over the
10M ids (hot ids scattered over the id space by a random permutation, as in
``bench/workloads.py``): ~91% of lookups hit. Also reported for each index:

- its table's bytes per resident key (``nbytes / capacity``: what a tier counts per row);
- find on uniform-random batches over the 10M ids (~90% misses, no locality: the worst case);
- erase and insert rates: a batch of 65,536 resident keys erased and inserted back (at capacity);
- a CPU tier's whole lookup, ``find`` then ``index_select`` of the found float32 rows (dim 128),
  as a fraction of ``index_select`` alone on the same slots (the brief asks >= 0.8).

With ``--device cuda`` (or ``auto``, the default, on a machine with CUDA) the same cases also
run for ``TorchIndex`` on the GPU ("TorchIndex (cuda)": keys, slots and the dim-128 rows on the
device, each call timed between ``torch.cuda.synchronize()`` calls).

Prints a Markdown table and writes ``bench/results/index.json``, ``index.md`` and ``index.png``
(``index-quick.*`` with ``--quick``; ``--out DIR`` writes them to DIR instead). A rate is batch size
over the median time of one batch across the repetitions (in rounds cycling through the indexes,
after a warm-up); the JSON also has the rates at the fastest and slowest repetition (``best``,
``worst``). The lookup ratio (find + index_select over index_select alone) is the ratio of the
median rates, and also given as the median over back-to-back (index_select alone, lookup) pairs.
"""

from __future__ import annotations

import argparse
import os
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

from _common import format_ratio, machine_info, markdown_table, write_json  # noqa: E402
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


def _no_sync() -> None:
    pass


def timings(fn: Callable[[int], Any], reps: int, warmup: int = 2, sync: Callable[[], None] = _no_sync) -> list[float]:
    """Wall times of ``fn(i)`` for ``i`` in ``range(reps)``, after ``warmup`` untimed calls.

    ``sync`` waits for queued device work (``torch.cuda.synchronize`` for a CUDA index): it is
    called before and after each timed call.
    """
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(reps):
        sync()
        t0 = time.perf_counter()
        fn(i)
        sync()
        out.append(time.perf_counter() - t0)
    return out


def finder(index: Any, batches: torch.Tensor) -> Callable[[int], Any]:
    """``i -> index.find(batches[i])``, cycling through the rows of ``batches`` ([n, batch])."""
    return lambda i: index.find(batches[i % batches.shape[0]])


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU; ``cuda`` without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")
    return torch.device(name)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--capacity", type=int, default=1 << 20)
    ap.add_argument("--ids", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto (default): also time TorchIndex on CUDA when present")
    ap.add_argument("--quick", action="store_true", help="2M ids, 12 repetitions; writes index-quick.json")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.ids, args.reps = min(args.ids, 2_000_000), min(args.reps, 12)
    stem = os.path.join(args.out, "index-quick" if args.quick else "index")
    device = resolve_device(args.device)
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

    makers: dict[str, Callable[[], Any]] = {
        "NumbaIndex": lambda: NumbaIndex(cap),
        "TorchIndex (cpu)": lambda: TorchIndex(cap, "cpu"),
        "dict": DictIndex,
    }
    cpu_data = {"zipf": zipf_batches, "uniform": uniform_batches, "resident": resident, "slots": slots,
                "weights": weights, "rows_of": rows_of}
    data_of: dict[str, dict[str, torch.Tensor]] = dict.fromkeys(makers, cpu_data)
    sync_of: dict[str, Callable[[], None]] = dict.fromkeys(makers, _no_sync)
    if device.type == "cuda":
        makers["TorchIndex (cuda)"] = lambda: TorchIndex(cap, device)
        data_of["TorchIndex (cuda)"] = {k: v.to(device) for k, v in cpu_data.items()}
        sync_of["TorchIndex (cuda)"] = lambda: torch.cuda.synchronize(device)
    indexes: dict[str, Any] = {}
    for name, make in makers.items():
        d = data_of[name]
        index = indexes[name] = make()
        index.insert(d["resident"], d["slots"])
        for i in range(n_batches):  # every batch answered right before anything is timed
            assert torch.equal(index.find(d["zipf"][i]).cpu(), expect[i]), name
            assert torch.equal(index.find(d["uniform"][i]).cpu(), expect_uniform[i]), name

    # The machine may be shared: time in rounds that cycle through the indexes, so that a burst
    # of outside load hits all of them rather than one, and time index_select alone paired with
    # each lookup (same batch, back to back) for the lookup ratio.
    rounds = 4
    t: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("zipf", "uniform", "lookup", "select", "erase", "insert")} for name in indexes}
    for r in range(rounds):
        for name, index in indexes.items():
            reps = max(1, args.reps // rounds if name != "dict" else args.reps // (8 * rounds))
            tn, d, sync = t[name], data_of[name], sync_of[name]
            tn["zipf"] += timings(finder(index, d["zipf"]), reps, sync=sync)
            tn["uniform"] += timings(finder(index, d["uniform"]), reps, sync=sync)

            def pair(i: int, ix: Any = index, tn: dict[str, list[float]] = tn, d: dict[str, torch.Tensor] = d,
                     sync: Callable[[], None] = sync) -> None:
                b = d["zipf"][i % n_batches]
                sync()
                t0 = time.perf_counter()
                d["weights"].index_select(0, d["rows_of"][i % n_batches])
                sync()
                t1 = time.perf_counter()
                d["weights"].index_select(0, ix.find(b).clamp_min(0))
                sync()
                t2 = time.perf_counter()
                tn["select"].append(t1 - t0)
                tn["lookup"].append(t2 - t1)

            for i in range(reps + 1):
                pair(i)
            del tn["select"][-reps - 1], tn["lookup"][-reps - 1]  # the first pair warms up

            for i in range(reps + 1):
                # Erase one batch of resident keys and insert them back: the index stays at
                # capacity, as a full tier's does under eviction.
                j = ((r * (reps + 1) + i) * batch) % (cap - batch + 1)
                keys, where = d["resident"][j:j + batch], d["slots"][j:j + batch]
                sync()
                t0 = time.perf_counter()
                index.erase(keys)
                sync()
                t1 = time.perf_counter()
                index.insert(keys, where)
                sync()
                t2 = time.perf_counter()
                if i:
                    tn["erase"].append(t1 - t0)
                    tn["insert"].append(t2 - t1)

    rows: list[dict[str, Any]] = []
    t_select: list[float] = []
    for name, index in indexes.items():
        assert torch.equal(index.find(data_of[name]["zipf"][0]).cpu(), expect[0]), name
        tn = t[name]
        if data_of[name] is cpu_data:
            t_select += tn["select"]

        def rates(stat: Callable[[list[float]], float], tn: dict[str, list[float]] = tn) -> dict[str, float]:
            return {
                "find_zipf_keys_per_s": batch / stat(tn["zipf"]),
                "find_uniform_keys_per_s": batch / stat(tn["uniform"]),
                "erase_keys_per_s": batch / stat(tn["erase"]),
                "insert_keys_per_s": batch / stat(tn["insert"]),
                "lookup_rows_per_s": batch / stat(tn["lookup"]),
                "index_select_rows_per_s": batch / stat(tn["select"]),
            }

        med = rates(statistics.median)
        rows.append({
            "index": name,
            "device": str(data_of[name]["zipf"].device),
            **med,
            "lookup_vs_index_select": med["lookup_rows_per_s"] / med["index_select_rows_per_s"],
            # the table's bytes per resident key (what a tier counts per row for its index)
            "bytes_per_key": index.nbytes / cap if hasattr(index, "nbytes") else None,
            "lookup_vs_index_select_median_of_pairs": statistics.median(
                s / lk for s, lk in zip(tn["select"], tn["lookup"], strict=True)),
            "best": rates(min),
            "worst": rates(max),
            "samples": {k: len(v) for k, v in tn.items()},
            "seconds": tn,
        })

    result = {
        "benchmark": "key -> slot index: find, erase, insert; find + index_select vs index_select",
        "command": info["command"],
        "machine": info,
        "device": str(device),
        "capacity": cap,
        "ids": args.ids,
        "batch": batch,
        "alpha": args.alpha,
        "zipf_hit_ratio": hit_ratio,
        "dim": args.dim,
        "reps": args.reps,
        "rounds": rounds,
        "statistic": "median over repetitions (best/worst: fastest/slowest repetition)",
        "index_select_rows_per_s": batch / statistics.median(t_select),
        "torch_threads": torch.get_num_threads(),
        "results": rows,
        # the find + index_select ratio of each index (no target of its own here; the cache's is in bench_cache)
        "summary": [{"case": f"find + index_select dim {args.dim}, {row['index']}", "ratio":
                     row["lookup_vs_index_select"], "reference": "index_select alone (same slots)", "target": None}
                    for row in rows],
    }

    def m(x: float) -> str:
        return f"{x / 1e6:.1f}M"

    head = (f"capacity {cap:,} holding the {cap:,} hottest of {args.ids:,} ids; batch {batch:,}; Zipf alpha "
            f"{args.alpha} (hit ratio {hit_ratio:.3f}); {torch.get_num_threads()} torch threads, "
            f"{os.cpu_count()} cpus; median of {args.reps} repetitions")
    table = markdown_table(
        ["index", "bytes/key", "find zipf (keys/s)", "find uniform (keys/s)", "erase (keys/s)", "insert (keys/s)",
         f"find + index_select dim {args.dim} (rows/s)", "index_select alone (rows/s)", "ratio"],
        [[row["index"], "—" if row["bytes_per_key"] is None else f"{row['bytes_per_key']:.1f}",
          m(row["find_zipf_keys_per_s"]), m(row["find_uniform_keys_per_s"]), m(row["erase_keys_per_s"]),
          m(row["insert_keys_per_s"]), m(row["lookup_rows_per_s"]), m(row["index_select_rows_per_s"]),
          format_ratio(row["lookup_vs_index_select"])] for row in rows])
    write_json(stem + ".json", result)
    with open(stem + ".md", "w") as f:
        f.write(f"# Key -> slot index rates\n\nCommand: `{info['command']}` (commit "
                f"{str(info['git_commit'])[:7]}{', dirty tree' if info['git_dirty'] else ''}); {info['cpu_model']}."
                f"\n\n{head}.\n\n{table}\n")
    plot(rows, stem + ".png", head)
    print(head + "\n")
    print(table)
    print(f"\nwrote {stem}.json/.md/.png")
    return 0


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Grouped bars (log keys/s): find zipf, find uniform, erase, insert per index, whiskers = fastest/slowest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [("find_zipf_keys_per_s", "find (Zipf)"), ("find_uniform_keys_per_s", "find (uniform)"),
           ("erase_keys_per_s", "erase"), ("insert_keys_per_s", "insert"),
           ("lookup_rows_per_s", "find + index_select")]
    fig, ax = plt.subplots(figsize=(9, 4.4))
    width = 0.8 / len(rows)
    for j, row in enumerate(rows):
        xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(ops))]
        med = [row[k] for k, _ in ops]
        lo = [row[k] - row["worst"][k] for k, _ in ops]
        hi = [row["best"][k] - row[k] for k, _ in ops]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=row["index"])
    ax.set_yscale("log")
    ax.set_xticks(range(len(ops)), [label for _, label in ops])
    ax.set_ylabel("keys/s (median; whiskers: fastest/slowest repetition)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
