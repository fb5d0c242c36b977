"""A/B of benchmarks: the same benchmark code against two revisions of the embcache package, in one run.

Run from the repository root::

    .venv/bin/python -m bench.ab --base main~1                         # cache, dlrm, server; full size; 3 rounds
    .venv/bin/python -m bench.ab --base 955a27f --quick --rounds 5     # each benchmark's quick mode, 5 rounds
    .venv/bin/python -m bench.ab --base HEAD --bench cache --quick --rounds 1   # a trial (A = B)

**Trees.** ``--base REV`` is checked out as a detached ``git worktree`` in a temporary directory
(removed afterwards). ``--head`` is ``WORKTREE`` by default: this checkout as it is, uncommitted
changes included; or a revision, checked out the same way. The benchmark code is always the
head's: the head's ``bench/`` and ``examples/`` (the DLRM benchmark's model and training loop)
are copied over the base tree's, so the two sides differ only in the ``embcache`` package, the
code under test (a head benchmark that needs something the base package lacks fails, with its
log). Every run is a subprocess with ``cwd`` and ``PYTHONPATH`` set to its tree (the benchmark
scripts also put their own tree first on ``sys.path``); a wrapper prints, at the child's exit,
the file ``embcache`` was imported from, and the A/B stops if that file is not inside the
tree meant (the path is kept in the JSON, per run).

**Order.** For each benchmark, ``--rounds N`` rounds (default 3), each running base then head
(ABAB...), so a drift in the load of this shared machine hits both sides alike. Each run writes
its results to a temporary directory (``--out DIR`` of the benchmark), never to ``bench/results``.

**Cases.** A case is one throughput figure of a benchmark's JSON, each the median over that run's
repeats: ``cache``: rows/s of every contender of each all-hot, tiered and tier-sweep case (the
embcache ones, and the peers: index_select, FBGEMM, RocksDB, LMDB, dict LRU, Redis); ``dlrm``:
samples/s (median over the passes after warm-up) of each configuration and mode; ``server``:
rows/s of each contender, op and client-thread count. Other benchmarks: every ``X_per_s`` with
``X_per_s_min``/``_max`` beside it. Each case is marked ``embcache`` (it runs embcache's code)
or ``peer`` (a reference; note that the RocksDB/LMDB/dict-LRU peers of ``cache`` read through
``embcache.stores``, so embcache changes can move them too; index_select, FBGEMM, the gRPC echo,
Redis and DLRM's torch mode are pure controls: their ratio shows how far the machine alone moved
the figures).

**Noise rule.** Per case and side, the *median* is the median over the rounds of the run's
figure, and the *interval* is its min-max over the rounds; the *spread* is that interval's width
as % of the median. A case is **slower** only when the head's interval lies wholly below the
base's (the head's best round is below the base's worst), **faster** when wholly above, and
otherwise **within noise**. The ratio is median(head) / median(base), with the extreme ratios the
intervals allow (head min / base max, head max / base min). With one round there is no
round-to-round spread, so the interval is that run's own min-max over its repeats (stated as
such in the output). Under no change at all, with N rounds per side, a given case comes out
"slower" by chance with probability 1 / C(2N, N): 5% with 3 rounds, 1.6% with 4, 0.4% with 5; with
some 30 cases, use ``--rounds 5`` before reading a lone "slower" as real, and look at its size
against the spreads.

**Output.** ``bench/results/ab-NAME.json`` (every round's figure per case, the runs with their
trees, commits, seconds and ``embcache`` file, this run's ``machine_info``), ``ab-NAME.md`` (the
table) and ``ab-NAME.png`` (head/base per case, bars: the ratio the spreads allow);
``ab-NAME-quick.*`` with ``--quick``; ``--out DIR`` puts them elsewhere. One line per run shows
the progress; each run's output goes to a log that is kept (and named) when the run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import __main__ as runner
from bench._common import command_line, format_ratio, machine_info, markdown_table, write_json

ROOT = runner.ROOT
RESULTS = runner.RESULTS
DEFAULT_BENCHES = ("cache", "dlrm", "server")
WORKTREE = "WORKTREE"
# the head's copies of these replace the base tree's: the benchmark code and the DLRM example it trains
OVERLAY = ("bench", "examples")
MARK = "bench.ab: embcache imported from "
# Runs the benchmark script as __main__ and, at exit, prints where embcache came from. Nothing is
# imported before the script runs (bench_cache.py sets NUMBA_NUM_THREADS before numba is imported).
_WRAPPER = (
    "import atexit, runpy, sys\n"
    "def _where():\n"
    "    m = sys.modules.get('embcache')\n"
    f"    print({MARK!r} + str(getattr(m, '__file__', None)), flush=True)\n"
    "atexit.register(_where)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
NOISE_RULE = ("slower: the head's min-max interval over the rounds lies wholly below the base's (head's best round "
              "< base's worst); faster: wholly above; else within noise. One round: the intervals are each run's "
              "min-max over its own repeats. Chance of a false 'slower' per case with no change: 1/C(2N,N) for N "
              "rounds (5% at 3, 0.4% at 5).")


class ABError(RuntimeError):
    """The A/B cannot go on (a git command failed, a run imported the wrong package)."""


# ---------------------------------------------------------------------------------- trees
def _git(*args: str, cwd: Path = ROOT) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise ABError(f"git {' '.join(args)}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout.strip()


@dataclass
class Side:
    """One side of the A/B: a tree holding the embcache package measured."""

    label: str  # "base" or "head"
    rev: str  # as given
    commit: str
    tree: Path
    dirty: bool = False  # its embcache/ differs from ``commit`` (head = WORKTREE with uncommitted changes there)
    temporary: bool = False  # a worktree made here, removed afterwards

    def describe(self) -> str:
        where = "this checkout" if not self.temporary else "temporary worktree"
        dirty = ", with uncommitted changes to embcache/" if self.dirty else ""
        return f"{self.label} `{self.commit[:10]}` ({self.rev}{dirty}; {where})"

    def as_json(self) -> dict[str, Any]:
        return {"rev": self.rev, "commit": self.commit, "tree": str(self.tree), "dirty": self.dirty,
                "temporary_worktree": self.temporary,
                "subject": _git("show", "-s", "--format=%s", self.commit)[:200]}


def _add_worktree(rev: str, path: Path, label: str) -> Side:
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    _git("worktree", "add", "--detach", str(path), commit)
    return Side(label, rev, commit, path, temporary=True)


def _remove_worktree(side: Side) -> None:
    if not side.temporary:
        return
    try:
        _git("worktree", "remove", "--force", str(side.tree))
    except ABError:
        shutil.rmtree(side.tree, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True, check=False)


def overlay(src: Path, dst: Path, dirs: tuple[str, ...] = OVERLAY) -> list[str]:
    """Replace ``dst``'s ``dirs`` with ``src``'s (no results, no bytecode); the directories copied."""
    copied = []
    for d in dirs:
        if not (src / d).is_dir():
            continue
        shutil.rmtree(dst / d, ignore_errors=True)
        shutil.copytree(src / d, dst / d, ignore=shutil.ignore_patterns("results", "__pycache__", "*.pyc", "logs"))
        copied.append(d)
    return copied



@contextlib.contextmanager
def trees(base_rev: str, head_rev: str, work: Path) -> Iterator[tuple[Side, Side, list[str]]]:
    """The base and head sides (worktrees under ``work``, removed on exit) and the directories overlaid."""
    made: list[Side] = []
    try:
        base = _add_worktree(base_rev, work / "base", "base")
        made.append(base)
        if head_rev == WORKTREE:
            # dirty: the package under test differs from HEAD (untracked files in it included)
            head = Side("head", WORKTREE, _git("rev-parse", "HEAD"), ROOT,
                        dirty=bool(_git("status", "--porcelain", "--", "embcache")))
        else:
            head = _add_worktree(head_rev, work / "head", "head")
            made.append(head)
        copied = overlay(head.tree, base.tree)
        yield base, head, copied
    finally:
        for side in made:
            _remove_worktree(side)


# ---------------------------------------------------------------------------------- cases
Case = dict[str, Any]  # {"kind": "embcache" | "peer", "unit": str, "value": float, "lo": float, "hi": float}


def _rate(d: Any, key: str = "rows_per_s") -> tuple[float, float, float] | None:
    """(median, min, max) of a rate entry of a benchmark's JSON, or None where there is none."""
    if not isinstance(d, dict) or not isinstance(d.get(key), (int, float)) or isinstance(d.get(key), bool):
        return None
    v = float(d[key])
    lo, hi = d.get(f"{key}_min", v), d.get(f"{key}_max", v)
    return v, float(lo if isinstance(lo, (int, float)) else v), float(hi if isinstance(hi, (int, float)) else v)


