"""The benchmark suite: run every benchmark, then one report of every target, met or not.

Run from the repository root::

    .venv/bin/python -m bench                 # everything, full size (long: see each benchmark)
    .venv/bin/python -m bench --quick         # every benchmark in its quick mode
    .venv/bin/python -m bench --only cache,scale --quick
    .venv/bin/python -m bench --only index,gpu --device cuda   # the GPU cases (HBM tier on the GPU)
    .venv/bin/python -m bench --report-only   # the report (and docs/benchmarks.md) from the results there

Each benchmark is its own script (``bench/bench_*.py``; its docstring states its method and
command) and runs here as a subprocess, so one that fails or lacks a peer (FBGEMM, Redis) is
reported and the rest go on. The suite is :data:`SUITE` plus any other ``bench/bench_NAME.py``
that follows the convention (found at run time, run as ``NAME``): it takes ``--quick`` and
``--out DIR``, and writes ``DIR/NAME.json`` (``NAME-quick.json`` in quick mode) whose
``"machine"`` entry is ``bench._common.machine_info()`` (machine, versions, git commit and
dirty flag, command line, start time) and whose ``"summary"`` lists its ratios, beside a
Markdown table and a PNG. Quick runs write ``*-quick.*`` beside the full results, so they
never overwrite them.

Afterwards this collects every ``summary`` row (a measured ratio against a reference measured
in the same run, and its target) of every benchmark with a result there (``--only`` picks what
runs, not what the report covers) into ``report.md`` and ``report.json`` (``report-quick.*`` in
quick mode). The report states, per benchmark, the commit and date its result was measured at
(from the result's JSON, not this run's checkout) and marks it **stale** when that commit
predates the latest commit that changed the benchmark's script or ``embcache/`` (for every
benchmark but ``server``, less the gRPC server, RPC and client code, which only ``server`` runs),
or when no commit was recorded. In full mode a benchmark without a full result contributes its quick
result, marked "quick".

``--device {auto,cpu,cuda}`` goes to the benchmarks that can measure on a GPU (``index``: the
key -> slot index on CUDA; ``gpu``: HBM-tier lookup and update rates with the hot tier on the
GPU and the DDR tier pinned); ``auto`` (the default) uses CUDA where present, and ``gpu`` is
skipped (exit 0, no result) on a machine without it; ``--device cuda`` without CUDA makes them
fail with that reason. ``big`` (a table about twice the RAM, ~45 GB of disk, ~30-40 min) and
``halflife`` (a tuning sweep) run in full mode only.

``--out DIR`` sends every benchmark's results (``--out DIR`` is passed on) and the report to
``DIR`` instead of ``bench/results/`` (for trial runs), and leaves docs/benchmarks.md alone; so does
``--no-readme``. Only a full run or ``--report-only`` into ``bench/results/`` rewrites the part
of docs/benchmarks.md between its markers.

To compare two revisions of ``embcache/`` instead (a refactoring that must not slow anything
down), ``python -m bench.ab --base REV`` runs chosen benchmarks alternately against a worktree of
``REV`` and this checkout and flags the cases slower beyond the noise: see ``bench/ab.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    served: bool = False  # runs embcache-server and Client (else none of their code runs)


SUITE = (
    Bench("cache", "bench_cache.py", "cache", what="lookup and lookup+update, all hot and tiered, vs index_select, "
          "FBGEMM, RocksDB, LMDB, Redis, a dict LRU; tiered throughput vs tier sizes"),
    Bench("policy", "bench_policy.py", "policy", what="HBM hit ratio vs LRU, LFU, W-TinyLFU and OPT over capacities"),
    Bench("mrc", "bench_mrc.py", "mrc", what="online miss-ratio-curve estimate vs exact replays: error and cost"),
    Bench("scale", "bench_scale.py", "scale", what="per-row cost at 1M, 10M (and 100M) rows"),
    Bench("dlrm", "bench_dlrm.py", "dlrm", what="DLRM training throughput: in-memory torch vs embcache with and "
          "without prefetch"),
    Bench("rounding", "bench_rounding.py", "rounding", what="DLRM with bfloat16 rows: stochastic rounding vs "
          "round-to-nearest, gap to float32 rows and loss"),
    Bench("server", "bench_server.py", "server", served=True, what="gRPC pull/push vs a raw gRPC echo and Redis"),
    Bench("overload", "bench_overload.py", "overload", served=True, what="a client's lookup p50/p99 with and "
          "without 64 stalled client streams"),
    Bench("reshard", "bench_reshard.py", "reshard", served=True, what="rows migrated/s while resharding 2 -> 3 -> "
          "2 shards; training steps/s during a migration vs before"),
    Bench("serving", "bench_serving.py", "serving", served=True, what="a serving server's lookup p50/p99 while it "
          "follows an export's delta versions, and the time each switch holds lookups off"),
    Bench("export", "bench_export.py", "export", what="full and delta export rows/s, import rows/s, training "
          "steps/s with change tracking on vs off"),
    Bench("index", "bench_index.py", "index", device=True, what="key -> slot find, erase, insert rates: numba, "
          "torch (CPU and CUDA), dict"),
    Bench("gpu", "bench_gpu.py", "gpu", device=True, what="HBM-tier lookup and update keys/s on CUDA vs "
          "index_select (skipped without CUDA)"),
    Bench("halflife", "bench_halflife.py", "halflife", in_quick=False, what="LRFU half-life sweep: HBM hit ratio "
          "at 10x, 40x, 160x the rows"),
    Bench("expiry", "bench_expiry.py", "expiry", what="store rows and bytes over a stream of 10M new IDs with and "
          "without TableConfig.ttl_steps; sweep rate; lookup latency while a sweep runs"),
    Bench("big", "bench_big.py", "big", in_quick=False, what="a table ~2x RAM (~45 GB on disk) trained with RSS "
          "within the tier budgets + 1 GiB"),
)


def suite(bench_dir: Path = ROOT / "bench") -> tuple[Bench, ...]:
    """:data:`SUITE` plus every other ``bench_NAME.py`` in ``bench_dir`` (run by the convention above)."""
    known = {b.script for b in SUITE}
    found = tuple(Bench(p.stem.removeprefix("bench_"), p.name, p.stem.removeprefix("bench_"),
                        what="(found by name: follows the bench_NAME.py convention)")
                  for p in sorted(bench_dir.glob("bench_*.py")) if p.name not in known)
    return SUITE + found


def command(b: Bench, quick: bool, device: str = "auto", out: Path | None = None) -> list[str]:
    """The arguments after the interpreter that run ``b`` (``--out`` only when not the default)."""
    return [f"bench/{b.script}", *(b.quick_args if quick else b.full_args),
            *(("--device", device) if b.device else ()),
            *(("--out", str(out)) if out is not None and out.resolve() != RESULTS.resolve() else ())]


def run_one(b: Bench, quick: bool, log_dir: Path, device: str = "auto", out: Path | None = None) -> dict[str, Any]:
    """Run one benchmark, streaming its output to a log; its status and time."""
    script = ROOT / "bench" / b.script
    if not script.exists():
        return {"name": b.name, "status": "missing", "seconds": 0.0}
    if quick and not b.in_quick:
        print(f"==> {b.name}: skipped in quick mode (full mode only)", flush=True)
        return {"name": b.name, "status": "skipped (full mode only)", "seconds": 0.0}
    args = command(b, quick, device, out)
    cmd = [sys.executable, str(ROOT / args[0]), *args[1:]]
    log = log_dir / f"{b.name}{'-quick' if quick else ''}.log"
    t0 = time.perf_counter()
    print(f"==> {b.name}: {' '.join(args)} (log: {_rel(log)})", flush=True)
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
    status = (f"skipped ({skipped})" if skipped else "ok") if rc == 0 else f"failed (exit {rc}, see {_rel(log)})"
    return {"name": b.name, "status": status, "seconds": seconds, "command": " ".join([".venv/bin/python", *args])}


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------- provenance
def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def result_path(b: Bench, quick: bool, results: Path = RESULTS) -> Path | None:
    """The result file the report uses for ``b``: the quick one in quick mode; else the full one, or the quick."""
    candidates = [f"{b.result}-quick.json"] if quick else [f"{b.result}.json", f"{b.result}-quick.json"]
    for name in candidates:
        if (results / name).exists():
            return results / name
    return None


# The code only the gRPC server and its client run: a change there cannot move the results of a
# benchmark that starts neither (every benchmark but ``server``).
# (the client was one file, embcache/client.py, before it became the package embcache/client/)
SERVED_CODE = ("embcache/server", "embcache/rpc", "embcache/client", "embcache/client.py", "embcache/receipts.py",
               "embcache/reshard.py", "embcache/ring.py")


# The code only TorchIndex runs: the cache's key index on a GPU, and on the CPU only where numba
# is missing, which no benchmark's environment is (each records numba's version). Only the
# benchmarks that time a device's index (``device``: index, gpu) depend on it.
TORCH_INDEX_CODE = ("embcache/index/torch_index.py", "embcache/index/triton_probe.py")


def _depends_on(b: Bench, path: str) -> bool:
    """Whether ``b``'s results can move with a change to ``path`` (a file under ``embcache/``)."""
    return (b.served or not path.startswith(SERVED_CODE)) and (b.device or not path.startswith(TORCH_INDEX_CODE))


