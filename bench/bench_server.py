"""Server benchmark: pull and push through embcache-server vs a raw gRPC echo (the ceiling) and Redis.

Run from the repository root::

    .venv/bin/python bench/bench_server.py            # 7 repeats (~3 min)
    .venv/bin/python bench/bench_server.py --quick    # 3 repeats (~1 min), writes server-quick.*

Needs Debian's ``redis-server`` on the PATH (``apt-get install -y redis-server``) and the
``bench`` extra (redis-py with hiredis); without them the Redis column is left out.

Workload: batches of 8,192 uniformly drawn keys of a 262,144-row table, dim 64, fp32 (2 MiB of
rows per batch), from 1 and 4 client threads in this process (each thread its own client),
against servers in their own processes on 127.0.0.1:

* **embcache**: ``embcache-server`` (one table, SGD, every row resident in memory, so the
  service path is measured, not the disk), ``embcache.Client``. *Pull* = ``lookup`` (int64 keys
  out, float32 rows back, as a torch tensor); *push* = ``apply_gradients`` (keys and gradients out,
  the server applies SGD).
* **gRPC echo** (the ceiling): a gRPC server in Python with raw-bytes methods and the same
  thread pool and message limits; pull sends the keys' bytes and gets a prebuilt 2 MiB reply,
  push sends keys + rows and gets an empty reply. The client wraps the reply as a tensor (no copy).
* **embedded cache** (a second reference): the same table in an in-process EmbeddingCache, called
  directly by the client threads: the cost of the cache work alone, which the server adds to the
  transport. ``apply_gradients`` of 8,192 rows costs more than a whole echo round trip here, so push
  cannot reach 0.8x of the echo on this machine whatever the service does.
* **Redis**: ``redis-server`` (no persistence), one 256-byte value per key; pull = ``MGET`` of the
  batch's keys (joined into one tensor), push = ``MSET`` of the batch's rows (Redis stores the rows
  it is given; embcache additionally runs the optimizer).

Each repeat runs every contender and op in turn (interleaved, so they see the same machine
load); each thread does a fixed number of batches; rows/s = rows moved / wall time; the median
repeat is reported with min and max. For each case the server process's CPU use is recorded too
(user + system CPU seconds from ``/proc/<pid>/stat``, all its threads, over the case's wall time:
1.0 = one core busy), pooled over the repeats (``server_cpu_cores``; per repeat in
``server_cpu_cores_per_repeat``): whether a server on this 2-core machine keeps both cores busy,
knowing that the client threads of this process share the same cores. One torch thread per
process (the servers and this one): on 2 shared cores intra-op threads only wait on each other.
Writes ``bench/results/server.json``, ``server.md`` and ``server.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._common import (  # noqa: E402
    RedisServer,
    RedisUnavailable,
    format_ratio,
    machine_info,
    markdown_table,
    write_json,
)

# Echo and Redis replies are wrapped without a copy (read-only bytes): fine for a reference that only reads them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

BATCH = 8192
DIM = 64
ROWS = 1 << 18
ROW_BYTES = DIM * 4
TARGET_VS_GRPC = 0.8
TARGET_VS_REDIS = 4.0
MAX_MESSAGE = 64 << 20
THREADS = (1, 4)
OPS = ("pull", "push")


# ---------------------------------------------------------------------- the raw gRPC echo server
def serve_echo(port_file: str, workers: int) -> None:
    """A raw-bytes gRPC server (run in its own process): /bench.Echo/Pull and /bench.Echo/Push."""
    import signal

    import grpc

    reply = np.random.default_rng(0).standard_normal((BATCH, DIM)).astype(np.float32).tobytes()

    def pull(request: bytes, context: Any) -> bytes:
        return reply

    def push(request: bytes, context: Any) -> bytes:
        return b""

    handlers = {"Pull": grpc.unary_unary_rpc_method_handler(pull), "Push": grpc.unary_unary_rpc_method_handler(push)}
    server = grpc.server(ThreadPoolExecutor(max_workers=workers),
                         options=[("grpc.max_send_message_length", MAX_MESSAGE),
                                  ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with open(port_file + ".tmp", "w") as f:
        json.dump({"port": port}, f)
    os.replace(port_file + ".tmp", port_file)
    stop: list[int] = []  # the handler takes no lock (an Event's set could deadlock with the main thread's wait)
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    while not stop:  # short sleeps: a SIGTERM taken by a gRPC thread wakes no long wait
        time.sleep(0.2)
    server.stop(0)


def _wait_file(path: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit {proc.poll()})")
        time.sleep(0.05)
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


# ---------------------------------------------------------------------- server CPU use
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far, all its threads (ended ones too).

    From ``/proc/<pid>/stat`` (fields 14 and 15, in clock ticks: 10 ms here); None where there is
    no such file (not Linux, or the process is gone).
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces: split after it
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


# ---------------------------------------------------------------------- contenders
class Contender:
    """One system under test: per-thread clients and the two operations."""

    name = ""

    @property
    def server_pid(self) -> int | None:
        """The pid of the server process whose CPU use is recorded (None: in this process)."""
        return None

    def make_client(self) -> Any:
        raise NotImplementedError

    def pull(self, client: Any, keys: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    def push(self, client: Any, keys: np.ndarray, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop the server."""


