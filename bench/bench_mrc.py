"""Accuracy and cost of the online miss-ratio-curve estimator (:mod:`embcache.mrc`) against exact replays.

Command (from the repository root)::

    .venv/bin/python bench/bench_mrc.py            # full: 4M accesses per workload (~6-8 min on 2 cores)
    .venv/bin/python bench/bench_mrc.py --quick    # 400k accesses, no rate-1 run (under a minute)

For each workload of ``bench/workloads.py`` (stationary Zipf with alpha 0.8, 1.05 and 1.2, and a
drifting popularity ranking) the trace is fed, in lookup batches of ``--batch`` keys, to a
:class:`~embcache.mrc.MissRatioEstimator` through its public API (``observe`` per batch,
``drain``, ``hit_ratios``) at the shipped default rate (:func:`~embcache.mrc.auto_sample_rate`
of the HBM rows) and at explicit rates, and the estimate at each of the ten points (HBM alone
and HBM+DDR, at 0.25x..4x the capacities) is compared with the exact answer:
:class:`embcache.sim.LrfuSim` at the full capacity, with the same batching (one aged-frequency
increment per batch, as the cache and the shadows apply it) and the same half-life as the
estimator's shadows (the cache's default, 40x the rows in memory, scaled with the capacity).
The estimator reports a sliding window (counts halve every ``window`` sampled accesses, i.e.
every ``window / rate`` lookups), so the exact hit ratio is decayed the same way: per rate,
the reference is ``sum_b w_b hits_b / sum_b w_b n_b`` over batches ``b`` with
``w_b = 0.5 ** (rate * lookups after b / window)``. Error = |estimate - exact| in hit ratio.

Cost, from CPU clocks: ``sample ns/key`` is the caller's thread time in ``observe`` per looked-up
key (the hash, on the lookup path); ``shadow us/sampled key`` is the rest of the process's CPU
time (the background thread running the ten shadows) per sampled key. The caller drains every
16 batches so that no batch is dropped (``dropped_batches`` is checked to be 0); in the cache
the shadows run behind the lookups. The number of sampled keys is counted with the estimator's
own hash (``embcache.sim.tuner.sample_keys``), outside the timed part.

Writes ``bench/results/mrc.json`` (``mrc-quick.json`` with ``--quick``; with the machine, package
versions and git commit), ``mrc.md`` (the error table) and ``mrc.png`` (error and cost against
the rate). Workloads are seeded (``--seed``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `bench` and `embcache` importable
    sys.path.insert(0, str(_ROOT))

from bench._common import machine_info, markdown_table, write_json  # noqa: E402
from bench.workloads import WORKLOADS as ALL_WORKLOADS  # noqa: E402
from bench.workloads import Workload  # noqa: E402
from embcache.mrc import FACTORS, MissRatioEstimator, auto_sample_rate  # noqa: E402
from embcache.policy import default_halflife  # noqa: E402
from embcache.sim import LrfuSim  # noqa: E402
from embcache.sim.tuner import sample_keys  # noqa: E402

RESULTS_DIR = _ROOT / "bench" / "results"
DEFAULT_WINDOW = 200_000  # MissRatioEstimator's default window (sampled accesses)
DRAIN_EVERY = 16  # batches between drains: keeps the pending queue far below the estimator's drop limit
EXPLICIT_RATES = (1 / 256, 1 / 64, 1 / 16, 0.2, 1.0)


# Stationary skew at three strengths and a drifting hot set (bench/workloads.py).
WORKLOADS: tuple[Workload, ...] = tuple(w for w in ALL_WORKLOADS if w.name in ("zipf-0.8", "zipf-1.05", "zipf-1.2",
                                                                            "drifting"))


def batch_bounds(n: int, batch: int) -> np.ndarray:
    """Start offsets of consecutive batches of ``batch`` keys, plus ``n`` (int64)."""
    bounds = np.arange(0, n, batch, dtype=np.int64)
    return np.append(bounds, np.int64(n))


def shadow_points(hbm_rows: int, ddr_rows: int) -> list[tuple[str, float, int, float]]:
    """``(tier, factor, capacity rows, half-life ticks)`` of the ten points the estimator reports.

    The same capacities and half-lives as the estimator's shadows before scaling by the rate
    (``embcache.mrc.MissRatioEstimator`` with ``halflife=None``: the cache's default).
    """
    memory = hbm_rows + ddr_rows
    return [(tier, f, round(rows * f), default_halflife(memory * f))
            for tier, rows in (("hbm", hbm_rows), ("ddr", memory)) for f in FACTORS]


def exact_batch_hits(trace: np.ndarray, bounds: np.ndarray, hbm_rows: int, ddr_rows: int,
                     progress: Callable[[str], None] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Hits per batch of the exact LRFU replay at each point: ``{tier: {factor label: int64 [batches]}}``."""
    out: dict[str, dict[str, np.ndarray]] = {"hbm": {}, "ddr": {}}
    for tier, f, rows, halflife in shadow_points(hbm_rows, ddr_rows):
        t0 = time.perf_counter()
        out[tier][f"{f:g}"] = LrfuSim(rows, halflife).access_batches(trace, bounds)
        if progress:
            progress(f"exact {tier} x{f:g} ({rows:,} rows): {time.perf_counter() - t0:.1f}s")
    return out


def decayed_ratios(batch_hits: dict[str, dict[str, np.ndarray]], sizes: np.ndarray, rate: float,
                   window: int = DEFAULT_WINDOW) -> dict[str, dict[str, float]]:
    """Exact hit ratios over the estimator's sliding window at ``rate``: hits and lookups decayed alike."""
    later = np.concatenate([np.cumsum(sizes[::-1])[::-1][1:], [0]]).astype(np.float64)  # lookups after batch b
    weights = 0.5 ** (rate * later / window)
    denom = float(weights @ sizes.astype(np.float64))
    return {tier: {label: float(weights @ hits.astype(np.float64)) / denom for label, hits in curve.items()}
            for tier, curve in batch_hits.items()}


def run_estimator(keys: torch.Tensor, bounds: np.ndarray, hbm_rows: int, ddr_rows: int,
                  rate: float | None) -> dict[str, Any]:
    """Feed the trace to a MissRatioEstimator batch by batch; its estimate and CPU cost."""
    est = MissRatioEstimator(hbm_rows, ddr_rows, rate=rate)
    proc0, thread0 = time.process_time(), time.thread_time()
    wall0 = time.perf_counter()
    sampling = 0.0
    for b in range(len(bounds) - 1):
        t = time.thread_time()
        est.observe(keys[int(bounds[b]):int(bounds[b + 1])])
        sampling += time.thread_time() - t
        if (b + 1) % DRAIN_EVERY == 0:
            est.drain()
    est.drain()
    caller_cpu = time.thread_time() - thread0
    shadow_cpu = max(time.process_time() - proc0 - caller_cpu, 0.0)
    wall = time.perf_counter() - wall0
    ratios = est.hit_ratios()
    dropped = est.dropped_batches
    est.close()
    return {"rate": est.rate, "ratios": ratios, "sampling_cpu_s": sampling, "shadow_cpu_s": shadow_cpu,
            "wall_s": wall, "dropped_batches": dropped}


def errors(estimate: dict[str, dict[str, float]], exact: dict[str, dict[str, float]]) -> dict[str, float]:
    """Max, mean and signed mean (bias) of estimate - exact over the ten points, and per tier."""
    diffs = {tier: np.array([estimate[tier][k] - exact[tier][k] for k in exact[tier]]) for tier in exact}
    every = np.concatenate(list(diffs.values()))
    out = {"max_abs": float(np.abs(every).max()), "mean_abs": float(np.abs(every).mean()),
           "bias": float(every.mean())}
    for tier, d in diffs.items():
        out[f"{tier}_max_abs"] = float(np.abs(d).max())
    return out


def rate_label(rate: float, default: bool) -> str:
    """``1/256``-style label for small rates, ``0.2`` otherwise, ``(default)`` appended."""
    text = f"1/{round(1 / rate)}" if rate < 0.1 and abs(1 / rate - round(1 / rate)) < 1e-6 else f"{rate:.3g}"
    return text + (" (default)" if default else "")


def bench_workload(w: Workload, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Exact replays and the estimator at every rate on one workload."""
    t0 = time.perf_counter()
    trace = np.ascontiguousarray(w.make(args.accesses, args.keys, args.seed), dtype=np.int64)
    log(f"{w.name}: trace of {trace.size:,} accesses, {np.unique(trace).size:,} distinct keys "
        f"({time.perf_counter() - t0:.1f}s)")
    bounds = batch_bounds(trace.size, args.batch)
    sizes = np.diff(bounds)
    exact_hits = exact_batch_hits(trace, bounds, args.hbm, args.ddr, progress=lambda m: log(f"  {m}"))
    keys = torch.from_numpy(trace)
    default = auto_sample_rate(args.hbm)
    rates: list[tuple[float | None, float]] = [(None, default)]
    rates += [(r, r) for r in args.rates if abs(r - default) > 1e-12]
    runs = []
    for asked, rate in rates:
        res = run_estimator(keys, bounds, args.hbm, args.ddr, asked)
        assert res["dropped_batches"] == 0, "the estimator dropped batches: the comparison would be biased"
        sampled = int(sample_keys(trace, res["rate"]).size)
        exact = decayed_ratios(exact_hits, sizes, res["rate"])
        err = errors(res["ratios"], exact)
        run = {"label": rate_label(rate, asked is None), "default": asked is None, "rate": res["rate"],
               "sampled_keys": sampled, "smallest_shadow_rows": round(FACTORS[0] * args.hbm * res["rate"]),
               "estimate": res["ratios"], "exact": exact, "errors": err,
               "sample_ns_per_key": 1e9 * res["sampling_cpu_s"] / trace.size,
               "shadow_us_per_sampled_key": 1e6 * res["shadow_cpu_s"] / max(sampled, 1),
               "shadow_cpu_s": res["shadow_cpu_s"], "wall_s": res["wall_s"]}
        runs.append(run)
        log(f"  rate {run['label']:>16s}: max err {err['max_abs']:.4f}, mean {err['mean_abs']:.4f}, "
            f"bias {err['bias']:+.4f}; {sampled:,} sampled keys, {run['shadow_us_per_sampled_key']:.2f} us CPU "
            f"each, sampling {run['sample_ns_per_key']:.1f} ns/key ({res['wall_s']:.1f}s)")
    return {"description": w.description, "accesses": int(trace.size), "distinct_keys": int(np.unique(trace).size),
            "runs": runs, "seconds": time.perf_counter() - t0}


def report_markdown(result: dict[str, Any]) -> str:
    """Error and cost per workload and rate, as a Markdown table."""
    cfg, m = result["config"], result["machine"]
    code = [p for p in m.get("git_dirty_paths") or [] if p.startswith("embcache/") or p == "bench/bench_mrc.py"]
    where = (f"`{m.get('command')}` at commit {str(m.get('git_commit'))[:7]}"
             + (f" with uncommitted changes to {', '.join(code[:3])}" if code else "")
             + f", {m.get('started_at')}, {m.get('cpu_count')} CPUs ({m.get('cpu_model')}).")
    rows = []
    for name, w in result["workloads"].items():
        for r in w["runs"]:
            e = r["errors"]
            rows.append([name, r["label"], f"{r['smallest_shadow_rows']:,}", f"{r['sampled_keys']:,}",
                         f"{e['max_abs']:.3f}", f"{e['mean_abs']:.3f}", f"{e['bias']:+.3f}",
                         f"{e['hbm_max_abs']:.3f}", f"{e['ddr_max_abs']:.3f}",
                         f"{r['shadow_us_per_sampled_key']:.2f}", f"{r['sample_ns_per_key']:.1f}"])
    head = (f"Miss-ratio estimator vs exact LRFU replay: {cfg['accesses']:,} accesses over {cfg['keys']:,} keys "
            f"per workload, HBM {cfg['hbm_rows']:,} rows, DDR {cfg['ddr_rows']:,} rows, batches of "
            f"{cfg['batch']:,} keys, default window ({DEFAULT_WINDOW:,} sampled accesses). Error = |estimate - "
            "exact| in hit ratio over the ten points (HBM and HBM+DDR at 0.25x..4x); bias = mean signed error. "
            f"Measured by {where}\n\n")
    return head + markdown_table(
        ["workload", "rate", "smallest shadow (rows)", "sampled keys", "max err", "mean err", "bias",
         "HBM max", "HBM+DDR max", "shadow us CPU / sampled key", "sampling ns / key"], rows) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Max error, mean error and shadow CPU per sampled key against the rate, one line per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for name, w in result["workloads"].items():
        runs = sorted(w["runs"], key=lambda r: r["rate"])
        x = [r["rate"] for r in runs]
        line, = axes[0].plot(x, [r["errors"]["max_abs"] for r in runs], marker="o", label=name)
        axes[1].plot(x, [r["errors"]["mean_abs"] for r in runs], marker="o", color=line.get_color(), label=name)
        axes[2].plot(x, [r["shadow_us_per_sampled_key"] for r in runs], marker="o", color=line.get_color(),
                     label=name)
        for r in runs:
            if r["default"]:
                axes[0].plot([r["rate"]], [r["errors"]["max_abs"]], marker="*", ms=14, color=line.get_color())
    for ax, title in zip(axes, ("max |estimate - exact| (10 points)", "mean |estimate - exact|",
                                "shadow CPU per sampled key (us)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("sampling rate (star: the default)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylim(bottom=0)  # linear: rate 1 is exact (0), a log axis would stretch its rounding
    axes[1].set_ylim(bottom=0)
    axes[2].set_yscale("log")
    axes[0].legend()
    cfg = result["config"]
    fig.suptitle(f"embcache.mrc vs exact replay: {cfg['accesses']:,} accesses, {cfg['keys']:,} keys, "
                 f"HBM {cfg['hbm_rows']:,} / DDR {cfg['ddr_rows']:,} rows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; sizes default by mode."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true",
                   help="400k accesses over 200k keys, HBM 4k / DDR 16k rows, no rate-1 run (its error is 0)")
    p.add_argument("--accesses", type=int, default=None, help="accesses per trace (full 4M, quick 400k)")
    p.add_argument("--keys", type=int, default=None, help="key space (full 2M, quick 200k)")
    p.add_argument("--hbm", type=int, default=None, help="HBM rows (full 40k, quick 4k)")
    p.add_argument("--ddr", type=int, default=None, help="DDR rows (full 160k, quick 16k)")
    p.add_argument("--batch", type=int, default=4096, help="lookup batch size (default 4096)")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="explicit rates besides the default (default 1/256 1/64 1/16 0.2 1; quick: without 1)")
    p.add_argument("--workloads", nargs="+", default=None, choices=[w.name for w in WORKLOADS])
    p.add_argument("--seed", type=int, default=1, help="seed of the traces (default 1)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="output directory (default bench/results)")
    args = p.parse_args(argv)
    args.accesses = args.accesses or (400_000 if args.quick else 4_000_000)
    args.keys = args.keys or (200_000 if args.quick else 2_000_000)
    args.hbm = args.hbm or (4_000 if args.quick else 40_000)
    args.ddr = args.ddr or (16_000 if args.quick else 160_000)
    if args.rates is None:
        args.rates = [r for r in EXPLICIT_RATES if not (args.quick and r == 1.0)]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run every workload, print the table, write JSON, Markdown and PNG."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    chosen = [w for w in WORKLOADS if args.workloads is None or w.name in args.workloads]
    result: dict[str, Any] = {
        "benchmark": "mrc",
        "machine": machine_info(script=__file__, argv=argv),
        "config": {"quick": args.quick, "accesses": args.accesses, "keys": args.keys, "hbm_rows": args.hbm,
                   "ddr_rows": args.ddr, "batch": args.batch, "seed": args.seed, "window": DEFAULT_WINDOW,
                   "default_rate": auto_sample_rate(args.hbm), "factors": list(FACTORS)},
        "workloads": {},
        "summary": [],  # no ratio against a reference: the errors are in "workloads" and the table
    }
    for w in chosen:
        result["workloads"][w.name] = bench_workload(w, args, log)
    result["seconds"] = time.perf_counter() - start
    stem = "mrc-quick" if args.quick else "mrc"
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(str(args.out / f"{stem}.json"), result)
    table = report_markdown(result)
    (args.out / f"{stem}.md").write_text(table)
    plot(result, args.out / f"{stem}.png")
    print("\n" + table)
    log(f"wrote {args.out / stem}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
