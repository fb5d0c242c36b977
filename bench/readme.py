"""Write the benchmark report's targets and plots into the docs' benchmarks page (docs/benchmarks.md).

The section lies between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``; everything
outside the markers is left as it is. ``python -m bench`` calls this after a full run (and
``--report-only`` rebuilds it from the results already in ``bench/results/``); by hand::

    .venv/bin/python -m bench.readme            # from bench/results/report.json

The section lived in README.md until the docs site (the module keeps its name). Plots are
linked as ``../bench/results/NAME.png``, relative to the page, so that they show on GitHub; the
site serves them through ``docs/hooks/repo_files.py``.

A target's row comes from the newest result of each benchmark: the full run's where there is
one, else the quick run's (marked "quick").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import format_ratio

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

# (title, result stem) of the plots shown, in this order; a stem's full result is preferred
PLOTS = (
    ("Lookup and lookup + update against index_select, FBGEMM, RocksDB, LMDB, Redis and a dict LRU", "cache"),
    ("Tiered lookup throughput and hit rates against the tier sizes", "cache-tiers"),
    ("DLRM training throughput and hit rates per pass", "dlrm"),
    ("HBM hit ratio against LRU, LFU, W-TinyLFU and Belady's OPT over capacities", "policy"),
    ("Parameter server pull/push against a raw gRPC echo and Redis", "server"),
    ("Per-row cost as the table grows", "scale"),
    ("A table twice the machine's RAM: resident memory against the tier budgets", "big"),
)

METHOD = (
    "Each benchmark runs a seeded workload, discards its warm-up and reports the median of "
    "repeated runs; every reference (the `index_select` ceiling, FBGEMM, RocksDB, a dict LRU, "
    "Redis, a raw gRPC echo, all-in-memory torch) is measured side by side in the same run, "
    "contenders alternating within each repeat, so a ratio never compares against a remembered "
    "number. Every contender gets the same thread count (one by default). The figures come from "
    "the machine named in each result's JSON (here a 2-core CPU VM shared with other jobs, so "
    "they carry noise); `python -m bench --device cuda` runs the GPU cases where CUDA is present."
)


def _plot(stem: str) -> str | None:
    base, _, extra = stem.partition("-")  # "cache-tiers": cache-tiers.png, else cache-quick-tiers.png
    quick = f"{base}-quick-{extra}.png" if extra else f"{stem}-quick.png"
    for name in (f"{stem}.png", quick):
        if (RESULTS / name).exists():
            return name
    return None


def target_table(targets: Sequence[dict[str, Any]], mark_quick: bool = True) -> list[str]:
    """Markdown lines of the targets table (a row from a quick result marked so with ``mark_quick``).

    The "measured at" column is the commit the row's result was measured at (``measured_commit``,
    from the result's JSON), marked **stale** when the report found it older than the latest change
    to the code it runs (``embcache/``, less the server and client code for all but ``server``)
    or to the benchmark's script. A ratio is shown with more than two digits where two
    would hide which side of 1x or of the target it lies (0.997x, not 1.00x).
    """
    lines = ["| benchmark | case | reference | ratio | target | met? | measured at |",
             "| --- | --- | --- | ---: | ---: | --- | --- |"]
    for r in targets:
        target = r.get("target")
        lower = r.get("lower_is_better", False)
        tgt = "—" if target is None else (f"<= {target:g}x" if lower else f">= {target:g}x")
        met = "n/a" if target is None or r.get("ratio") is None else ("yes" if r.get("met") else "**no**")
        quick = " (quick)" if mark_quick and str(r.get("result", "")).endswith("-quick.json") else ""
        commit = r.get("measured_commit")
        measured = f"`{commit[:7]}`" if commit else "unknown"
        if r.get("stale"):
            measured += " **stale**"
        lines.append(f"| {r.get('bench', '')}{quick} | {r.get('case', '')} | {r.get('reference', '')} | "
                     f"{format_ratio(r.get('ratio'), target)} | {tgt} | {met} | {measured} |")
    return lines


def section(report: dict[str, Any]) -> str:
    """The generated part of the performance section, in Markdown."""
    lines = [BEGIN, "", METHOD, "",
             "Targets of every issue, from `bench/results/report.md` (each row names the commit its result was "
             "measured at; **stale**: measured before the latest change to the code it runs (`embcache/`; "
             "for all but `server`, less the gRPC server, RPC and client code, which only it starts) or "
             "to the benchmark's script):",
             ""]
    lines += target_table(report.get("targets", []))
    for title, stem in PLOTS:
        png = _plot(stem)
        if png is not None:
            lines += ["", f"**{title}** (`bench/results/{png}`)", "", f"![{title}](../bench/results/{png})"]
    lines += ["", END]
    return "\n".join(lines)


def update_readme(report: dict[str, Any], readme: Path = PAGE) -> bool:
    """Replace the section between the markers of docs/benchmarks.md (or ``readme``); False (page
    untouched) when they are missing."""
    text = readme.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return False
    readme.write_text(text[:start] + section(report) + text[end + len(END):])
    return True


def main(argv: list[str] | None = None) -> int:
    """Update docs/benchmarks.md from ``bench/results/report.json`` (or the path given)."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else RESULTS / "report.json"
    if not path.exists():
        print(f"{path} does not exist: run `.venv/bin/python -m bench` first", file=sys.stderr)
        return 1
    ok = update_readme(json.loads(path.read_text()))
    page = PAGE.relative_to(ROOT)
    print(f"{page} updated" if ok else f"{page} has no {BEGIN} ... {END} section; nothing written")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