def _add(out: dict[str, Case], name: str, entry: Any, kind: str, key: str = "rows_per_s",
         unit: str = "rows/s") -> None:
    r = _rate(entry, key)
    if r is not None and math.isfinite(r[0]) and r[0] > 0:
        out[name] = {"kind": kind, "unit": unit, "value": r[0], "lo": r[1], "hi": r[2]}


_CACHE_HOT = {"lookup": "lookup", "lookup_update": "lookup+update", "ceiling": "index_select ceiling",
              "ceiling_huge_pages": "index_select over huge pages"}
_CACHE_TIERED = {"cache": "lookup", "cache_lookahead": "lookup + LookAhead",
                 "cache_passes": "lookup, passes + prefetch", "cache_update": "lookup + update",
                 "rocksdb": "RocksDB multi-get direct",
                 "rocksdb_rmw": "RocksDB read-modify-write direct", "lmdb": "LMDB get direct",
                 "dict_lru": "Python dict LRU + RocksDB", "redis": "Redis MGET"}


def cases_cache(doc: dict[str, Any]) -> dict[str, Case]:
    """bench_cache.py: every contender's rows/s of each all-hot, tiered and tier-sweep case."""
    out: dict[str, Case] = {}
    for r in doc.get("all_hot") or []:
        tag = f"B={r['batch']:,} d={r['dim']}"
        for key, v in r.items():
            kind = "embcache" if key.startswith("lookup") else "peer"
            _add(out, f"all-hot {_CACHE_HOT.get(key, key)} {tag}", v, kind)
        fb = r.get("fbgemm") or {}
        for phase in ("forward", "forward_backward"):
            for mode, v in (fb.get(phase) or {}).items():
                _add(out, f"all-hot FBGEMM {phase.replace('_', '+')} {mode} {tag}", v, "peer")
    for r in doc.get("tiered") or []:
        tag = f"B={r['batch']:,} d={r['dim']}"
        for key, v in r.items():
            kind = "embcache" if key.startswith("cache") else "peer"
            _add(out, f"tiered {_CACHE_TIERED.get(key, key)} {tag}", v, kind)
    for p in doc.get("tier_sweep") or []:
        tag = f"HBM {p['hbm_fraction']:.1%} B={p['batch']:,} d={p['dim']}"
        _add(out, f"tier sweep lookup {tag}", p.get("cache"), "embcache")
        _add(out, f"tier sweep RocksDB direct {tag}", p.get("rocksdb"), "peer")
    return out