def code_paths(b: Bench) -> list[str]:
    """Git pathspecs of the code ``b``'s results depend on: ``embcache/`` (less the served code
    unless ``b.served``, less TorchIndex's unless ``b.device``) and ``b``'s script."""
    excluded = ([] if b.served else [f":(exclude){p}" for p in SERVED_CODE]) + \
        ([] if b.device else [f":(exclude){p}" for p in TORCH_INDEX_CODE])
    return ["embcache", *excluded, f"bench/{b.script}"]


def latest_change(b: Bench) -> dict[str, str | None]:
    """The latest commit that changed the code ``b``'s results depend on (:func:`code_paths`)."""
    out = _git("log", "-1", "--format=%H%x09%cI", "--", *code_paths(b))
    commit, _, date = out.stdout.strip().partition("\t")
    return {"commit": commit or None, "date": date or None}


def provenance(b: Bench, doc: dict[str, Any]) -> dict[str, Any]:
    """Commit, date and dirty flag a result was measured at (from its JSON), and whether it is stale.

    Stale: no commit recorded, a commit not in this repository's history, or one older than the
    latest change to ``embcache/`` or the benchmark's script (that change is not an ancestor of it).
    """
    m: dict[str, Any] = doc["machine"] if isinstance(doc.get("machine"), dict) else {}
    commit = m.get("git_commit") or doc.get("git_commit")
    when = m.get("started_at")
    if when is None and isinstance(m.get("unix_time"), (int, float)):
        when = datetime.datetime.fromtimestamp(m["unix_time"], datetime.timezone.utc).isoformat(timespec="seconds")
    dirty_paths = [p for p in m.get("git_dirty_paths") or []
                   if (p.startswith("embcache/") and _depends_on(b, p))
                   or p == f"bench/{b.script}"]
    latest = latest_change(b)
    if not commit:
        stale, why = True, "no commit recorded in the result"
    elif latest["commit"] is None:
        stale, why = False, ""
    else:
        rc = _git("merge-base", "--is-ancestor", latest["commit"], commit).returncode
        if rc == 0:
            stale, why = False, ""
        elif rc == 1:
            stale, why = True, f"{latest['commit'][:7]} ({(latest['date'] or '')[:10]}) changed its code or script"
        else:
            stale, why = True, f"commit {commit[:7]} is not in this repository's history"
    return {"commit": commit, "measured_at": when, "dirty": m.get("git_dirty"), "dirty_code_paths": dirty_paths,
            "stale": stale, "stale_reason": why, "latest_change": latest["commit"]}