class Embcache(Contender):
    """embcache-server + embcache.Client."""

    name = "embcache"

    def __init__(self, workdir: str, workers: int) -> None:
        from embcache.client import Client
        from embcache.server.local import LocalServer

        self._Client = Client
        table = f"name=bench,dim={DIM},optimizer=sgd,lr=0.001"
        self.server = LocalServer(os.path.join(workdir, "store"), tables=[table],
                                  args=["--hbm-bytes", str(160 << 20), "--ddr-bytes", str(32 << 20), "--torch-threads",
                                        "1", "--workers", str(workers), "--max-message-bytes", str(MAX_MESSAGE)],
                                  workdir=os.path.join(workdir, "run")).start()
        with Client([self.server.address]) as c:  # every row written once, so every lookup is a memory hit
            for start in range(0, ROWS, 1 << 16):
                keys = np.arange(start, start + (1 << 16))
                c.assign("bench", keys, torch.randn(keys.size, DIM))
            self.resident = c.stats()["bench"]["hbm"]["resident_rows"]

    @property
    def server_pid(self) -> int | None:
        return self.server.proc.pid if self.server.proc is not None else None

    def make_client(self) -> Any:
        return self._Client([self.server.address], max_message_bytes=MAX_MESSAGE)

    def pull(self, client: Any, keys: np.ndarray) -> torch.Tensor:
        rows: torch.Tensor = client.lookup("bench", keys)
        return rows

    def push(self, client: Any, keys: np.ndarray, rows: torch.Tensor) -> None:
        client.apply_gradients("bench", keys, rows)

    def close(self) -> None:
        self.server.stop()


class Embedded(Contender):
    """The library in this process, no network: what the server's cache work alone allows."""

    name = "embedded cache"

    def __init__(self, workdir: str) -> None:
        from embcache import CacheConfig, EmbeddingCache, TableConfig

        self.cache = EmbeddingCache(CacheConfig(path=os.path.join(workdir, "embedded"), hbm_bytes=160 << 20,
                                                ddr_bytes=32 << 20, device="cpu"),
                                    [TableConfig(name="bench", dim=DIM, optimizer="sgd", lr=0.001)])
        for start in range(0, ROWS, 1 << 16):
            self.cache.assign("bench", torch.arange(start, start + (1 << 16)), torch.randn(1 << 16, DIM))

    def make_client(self) -> Any:
        return self.cache

    def pull(self, client: Any, keys: np.ndarray) -> torch.Tensor:
        rows: torch.Tensor = client.lookup("bench", torch.from_numpy(keys))
        return rows

    def push(self, client: Any, keys: np.ndarray, rows: torch.Tensor) -> None:
        client.apply_gradients("bench", torch.from_numpy(keys), rows)

    def close(self) -> None:
        self.cache.close()