def cases_dlrm(doc: dict[str, Any]) -> dict[str, Case]:
    """bench_dlrm.py: samples/s (median over the passes after warm-up) per configuration and mode."""
    out: dict[str, Case] = {}
    for config, entry in (doc.get("configs") or {}).items():
        for mode, m in (entry.get("modes") or {}).items():
            _add(out, f"DLRM {config}: {mode}", (m or {}).get("summary"), "peer" if mode == "torch" else "embcache",
                 key="samples_per_s", unit="samples/s")
    return out


def cases_server(doc: dict[str, Any]) -> dict[str, Case]:
    """bench_server.py: rows/s per contender, op and client-thread count."""
    out: dict[str, Case] = {}
    for contender, ops in (doc.get("results") or {}).items():
        kind = "embcache" if contender in ("embcache", "embedded cache") else "peer"
        for op, per_threads in ops.items():
            for threads, v in per_threads.items():
                _add(out, f"{contender} {op}, {threads} client thread{'s' if str(threads) != '1' else ''}", v, kind)
    return out


def cases_generic(doc: dict[str, Any]) -> dict[str, Case]:
    """Any other benchmark: every ``X_per_s`` that has ``X_per_s_min`` and ``X_per_s_max`` beside it."""
    out: dict[str, Case] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k in node:
                if isinstance(k, str) and k.endswith("_per_s") and f"{k}_min" in node and f"{k}_max" in node:
                    _add(out, f"{path} {k}".strip(), node, "embcache", key=k, unit=k.removesuffix("_per_s") + "/s")
            for k, v in node.items():
                if k != "machine":
                    walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(doc, "")
    return out