def collect(b: Bench, quick: bool, results: Path = RESULTS) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(provenance of ``b``'s result, its ``summary`` rows) from the result file the report uses."""
    path = result_path(b, quick, results)
    if path is None:
        return {"name": b.name, "result": None}, []
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"name": b.name, "result": path.name, "error": f"unreadable: {exc}"}, []
    info = {"name": b.name, "result": path.name, **provenance(b, doc)}
    rows = [dict(r, bench=b.name, result=path.name, measured_commit=info["commit"], stale=info["stale"])
            for r in doc.get("summary") or [] if isinstance(r, dict) and "ratio" in r]
    return info, rows


def summaries(b: Bench, quick: bool, results: Path = RESULTS) -> list[dict[str, Any]]:
    """The ``summary`` rows of a benchmark's JSON result (empty when it has none)."""
    return collect(b, quick, results)[1]


# ---------------------------------------------------------------------------------- report
def _measured(info: dict[str, Any]) -> str:
    if info.get("result") is None:
        return "no result"
    if "error" in info:
        return info["error"]
    commit = f"`{info['commit'][:7]}`" if info.get("commit") else "commit not recorded"
    when = info["measured_at"].replace("T", " ")[:16] + " UTC" if info.get("measured_at") else "date not recorded"
    dirty = ""
    if info.get("dirty_code_paths"):
        dirty = f", with uncommitted changes to {', '.join(info['dirty_code_paths'][:3])}"
    elif info.get("dirty"):
        dirty = ", tree dirty (not embcache/ or the script)"
    return f"{commit}, {when}{dirty}"


