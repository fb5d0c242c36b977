"""Sweep of the LRFU half-life: HBM hit ratio at 10x, 40x and 160x the tier's rows.

Command: ``.venv/bin/python bench/bench_halflife.py`` (about 8 minutes on 2 cores; full mode
only in ``python -m bench``). Traces from ``bench/workloads.py`` (the same as
``bench_policy.py``): 200k keys, 500k accesses, lookups of 256 keys through a real
EmbeddingCache with only an HBM tier of 0.1%, 1% and 5% of the keys, with the default idle
discount (``CacheConfig.idle_halving``). It checks the default half-life (40x the rows in
memory, chosen with the simulators of ``embcache.sim``: see ``embcache/policy.py``) against a
quarter and four times it. The hit ratios are exact counts of one seeded trace (no
timing). ``--quick`` runs 50k keys and 125k accesses (about half a minute).

Writes ``bench/results/halflife.json`` (with the machine, versions and git commit), ``halflife.md``
and ``halflife.png`` (hit ratio against the half-life, one panel per workload, one line per
capacity); ``halflife-quick.*`` with ``--quick``; ``--out DIR`` writes them to DIR. The
``summary`` rows give the default (40x) against the best of the other half-lives at 1% capacity
(no target: a tuning record).
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

from bench._common import format_ratio, machine_info, markdown_table, write_json  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.policy import DEFAULT_HALFLIFE_ROWS  # noqa: E402

N_KEYS, N_ACCESSES, BATCH = 200_000, 500_000, 256
QUICK_KEYS, QUICK_ACCESSES = 50_000, 125_000
FRACTIONS = (0.001, 0.01, 0.05)
DEFAULT_MULTIPLIER = DEFAULT_HALFLIFE_ROWS
MULTIPLIERS = (DEFAULT_MULTIPLIER // 4, DEFAULT_MULTIPLIER, DEFAULT_MULTIPLIER * 4)
NAMES = ("zipf-1.05", "drifting", "bursty")


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


def summary_rows(results: dict[str, dict[str, list[float]]], fraction_index: int) -> list[dict[str, Any]]:
    """The default half-life's hit ratio over the best other one's, per workload, at one capacity."""
    rows = []
    default = f"{DEFAULT_MULTIPLIER}x"
    for name, by_mult in results.items():
        others = {m: r[fraction_index] for m, r in by_mult.items() if m != default}
        if default not in by_mult or not others:
            continue
        best = max(others, key=lambda m: others[m])
        ours = by_mult[default][fraction_index]
        rows.append({"case": f"LRFU half-life {default} rows, {name}, capacity {FRACTIONS[fraction_index]:.1%} "
                             f"(hit ratio {ours:.3f})",
                     "reference": f"half-life {best} rows ({others[best]:.3f})",
                     "ratio": ours / others[best] if others[best] else None, "target": None, "met": None})
    return rows


def plot(results: dict[str, dict[str, list[float]]], path: str, title: str) -> None:
    """Hit ratio against the half-life multiplier (log x), one panel per workload, one line per capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 3.8), squeeze=False)
    for ax, (name, by_mult) in zip(axes[0], results.items(), strict=True):
        mults = [int(m.rstrip("x")) for m in by_mult]
        for i, f in enumerate(FRACTIONS):
            ax.plot(mults, [r[i] for r in by_mult.values()], marker="o", label=f"HBM {f:.1%} of keys")
        ax.axvline(DEFAULT_MULTIPLIER, color="k", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(mults, [f"{m}x" for m in mults])
        ax.minorticks_off()
        ax.set_xlabel("half-life (x the rows in memory); dotted: default")
        ax.set_ylabel("HBM hit ratio")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, print the table, write the JSON, Markdown and PNG."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_KEYS:,} keys, {QUICK_ACCESSES:,} accesses")
    ap.add_argument("--n-keys", type=int, default=None, help=f"key space (default {N_KEYS:,})")
    ap.add_argument("--n-accesses", type=int, default=None, help=f"trace length (default {N_ACCESSES:,})")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    args = ap.parse_args(argv)
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    n_keys = args.n_keys or (QUICK_KEYS if args.quick else N_KEYS)
    n_accesses = args.n_accesses or (QUICK_ACCESSES if args.quick else N_ACCESSES)
    t_start = time.perf_counter()
    results: dict[str, dict[str, list[float]]] = {}
    runs, done = len(NAMES) * len(MULTIPLIERS), 0
    for w in (w for w in WORKLOADS if w.name in NAMES):
        trace = torch.from_numpy(np.ascontiguousarray(w.make(n_accesses, n_keys, args.seed), dtype=np.int64))
        results[w.name] = {}
        for mult in MULTIPLIERS:
            t0 = time.perf_counter()
            ratios = [hit_ratio(trace, max(1, int(n_keys * f)), float(mult * max(1, int(n_keys * f))))
                      for f in FRACTIONS]
            results[w.name][f"{mult}x"] = ratios
            done += 1
            print(f"[{done}/{runs}] {w.name:10s} half-life {mult:2d}x rows: " + "  ".join(f"{r:.4f}" for r in ratios)
                  + f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    table = markdown_table(["workload", "half-life", *(f"{f:.1%} of keys" for f in FRACTIONS)],
                           [[name, mult, *(f"{r:.4f}" for r in ratios)]
                            for name, by_mult in results.items() for mult, ratios in by_mult.items()])
    summary = summary_rows(results, FRACTIONS.index(0.01))
    print("\n" + table)
    stem = os.path.join(args.out, "halflife-quick" if args.quick else "halflife")
    write_json(stem + ".json", {"benchmark": "LRFU half-life sweep: HBM hit ratio", "command": info["command"],
                                "machine": info, "n_keys": n_keys, "n_accesses": n_accesses, "batch": BATCH,
                                "seed": args.seed, "fractions": FRACTIONS, "multipliers": MULTIPLIERS,
                                "hit_ratio": results, "summary": summary,
                                "seconds": time.perf_counter() - t_start})
    lines = [f"# LRFU half-life sweep{' (quick)' if args.quick else ''}", "",
             f"Command: `{info['command']}` (commit {str(info['git_commit'])[:7]}"
             f"{', dirty tree' if info['git_dirty'] else ''}, {info['started_at']}); {n_keys:,} keys, "
             f"{n_accesses:,} accesses, lookups of {BATCH}, HBM tier only.", "", table, ""]
    lines += [f"- {r['case']}: {format_ratio(r['ratio'])} the {r['reference']}" for r in summary]
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    plot(results, stem + ".png", f"LRFU half-life sweep: {n_keys:,} keys, {n_accesses:,} accesses")
    print(f"wrote {stem}.json/.md/.png ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