EXTRACTORS: dict[str, Callable[[dict[str, Any]], dict[str, Case]]] = {
    "cache": cases_cache, "dlrm": cases_dlrm, "server": cases_server}


def extract(bench: str, doc: dict[str, Any]) -> dict[str, Case]:
    """The cases of one run's result document."""
    return EXTRACTORS.get(bench, cases_generic)(doc)


# ---------------------------------------------------------------------------------- comparison
def side_stats(figures: list[Case]) -> dict[str, Any]:
    """Median, interval and spread of one side's figures of a case (one per round; see the noise rule)."""
    values = [f["value"] for f in figures]
    med = statistics.median(values)
    if len(values) > 1:
        lo, hi, source = min(values), max(values), "rounds"
    else:
        lo, hi, source = figures[0]["lo"], figures[0]["hi"], "repeats of the one run"
    return {"median": med, "min": lo, "max": hi, "spread_pct": 100.0 * (hi - lo) / med if med else None,
            "values": values, "interval_from": source}


def compare(base: list[Case], head: list[Case]) -> dict[str, Any]:
    """One case's A/B: each side's statistics, head/base, the ratios the intervals allow, and the verdict."""
    if not base or not head:
        return {"base": side_stats(base) if base else None, "head": side_stats(head) if head else None,
                "ratio": None, "ratio_low": None, "ratio_high": None,
                "verdict": "missing in " + ("base" if not base else "head")}
    b, h = side_stats(base), side_stats(head)
    if h["max"] < b["min"]:
        verdict = "slower"
    elif h["min"] > b["max"]:
        verdict = "faster"
    else:
        verdict = "within noise"
    return {"base": b, "head": h, "ratio": h["median"] / b["median"],
            "ratio_low": h["min"] / b["max"] if b["max"] else None,
            "ratio_high": h["max"] / b["min"] if b["min"] else None, "verdict": verdict}


def compare_all(per_round: dict[str, list[dict[str, Case]]]) -> list[dict[str, Any]]:
    """Every case seen on either side (in first-seen order), compared."""
    names: dict[str, Case] = {}
    for side in ("base", "head"):
        for run in per_round[side]:
            for name, c in run.items():
                names.setdefault(name, c)
    rows = []
    for name, first in names.items():
        base = [r[name] for r in per_round["base"] if name in r]
        head = [r[name] for r in per_round["head"] if name in r]
        rows.append({"case": name, "kind": first["kind"], "unit": first["unit"], **compare(base, head)})
    return rows