def render(runs: list[dict[str, Any]] | None, infos: list[dict[str, Any]], rows: list[dict[str, Any]],
           quick: bool, head: str | None = None) -> str:
    """The report in Markdown; ``runs`` is None for ``--report-only`` (nothing was run)."""
    how = ".venv/bin/python -m bench" + (" --quick" if quick else "") + (" --report-only" if runs is None else "")
    lines = [f"# Benchmark report{' (quick mode)' if quick else ''}", "",
             f"Generated by `{how}` with the checkout at `{(head or _head())[:7]}`. Each result below was measured "
             "at the commit and date it records (its JSON's `machine` entry); **stale** marks one measured before "
             "the latest change to `embcache/` or its script. Ratios compare against references measured in the "
             "same run; see each benchmark's Markdown and PNG beside this file.", ""]
    by_name = {r["name"]: r for r in runs or []}
    header = "| benchmark | result | measured at | stale? |"
    rule = "| --- | --- | --- | --- |"
    if runs is not None:
        header += " this run | seconds | command |"
        rule += " --- | ---: | --- |"
    lines += [header, rule]
    for info in infos:
        stale = "—" if info.get("result") is None or "stale" not in info else (
            f"**stale**: {info['stale_reason']}" if info["stale"] else "no")
        line = f"| {info['name']} | {info.get('result') or '—'} | {_measured(info)} | {stale} |"
        if runs is not None:
            r = by_name.get(info["name"], {})
            line += (f" {r['status']} | {r['seconds']:.0f} | `{r.get('command', '')}` |" if r else " not run | | |")
        lines.append(line)
    lines += ["", "## Targets", "", *target_table(rows, mark_quick=not quick)]
    return "\n".join(lines) + "\n"


def _head() -> str:
    out = _git("rev-parse", "HEAD")
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    """Run the suite (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = suite()
    ap.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    ap.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(b.name for b in benches))
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from existing results")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="device for the benchmarks that can use a GPU (index, gpu); auto: CUDA when present")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="results and report directory (default bench/results; others leave docs/benchmarks.md)")
    ap.add_argument("--no-readme", action="store_true", help="do not rewrite docs/benchmarks.md's generated section")
    args = ap.parse_args(argv)
    wanted = None if args.only is None else args.only.split(",")
    unknown = sorted(set(wanted or ()) - {b.name for b in benches})
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
    chosen = [b for b in benches if wanted is None or b.name in wanted]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    runs = None if args.report_only else [run_one(b, args.quick, log_dir, args.device, out) for b in chosen]
    # every benchmark's result, not only the ones run now: a report of a subset would drop the others' rows
    collected = [collect(b, args.quick, out) for b in benches]
    infos = [c[0] for c in collected]
    rows = [row for c in collected for row in c[1]]
    stem = out / ("report-quick" if args.quick else "report")
    head = _head()
    text = render(runs, infos, rows, args.quick, head)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"runs": runs, "results": infos, "targets": rows,
                                                     "commit": head, "seconds": time.perf_counter() - t0}, indent=2))
    print(text)
    if not args.quick and not args.no_readme and out.resolve() == RESULTS.resolve():
        report = json.loads(stem.with_suffix(".json").read_text())
        print("docs/benchmarks.md section " + ("updated" if update_readme(report) else "not found (no markers)"))
    print(f"wrote {stem.with_suffix('.md')} ({time.perf_counter() - t0:.0f} s)")
    return 0 if all(r["status"] in ("ok", "missing") or str(r["status"]).startswith("skipped")
                    for r in runs or []) else 1


if __name__ == "__main__":
    sys.exit(main())
