"""Training throughput of the DLRM example: all tables in memory vs embcache with and without prefetch.

Run from the repository root::

    .venv/bin/python bench/bench_dlrm.py            # full: 3 configurations, ~15-20 min on 2 busy cores
    .venv/bin/python bench/bench_dlrm.py --quick    # the main configuration, smaller passes: ~1.5 min

Workload: ``examples/dlrm.py`` on its synthetic Criteo-like data (``examples/synthetic.py``:
13 dense features, 26 sparse features with Zipf popularity drifting from pass to pass), embedding
dim 16, row-wise AdaGrad on the embeddings (lr 0.05), Adam on the dense part. The data set is
generated once and every contender trains on the same bytes, from the same initial model (the
torch tables start from the cache's initializer), so their losses agree to float rounding; the
benchmark checks that the final losses match. Contenders, one after another in one process:

* **(a) torch**: all 26 tables in memory as ``torch.nn.EmbeddingBag(sparse=True)`` (every row
  of every table, ids mapped to rows by inverting the data set's id hash), row-wise AdaGrad on
  the coalesced sparse gradients (embcache's update rule; torch has no row-wise AdaGrad).
* **(b) cache**: ``CachedEmbeddingBagCollection`` through an ``EmbeddingCache`` (RocksDB),
  with the pass protocol and ``prefetch`` of pass p+1 while pass p trains.
* **(c1) cache-noprefetch**: the same passes, ``begin_pass``/``end_pass`` without ``prefetch``:
  each pass's rows are read from disk synchronously when it begins.
* **(c2) cache-nopass**: no pass protocol; rows move on demand (misses read the store or
  create the row inside the lookup).

The cache's HBM+DDR hold about 1.2x a pair of consecutive passes (HBM: the largest pass +10%;
DDR: room to stage the next pass's new rows), while the rows touched over the run must be >= 4x
what HBM+DDR hold (``MIN_TOUCHED_OVER_MEMORY``): the benchmark checks it for every configuration
right after sizing the tiers, before training, and again on the final counts, and exits with
status 2 and a message saying by how much it fell short otherwise (the full configurations are
at 5.0x, 4.4x and 4.4x; the quick one at 4.4x). On a CPU-only machine "HBM" is host memory too.

Configurations (full run): ``kaggle`` = DLRM's Criteo Kaggle architecture (bottom MLP
13-512-256-64-16, top 367-512-256-1), batch 2048, 32 passes of 50,000 samples (the example's
defaults; the headline); ``kaggle-b8k``: the same model with batch 8192, and ``light``: bottom
13-64-16, top 367-128-64-1, batch 2048, where the embedding path dominates the step, both on 24
passes of 20,000. ``--quick`` runs ``kaggle`` on 24 passes of 6,000 samples (more, smaller
passes than before: 14 of 12,000 touched only 3.1x HBM+DDR).

Method: the contenders are open side by side (``examples.dlrm.Trainer``) and take turns pass by
pass (the order rotates every pass), so a change in the load of this shared machine hits them
alike. A pass's time is ``begin_pass`` + its batches + ``end_pass`` + waiting for its own
background work (write-back, the prefetch of the next pass), so none of it runs during another
contender's pass; (b) thus keeps the overlap of prefetch with training but, like (c1), not the
overlap of the write-back with the next pass it has in a plain run. The first two passes are
warm-up and discarded; the headline is the median over the remaining passes (min and max in
brackets and in the JSON); "overall" is all samples over all pass times, warm-up included.
Per-tier hit rates are recorded per pass.
Threads: one torch (and numba) thread for every contender by default (``--threads``), as in the
other benchmarks: on this shared 2-core machine torch's 2-thread regions stall whenever the
other core is busy; the second core is left to the cache's background staging and write-back.
Each cache contender also reports the seconds spent inside the cache's ``lookup_many`` and
``apply_gradients_many`` per step, which is what separates (b) from (a).

Writes ``bench/results/dlrm.json`` (machine, package versions, git commit, every pass),
``dlrm.md`` (Markdown tables) and ``dlrm.png`` (hit rate per tier vs pass; samples/s per mode
with the ratio to (a)); ``--quick`` writes ``dlrm-quick.*``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _common import format_ratio, machine_info, markdown_table, write_json  # noqa: E402
from tqdm import tqdm  # noqa: E402

from examples import dlrm  # noqa: E402

MODES = {"torch": "(a) torch, all in memory", "cache": "(b) embcache + prefetch",
         "cache-noprefetch": "(c1) embcache, passes, no prefetch", "cache-nopass": "(c2) embcache, no passes"}
WARMUP_PASSES = 2
# name: (model and batch options, full-run data as (passes, samples per pass))
CONFIGS: dict[str, tuple[list[str], tuple[int, int]]] = {
    "kaggle": (["--batch", "2048", "--bottom-mlp", "512,256,64", "--top-mlp", "512,256"], (32, 50_000)),
    "kaggle-b8k": (["--batch", "8192", "--bottom-mlp", "512,256,64", "--top-mlp", "512,256"], (24, 20_000)),
    "light": (["--batch", "2048", "--bottom-mlp", "64", "--top-mlp", "128,64"], (24, 20_000)),
}
QUICK_DATA = (24, 6_000)  # 4.4x HBM+DDR touched; (14, 12_000) was only 3.1x
MIN_TOUCHED_OVER_MEMORY = 4.0  # rows touched by a run over the rows HBM+DDR hold


class TooSmallError(Exception):
    """The tables touched by a run are less than MIN_TOUCHED_OVER_MEMORY x HBM+DDR."""


def touched_over_memory(trainer: Any) -> float | None:
    """Rows the run touches over the rows HBM+DDR hold, from a freshly built cache trainer (None for torch)."""
    cache = getattr(trainer, "cache", None)
    if cache is None:
        return None
    memory = sum(sum(cache.capacity_rows(t).values()) for t in dlrm.TABLES)
    touched = sum(len(k) for k in trainer.touched.values())
    return touched / memory if memory else None


def check_sizes(config: str, ratio: float | None, when: str) -> None:
    """Raise TooSmallError when ``ratio`` (touched rows / HBM+DDR rows) is below the minimum."""
    if ratio is not None and ratio < MIN_TOUCHED_OVER_MEMORY:
        raise TooSmallError(
            f"bench_dlrm: config {config!r}: the rows touched are only {ratio:.2f}x what HBM+DDR hold ({when}); "
            f"the benchmark needs >= {MIN_TOUCHED_OVER_MEMORY:g}x so that the tables do not fit in memory. "
            "Use more passes or fewer samples per pass (--passes, --samples-per-pass).")


PROFILED_PASS = 4


class _Profile:
    """torch.profiler over one pass's batches; ``top(batches)`` lists the costliest ops per step."""

    def __init__(self) -> None:
        self.prof: Any = None

    def top(self, batches: int, n: int = 25) -> list[dict[str, Any]]:
        if self.prof is None:
            return []
        rows = sorted(self.prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
        return [{"op": e.key, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / batches,
                 "cpu_ms_per_step": e.cpu_time_total / 1e3 / batches, "calls_per_step": e.count / batches}
                for e in rows]


@contextlib.contextmanager
def _profiler(on: bool) -> Iterator[_Profile]:
    """torch.profiler (CPU) over the batches the example trains inside the block, when ``on``."""
    out = _Profile()
    if not on:
        yield out
        return
    from torch.profiler import ProfilerActivity, profile

    original = dlrm._batches

    def batches(*a: Any) -> Iterator[Any]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield from original(*a)
        out.prof = prof

    dlrm._batches = batches  # type: ignore[assignment]
    try:
        yield out
    finally:
        dlrm._batches = original  # type: ignore[assignment]


def _summarize(s: dict[str, Any]) -> dict[str, Any]:
    """Headline figures of one run: per-pass rates after warm-up, overall rate, hit rates, cache time."""
    steady = s["passes"][WARMUP_PASSES:] or s["passes"]
    rates = [p["samples_per_s"] for p in steady]
    batches = sum(p["batches"] for p in steady)
    return {
        "samples_per_s": statistics.median(rates), "samples_per_s_min": min(rates),
        "samples_per_s_max": max(rates), "samples_per_s_overall": s["samples_per_s"],
        "cache_ms_per_step": 1e3 * sum(p["cache_call_seconds"] for p in steady) / max(batches, 1),
        "step_ms": 1e3 * sum(p["seconds"] for p in steady) / max(batches, 1),
        "begin_pass_seconds": sum(p["begin_pass_seconds"] for p in steady) / len(steady),
        "hit_rates": s["tier_hit_rates"], "auc": s["auc"], "last_pass_loss": s["last_pass_loss"],
        "touched_over_memory": s["touched_over_memory"],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); 2 when the tables are too small for the tiers."""
    try:
        return _main(argv)
    except TooSmallError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the kaggle configuration only, 14 passes of 12,000")
    ap.add_argument("--threads", type=int, default=1, help="torch/numba threads per contender (0 = all cores)")
    ap.add_argument("--configs", default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes")
    ap.add_argument("--passes", type=int, default=None, help="override the number of training passes")
    ap.add_argument("--samples-per-pass", type=int, default=None, help="override the samples per pass")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one pass of (a) and (b) of the first configuration with torch.profiler")
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one, removed)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="results directory")
    args = ap.parse_args(argv)

    quick = args.quick
    configs = args.configs.split(",") if args.configs else (["kaggle"] if quick else list(CONFIGS))
    modes = args.modes.split(",")
    work = args.work or tempfile.mkdtemp(prefix="embcache-bench-dlrm-")
    os.makedirs(work, exist_ok=True)
    common = ["--scale", "0.3", "--dim", "16", "--threads", str(args.threads), "--no-progress"]

    def data_args(config: str) -> list[str]:
        passes, samples = QUICK_DATA if quick else CONFIGS[config][1]
        passes, samples = args.passes or passes, args.samples_per_pass or samples
        return ["--passes", str(passes), "--samples-per-pass", str(samples),
                "--data", os.path.join(work, f"data-{passes}x{samples}")]
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)  # dlrm.run sets it again; here so machine_info records it
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    results: dict[str, Any] = {
        "benchmark": "DLRM example training throughput: torch in memory vs embcache with/without prefetch",
        "command": info["command"],
        "mode": "quick" if quick else "full", "machine": info, "warmup_passes": WARMUP_PASSES,
        "common_args": common, "configs": {},
    }
    t0 = time.perf_counter()
    profiles: dict[str, Any] = {}
    try:
        for config in configs:
            entry: dict[str, Any] = {"args": CONFIGS[config][0] + data_args(config)[:4], "modes": {}}
            results["configs"][config] = entry
            trainers = {}
            try:
                for mode in modes:  # the first one generates the data set, the others reuse it
                    argv_run = [*common, *data_args(config), *CONFIGS[config][0], "--mode", mode,
                                "--path", os.path.join(work, f"{config}-{mode}")]
                    trainers[mode] = dlrm.Trainer(dlrm.build_parser().parse_args(argv_run))
                    ratio = touched_over_memory(trainers[mode])
                    check_sizes(config, ratio, f"mode {mode}, tiers as sized before training")
                    if ratio is not None:
                        print(f"{config}: rows touched = {ratio:.2f}x HBM+DDR (mode {mode})", flush=True)
                passes = next(iter(trainers.values())).train_passes
                rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
                for p in tqdm(range(passes), desc=f"bench_dlrm {config}", unit="pass", dynamic_ncols=True):
                    for mode in modes[p % len(modes):] + modes[:p % len(modes)]:  # rotate who goes first
                        profiled = args.profile and config == configs[0] and mode in ("torch", "cache") and \
                            p == PROFILED_PASS
                        with _profiler(profiled) as prof:
                            row = trainers[mode].train_pass(p)
                            # the pass's own background work (write-back, prefetch) finishes inside its time,
                            # so it never runs during another contender's pass
                            waited = trainers[mode].drain()
                        row["drain_seconds"] = waited
                        row["seconds"] += waited
                        row["samples_per_s"] = row["samples"] / row["seconds"]
                        rows[mode].append(row)
                        if profiled:
                            profiles[mode] = {"config": config, "pass": p,
                                              "top_ops_by_self_cpu": prof.top(row["batches"])}
                for mode, tr in trainers.items():
                    summary = tr.finish()
                    summary["passes"] = rows[mode]
                    summary["samples_per_s"] = summary["train_samples"] / sum(r["seconds"] for r in rows[mode])
                    entry["modes"][mode] = {
                        "summary": _summarize(summary), "passes": summary["passes"], "eval": summary["eval"],
                        "seconds": summary["seconds"],
                        "memory": {k: summary[k] for k in ("hbm_bytes", "ddr_bytes", "memory_rows", "touched_rows",
                                                           "table_rows", "row_bytes")}}
            finally:
                for tr in trainers.values():
                    tr.close()
                for mode in modes:
                    shutil.rmtree(os.path.join(work, f"{config}-{mode}"), ignore_errors=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if profiles:
        results["profile"] = profiles
    results["seconds"] = time.perf_counter() - t0
    results["machine"]["loadavg_at_end"] = list(os.getloadavg())
    for entry in results["configs"].values():
        _ratios(entry)
    stem = "dlrm-quick" if quick else "dlrm"
    os.makedirs(args.out, exist_ok=True)
    results["summary"] = summary_rows(results)
    write_json(os.path.join(args.out, f"{stem}.json"), results)
    md = _markdown(results)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(md)
    _plot(results, os.path.join(args.out, f"{stem}.png"))
    print(md)
    for name, entry in results["configs"].items():
        check_sizes(name, entry["touched_over_memory"], "final counts")
    return 0


TARGET = 0.9  # issue: (b) embcache with pass prefetch >= 0.9x (a) all-in-memory torch
MODE_NAMES = {"cache": "(b) embcache + pass prefetch", "cache-noprefetch": "(c1) passes, no prefetch",
              "cache-nopass": "(c2) no passes"}


def summary_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per config and cache mode: samples/s over (a) torch's, the target on (b) only."""
    rows = []
    for config, entry in results["configs"].items():
        modes = entry["modes"]
        if "torch" not in modes:
            continue
        ref = modes["torch"]["summary"]["samples_per_s"]
        for mode, name in MODE_NAMES.items():
            if mode not in modes:
                continue
            ratio = modes[mode]["summary"]["samples_per_s"] / ref
            target = TARGET if mode == "cache" else None
            rows.append({"case": f"DLRM {config}: {name}", "reference": "(a) torch, all tables in memory",
                         "ratio": ratio, "target": target, "met": None if target is None else ratio >= target})
    return rows


def _ratios(entry: dict[str, Any]) -> None:
    """Ratio of every mode's rate to (a); check the runs trained the same model on tables >= 4x memory."""
    modes = entry["modes"]
    ref = modes.get("torch")
    for m in modes.values():
        s = m["summary"]
        if ref is not None:
            r = ref["summary"]
            s["ratio_to_torch"] = s["samples_per_s"] / r["samples_per_s"]
            s["ratio_to_torch_overall"] = s["samples_per_s_overall"] / r["samples_per_s_overall"]
            s["loss_matches_torch"] = abs(s["last_pass_loss"] - r["last_pass_loss"]) < 1e-3
    cache = [m for name, m in modes.items() if name != "torch"]
    entry["touched_over_memory"] = min(m["summary"]["touched_over_memory"] for m in cache) if cache else None


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"# DLRM training throughput ({res['mode']})", "",
             f"Command: `{res['command']}`. Machine: {m['cpu_model']}, {m['cpu_count']} cores, "
             f"torch {m['packages'].get('torch')}, {m.get('torch_threads')} torch thread(s) per contender, "
             f"commit {str(m.get('git_commit'))[:10]}, load average {m['loadavg_at_start'][0]:.1f} at start. "
             f"Throughput: median over passes after {res['warmup_passes']} warm-up passes "
             f"(min-max in brackets); overall = all passes incl. warm-up. Contenders take turns pass by pass; a pass "
             f"includes waiting for its own background work (see the docstring).", ""]
    for name, entry in res["configs"].items():
        cache_modes = [r for mode, r in entry["modes"].items() if mode != "torch"] or list(entry["modes"].values())
        mem = cache_modes[0]["memory"]
        lines += [f"## {name}: `{' '.join(entry['args'])}`", "",
                  f"Tables: {mem['table_rows']:,} rows; {mem['touched_rows']:,} touched by the run = "
                  f"{(entry['touched_over_memory'] or 0):.1f}x the {mem['memory_rows']:,} rows HBM+DDR hold "
                  f"(HBM {mem['hbm_bytes'] / 2**20:.1f} MiB + DDR {mem['ddr_bytes'] / 2**20:.1f} MiB, "
                  f"{mem['row_bytes']} B/row).", ""]
        rows = []
        for mode, r in entry["modes"].items():
            s = r["summary"]
            h = s["hit_rates"]
            rows.append([MODES.get(mode, mode),
                         f"{s['samples_per_s']:,.0f} [{s['samples_per_s_min']:,.0f}-{s['samples_per_s_max']:,.0f}]",
                         f"{s['samples_per_s_overall']:,.0f}",
                         format_ratio(s["ratio_to_torch"], TARGET if mode == "cache" else None)
                         if "ratio_to_torch" in s else "",
                         f"{s['step_ms']:.0f}", f"{s['cache_ms_per_step']:.0f}" if mode != "torch" else "",
                         f"{s['begin_pass_seconds']:.2f}" if mode in ("cache", "cache-noprefetch") else "",
                         _pct(h["hbm"]) if h else "", _pct(h["ddr"]) if h else "", _pct(h["ssd"]) if h else "",
                         _pct(h["created"]) if h else "", f"{s['auc']:.4f}", f"{s['last_pass_loss']:.4f}"])
        lines.append(markdown_table(["mode", "samples/s (median pass)", "overall", "ratio to (a)", "ms/step",
                                     "cache ms/step", "begin_pass s", "HBM hit", "DDR hit", "SSD hit", "created",
                                     "AUC", "last loss"], rows))
        lines.append("")
    prof = res.get("profile")
    if prof:
        lines += [f"## Where the time goes (torch.profiler over pass {PROFILED_PASS}, ms per step, self CPU)", ""]
        names: list[str] = []
        for p in prof.values():
            names += [r["op"] for r in p["top_ops_by_self_cpu"] if r["op"] not in names]
        table = []
        for name in names[:30]:
            cells = [name]
            for p in prof.values():
                hit = [r for r in p["top_ops_by_self_cpu"] if r["op"] == name]
                cells.append(f"{hit[0]['self_cpu_ms_per_step']:.2f}" if hit else "")
            table.append(cells)
        totals = ["total of these"] + [f"{sum(r['self_cpu_ms_per_step'] for r in p['top_ops_by_self_cpu']):.1f}"
                                       for p in prof.values()]
        lines.append(markdown_table(["op", *(MODES[m] for m in prof)], [*table, totals]))
        lines.append("")
    return "\n".join(lines)