def verdict_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts, the cases flagged, and the widest spread of each side."""
    def widest(side: str, kind: str | None = None) -> float | None:
        spreads = [c[side]["spread_pct"] for c in cases if c[side] is not None and c[side]["spread_pct"] is not None
                   and (kind is None or c["kind"] == kind)]
        return max(spreads) if spreads else None

    peer_ratios = [c["ratio"] for c in cases if c["kind"] == "peer" and c["ratio"] is not None]
    return {"cases": len(cases),
            "slower": [c["case"] for c in cases if c["verdict"] == "slower"],
            "slower_embcache": [c["case"] for c in cases if c["verdict"] == "slower" and c["kind"] == "embcache"],
            "faster": [c["case"] for c in cases if c["verdict"] == "faster"],
            "missing": [c["case"] for c in cases if c["verdict"].startswith("missing")],
            "max_spread_pct": {"base": widest("base"), "head": widest("head")},
            "peer_ratio_range": [min(peer_ratios), max(peer_ratios)] if peer_ratios else None,
            "median_spread_pct": {side: (statistics.median(s) if (s := [c[side]["spread_pct"] for c in cases
                                                                          if c[side] is not None]) else None)
                                  for side in ("base", "head")}}


# ---------------------------------------------------------------------------------- runs
@dataclass
class Run:
    """One benchmark run on one side."""

    bench: str
    side: str
    round: int
    seconds: float = 0.0
    exit: int | None = None
    embcache_file: str | None = None
    log: str = ""
    error: str = ""
    loadavg_at_start: list[float] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"round": self.round, "side": self.side, "seconds": self.seconds, "exit": self.exit,
                "embcache_file": self.embcache_file, "loadavg_at_start": self.loadavg_at_start,
                **({"error": self.error} if self.error else {})}


def bench_command(b: runner.Bench, quick: bool, device: str, out: Path, extra: list[str]) -> list[str]:
    """The benchmark's script (relative to its tree) and arguments, writing into ``out``."""
    args = runner.command(b, quick, device)
    return [*args, *extra, "--out", str(out)]


def run_once(b: runner.Bench, side: Side, rnd: int, quick: bool, device: str, extra: list[str], work: Path,
             timeout: float) -> tuple[Run, dict[str, Any] | None]:
    """Run ``b`` from ``side``'s tree; the run and its result document (None when it failed)."""
    out = work / "runs" / f"{b.name}-{side.label}-r{rnd}"
    out.mkdir(parents=True, exist_ok=True)
    args = bench_command(b, quick, device, out, extra)
    cmd = [sys.executable, "-c", _WRAPPER, str(side.tree / args[0]), *args[1:]]
    env = {**os.environ, "PYTHONPATH": str(side.tree)}
    run = Run(b.name, side.label, rnd, log=str(out / "run.log"), loadavg_at_start=list(os.getloadavg()))
    t0 = time.perf_counter()
    with open(run.log, "w") as log:
        shown = shlex.join([cmd[0], "-c", "<bench.ab's wrapper>", *cmd[3:]])
        log.write(f"$ cd {side.tree} && PYTHONPATH={side.tree} {shown}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=side.tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            run.exit = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.error = f"timed out after {timeout:g} s"
        finally:
            if proc.poll() is None:  # timed out or interrupted: stop the run this function started
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    run.seconds = time.perf_counter() - t0
    text = Path(run.log).read_text(errors="replace")
    marks = [line[len(MARK):].strip() for line in text.splitlines() if line.startswith(MARK)]
    run.embcache_file = marks[-1] if marks else None
    if not run.error and run.exit != 0:
        run.error = f"exit {run.exit}"
    if run.embcache_file is not None and run.embcache_file != "None":
        if not Path(run.embcache_file).resolve().is_relative_to(side.tree.resolve()):
            raise ABError(f"{b.name} {side.label} round {rnd} imported embcache from {run.embcache_file}, not from "
                          f"{side.tree}: the A/B would compare the wrong package (log: {run.log})")
    elif not run.error:
        run.error = "embcache was not imported (or the wrapper's line is missing)"
    if run.error:
        return run, None
    path = runner.result_path(b, quick, out)
    if path is None:
        run.error = f"no result file in {out}"
        return run, None
    return run, json.loads(path.read_text())


# ---------------------------------------------------------------------------------- report
def fmt_rate(v: float | None) -> str:
    """A rate as 12.3M / 456k / 789."""
    if v is None:
        return "—"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}%"


