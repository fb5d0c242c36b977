"""The benchmark suite: run every benchmark, then one report of every target, met or not.

Run from the repository root::

    .venv/bin/python -m bench                 # everything, full size (long: see each benchmark)
    .venv/bin/python -m bench --quick         # every benchmark in its quick mode
    .venv/bin/python -m bench --only cache,scale --quick
    .venv/bin/python -m bench --only index,gpu --device cuda   # the GPU cases (HBM tier on the GPU)

Each benchmark is its own script (``bench/bench_*.py``; its docstring states its method and
command) and runs here as a subprocess, so one that fails or lacks a peer (FBGEMM, Redis) is
reported and the rest go on. Each writes JSON (with the machine, versions and git commit), a
Markdown table and a PNG to ``bench/results/``; quick runs write ``*-quick.*`` beside the full
results, so they never overwrite them. Afterwards this collects every ``summary`` row (a
measured ratio against a reference measured in the same run, and its target) into
``bench/results/report.md`` and ``report.json`` (``report-quick.*`` in quick mode).

``--device {auto,cpu,cuda}`` goes to the benchmarks that can measure on a GPU (``index``: the
key -> slot index on CUDA; ``gpu``: HBM-tier lookup and update rates with the hot tier on the
GPU and the DDR tier pinned); ``auto`` (the default) uses CUDA where present, and ``gpu`` is
skipped (exit 0, no result) on a machine without it. ``big`` (a table about twice the RAM,
~45 GB of disk, ~30-40 min) runs in full mode only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.readme import target_table, update_readme

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Bench:
    """One benchmark script and the result file it writes (without ``-quick``)."""

    name: str
    script: str
    result: str
    quick_args: tuple[str, ...] = ("--quick",)
    full_args: tuple[str, ...] = ()
    what: str = ""
    device: bool = False  # takes --device {auto,cpu,cuda}
    in_quick: bool = True  # runs in quick mode (else full mode only)


SUITE = (
    Bench("cache", "bench_cache.py", "cache", what="lookup and lookup+update, all hot and tiered, vs index_select, "
          "FBGEMM, RocksDB, a dict LRU"),
    Bench("policy", "bench_policy.py", "policy", what="HBM hit ratio vs LRU, LFU, W-TinyLFU and OPT over capacities"),
    Bench("scale", "bench_scale.py", "scale", what="per-row cost at 1M, 10M (and 100M) rows"),
    Bench("dlrm", "bench_dlrm.py", "dlrm", what="DLRM training throughput: in-memory torch vs embcache with and "
          "without prefetch"),
    Bench("server", "bench_server.py", "server", what="gRPC pull/push vs a raw gRPC echo and Redis"),
    Bench("index", "bench_index.py", "index", device=True, what="key -> slot find, erase, insert rates: numba, "
          "torch (CPU and CUDA), dict"),
    Bench("gpu", "bench_gpu.py", "gpu", device=True, what="HBM-tier lookup and update keys/s on CUDA vs "
          "index_select (skipped without CUDA)"),
    Bench("big", "bench_big.py", "big", in_quick=False, what="a table ~2x RAM (~45 GB on disk) trained with RSS "
          "within the tier budgets + 1 GiB"),
)


def run_one(b: Bench, quick: bool, log_dir: Path, device: str = "auto") -> dict[str, Any]:
    """Run one benchmark, streaming its output to a log; its status and time."""
    script = ROOT / "bench" / b.script
    if not script.exists():
        return {"name": b.name, "status": "missing", "seconds": 0.0}
    if quick and not b.in_quick:
        print(f"==> {b.name}: skipped in quick mode (full mode only)", flush=True)
        return {"name": b.name, "status": "skipped (full mode only)", "seconds": 0.0}
    cmd = [sys.executable, str(script), *(b.quick_args if quick else b.full_args),
           *(("--device", device) if b.device else ())]
    log = log_dir / f"{b.name}{'-quick' if quick else ''}.log"
    t0 = time.perf_counter()
    print(f"==> {b.name}: {' '.join(cmd[1:])} (log: {log.relative_to(ROOT)})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        skipped = ""
        for line in proc.stdout:
            f.write(line)
            if line.startswith(f"bench_{b.name}: skipped: "):  # e.g. bench_gpu without CUDA
                skipped = line.split(": skipped: ", 1)[1].strip()
            if not line.startswith("\r") and "it/s]" not in line:  # keep progress bars out of the console
                print(f"  [{b.name}] {line.rstrip()[:160]}", flush=True)
        rc = proc.wait()
    seconds = time.perf_counter() - t0
    print(f"<== {b.name}: exit {rc} in {seconds:.0f} s", flush=True)
    status = (f"skipped ({skipped})" if skipped else "ok") if rc == 0 else f"failed (exit {rc})"
    return {"name": b.name, "status": status, "seconds": seconds,
            "command": " ".join([".venv/bin/python", f"bench/{b.script}", *cmd[2:]])}


def summaries(b: Bench, quick: bool) -> list[dict[str, Any]]:
    """The ``summary`` rows of a benchmark's JSON result (empty when it has none).

    In full mode a benchmark without a full result contributes its quick result's rows, marked.
    """
    path = RESULTS / f"{b.result}{'-quick' if quick else ''}.json"
    if not path.exists() and not quick:
        path = RESULTS / f"{b.result}-quick.json"
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    rows = doc.get("summary") or []
    return [dict(r, bench=b.name, result=path.name) for r in rows if isinstance(r, dict) and "ratio" in r]


def render(runs: list[dict[str, Any]], rows: list[dict[str, Any]], quick: bool) -> str:
    """The report in Markdown."""
    lines = [f"# Benchmark report{' (quick mode)' if quick else ''}", "",
             f"Generated by `.venv/bin/python -m bench{' --quick' if quick else ''}` at commit "
             f"`{_commit()}` on {os.cpu_count()} CPUs. Ratios compare against references measured in the same "
             "run; see each benchmark's Markdown and PNG beside this file.", "",
             "| benchmark | status | seconds | command |", "| --- | --- | ---: | --- |"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.0f} | `{r.get('command', '')}` |")
    lines += ["", "## Targets", "", *target_table(rows, mark_quick=not quick)]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    """Run the suite (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    ap.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(b.name for b in SUITE))
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from existing results")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="device for the benchmarks that can use a GPU (index, gpu); auto: CUDA when present")
    args = ap.parse_args(argv)
    chosen = [b for b in SUITE if args.only is None or b.name in args.only.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_dir = RESULTS / "logs"
    log_dir.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    runs = [{"name": b.name, "status": "not run", "seconds": 0.0} if args.report_only
            else run_one(b, args.quick, log_dir, args.device) for b in chosen]
    rows = [row for b in chosen for row in summaries(b, args.quick)]
    stem = RESULTS / ("report-quick" if args.quick else "report")
    stem.with_suffix(".md").write_text(render(runs, rows, args.quick))
    stem.with_suffix(".json").write_text(json.dumps({"runs": runs, "targets": rows, "commit": _commit(),
                                                     "seconds": time.perf_counter() - t0}, indent=2))
    print(render(runs, rows, args.quick))
    if not args.quick:
        report = json.loads(stem.with_suffix(".json").read_text())
        print("README.md performance section " + ("updated" if update_readme(report) else "not found (no markers)"))
    print(f"wrote {stem.with_suffix('.md')} ({time.perf_counter() - t0:.0f} s)")
    return 0 if all(r["status"] in ("ok", "missing", "not run") or str(r["status"]).startswith("skipped")
                    for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
