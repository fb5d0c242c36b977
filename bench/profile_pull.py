"""Where a pull's time goes: one Lookup of 8,192 keys at dim 64 over loopback, taken apart.

Run from the repository root::

    .venv/bin/python bench/profile_pull.py            # writes bench/results/profile-pull.json and .md

In one run, with the same batches of keys (uniform over the table, a new one each call, every row
resident in memory, as in ``bench_server``), each part is the median of ``--reps`` calls (the
server's handler: the mean over those calls):

- **end to end**: ``embcache.Client.lookup`` against a real ``embcache-server`` process;
- **server handler**: the time the server spent in the call, from its own metrics
  (``embcache_rpc_request_duration_seconds``, scraped over HTTP before and after: the mean);
- of which **cache lookup**: ``EmbeddingCache.lookup`` of the batch in this process, same table;
- **client encode** and **client decode**: the client's request encoding and reply parsing
  (``embcache.rpc.wire``), in this process;
- **the rest** (end to end less the three above): gRPC and the transport, both ways, and the
  client's routing; beside it, **gRPC echo**: a raw-bytes gRPC server in another process
  answering the same request bytes with the same reply bytes (``bench_server``'s echo), the
  floor of what gRPC in Python costs for these payloads.

The bound for a server that does the cache's work and gRPC's one after the other is
echo + cache lookup; the report gives the measured end to end against it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._common import machine_info, markdown_table, timings, write_json  # noqa: E402
from bench.bench_server import DIM, MAX_MESSAGE, GrpcEcho  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.client import Client  # noqa: E402
from embcache.errors import InvalidRowsError  # noqa: E402
from embcache.rpc import codec, wire  # noqa: E402
from embcache.server.local import LocalServer  # noqa: E402

BATCHES = 64
_HANDLER = re.compile(r'^embcache_rpc_request_duration_seconds_(sum|count)\{[^}]*method="Lookup"[^}]*\} (\S+)$', re.M)


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    return 1e3 * statistics.median(timings(fn, reps, warmup))


def handler_totals(metrics_port: int) -> tuple[float, float]:
    """(sum of seconds, count) of the server's Lookup calls so far, from its /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    got = {"sum": 0.0, "count": 0.0}
    for kind, value in _HANDLER.findall(text):
        got[kind] += float(value)
    return got["sum"], got["count"]


def profile(batch: int, reps: int, rows: int, work: str) -> dict[str, Any]:
    """Every part of the pull (see the module docstring), in milliseconds."""
    rng = np.random.default_rng(0)
    # a new batch each call, cycling through BATCHES of them: the same keys every time would find
    # their rows in the CPU's caches, which a training job's next batch does not
    batches = [rng.integers(0, rows, batch, dtype=np.int64) for _ in range(BATCHES)]
    keys = batches[0]
    nxt = itertools.cycle(range(BATCHES)).__next__
    values = torch.randn(rows, DIM)
    table = TableConfig(name="bench", dim=DIM, optimizer="sgd", lr=0.001)
    parts: dict[str, float] = {}
    server = LocalServer(os.path.join(work, "store"), tables=[f"name=bench,dim={DIM},optimizer=sgd,lr=0.001"],
                         args=["--hbm-bytes", str(160 << 20), "--ddr-bytes", str(32 << 20), "--torch-threads", "1",
                               "--max-message-bytes", str(MAX_MESSAGE)], metrics=True,
                         workdir=os.path.join(work, "run")).start()
    try:
        with Client([server.address], max_message_bytes=MAX_MESSAGE) as client:
            for start in range(0, rows, 1 << 16):
                client.assign("bench", np.arange(start, min(rows, start + (1 << 16))), values[start:start + (1 << 16)])
            client.lookup("bench", keys)
            s0, n0 = handler_totals(server.metrics_port)
            parts["end to end"] = median_ms(lambda: client.lookup("bench", batches[nxt()]), reps, warmup=0)
            s1, n1 = handler_totals(server.metrics_port)
            parts["server handler"] = 1e3 * (s1 - s0) / max(n1 - n0, 1)
    finally:
        server.stop()
    torch.set_num_threads(1)  # as the server runs (--torch-threads 1)
    with EmbeddingCache(CacheConfig(path=os.path.join(work, "embedded"), hbm_bytes=160 << 20, ddr_bytes=32 << 20,
                                    device="cpu"), [table]) as cache:
        for start in range(0, rows, 1 << 16):
            cache.assign("bench", torch.arange(start, min(rows, start + (1 << 16))), values[start:start + (1 << 16)])
        tkeys = [torch.from_numpy(k) for k in batches]
        out = torch.empty(batch, DIM)
        parts["cache lookup"] = median_ms(lambda: cache.lookup("bench", tkeys[nxt()], out=out), reps)
        reply = wire.encode_lookup_response([("bench", cache.lookup("bench", tkeys[0]).numpy())])
    parts["client encode"] = median_ms(lambda: wire.encode_lookup_request([("bench", keys)]), reps)
    def decode() -> torch.Tensor:  # as embcache.client.routing.fill does for a whole batch's reply
        rows = codec.decode_tensor(wire.parse_lookup_response(reply)[0].rows, "rows", InvalidRowsError, ("float32",), 2)
        return wire.as_tensor(reply, rows)

    parts["client decode"] = median_ms(decode, reps)
    echo = GrpcEcho(work, 8)
    try:
        echo_client = echo.make_client()
        request = wire.encode_lookup_request([("bench", keys)])
        parts["gRPC echo"] = median_ms(lambda: echo_client[1](request, timeout=60), reps)
        echo_client[0].close()
    finally:
        echo.close()
    parts["the rest"] = parts["end to end"] - parts["server handler"] - parts["client encode"] - parts["client decode"]
    parts["server handler less cache lookup"] = parts["server handler"] - parts["cache lookup"]
    return parts


def main(argv: list[str] | None = None) -> int:
    """Profile and report (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8192, help="keys per pull (default 8,192)")
    ap.add_argument("--rows", type=int, default=1 << 18, help="rows in the table, all resident (default 262,144)")
    ap.add_argument("--reps", type=int, default=30, help="calls per part (default 30)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    args = ap.parse_args(argv)
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="embcache-pull-") as work:
        parts = profile(args.batch, args.reps, args.rows, work)
    e2e = parts["end to end"]
    bound = parts["gRPC echo"] + parts["cache lookup"]
    order = ["end to end", "server handler", "cache lookup", "server handler less cache lookup", "client encode",
             "client decode", "the rest", "gRPC echo"]
    table = markdown_table(["part", "ms per pull", "share of end to end"],
                           [[p, f"{parts[p]:.3f}", f"{parts[p] / e2e:.0%}"] for p in order])
    res = {"benchmark": "where a pull's time goes", "command": info["command"], "machine": info,
           "batch": args.batch, "dim": DIM, "reps": args.reps, "parts_ms": parts,
           "serial_bound_ms": bound, "end_to_end_over_bound": bound / e2e,
           "end_to_end_over_echo": parts["gRPC echo"] / e2e}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "profile-pull.json"), res)
    text = (f"# Where a pull's time goes\n\nCommand: `{info['command']}`; batch {args.batch:,} keys, dim {DIM}, "
            f"every row resident; medians of {args.reps} calls.\n\n{table}\n\nEnd to end runs at "
            f"{bound / e2e:.2f} of the serial bound (gRPC echo + cache lookup = {bound:.3f} ms) and at "
            f"{parts['gRPC echo'] / e2e:.2f} of the echo alone.\n")
    Path(args.out, "profile-pull.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
