"""embcache-server: serve an embedding cache over gRPC.

    embcache-server --path ./embcache-data        # defaults: 127.0.0.1:50051, tiers sized from the machine
    embcache-server --config server.toml --listen 0.0.0.0:50051 --metrics-port 9400

The server holds one :class:`~embcache.EmbeddingCache` (store under ``--path``) and serves
``embcache.rpc.v1.EmbeddingCacheService``, the standard gRPC health service and server
reflection. Tables come from the config file (``[[tables]]``), from ``--table``, or from clients
(CreateTable); every table persists with the store, so a restart on the same ``--path`` serves
them again with their rows. Prometheus metrics (the cache's own,
``embcache_rpc_request_duration_seconds{method,code}`` and the standard gRPC server names
``grpc_server_handled_total``, ``grpc_server_handling_seconds``, ... from the same count) are
served on ``http://METRICS_HOST:METRICS_PORT/metrics``.

Durability (what an acknowledged write survives):
  default                     Updates live in memory (HBM/DDR) and in the store only once written
                              back. A clean stop (SIGTERM/SIGINT) flushes them all. A crash
                              (kill -9, power loss) keeps what the last Flush or Checkpoint call,
                              or a row's eviction, wrote; later acknowledged updates may be lost.
  --flush-every-updates N     The write request that completes every N-th write request flushes
                              before it is acknowledged: after a crash at most the N-1 most recent
                              acknowledged write requests are lost.
  --flush-interval-seconds S  A background thread flushes every S seconds when anything was
                              written: a crash loses at most the updates acknowledged in the last
                              S seconds (plus the time one flush takes).
  --sync                      Every write request is flushed before it is acknowledged: a crash
                              loses no acknowledged update (each write pays a flush and a synced
                              WAL write). If that flush fails the call fails, with the update
                              applied in memory but not yet durable.
  A flush writes every dirty row and syncs the store (RocksDB WAL synced, LMDB env.sync), so
  what it covers survives kill -9 and power loss.
  Across restarts: each process draws a random incarnation at start and numbers the writes it
  acknowledges (every write reply carries both); each flush, and a clean stop, records in
  PATH/server-incarnations.json how far its writes are durable. A restarted process answers
  clients' Flush and Checkpoint calls for its predecessors, so embcache.Client.flush() raises
  DataLossError, naming the shard, when a crash lost writes it had acknowledged.

Shard map: a fleet's clients install their shard list on the servers as version 1 of the fleet's
map (PATH/shard-map.json); from then on a server refuses a keyed request routed by another map
version, or carrying a key it does not own (WrongShardError, FAILED_PRECONDITION, not applied,
with its map in the trailing metadata, which clients adopt). `embcache reshard` (or
Client.reshard) adds or removes shards: it moves every row whose owner changes, then commits the
next map version on every server; while a migration is pending, writes to the rows that leave a
server are refused with MigratingError (UNAVAILABLE, not applied; clients resend them).

Shutdown (SIGTERM or SIGINT): the health service turns NOT_SERVING and new calls are refused with
UNAVAILABLE, marked not applied (embcache.Client resends them, writes included), for
--drain-seconds; then the server stops listening, calls already running finish (up to
--grace-seconds), every dirty row is flushed and the store closed. With the default
--drain-seconds 0 it stops listening at once: a call arriving just then is cancelled by gRPC
(CANCELLED, unmarked; the client resends it only if it is idempotent), later ones find no server
(the client waits for one on that address until the call's deadline).

Security: TLS with --tls-cert/--tls-key; mutual TLS adds --tls-client-ca (clients must present a
certificate signed by it). --auth-token-file requires ``authorization: Bearer <token>`` on every
cache call (missing or wrong: UNAUTHENTICATED); tokens in --auth-readonly-token-file may only
call the methods of role "read" (the table of token roles at the end of this help; others:
PERMISSION_DENIED). Health and reflection stay open for probes. Token files hold one token per
line; EMBCACHE_AUTH_TOKEN adds a read-write token.

Overload isolation: health checks (grpc.health.v1 Check) run on 2 threads of their own, so a
probe is answered while every other thread is busy. Calls that stream, either way (the *Stream
calls, Prefetch, EndPass, ResidentKeys), run on --stream-workers threads of their own (default
max(2, workers / 2)) and never take the --workers threads of unary calls (Lookup, ApplyGradients,
Assign, ...); when all are busy, further streams wait in a queue, holding no thread. A client
stream that sends no message for --stream-idle-seconds (default 30) is cut: the call is cancelled
(the client sees CANCELLED) and nothing of it is applied (a stream's chunks are applied together
once it ends). Nor is a stream the client cancels, or whose deadline passes, before its end (gRPC
reports such an end like a normal one: each stream's end waits up to 10 ms to tell them apart).
A Lookup whose reply would exceed --max-message-bytes is refused
(RESOURCE_EXHAUSTED, BatchTooLargeError) before any row is read or created, and a large one is
handed to the cache 65,536 keys at a time (its working memory is one chunk's). Not bounded yet: a
client that reads a server stream (ResidentKeys, Prefetch) slowly holds its stream thread.

Lookups of unknown keys (any token, read-only ones too) return the initializer's rows and cache
them in memory as clean rows: only an update or an assign makes a row dirty, so such rows are
never written to the store (a flush or eviction drops them; looked up again, they come back the
same). A read-only token thus creates no persisted row; its lookups move rows between the memory
tiers like any other lookup, within the tiers' budgets and the reply-size limit.

Malformed requests: bytes that are no valid request message and impossible tensor shapes get
INVALID_ARGUMENT (embcache-error-type InvalidKeysError, "malformed ..." or the tensor's problem).

Batch leases (Client.prefetch_batch, LookAhead over a Client): the rows of a leased batch stay
pinned until the client releases them, or until the lease goes its time-to-live without a
renewal (the client asks for one, 30 s by default; at most --max-lease-seconds): a crashed or
cut-off client never pins rows for longer. A held lease costs no server thread.

Serving mode (--serve DIR): serve a model exported by embcache.export (numbered full and delta
versions) read-only. The tables and rows come from the newest complete version in DIR; the rows
go into a fresh store under --path (removed at a clean stop), weights only (no optimizer state in
memory or on disk), with the tiers sized as usual. A key the model lacks gets --unknown-rows
(zeros by default, or the table's initializer) and creates no row. Every write call (role "write"
below) is refused: FAILED_PRECONDITION, ReadOnlyError, naming the version served. --follow polls
DIR every --follow-interval-seconds and applies each new complete version atomically: a Lookup,
over all its tables, sees one version, never a mix; a version still being written is waited for;
a broken chain is logged and counted, and the last good version served on. The version served is
in ListTables (ServerInfo.serving_version, Client.server_info()), in Stats (each table's
"serving") and in the metrics (embcache_serving_version, ..._version_age_seconds, ...).

Diagnostics: ``kill -USR1 PID`` prints every thread's stack to stderr, named, the main thread first
(while shutting down: faulthandler's dump, at most 100 threads); ``kill -USR2 PID`` prints
faulthandler's dump at any time, for an interpreter too stuck to answer USR1. A shutdown still
running 30 s after its drain and grace prints the stacks too (every 30 s until it ends).

Config file (TOML, or JSON when the name ends in .json); EMBCACHE_<SETTING> environment variables
(EMBCACHE_METRICS_PORT, EMBCACHE_HBM_BYTES, EMBCACHE_PATH, ...: any key below, [cache] fields by
their own name) override it, and flags override both. Every value is checked against its type
(a wrong one stops the server with exit status 2 and names the key); sizes in bytes also take
units: "4GiB", "512MB" (KiB/MiB/GiB/TiB: powers of 1024; KB/MB/GB/TB: of 1000).

    listen = "127.0.0.1:50051"
    metrics_port = 9400                # -1: no metrics server; 0: a free port
    max_message_bytes = 67108864       # per message, both directions
    max_lease_seconds = 600            # the longest time-to-live of a batch lease
    stream_idle_seconds = 30           # cut a client stream silent this long
    [cache]                            # embcache.CacheConfig fields
    path = "./embcache-data"
    hbm_bytes = 1073741824
    [durability]
    flush_interval_seconds = 5
    [tls]
    cert = "server.pem"
    key = "server.key"
    [auth]
    token_file = "tokens.txt"
    # [serving]                        # serving mode, instead of [[tables]] and [durability]
    # directory = "./exports"
    # follow = true
    # follow_interval_seconds = 1
    # unknown_rows = "zeros"
    [[tables]]                         # embcache.TableConfig fields
    name = "user"
    dim = 64
    optimizer = "rowwise_adagrad"
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from .. import __version__
from ..config import TableConfig
from ..errors import ConfigError
from .auth import roles_text
from .serve import RunningServer, start_server
from .settings import (
    ServerSettings,
    apply_environment,
    check_settings,
    parse_size,
    read_settings_file,
    typed_value,
)
from .stacks import dump_stacks

__all__ = ["DIE_WITH_PARENT_ENV", "RunningServer", "ServerSettings", "build_parser", "load_settings", "main",
           "parse_size", "start_server"]

_SIGNAL_POLL_SECONDS = 0.2  # how soon the main thread notices a signal another thread received

#: Environment variable holding the pid of the process that started this server (set by
#: embcache.server.local.LocalServer): on Linux the server gets SIGTERM when that thread dies.
DIE_WITH_PARENT_ENV = "EMBCACHE_DIE_WITH_PARENT"


# ---------------------------------------------------------------------- flags
def _parse_table(spec: str) -> TableConfig:
    """``name=user,dim=64,optimizer=adagrad`` -> TableConfig (values typed by the dataclass fields)."""
    types = {f.name: f.type for f in dataclasses.fields(TableConfig)}
    kwargs: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in types:
            raise ConfigError(f"--table {spec!r}: expected key=value pairs with keys from {sorted(types)}")
        kwargs[key] = typed_value(f"--table {spec!r}: {key}", value.strip(), str(types[key]), from_text=True,
                                  field=key)
    return TableConfig(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (flags override the config file)."""
    p = argparse.ArgumentParser(prog="embcache-server", description=__doc__, epilog=roles_text(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"embcache-server {__version__}")
    p.add_argument("--config", help="TOML or JSON config file")
    p.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:50051; port 0 picks a free port)")
    p.add_argument("--path", help="store directory (default ./embcache-data)")
    p.add_argument("--store", choices=["rocksdb", "lmdb"], help="cold-tier store (default rocksdb)")
    p.add_argument("--hbm-bytes", help="hot tier size, bytes or with a unit like 2GiB (default: 1/8 of the device "
                                       "memory, at most 4 GiB)")
    p.add_argument("--ddr-bytes",
                   help="warm tier bytes (default: 1/8 of RAM, or of the container's memory limit, at most 8 GiB)")
    p.add_argument("--device", help="device of the hot tier (default cuda if available, else cpu)")
    p.add_argument("--max-batch-keys", type=int, help="largest batch per table per call (default 2**24)")
    p.add_argument("--table", action="append", default=[], metavar="SPEC",
                   help="a table to open or create, e.g. name=user,dim=64,optimizer=adagrad,lr=0.05 (repeatable)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default 9400; 0 = free port, -1 = none)")
    p.add_argument("--metrics-host", help="Prometheus bind address (default 127.0.0.1)")
    p.add_argument("--max-message-bytes", help="largest message either way (default 64 MiB)")
    p.add_argument("--max-lease-seconds", type=float,
                   help="longest time-to-live of a batch lease: a client that stops renewing its leases pins "
                        "rows at most this long (default 600)")
    p.add_argument("--workers", type=int, help="threads serving unary calls (default max(8, 4 x cores))")
    p.add_argument("--stream-workers", type=int,
                   help="threads serving the calls that stream, either way (default max(2, workers / 2)); "
                        "further streams wait in a queue holding no thread")
    p.add_argument("--stream-idle-seconds", type=float, metavar="S",
                   help="cut a client stream that sends no message for S seconds (default 30)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    p.add_argument("--checkpoint-root", help="Checkpoint writes only under this directory (default PATH/checkpoints)")
    p.add_argument("--flush-every-updates", type=int, metavar="N", help="flush before acknowledging every N-th write")
    p.add_argument("--flush-interval-seconds", type=float, metavar="S", help="flush every S seconds in the background")
    p.add_argument("--sync", action="store_true", default=None, help="flush every write before acknowledging it")
    p.add_argument("--grace-seconds", type=float, help="shutdown waits this long for calls in flight (default 30)")
    p.add_argument("--drain-seconds", type=float,
                   help="shutdown refuses new calls (NOT_SERVING) this long before it stops listening (default 0)")
    p.add_argument("--tls-cert", help="server certificate chain (PEM); enables TLS")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", help="CA (PEM) that client certificates must be signed by (mutual TLS)")
    p.add_argument("--auth-token-file", action="append", default=[], help="file of read-write bearer tokens")
    p.add_argument("--auth-readonly-token-file", action="append", default=[], help="file of read-only bearer tokens")
    p.add_argument("--port-file", help="write {port, metrics_port, pid} as JSON here once serving")
    p.add_argument("--serve", metavar="DIR",
                   help="serving mode: serve the exported model in DIR read-only (every write call refused)")
    p.add_argument("--follow", action="store_true", default=None,
                   help="serving mode: apply each new version of the export as it appears")
    p.add_argument("--follow-interval-seconds", type=float, metavar="S",
                   help="serving mode: look for a new version every S seconds (default 1)")
    p.add_argument("--unknown-rows", choices=["zeros", "init"],
                   help="serving mode: what a key the model lacks gets (default zeros; init: the initializer's row)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def load_settings(argv: Sequence[str] | None = None) -> tuple[ServerSettings, argparse.Namespace]:
    """Settings from ``--config`` (if any), overridden by ``EMBCACHE_*`` variables, then by flags; typed and checked.

    Raises:
        ConfigError: the config file, a variable or a flag is invalid.
    """
    args = build_parser().parse_args(argv)
    s = read_settings_file(args.config) if args.config else ServerSettings()
    apply_environment(s, os.environ)
    overrides = {"listen": args.listen, "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
                 "max_message_bytes": args.max_message_bytes, "max_lease_seconds": args.max_lease_seconds,
                 "workers": args.workers, "stream_workers": args.stream_workers,
                 "stream_idle_seconds": args.stream_idle_seconds,
                 "torch_threads": args.torch_threads,
                 "checkpoint_root": args.checkpoint_root, "flush_every_updates": args.flush_every_updates,
                 "flush_interval_seconds": args.flush_interval_seconds, "sync": args.sync,
                 "grace_seconds": args.grace_seconds, "drain_seconds": args.drain_seconds,
                 "tls_cert": args.tls_cert, "tls_key": args.tls_key,
                 "tls_client_ca": args.tls_client_ca, "port_file": args.port_file, "serve": args.serve,
                 "follow": args.follow, "follow_interval_seconds": args.follow_interval_seconds,
                 "unknown_rows": args.unknown_rows}
    for key, value in overrides.items():
        if value is not None:
            setattr(s, key, value)
    for key, value in (("path", args.path), ("store", args.store), ("hbm_bytes", args.hbm_bytes),
                       ("ddr_bytes", args.ddr_bytes), ("device", args.device),
                       ("max_batch_keys", args.max_batch_keys)):
        if value is not None:
            s.cache[key] = value
    s.auth_token_files += args.auth_token_file
    s.auth_readonly_token_files += args.auth_readonly_token_file
    given = {t.name: t for t in s.tables}
    for spec in args.table:
        t = _parse_table(spec)
        given[t.name] = t
    s.tables = list(given.values())
    check_settings(s)
    return s, args


# ---------------------------------------------------------------------- the process
def _die_with_parent() -> None:
    """With ``EMBCACHE_DIE_WITH_PARENT=<pid>`` (Linux): SIGTERM this process when the thread that started it dies.

    ``PR_SET_PDEATHSIG`` survives ``execve`` and refers to the thread that forked this process,
    so setting it here is what a ``preexec_fn`` would do, without making the parent ``fork()``.
    A parent that died before this ran is no longer our parent: then SIGTERM is sent at once.
    """
    parent = os.environ.get(DIE_WITH_PARENT_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def _write_port_file(path: str, running: RunningServer) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"port": running.port, "metrics_port": running.metrics_port, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGTERM or SIGINT; returns the exit status (2: bad configuration)."""
    try:
        s, args = load_settings(argv)
        logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        # The handler only appends to a list: it must take no lock. It runs on the main thread
        # between two bytecodes, and setting a threading.Event there deadlocked when the signal
        # came while the main thread's Event.wait held the Event's lock (seen: a second SIGTERM
        # found the first handler blocked, and the server never stopped).
        stop: list[int] = []
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:  # installed before serving: a signal during start-up still stops cleanly
            signal.signal(sig, lambda signum, _frame: stop.append(signum))
        _die_with_parent()
        # `kill -USR1 PID`: every thread's stack, named, printed by the main loop below (the handler
        # only flags it, as above); `kill -USR2 PID`: faulthandler's dump from C, for an interpreter
        # too stuck to run the main loop (at most 100 threads, no names)
        dumps: list[int] = []
        if hasattr(signal, "SIGUSR1"):
            signal.signal(signal.SIGUSR1, lambda signum, _frame: dumps.append(signum))
            faulthandler.register(signal.SIGUSR2, all_threads=True)
        running = start_server(s)
    except (ConfigError, ValueError, RuntimeError) as exc:
        print(f"embcache-server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    host = s.listen.rsplit(":", 1)[0]
    metrics = f", metrics http://{s.metrics_host}:{running.metrics_port}/metrics" if running.metrics_port >= 0 else ""
    tls = " (mutual TLS)" if s.tls_client_ca else " (TLS)" if s.tls_cert else ""
    mode = (f"version {running.serving.version} of {running.serving.directory!r} read-only"
            f"{' (following)' if s.follow else ''}" if running.serving is not None
            else f"durability: {running.durability.describe()}")
    print(f"embcache-server {__version__}: serving {sorted(running.cache.tables())} from "
          f"{running.cache.config.path!r} on {host}:{running.port}{tls}{metrics}; {mode}", flush=True)
    if s.port_file:
        _write_port_file(s.port_file, running)
    # Short waits: CPython runs signal handlers on the main thread only, and a signal the kernel hands
    # to another thread (any of gRPC's or the store's may take a process-directed SIGTERM) does not
    # wake a main thread blocked in a long wait. With one wait of an hour, SIGTERM was answered only
    # when something else woke it (seen in tests: a server still up 60 s after SIGTERM).
    while not stop:
        time.sleep(_SIGNAL_POLL_SECONDS)
        if dumps:
            dumps.clear()
            dump_stacks()
    if hasattr(signal, "SIGUSR1"):  # the main thread is busy shutting down: USR1 answered from C now
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    t0 = time.perf_counter()
    print("embcache-server: shutting down (NOT_SERVING, draining calls, flushing)", flush=True)
    running.shutdown()
    print(f"embcache-server: stopped cleanly in {time.perf_counter() - t0:.2f} s", flush=True)
    logging.shutdown()
    # Everything is flushed and closed: skip the interpreter's teardown of torch, numba and gRPC
    # (about a second that restarts and rolling updates would wait for).
    os._exit(0)