class GrpcEcho(Contender):
    """The raw gRPC loopback echo: the same bytes, no protobuf, no cache."""

    name = "gRPC echo"

    def __init__(self, workdir: str, workers: int) -> None:
        port_file = os.path.join(workdir, "echo.json")
        env = {**os.environ, "PYTHONPATH": str(_ROOT)}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-echo", port_file, "--workers", str(workers)],
                                     env=env)
        self.address = f"127.0.0.1:{_wait_file(port_file, self.proc, 'the echo server')['port']}"

    @property
    def server_pid(self) -> int | None:
        return self.proc.pid

    def make_client(self) -> Any:
        import grpc

        channel = grpc.insecure_channel(self.address, options=[("grpc.max_send_message_length", MAX_MESSAGE),
                                                               ("grpc.max_receive_message_length", MAX_MESSAGE)])
        return (channel, channel.unary_unary("/bench.Echo/Pull"), channel.unary_unary("/bench.Echo/Push"))

    def pull(self, client: Any, keys: np.ndarray) -> torch.Tensor:
        data = client[1](keys.tobytes(), timeout=60)
        return torch.frombuffer(data, dtype=torch.float32).view(-1, DIM)  # no copy: the ceiling

    def push(self, client: Any, keys: np.ndarray, rows: torch.Tensor) -> None:
        # one copy into the request, as embcache.Client makes (gRPC takes bytes): keys.tobytes() + rows.tobytes()
        # would copy the rows twice more and lower the ceiling
        client[2](b"".join((memoryview(keys).cast("B"), memoryview(rows.numpy()).cast("B"))),  # type: ignore[arg-type]
                  timeout=60)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


class Redis(Contender):
    """redis-server (no persistence) + redis-py with hiredis; one 256-byte value per key."""

    name = "Redis"

    def __init__(self, workdir: str) -> None:
        self.server = RedisServer(workdir)  # RedisUnavailable: no redis-server or redis-py
        self.parser = self.server.parser
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        client = self.server.client()
        rng = np.random.default_rng(1)
        for start in range(0, ROWS, 1 << 15):
            keys = np.arange(start, start + (1 << 15))
            data = rng.standard_normal((keys.size, DIM)).astype(np.float32).tobytes()
            client.mset({k: data[i * ROW_BYTES:(i + 1) * ROW_BYTES] for i, k in enumerate(self._names(keys))})
        client.close()

    @property
    def server_pid(self) -> int | None:
        return int(self.server.proc.pid)

    @staticmethod
    def _names(keys: np.ndarray) -> list[bytes]:
        raw = keys.astype("<i8").tobytes()
        return [raw[i:i + 8] for i in range(0, len(raw), 8)]

    def make_client(self) -> Any:
        return self.server.client()

    def pull(self, client: Any, keys: np.ndarray) -> torch.Tensor:
        values = client.mget(self._names(keys))
        return torch.frombuffer(b"".join(values), dtype=torch.float32).view(-1, DIM)

    def push(self, client: Any, keys: np.ndarray, rows: torch.Tensor) -> None:
        data = rows.numpy().tobytes()
        client.mset({k: data[i * ROW_BYTES:(i + 1) * ROW_BYTES] for i, k in enumerate(self._names(keys))})

    def close(self) -> None:
        self.server.close()


# ---------------------------------------------------------------------- timing
def run_case(c: Contender, op: str, threads: int, clients: list[Any], batches: int,
             seed: int) -> tuple[float, float | None]:
    """Wall seconds of ``threads`` threads each doing ``batches`` batches of ``op``; server CPU seconds meanwhile."""
    rng = np.random.default_rng(seed)
    work = [[np.sort(rng.integers(0, ROWS, BATCH)) for _ in range(batches)] for _ in range(threads)]
    grads = torch.randn(BATCH, DIM) * 1e-3
    fn: Callable[[Any, np.ndarray], object] = ((lambda cl, k: c.pull(cl, k)) if op == "pull"
                                              else (lambda cl, k: c.push(cl, k, grads)))
    barrier = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        barrier.wait()
        for keys in work[i]:
            fn(clients[i], keys)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    pid = c.server_pid
    cpu0 = cpu_seconds(pid) if pid is not None else None
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = cpu_seconds(pid) if pid is not None else None
    return wall, (cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None)


