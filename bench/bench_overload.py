"""Overload benchmark: a well-behaved client's lookup latency with and without 64 stalled client streams.

Run from the repository root::

    .venv/bin/python bench/bench_overload.py            # 400 lookups per phase (~1 min)
    .venv/bin/python bench/bench_overload.py --quick    # 100 per phase, writes overload-quick.*

One ``embcache-server`` on 127.0.0.1 (default workers), one table of dim 64 with 100,000 rows.
A client runs lookups of 4,096 uniformly drawn keys one after another, first alone, then while 64
other calls of ``ApplyGradientsStream`` have each sent one chunk and stalled (their generators
block, as a client that hangs mid-stream would), then again after those are released. Every
lookup has a 10 s deadline; one that misses it counts as failed. The health check's latency is
measured in each phase too. Reported: p50 and p99 of the lookups per phase, the ratio of the
loaded p99 to the unloaded one (the issue's target: at most 2x), failures, and how many stalled
streams the server applied once released (a stream that was cut for idling is refused, not
applied).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine_info, markdown_table, plot_phase_latency, write_json
from embcache import Client
from embcache.rpc import codec
from embcache.rpc.v1 import embcache_pb2 as pb
from embcache.rpc.v1 import embcache_pb2_grpc as pb_grpc
from embcache.server.local import LocalServer

DIM, ROWS, BATCH, STALLED = 64, 100_000, 4096, 64
TARGET = 2.0


def _lookups(client: Client, n: int, rng: np.random.Generator) -> tuple[list[float], int]:
    """Latencies of the lookups that succeeded, and how many failed (after 5 failures in a row the
    server is taken as starved and the rest count as failed without waiting out their deadlines)."""
    times: list[float] = []
    failed = streak = 0
    for i in range(n):
        keys = rng.integers(0, ROWS, BATCH)
        t0 = time.perf_counter()
        try:
            client.lookup("t", keys)
        except Exception:
            failed += 1
            streak += 1
            if streak == 5:
                return times, failed + (n - i - 1)
            continue
        streak = 0
        times.append(time.perf_counter() - t0)
    return times, failed


def _health(address: str, n: int = 20) -> tuple[list[float], int]:
    times, failed = [], 0
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(n):
            t0 = time.perf_counter()
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                times.append(time.perf_counter() - t0)
            except grpc.RpcError:
                failed += 1
    return times, failed


def _stall(address: str, release: threading.Event) -> tuple[list[Any], grpc.Channel]:
    """Start STALLED ApplyGradientsStream calls that send one chunk each and block until ``release``."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.EmbeddingCacheServiceStub(channel)
    chunk = pb.ApplyGradientsRequest(tables=[pb.TableValues(table="t", keys=codec.encode_tensor(np.arange(8)),
                                                            values=codec.encode_tensor(np.zeros((8, DIM),
                                                                                                np.float32)))])

    def requests() -> Any:
        yield chunk
        release.wait()

    calls = [stub.ApplyGradientsStream.future(requests(), timeout=600) for _ in range(STALLED)]
    return calls, channel


def _pct(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times) * 1e3, q)) if times else float("nan")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="100 lookups per phase instead of 400")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results directory")
    args = p.parse_args(argv)
    info = machine_info(script=__file__, argv=argv)
    n = 100 if args.quick else 400
    stem = os.path.join(args.out, "overload-quick" if args.quick else "overload")
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    phases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="embcache-bench-overload-") as tmp:
        server = LocalServer(Path(tmp) / "s", tables=[f"name=t,dim={DIM},optimizer=sgd"], workdir=Path(tmp) / "run",
                             args=["--hbm-bytes", str(64 << 20), "--ddr-bytes", str(64 << 20)],
                             start_timeout=300).start()
        try:
            with Client([server.address], timeout=10) as client:
                for start in range(0, ROWS, 25_000):
                    client.assign("t", np.arange(start, start + 25_000), torch.randn(25_000, DIM))
                _lookups(client, 20, rng)  # warm-up
                for label in ("alone", f"{STALLED} stalled streams", "after release"):
                    release = threading.Event()
                    calls: list[Any] = []
                    channel = None
                    if label.endswith("streams"):
                        calls, channel = _stall(server.address, release)
                        time.sleep(1.0)  # every stream has sent its chunk and stalled
                    print(f"{label}: {n} lookups ...", flush=True)
                    times, failed = _lookups(client, n, rng)
                    htimes, hfailed = _health(server.address)
                    phase: dict[str, Any] = {"p50_ms": _pct(times, 50), "p99_ms": _pct(times, 99), "failed": failed,
                                             "health_p99_ms": _pct(htimes, 99), "health_failed": hfailed}
                    if calls:
                        release.set()
                        applied = refused = 0
                        for call in calls:
                            try:
                                call.result(timeout=120)
                                applied += 1
                            except grpc.RpcError:
                                refused += 1
                        phase.update(streams_applied=applied, streams_refused=refused)
                        assert channel is not None
                        channel.close()
                    phases[label] = phase
        finally:
            server.stop()
    alone, loaded = phases["alone"], phases[f"{STALLED} stalled streams"]
    ratio = loaded["p99_ms"] / alone["p99_ms"] if alone["p99_ms"] else float("nan")
    summary = [{"case": f"lookup p99 with {STALLED} stalled client streams ({loaded['p99_ms']:.1f} ms, "
                        f"{loaded['failed']} of {n} failed)",
                "reference": f"lookup p99 alone ({alone['p99_ms']:.1f} ms)", "ratio": ratio,
                "target": TARGET, "met": bool(ratio <= TARGET and loaded["failed"] == 0), "lower_is_better": True}]
    rows = [[label, f"{ph['p50_ms']:.1f}", f"{ph['p99_ms']:.1f}", f"{ph['failed']} / {n}", f"{ph['health_p99_ms']:.1f}",
             f"{ph['health_failed']} / 20", f"{ph.get('streams_applied', '')}", f"{ph.get('streams_refused', '')}"]
            for label, ph in phases.items()]
    table = markdown_table(["phase", "lookup p50 ms", "lookup p99 ms", "lookups failed", "health p99 ms",
                            "health failed", "stalled streams applied", "refused"], rows)
    doc = {"benchmark": "lookup latency with and without stalled client streams", "command": info["command"],
           "machine": info, "dim": DIM, "rows": ROWS, "batch": BATCH, "stalled": STALLED, "lookups": n,
           "phases": phases, "summary": summary, "seconds": time.perf_counter() - t_start}
    write_json(stem + ".json", doc)
    with open(stem + ".md", "w") as f:
        f.write(f"# Lookups while {STALLED} client streams stall\n\n`{info['command']}` — {n} lookups of {BATCH:,} "
                f"keys (dim {DIM}, {ROWS:,} rows in memory) per phase, one at a time, deadline 10 s; 20 health "
                f"checks per phase.\n\n{table}\n")
    plot_phase_latency(phases, stem + ".png", "A client's lookups while other clients' streams stall", width=7)
    print(table)
    print(f"wrote {stem}.json/.md/.png ({time.perf_counter() - t_start:.0f} s)")
    return 0



if __name__ == "__main__":
    sys.exit(main())