def _short(text: str, n: int = 100) -> str:
    return text if len(text) <= n else text[:n - 1].rstrip() + "…"


def render(doc: dict[str, Any]) -> str:
    """The A/B as Markdown: sides, method, the table of cases, the verdict, the runs."""
    v = doc["verdict"]
    base, head = doc["base"], doc["head"]
    one = doc["rounds"] == 1
    lines = [
        f"# A/B: {doc['benchmark']} ({doc['mode']})", "",
        f"- **base** (A): `{base['commit'][:10]}` ({base['rev']}) — {_short(base['subject'])}",
        f"- **head** (B): `{head['commit'][:10]}` ({head['rev']}"
        f"{', with uncommitted changes to embcache/' if head['dirty'] else ''}) — {_short(head['subject'])}",
        f"- Benchmark code: the head's ({', '.join(doc['overlay'])} copied into the base tree); command `"
        f"{doc['bench_command']}`",
        f"- {doc['rounds']} round(s), order {doc['order']}; {doc['machine']['cpu_count']} cores "
        f"({doc['machine']['cpu_model']}), load {doc['machine']['loadavg_at_start'][0]:.2f} at start; "
        f"{doc['seconds']:.0f} s in all; `{doc['command']}`",
        f"- Noise rule: {NOISE_RULE}",
        f"- Spread = (max - min) / median of each side's {'repeats (one round)' if one else 'rounds'}.",
        "",
    ]
    if doc["rounds"] < 3:
        lines += [f"*{doc['rounds']} round(s): a trial of the harness, not a verdict; the runs' load differs and "
                  "one run's repeats understate it. Use --rounds 3 or more (5 with many cases).*", ""]
    rows = []
    for c in doc["cases"]:
        b, h = c["base"], c["head"]
        rng = ("—" if c["ratio_low"] is None else
               f"{format_ratio(c['ratio_low'])}–{format_ratio(c['ratio_high'])}")
        verdict = f"**{c['verdict']}**" if c["verdict"] == "slower" else c["verdict"]
        rows.append([c["case"], c["kind"], fmt_rate(b and b["median"]), _pct(b and b["spread_pct"]),
                     fmt_rate(h and h["median"]), _pct(h and h["spread_pct"]), format_ratio(c["ratio"]), rng, verdict])
    unit = ", ".join(sorted({c["unit"] for c in doc["cases"]})) or "rate"
    lines.append(markdown_table(["case", "kind", f"base ({unit})", "base spread", f"head ({unit})", "head spread",
                                 "head/base", "range allowed", "verdict"], rows))
    lines.append("")
    spread = (f"spread up to {_pct(v['max_spread_pct']['base'])} (base) and "
              f"{_pct(v['max_spread_pct']['head'])} (head), median {_pct(v['median_spread_pct']['base'])} and "
              f"{_pct(v['median_spread_pct']['head'])}")
    if v["slower"]:
        lines.append(f"**{len(v['slower'])} of {v['cases']} case(s) slower than the noise** "
                     f"({len(v['slower_embcache'])} of them embcache's): {'; '.join(v['slower'])}. {spread}.")
    else:
        lines.append(f"No case slower than the noise ({v['cases']} cases; {spread}).")
    if v["faster"]:
        lines.append(f"Faster beyond the noise: {'; '.join(v['faster'])}.")
    if v["missing"]:
        lines.append(f"On one side only: {'; '.join(v['missing'])}.")
    if v.get("peer_ratio_range"):
        lo, hi = v["peer_ratio_range"]
        lines.append(f"The peers (references; see the kinds in bench/ab.py's docstring) moved by head/base "
                     f"{format_ratio(lo)}–{format_ratio(hi)}: how far the machine alone moved the figures between "
                     "the runs.")
    lines += ["", "## Runs", ""]
    lines.append(markdown_table(["round", "side", "seconds", "load at start", "embcache imported from", "status"],
                                [[r["round"], r["side"], f"{r['seconds']:.0f}", f"{r['loadavg_at_start'][0]:.2f}",
                                  f"`{r['embcache_file']}`", r.get("error") or "ok"] for r in doc["runs"]]))
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """head/base per case, with bars from the lowest to the highest ratio the spreads allow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cases = [c for c in doc["cases"] if c["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.32 * max(len(cases), 1)))
    colors = {"slower": "tab:red", "faster": "tab:green", "within noise": "tab:gray"}
    for i, c in enumerate(cases):
        lo, hi = c["ratio_low"] or c["ratio"], c["ratio_high"] or c["ratio"]
        ax.errorbar([c["ratio"]], [i], xerr=[[c["ratio"] - lo], [hi - c["ratio"]]], fmt="o" if
                    c["kind"] == "embcache" else "s", color=colors.get(c["verdict"], "tab:blue"), capsize=3,
                    mfc="white" if c["kind"] == "peer" else None)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")  # 0.5x and 2x equally far from 1x
    ends = [r for c in cases for r in (c["ratio_low"], c["ratio_high"], c["ratio"]) if r] or [1.0]
    lo, hi = min(min(ends), 0.95), max(max(ends), 1.05)
    ax.set_xlim(lo / 1.1, hi * 1.1)
    steps = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0) if hi / lo > 4 else (
        0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
    ticks = [t for t in steps if lo <= t <= hi]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yticks(range(len(cases)), [f"{c['case']}{' (peer)' if c['kind'] == 'peer' else ''}" for c in cases],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("head / base (median over rounds; bars: head min/base max to head max/base min)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"A/B {doc['benchmark']} ({doc['mode']}): head {doc['head']['commit'][:7]}"
                 f"{'+dirty' if doc['head']['dirty'] else ''} vs base {doc['base']['commit'][:7]}, "
                 f"{doc['rounds']} round(s); red = slower beyond the noise", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------------- main
def _parse_bench_args(items: list[str], known: set[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, rest = item.partition(":")
        if not sep or name not in known:
            raise ValueError(f"--bench-args {item!r}: expected NAME:ARGS with NAME one of {', '.join(sorted(known))}")
        out.setdefault(name, []).extend(shlex.split(rest))
    return out


def ab_one(b: runner.Bench, base: Side, head: Side, args: argparse.Namespace, extra: list[str], work: Path,
           progress: Callable[[str], None], counter: list[int], total: int, t_start: float,
           copied: list[str]) -> tuple[dict[str, Any] | None, list[Run]]:
    """Run ``b`` ABAB... and build its A/B document (None when a run failed)."""
    per_round: dict[str, list[dict[str, Case]]] = {"base": [], "head": []}
    runs: list[Run] = []
    t0 = time.perf_counter()
    for rnd in range(1, args.rounds + 1):
        for side in (base, head):
            counter[0] += 1
            progress(f"[{counter[0]}/{total}] {b.name} round {rnd}/{args.rounds} {side.label}: running ...")
            run, doc = run_once(b, side, rnd, args.quick, args.device, extra, work, args.timeout)
            runs.append(run)
            done = counter[0]
            elapsed = time.perf_counter() - t_start
            eta = elapsed / done * (total - done)
            where = run.embcache_file or "?"
            if doc is None:
                progress(f"[{done}/{total}] {b.name} round {rnd}/{args.rounds} {side.label}: FAILED ({run.error}) "
                         f"after {run.seconds:.0f} s; log: {run.log}")
                return None, runs
            figures = extract(b.name, doc)
            per_round[side.label].append(figures)
            progress(f"[{done}/{total}] {b.name} round {rnd}/{args.rounds} {side.label}: {len(figures)} cases in "
                     f"{run.seconds:.0f} s, embcache from {where} (ETA {eta:.0f} s)")
    cases = compare_all(per_round)
    unit_cmd = bench_command(b, args.quick, args.device, Path("OUT"), extra)
    doc = {
        "benchmark": b.name,
        "mode": "quick" if args.quick else "full",
        "rounds": args.rounds,
        "order": "ABAB (base, then head, in every round)",
        "base": base.as_json(),
        "head": head.as_json(),
        "overlay": copied,
        "bench_command": "python " + shlex.join(unit_cmd),
        "command": command_line("-m bench.ab", argv=args.argv),
        "machine": machine_info(),
        "noise_rule": NOISE_RULE,
        "seconds": time.perf_counter() - t0,
        "runs": [r.as_json() for r in runs],
        "cases": cases,
        "verdict": verdict_summary(cases),
    }
    return doc, runs


def main(argv: list[str] | None = None) -> int:
    """Run the A/B (see the module docstring); 0 when every run succeeded, 1 otherwise."""
    benches = {b.name: b for b in runner.suite()}
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision to compare against (A), e.g. main~1 or a commit")
    ap.add_argument("--head", default=WORKTREE,
                    help=f"the revision measured (B); {WORKTREE} (default): this checkout, uncommitted changes "
                    "included")
    ap.add_argument("--bench", default=",".join(DEFAULT_BENCHES),
                    help=f"comma-separated benchmarks (default {','.join(DEFAULT_BENCHES)}; any of: "
                    f"{', '.join(benches)})")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of base-then-head runs (default 3)")
    ap.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="passed to the benchmarks that take --device (index, gpu)")
    ap.add_argument("--bench-args", action="append", default=[], metavar="NAME:ARGS",
                    help="further arguments for one benchmark, e.g. 'cache:--cases hot --repeats 2' (repeatable)")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds one run may take (default 7200)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where ab-NAME.* go (default bench/results)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory of the runs (not the worktrees)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    chosen = [s.strip() for s in args.bench.split(",") if s.strip()]
    unknown = [n for n in chosen if n not in benches]
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    try:
        extra = _parse_bench_args(args.bench_args, set(chosen))
    except ValueError as exc:
        ap.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="embcache-ab-"))
    t_start = time.perf_counter()
    ok = True

    def progress(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    try:
        with trees(args.base, args.head, work) as (base, head, copied):
            progress(f"A/B of {', '.join(chosen)}: {base.describe()} vs {head.describe()}; {args.rounds} round(s)"
                     f"{', quick' if args.quick else ''}; benchmark code: the head's ({', '.join(copied)}); "
                     f"work in {work}")
            total = len(chosen) * args.rounds * 2
            counter = [0]
            for name in chosen:
                b = benches[name]
                doc, runs = ab_one(b, base, head, args, extra.get(name, []), work, progress, counter, total,
                                   t_start, copied)
                if doc is None:
                    ok = False
                    failed = runs[-1]
                    kept = args.out / f"ab-{name}-failed-{failed.side}-r{failed.round}.log"
                    shutil.copyfile(failed.log, kept)
                    tail = Path(failed.log).read_text(errors="replace").splitlines()[-25:]
                    print("\n".join(["--- last lines of the failed run's log:", *tail, f"--- kept as {kept}"]),
                          flush=True)
                    counter[0] += total // len(chosen) - len(runs)  # this benchmark's remaining runs are skipped
                    continue
                stem = args.out / (f"ab-{name}-quick" if args.quick else f"ab-{name}")
                write_json(str(stem.with_suffix(".json")), doc)
                text = render(doc)
                stem.with_suffix(".md").write_text(text)
                plot(doc, stem.with_suffix(".png"))
                print(text, flush=True)
                progress(f"wrote {stem}.json, .md, .png")
    except ABError as exc:
        print(f"bench.ab: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if args.keep:
            print(f"runs kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