def check_correct(c: Contender, client: Any) -> None:
    """The pull of each contender returns [BATCH, DIM] float32 rows (and embcache the rows it stores)."""
    keys = np.arange(BATCH)
    rows = c.pull(client, keys)
    assert rows.shape == (BATCH, DIM) and rows.dtype == torch.float32, (c.name, rows.shape)


def plot(results: dict[str, Any], path: str) -> None:
    """Grouped bars: rows/s per case, one bar per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [f"{op}, {t} thread{'s' if t > 1 else ''}" for op in OPS for t in THREADS]
    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = [results[name][op][str(t)]["rows_per_s"] / 1e6 for op in OPS for t in THREADS]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cases))]
        bars = ax.bar(xs, vals, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("million rows/s (dim 64 fp32, batch 8,192)")
    ax.set_title("embcache-server vs raw gRPC echo and Redis (127.0.0.1, 2 CPUs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 repeats, fewer batches; writes server-quick.*")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--batches", type=int, default=None, help="batches per thread per repeat")
    ap.add_argument("--workers", type=int, default=8, help="server worker threads (embcache and echo)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    ap.add_argument("--serve-echo", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_echo:
        serve_echo(args.serve_echo, args.workers)
        return 0
    torch.set_num_threads(1)
    repeats = args.repeats or (3 if args.quick else 7)
    batches = args.batches or (12 if args.quick else 24)
    info = machine_info(("protobuf", "redis", "hiredis"), script=__file__, argv=sys.argv[1:] if argv is None else argv)
    stem = os.path.join(args.out, "server-quick" if args.quick else "server")
    t_start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="embcache-bench-server-")
    contenders: list[Contender] = []
    notes: list[str] = []
    try:
        print("starting servers and loading rows ...", flush=True)
        contenders.append(Embcache(workdir, args.workers))
        contenders.append(GrpcEcho(workdir, args.workers))
        contenders.append(Embedded(workdir))
        redis_parser = None
        try:
            r = Redis(workdir)
            contenders.append(r)
            redis_parser = r.parser
        except RedisUnavailable as exc:
            notes.append(f"Redis left out: {exc}")
        clients = {c.name: [c.make_client() for _ in range(max(THREADS))] for c in contenders}
        for c in contenders:
            check_correct(c, clients[c.name][0])
        seconds: dict[str, dict[str, dict[str, list[float]]]] = {
            c.name: {op: {str(t): [] for t in THREADS} for op in OPS} for c in contenders}
        cpu: dict[str, dict[str, dict[str, list[float]]]] = {
            c.name: {op: {str(t): [] for t in THREADS} for op in OPS} for c in contenders}
        from tqdm import tqdm

        total = repeats * len(contenders) * len(OPS) * len(THREADS)
        with tqdm(total=total, desc="server bench", unit="case") as bar:
            for rep in range(-1, repeats):  # repeat -1 warms every path up and is discarded
                for op in OPS:
                    for t in THREADS:
                        for c in contenders:
                            s, used = run_case(c, op, t, clients[c.name], batches if rep >= 0 else 2,
                                               seed=rep + 100)
                            if rep >= 0:
                                seconds[c.name][op][str(t)].append(s)
                                if used is not None:
                                    cpu[c.name][op][str(t)].append(used)
                                bar.update()
        results: dict[str, Any] = {}
        for name, per_op in seconds.items():
            results[name] = {}
            for op, per_t in per_op.items():
                results[name][op] = {}
                for t_key, secs in per_t.items():
                    rows = int(t_key) * batches * BATCH
                    rates = [rows / s for s in secs]
                    med = statistics.median(rates)
                    busy = cpu[name][op][t_key]
                    results[name][op][t_key] = {"rows_per_s": med, "rows_per_s_min": min(rates),
                                            "rows_per_s_max": max(rates), "mb_per_s": med * ROW_BYTES / 1e6,
                                            "rows_per_repeat": rows, "seconds": secs,
                                            # CPU seconds over wall seconds, pooled over the repeats (ticks of
                                            # 10 ms are coarse next to one repeat); None: no server process
                                            "server_cpu_cores": sum(busy) / sum(secs) if busy else None,
                                            "server_cpu_cores_per_repeat": ([u / w for u, w in zip(busy, secs,
                                                                                                    strict=True)]
                                                                            if busy else None),
                                            "server_cpu_seconds": busy or None}
        emb = contenders[0]
        assert isinstance(emb, Embcache)
        resident = emb.resident
    finally:
        for c in contenders:
            c.close()
        shutil.rmtree(workdir, ignore_errors=True)

    summary = []
    table_rows = []
    cores = os.cpu_count() or 1
    with_cpu = [n for n in results if results[n]["pull"][str(THREADS[0])]["server_cpu_cores"] is not None]

    def cpu_cell(r: dict[str, Any]) -> str:
        used = r["server_cpu_cores"]
        return "—" if used is None else f"{used:.2f} ({100 * used / cores:.0f}% of {cores})"

    for op in OPS:
        for t in THREADS:
            e = results["embcache"][op][str(t)]["rows_per_s"]
            row: list[Any] = [op, t]
            for name in results:
                r = results[name][op][str(t)]
                row.append(f"{r['rows_per_s'] / 1e6:.2f} M ({r['mb_per_s']:.0f} MB/s)")
            for name in with_cpu:
                row.append(cpu_cell(results[name][op][str(t)]))
            g = results["gRPC echo"][op][str(t)]["rows_per_s"]
            row.append(format_ratio(e / g, TARGET_VS_GRPC))
            summary.append({"case": f"{op}, {t} client thread{'s' if t > 1 else ''}", "reference": "raw gRPC echo",
                            "ratio": e / g, "target": TARGET_VS_GRPC, "met": e / g >= TARGET_VS_GRPC})
            if "Redis" in results:
                red = results["Redis"][op][str(t)]["rows_per_s"]
                row.append(format_ratio(e / red, TARGET_VS_REDIS))
                summary.append({"case": f"{op}, {t} client thread{'s' if t > 1 else ''}",
                                "reference": "Redis MGET/MSET" if op == "pull" else "Redis MSET",
                                "ratio": e / red, "target": TARGET_VS_REDIS, "met": e / red >= TARGET_VS_REDIS})
            table_rows.append(row)
    headers = ["op", "client threads", *[f"{n} rows/s" for n in results],
               *[f"{n} server CPU, cores" for n in with_cpu], "embcache / gRPC echo"]
    if "Redis" in results:
        headers.append("embcache / Redis")
    table = markdown_table(headers, table_rows)
    command = info["command"]
    doc = {"benchmark": "embcache-server pull/push vs raw gRPC echo and Redis", "command": command,
           "machine": info,
           "batch": BATCH, "dim": DIM, "rows": ROWS, "repeats": repeats, "batches_per_thread": batches,
           "server_workers": args.workers, "embcache_resident_rows": resident, "redis_parser": redis_parser,
           "notes": notes, "results": results, "summary": summary, "seconds": time.perf_counter() - t_start}
    write_json(stem + ".json", doc)
    with open(stem + ".md", "w") as f:
        f.write(f"# embcache-server vs raw gRPC echo and Redis\n\n`{command}` — batch {BATCH:,} keys, dim {DIM} "
                f"fp32, {ROWS:,}-row table, median of {repeats} repeats x {batches} batches per thread "
                f"(rows/s and MB/s of row payload). *Server CPU*: the server process's user + system CPU "
                f"seconds (all threads, `/proc/<pid>/stat`) over the wall time, pooled over the repeats "
                f"(1.00 = one core busy; this machine has {cores}, shared with the client threads).\n\n{table}\n")
        for n in notes:
            f.write(f"\n- {n}\n")
    plot(results, stem + ".png")
    print(table)
    for n in notes:
        print("note:", n)
    print(f"wrote {stem}.json/.md/.png ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
