"""Serving benchmark: a serving server's lookup latency while it follows an export's new versions.

Run from the repository root::

    .venv/bin/python bench/bench_serving.py            # 1,000 lookups per phase (~1 min)
    .venv/bin/python bench/bench_serving.py --quick    # 200 per phase, writes serving-quick.*

An export of one table, dim 64, 200,000 rows (fp32), version 1 written in full by this process
(:func:`embcache.export.write_version`). One ``embcache-server --serve DIR --follow
--follow-interval-seconds 0.05`` on 127.0.0.1 serves it, tiers large enough for every row (the
service path and the version switch are measured, not the disk; every row is looked up once
before the phases, so all are resident). A client looks up 4,096
uniformly drawn keys at a time, one lookup after another, in three phases:

* **steady**: no new version appears;
* **exporting elsewhere**: a process of its own (the trainer's side) writes a delta version
  every 0.25 s, each changing 10,000 rows and deleting 100 keys, into a directory the server
  does not follow: the lookups share the cores with the exporter, and nothing is applied;
* **applying deltas**: the same exporter writes into the served directory (as a trainer
  exporting often would), and the server applies each delta as it appears.

Per phase: lookup p50, p99 and max, and, for the last, the versions the server applied during
the phase and the time lookups were held off per switch (``embcache_serving_switch_seconds_total``
over ``embcache_serving_versions_applied_total``, scraped from the server's metrics before and
after). The summary's ratio is the applying phase's p99 over the steady phase's (target: at most
2x); a second row, without a target, divides it by the exporting phase's p99: what applying adds
beyond the exporter's share of the cores. Each lookup of the two busy phases is also labelled by
what ran beside it: the server writing a delta's rows, or staging and switching to it (both from
the log line the server writes after each version, its time stamp and the phases' durations),
the exporter making and writing a delta (its own clock), or nothing; per label the lookups, their
p50 and p99, and how many of the slowest 1% it holds. The exporting process shares this machine's 2 cores
with the server and the client (a trainer would run elsewhere); one torch thread per process
(the server's ``--torch-threads 1`` and this one's), as in ``bench_server.py``. Until
2026-11-26 the exporter was a thread of the client's process, whose GIL it held while writing.
Writes ``bench/results/serving.json``, ``serving.md`` and ``serving.png``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine_info, markdown_table, plot_phase_latency, write_json
from embcache import Client, TableConfig
from embcache.export import TablePart, write_version
from embcache.server.local import LocalServer

DIM, ROWS, BATCH, DELTA_ROWS, DELTA_DELETED, EVERY = 64, 200_000, 4096, 10_000, 100, 0.25
TARGET = 2.0
CONFIG = TableConfig(name="t", dim=DIM).to_dict()


def _pct(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times) * 1e3, q)) if times else float("nan")


def _metrics(server: LocalServer) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("embcache_serving_")}


def _lookups(client: Client, n: int, rng: np.random.Generator,
             starts: list[float] | None = None) -> list[float]:
    """Seconds of each of ``n`` lookups; their wall-clock starts appended to ``starts``."""
    times = []
    for _ in range(n):
        keys = rng.integers(0, ROWS, BATCH)
        wall, t0 = time.time(), time.perf_counter()
        client.lookup("t", keys)
        times.append(time.perf_counter() - t0)
        if starts is not None:
            starts.append(wall)
    return times


_APPLIED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*serving version \d+ \(delta\)"
                      r".*staged in ([\d.]+) ms, switched in ([\d.]+) ms, \d+ rows written in ([\d.]+) ms")


def _server_intervals(log_text: str) -> dict[str, list[tuple[float, float]]]:
    """Wall-clock (start, end) of each delta's staging (switch included) and writing, from the
    server's log line at the end of each apply (its time stamp, then the phases' durations)."""
    out: dict[str, list[tuple[float, float]]] = {"server writing rows": [], "server staging or switching": []}
    for line in log_text.splitlines():
        m = _APPLIED.match(line)
        if m is None:
            continue
        end = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
        stage, switch, write = (float(m.group(i)) / 1e3 for i in (3, 4, 5))
        out["server writing rows"].append((end - write, end))
        out["server staging or switching"].append((end - write - switch - stage, end - write))
    return out


def attribute(starts: list[float], times: list[float], beside: dict[str, list[tuple[float, float]]],
              slowest: float = 0.01) -> list[dict[str, Any]]:
    """Each lookup labelled by the first of ``beside``'s activities (in order) it overlapped, else
    "nothing"; per label the lookups, their p50 and p99, and how many of the slowest ``slowest``
    share of all lookups it holds."""
    labels = []
    for start, took in zip(starts, times, strict=True):
        end = start + took
        label = next((name for name, spans in beside.items() if any(a < end and start < b for a, b in spans)),
                     "nothing")
        labels.append(label)
    k = max(1, round(slowest * len(times)))
    worst = set(np.argsort(times)[-k:].tolist())
    rows = []
    for name in [*beside, "nothing"]:
        idx = [i for i, lab in enumerate(labels) if lab == name]
        sel = [times[i] for i in idx]
        rows.append({"beside": name, "lookups": len(idx), "p50_ms": _pct(sel, 50), "p99_ms": _pct(sel, 99),
                     "slowest": sum(1 for i in idx if i in worst), "slowest_of": k})
    return rows


def _export_deltas(directory: str, first: int, stop: Any, done: Any) -> None:
    """Write a delta version every EVERY seconds until ``stop`` is set; send the write times to ``done``."""
    rng = np.random.default_rng(1)
    version, writes = first, []
    done.send("ready")
    while not stop.wait(EVERY):
        wall, t0 = time.time(), time.perf_counter()
        keys = np.unique(rng.integers(0, ROWS, DELTA_ROWS + DELTA_DELETED))
        changed, deleted = keys[:-DELTA_DELETED], keys[-DELTA_DELETED:]
        write_version(directory, version + 1, "delta", {"t": TablePart(
            CONFIG, changed, rng.standard_normal((changed.size, DIM), dtype=np.float32), deleted)},
            base_version=version)
        writes.append((wall, time.perf_counter() - t0))
        version += 1
    done.send(writes)


class _Exporter:
    """The trainer's side, in a process of its own (as a trainer runs apart from the servers it
    feeds): a delta version every EVERY seconds until stopped. A thread of this process would hold
    the client's GIL while it writes (18 ms a delta) and delay lookups the server had answered."""

    def __init__(self, directory: str, first: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_export_deltas, args=(directory, first, self.stop, child), daemon=True)
        self.write_seconds: list[float] = []
        self.spans: list[tuple[float, float]] = []  # wall-clock (start, end) of each delta made and written

    def start(self) -> None:
        """Start the process; returns once it is ready to write."""
        self._proc.start()
        if self._conn.recv() != "ready":
            raise RuntimeError("the exporting process did not start")

    def finish(self) -> None:
        """Stop writing; collect the write times."""
        if not self._proc.is_alive():
            return
        self.stop.set()
        writes = self._conn.recv()
        self.write_seconds = [took for _, took in writes]
        self.spans = [(wall, wall + took) for wall, took in writes]
        self._proc.join(timeout=60)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="200 lookups per phase instead of 1,000")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results directory")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the server (--torch-threads 1): on 2 shared cores intra-op threads only wait
    info = machine_info(script=__file__, argv=argv)
    n = 200 if args.quick else 1000
    stem = os.path.join(args.out, "serving-quick" if args.quick else "serving")
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    phases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="embcache-bench-serving-") as tmp:
        export = os.path.join(tmp, "export")
        keys = np.arange(ROWS, dtype=np.int64)
        write_version(export, 1, "full", {"t": TablePart(CONFIG, keys, rng.standard_normal((ROWS, DIM),
                                                                                           dtype=np.float32))})
        t0 = time.perf_counter()
        server = LocalServer(Path(tmp) / "s", workdir=Path(tmp) / "run", metrics=True, start_timeout=300,
                             args=["--serve", export, "--follow", "--follow-interval-seconds", "0.05",
                                   "--torch-threads", "1", "--hbm-bytes", str(128 << 20),
                                   "--ddr-bytes", str(64 << 20)]).start()
        start_seconds = time.perf_counter() - t0
        try:
            with Client([server.address], timeout=30) as client:
                for start in range(0, ROWS, 50_000):  # warm-up: every row in memory, as in the phases
                    client.lookup("t", keys[start:start + 50_000])
                _lookups(client, 20, rng)
                elsewhere = os.path.join(tmp, "elsewhere")  # an export the server does not follow
                write_version(elsewhere, 1, "full", {"t": TablePart(CONFIG, keys[:1], np.zeros((1, DIM), np.float32))})
                for label in ("steady", "exporting elsewhere", "applying deltas"):
                    before = _metrics(server)
                    exporter = (_Exporter(export, int(before["embcache_serving_version"])) if label == "applying deltas"
                                else _Exporter(elsewhere, 1))
                    if label != "steady":
                        exporter.start()
                    print(f"{label}: {n} lookups ...", flush=True)
                    t0 = time.perf_counter()
                    starts: list[float] = []
                    times = _lookups(client, n, rng, starts)
                    wall = time.perf_counter() - t0
                    exporter.finish()
                    after = _metrics(server)
                    applied = after["embcache_serving_versions_applied_total"] - before[
                        "embcache_serving_versions_applied_total"]
                    stall = after["embcache_serving_switch_seconds_total"] - before[
                        "embcache_serving_switch_seconds_total"]
                    phases[label] = {"p50_ms": _pct(times, 50), "p99_ms": _pct(times, 99),
                                     "max_ms": max(times) * 1e3, "seconds": wall,
                                     "versions_written": len(exporter.write_seconds),
                                     "versions_applied": int(applied),
                                     "switch_ms_mean": 1e3 * stall / applied if applied else 0.0,
                                     "export_write_ms_mean": 1e3 * float(np.mean(exporter.write_seconds))
                                     if exporter.write_seconds else 0.0}
                    if label != "steady":  # what ran beside each lookup (server phases from its log)
                        beside = _server_intervals(server.log()) if label == "applying deltas" else {}
                        beside = {k: [(a, b) for a, b in v if b > starts[0]] for k, v in beside.items()}
                        beside["exporter making and writing a delta"] = exporter.spans
                        phases[label]["beside"] = attribute(starts, times, beside)
                assert after["embcache_serving_errors_total"] == 0
        finally:
            server.stop()
    steady, busy, loaded = phases["steady"], phases["exporting elsewhere"], phases["applying deltas"]
    ratio = loaded["p99_ms"] / steady["p99_ms"] if steady["p99_ms"] else float("nan")
    case = (f"serving lookup p99 while applying a delta every {EVERY:g} s ({loaded['p99_ms']:.1f} ms, "
            f"{loaded['versions_applied']} versions, {loaded['switch_ms_mean']:.1f} ms per switch)")
    summary = [{"case": case, "reference": f"serving lookup p99, no new version ({steady['p99_ms']:.1f} ms)",
                "ratio": ratio, "target": TARGET, "met": bool(ratio <= TARGET and loaded["versions_applied"] > 0),
                "lower_is_better": True},
               # what applying adds beyond the exporter's share of this machine's cores (no target)
               {"case": case, "reference": f"serving lookup p99 while the same deltas are exported where the server "
                                           f"does not follow ({busy['p99_ms']:.1f} ms)",
                "ratio": loaded["p99_ms"] / busy["p99_ms"] if busy["p99_ms"] else float("nan"), "target": None,
                "met": None, "lower_is_better": True}]
    rows = [[label, f"{ph['p50_ms']:.2f}", f"{ph['p99_ms']:.2f}", f"{ph['max_ms']:.2f}", ph["versions_applied"],
             f"{ph['switch_ms_mean']:.1f}" if ph["versions_applied"] else "", f"{ph['export_write_ms_mean']:.1f}"
             if ph["versions_written"] else ""] for label, ph in phases.items()]
    table = markdown_table(["phase", "lookup p50 ms", "lookup p99 ms", "max ms", "versions applied",
                            "switch ms (lookups held)", "delta write ms (exporter)"], rows)
    beside_rows = [[label, b["beside"], b["lookups"], f"{b['p50_ms']:.2f}" if b["lookups"] else "",
                    f"{b['p99_ms']:.2f}" if b["lookups"] else "", f"{b['slowest']} of {b['slowest_of']}"]
                   for label, ph in phases.items() for b in ph.get("beside", [])]
    table += ("\n\nEach lookup by the first activity it overlapped (the server's phases from its log, the "
              "exporter's from its own clock):\n\n" + markdown_table(
                  ["phase", "beside", "lookups", "p50 ms", "p99 ms", "of the slowest 1%"], beside_rows))
    doc = {"benchmark": "serving lookup latency while following an export", "command": info["command"],
           "machine": info, "dim": DIM, "rows": ROWS, "batch": BATCH, "delta_rows": DELTA_ROWS,
           "delta_deleted": DELTA_DELETED, "every_seconds": EVERY, "lookups": n,
           "server_start_seconds": start_seconds, "phases": phases, "summary": summary,
           "seconds": time.perf_counter() - t_start}
    write_json(stem + ".json", doc)
    with open(stem + ".md", "w") as f:
        f.write(f"# Serving lookups while versions switch\n\n`{info['command']}` — {n} lookups of {BATCH:,} uniform "
                f"keys per phase, one at a time, from a server serving an export of {ROWS:,} rows (dim {DIM}, every "
                f"row in memory); while applying, a delta of {DELTA_ROWS:,} changed rows and {DELTA_DELETED} deleted "
                f"keys is exported every {EVERY:g} s and applied by the server's follow thread (polling every "
                f"0.05 s). Server start (loading version 1): {start_seconds:.1f} s.\n\n{table}\n")
    plot_phase_latency(phases, stem + ".png", "Serving lookups while the server follows an export", width=6)
    print(table)
    print(f"wrote {stem}.json/.md/.png ({time.perf_counter() - t_start:.0f} s)")
    return 0



if __name__ == "__main__":
    sys.exit(main())