def _plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(res["configs"]))
    cache_modes = [m for m in res["configs"][first]["modes"] if m != "torch"]
    fig, axes = plt.subplots(1, len(cache_modes) + 1, figsize=(5 * (len(cache_modes) + 1), 4.2))
    colors = {"hbm": "tab:green", "ddr": "tab:blue", "ssd": "tab:red", "created": "tab:orange"}
    for ax, mode in zip(axes, cache_modes, strict=False):
        passes = res["configs"][first]["modes"][mode]["passes"]
        x = [p["pass"] for p in passes]
        for tier, c in colors.items():
            ax.plot(x, [100 * p["hit_rates"].get(tier, 0) for p in passes], marker=".", color=c, label=tier)
        ax.set_title(f"{MODES[mode]}\n({first})", fontsize=9)
        ax.set_xlabel("pass")
        ax.set_ylabel("share of lookups (%)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    names = list(res["configs"])
    modes = list(MODES)
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs, ys, labels = [], [], []
        for i, name in enumerate(names):
            r = res["configs"][name]["modes"].get(mode)
            if r is None:
                continue
            xs.append(i + (j - (len(modes) - 1) / 2) * width)
            ys.append(r["summary"]["samples_per_s"])
            labels.append(f"{r['summary'].get('ratio_to_torch', float('nan')):.2f}x")
        bars = ax.bar(xs, ys, width, label=MODES[mode])
        for b, lab in zip(bars, labels, strict=True):
            ax.annotate(lab, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("samples/s (median pass)")
    ax.set_title("training throughput (ratio to (a))", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
