"""embcache-server: serve an embedding cache over gRPC.

    embcache-server --path ./embcache-data        # defaults: 127.0.0.1:50051, tiers sized from the machine
    embcache-server --config server.toml --listen 0.0.0.0:50051 --metrics-port 9400

The server holds one :class:`~embcache.EmbeddingCache` (store under ``--path``) and serves
``embcache.rpc.v1.EmbeddingCacheService``, the standard gRPC health service and server
reflection. Tables come from the config file (``[[tables]]``), from ``--table``, or from clients
(CreateTable); every table persists with the store, so a restart on the same ``--path`` serves
them again with their rows. Prometheus metrics (the cache's own and
``embcache_rpc_request_duration_seconds{method,code}``) are served on
``http://METRICS_HOST:METRICS_PORT/metrics``.

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

Diagnostics: ``kill -USR1 PID`` prints every thread's stack to stderr; a shutdown still running
30 s after its drain and grace prints them too (every 30 s until it ends).

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
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from .. import __version__
from ..cache import EmbeddingCache
from ..config import CacheConfig, TableConfig
from ..errors import ConfigError
from ..rpc.v1 import embcache_pb2 as pb
from .auth import TokenAuth, read_tokens, roles_text
from .durability import Durability
from .handlers import SERVICE_NAME, add_to_server
from .leases import MIN_TTL_SECONDS, LeaseTable
from .ledger import WriteLedger
from .overload import HEALTH_THREADS, StreamWatchdog, add_health
from .procmetrics import register_process_metrics
from .servicer import EmbeddingCacheServicer
from .sharding import ShardGate

__all__ = ["DIE_WITH_PARENT_ENV", "RunningServer", "ServerSettings", "load_settings", "main", "start_server"]

log = logging.getLogger("embcache.server")
# How long shutdown waits, past the grace period, for gRPC to report every call ended.
_STOP_SLACK_SECONDS = 10.0
_SIGNAL_POLL_SECONDS = 0.2  # how soon the main thread notices a signal another thread received

#: Environment variable holding the pid of the process that started this server (set by
#: embcache.server.local.LocalServer): on Linux the server gets SIGTERM when that thread dies.
DIE_WITH_PARENT_ENV = "EMBCACHE_DIE_WITH_PARENT"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class ServerSettings:
    """Everything the server needs; built from the config file and flags by :func:`load_settings`.

    Args:
        listen: ``HOST:PORT`` to bind (port 0: a free port).
        cache: keyword arguments of :class:`~embcache.CacheConfig` (``path``, ``hbm_bytes``, ...).
        tables: tables to open or create at start.
        metrics_port: Prometheus HTTP port (-1: none, 0: a free port).
        metrics_host: address of the metrics server (default 127.0.0.1).
        max_message_bytes: largest message in either direction (default 64 MiB).
        max_lease_seconds: the longest time-to-live a batch lease is granted (default 600): a
            client that stops renewing its leases (crashed, cut off) pins rows at most this long.
        workers: threads serving unary calls (default 4 per core, at least 8).
        stream_workers: threads serving the calls that stream, either way (default half of
            ``workers``, at least 2): streams never take the unary calls' threads, and wait in a
            queue (holding no thread) when these are all busy. Health checks have 2 of their own.
        stream_idle_seconds: a client stream that sends no message for this long is cut
            (cancelled, nothing of it applied; default 30).
        torch_threads: torch's intra-op threads (0: torch's default, one per core). Concurrent
            calls already use the cores; 1 avoids threads waiting on each other on a busy machine.
        checkpoint_root: Checkpoint writes only under here (default ``<path>/checkpoints``).
        flush_every_updates, flush_interval_seconds, sync: durability (see the module docs).
        grace_seconds: how long shutdown waits for calls in flight.
        drain_seconds: how long shutdown stays NOT_SERVING, refusing new calls, before it stops
            listening (time for load balancers and clients to notice; default 0).
        tls_cert, tls_key, tls_client_ca: PEM files (TLS; with a client CA, mutual TLS).
        auth_token_files, auth_readonly_token_files: files of bearer tokens, one per line.
        port_file: a JSON file written once serving: ``{"port", "metrics_port", "pid"}``.
    """

    listen: str = "127.0.0.1:50051"
    cache: dict[str, Any] = field(default_factory=dict)
    tables: list[TableConfig] = field(default_factory=list)
    metrics_port: int = 9400
    metrics_host: str = "127.0.0.1"
    max_message_bytes: int = 64 << 20
    max_lease_seconds: float = 600.0
    workers: int = 0
    stream_workers: int = 0
    stream_idle_seconds: float = 30.0
    torch_threads: int = 0
    checkpoint_root: str | None = None
    flush_every_updates: int = 0
    flush_interval_seconds: float = 0.0
    sync: bool = False
    grace_seconds: float = 30.0
    drain_seconds: float = 0.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token_files: list[str] = field(default_factory=list)
    auth_readonly_token_files: list[str] = field(default_factory=list)
    port_file: str | None = None

    def cache_config(self) -> CacheConfig:
        """The CacheConfig to open (``path`` defaults to ./embcache-data).

        Raises:
            ConfigError: an unknown or invalid field.
        """
        names = {f.name for f in dataclasses.fields(CacheConfig)}
        unknown = set(self.cache) - names
        if unknown:
            raise ConfigError(f"unknown [cache] fields {sorted(unknown)}; allowed: {sorted(names)}")
        return CacheConfig(**self.cache)


# ---------------------------------------------------------------------- config file and flags
def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(raw)
        else:
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            data = tomllib.loads(raw.decode())
    except ValueError as exc:
        raise ConfigError(f"config file {path!r} is not valid {'JSON' if path.endswith('.json') else 'TOML'}: "
                          f"{exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a table/object at the top level")
    return data


_TOP_KEYS = {"listen", "metrics_port", "metrics_host", "max_message_bytes", "max_lease_seconds", "workers",
             "stream_workers", "stream_idle_seconds", "torch_threads",
             "checkpoint_root",
             "grace_seconds", "drain_seconds", "port_file", "cache", "tables", "durability", "tls", "auth"}
_SECTION_KEYS = {
    "durability": {"flush_every_updates", "flush_interval_seconds", "sync"},
    "tls": {"cert", "key", "client_ca"},
    "auth": {"token_file", "readonly_token_file"},
}


def _settings_from_dict(data: Mapping[str, Any]) -> ServerSettings:
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown config keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    for section, keys in _SECTION_KEYS.items():
        extra = set(data.get(section, {})) - keys
        if extra:
            raise ConfigError(f"unknown [{section}] keys {sorted(extra)}; allowed: {sorted(keys)}")
    s = ServerSettings()
    for key in ("listen", "metrics_port", "metrics_host", "max_message_bytes", "max_lease_seconds", "workers",
                "stream_workers", "stream_idle_seconds", "torch_threads",
                "checkpoint_root",
                "grace_seconds", "drain_seconds", "port_file"):
        if key in data:
            setattr(s, key, data[key])
    s.cache = dict(data.get("cache", {}))
    s.tables = [TableConfig.from_dict(t) for t in data.get("tables", [])]
    for key, value in data.get("durability", {}).items():
        setattr(s, key, value)
    tls = data.get("tls", {})
    s.tls_cert, s.tls_key, s.tls_client_ca = tls.get("cert"), tls.get("key"), tls.get("client_ca")
    auth = data.get("auth", {})
    s.auth_token_files = [auth["token_file"]] if "token_file" in auth else []
    s.auth_readonly_token_files = [auth["readonly_token_file"]] if "readonly_token_file" in auth else []
    return s


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
#: Settings (and CacheConfig fields) that are sizes in bytes: they also take units ("4GiB", "512 MB").
_SIZES = {"max_message_bytes", "hbm_bytes", "ddr_bytes", "block_cache_bytes"}


def parse_size(value: Any, what: str) -> int:
    """Bytes from an integer or a string with a unit (``"4GiB"``, ``"512MB"``, ``"1.5 GiB"``; KiB/MiB/GiB/TiB
    are powers of 1024, KB/MB/GB/TB of 1000).

    Raises:
        ConfigError: not a size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().replace("_", "").replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
        unit = text[len(number):].lower()
        try:
            if unit in _UNITS and number:
                return int(float(number) * _UNITS[unit])
        except ValueError:
            pass
    raise ConfigError(f"{what}={value!r}: expected a size in bytes, e.g. 1073741824, \"1GiB\" or \"512MB\"")


def _typed(what: str, value: Any, annotation: str, from_text: bool = False, field: str = "") -> Any:
    """``value`` checked against a field's annotation; ``from_text``: an environment variable's text, converted.

    Raises:
        ConfigError: the value has another type, saying which was expected.
    """
    kinds = [k.strip() for k in str(annotation).split("|")]
    if value is None and "None" in kinds:
        return None
    base = kinds[0]
    if (field or what.rsplit(".", 1)[-1]) in _SIZES:
        return parse_size(value, what)
    text = from_text and isinstance(value, str)
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if text and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
        elif base == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if text and value.strip().lstrip("-").isdigit():
                return int(value)
        elif base == "float":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if text:
                return float(value)
        elif base == "str":
            if isinstance(value, str):
                return value
        else:
            return value
    except ValueError:
        pass
    raise ConfigError(f"{what}={value!r}: expected {' or '.join(kinds)}, got {type(value).__name__}")


def _check_types(s: ServerSettings) -> None:
    """Every setting, and every [cache] field, of the type its dataclass declares (sizes may carry units).

    Raises:
        ConfigError: a wrongly typed value, named with its key.
    """
    for f in dataclasses.fields(ServerSettings):
        if f.name in ("cache", "tables"):
            continue
        value = getattr(s, f.name)
        if str(f.type).startswith("list"):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{f.name}={value!r}: expected a list of file names")
            continue
        setattr(s, f.name, _typed(f.name, value, str(f.type)))
    cache_types = {f.name: str(f.type) for f in dataclasses.fields(CacheConfig)}
    for key, value in list(s.cache.items()):
        if key in cache_types:
            s.cache[key] = _typed(f"cache.{key}", value, cache_types[key])


def _from_environment(s: ServerSettings, environ: Mapping[str, str]) -> None:
    """``EMBCACHE_<SETTING>`` (e.g. EMBCACHE_METRICS_PORT) and ``EMBCACHE_<CACHE FIELD>`` (e.g. EMBCACHE_HBM_BYTES,
    EMBCACHE_PATH) override the config file; flags override them.

    Raises:
        ConfigError: a variable's text is not of its setting's type.
    """
    for f in dataclasses.fields(ServerSettings):
        key = f"EMBCACHE_{f.name.upper()}"
        if key in environ and f.name not in ("cache", "tables") and not str(f.type).startswith("list"):
            setattr(s, f.name, _typed(key, environ[key], str(f.type), from_text=True, field=f.name))
    for f in dataclasses.fields(CacheConfig):
        key = f"EMBCACHE_{f.name.upper()}"
        if key in environ and not hasattr(s, f.name):
            s.cache[f.name] = _typed(key, environ[key], str(f.type), from_text=True, field=f.name)


def _parse_table(spec: str) -> TableConfig:
    """``name=user,dim=64,optimizer=adagrad`` -> TableConfig (values typed by the dataclass fields)."""
    types = {f.name: f.type for f in dataclasses.fields(TableConfig)}
    kwargs: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in types:
            raise ConfigError(f"--table {spec!r}: expected key=value pairs with keys from {sorted(types)}")
        kwargs[key] = _typed(f"--table {spec!r}: {key}", value.strip(), str(types[key]), from_text=True,
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
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def load_settings(argv: Sequence[str] | None = None) -> tuple[ServerSettings, argparse.Namespace]:
    """Settings from ``--config`` (if any) overridden by flags.

    Raises:
        ConfigError: the config file or a flag is invalid.
    """
    args = build_parser().parse_args(argv)
    s = _settings_from_dict(_read_config(args.config)) if args.config else ServerSettings()
    _from_environment(s, os.environ)
    overrides = {"listen": args.listen, "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
                 "max_message_bytes": args.max_message_bytes, "max_lease_seconds": args.max_lease_seconds,
                 "workers": args.workers, "stream_workers": args.stream_workers,
                 "stream_idle_seconds": args.stream_idle_seconds,
                 "torch_threads": args.torch_threads,
                 "checkpoint_root": args.checkpoint_root, "flush_every_updates": args.flush_every_updates,
                 "flush_interval_seconds": args.flush_interval_seconds, "sync": args.sync,
                 "grace_seconds": args.grace_seconds, "drain_seconds": args.drain_seconds,
                 "tls_cert": args.tls_cert, "tls_key": args.tls_key,
                 "tls_client_ca": args.tls_client_ca, "port_file": args.port_file}
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
    _check_types(s)
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    if s.tls_client_ca and not s.tls_cert:
        raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    if s.max_message_bytes < 1 << 16:
        raise ConfigError(f"max_message_bytes={s.max_message_bytes}: must be at least 65536")
    if not 0 < float(s.stream_idle_seconds) < float("inf"):
        raise ConfigError(f"stream_idle_seconds={s.stream_idle_seconds}: must be a number of seconds > 0")
    if s.workers < 0 or s.stream_workers < 0:
        raise ConfigError(f"workers={s.workers}, stream_workers={s.stream_workers}: must be >= 0 (0: the default)")
    if not MIN_TTL_SECONDS <= float(s.max_lease_seconds) < float("inf"):
        raise ConfigError(f"max_lease_seconds={s.max_lease_seconds}: must be a number of seconds >= {MIN_TTL_SECONDS}")
    return s, args


# ---------------------------------------------------------------------- the server
@dataclass
class RunningServer:
    """A started server; :meth:`shutdown` stops it gracefully."""

    server: grpc.Server
    cache: EmbeddingCache
    servicer: EmbeddingCacheServicer
    health: health.HealthServicer
    durability: Durability
    port: int
    metrics_port: int
    grace_seconds: float
    drain_seconds: float = 0.0
    _metrics_httpd: Any = None
    _pools: tuple[ThreadPoolExecutor, ...] = ()
    _stopped: bool = False

    def shutdown(self) -> None:
        """NOT_SERVING, refuse new calls, let calls in flight finish, flush and close. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        # A shutdown that takes far longer than its drain and grace is stuck: print every thread's
        # stack to stderr (the server log) so that the cause can be read there, and go on waiting.
        faulthandler.dump_traceback_later(self.drain_seconds + self.grace_seconds + 30.0, repeat=True)
        t0 = time.perf_counter()
        try:
            self.health.enter_graceful_shutdown()
            self.servicer.begin_shutdown()
            if self.drain_seconds > 0:
                time.sleep(self.drain_seconds)
            # gRPC cancels what still runs after the grace period, but its "stopped" event waits for
            # every handler thread, and one can be stuck outside our code: bound that wait too. The
            # flush below still takes the table locks, so a handler inside the cache finishes first.
            if not self.server.stop(self.grace_seconds).wait(self.grace_seconds + _STOP_SLACK_SECONDS):
                log.warning("shutdown: gRPC calls still not finished %.0f s after the grace period; flushing "
                            "anyway (their stacks follow on stderr)", _STOP_SLACK_SECONDS)
                faulthandler.dump_traceback(all_threads=True)
            log.info("shutdown: calls finished after %.2f s", time.perf_counter() - t0)
            self.durability.stop()
            for pool in self._pools:  # the stream and health threads: their calls ended with the server
                pool.shutdown(wait=False, cancel_futures=True)
            self.servicer.close()  # cancels the batch leases: nothing pinned is left to the cache's close
            self.cache.close()
            self.durability.ledger.close()  # every write this process acknowledged is durable: say so on disk
            log.info("shutdown: cache flushed and closed after %.2f s", time.perf_counter() - t0)
            if self._metrics_httpd is not None:
                self._metrics_httpd.shutdown()
                self._metrics_httpd.server_close()
        finally:
            faulthandler.cancel_dump_traceback_later()


def _credentials(s: ServerSettings) -> grpc.ServerCredentials | None:
    if not s.tls_cert:
        return None

    def read(path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read TLS file {path!r}: {exc}") from None

    assert s.tls_key is not None
    ca = read(s.tls_client_ca) if s.tls_client_ca else None
    return grpc.ssl_server_credentials([(read(s.tls_key), read(s.tls_cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def start_server(s: ServerSettings) -> RunningServer:
    """Open the cache and start serving (returns once the port is bound and health is SERVING).

    Raises:
        ConfigError, TableConflictError, StoreLockedError, StoreError: the cache could not be opened.
        RuntimeError: the address could not be bound.
    """
    from prometheus_client import CollectorRegistry, Histogram, start_http_server

    from ..metrics import register_metrics

    # The servicer hands the library read-only tensors over request bytes; the cache never writes its inputs.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    config = s.cache_config()
    if s.torch_threads > 0:
        import torch

        torch.set_num_threads(s.torch_threads)
    rw = read_tokens(s.auth_token_files)
    ro = read_tokens(s.auth_readonly_token_files)
    env_token = os.environ.get("EMBCACHE_AUTH_TOKEN", "").strip()
    if env_token:
        rw.add(env_token)
    credentials = _credentials(s)
    cache = EmbeddingCache(config, s.tables)
    servicer: EmbeddingCacheServicer | None = None
    try:
        registry = CollectorRegistry()
        register_metrics(cache, registry)
        latency = Histogram("embcache_rpc_request_duration_seconds", "Time to serve a call, by method and status code",
                            ["method", "code"], registry=registry, buckets=_LATENCY_BUCKETS)

        def observe(method: str, code: str, seconds: float) -> None:
            latency.labels(method, code).observe(seconds)

        durability = Durability(cache, WriteLedger(config.path, s.sync), s.flush_every_updates,
                                s.flush_interval_seconds, s.sync)
        info = pb.ServerInfo(version=__version__, max_batch_keys=config.max_batch_keys,
                             reject_nonfinite=config.reject_nonfinite, max_receive_message_bytes=s.max_message_bytes,
                             max_send_message_bytes=s.max_message_bytes, device=str(cache.device),
                             durability=durability.describe(), max_lease_seconds=float(s.max_lease_seconds),
                             incarnation=durability.ledger.incarnation)
        gate = ShardGate(config.path, cache)
        gate.register_metrics(registry)
        register_process_metrics(registry, __version__)
        servicer = EmbeddingCacheServicer(cache, durability, info, observe,
                                          s.checkpoint_root or os.path.join(config.path, "checkpoints"),
                                          LeaseTable(cache, float(s.max_lease_seconds)), gate,
                                          StreamWatchdog(float(s.stream_idle_seconds)))
        workers = s.workers or max(8, 4 * (os.cpu_count() or 1))
        stream_pool = ThreadPoolExecutor(max_workers=s.stream_workers or max(2, workers // 2),
                                         thread_name_prefix="embcache-stream")
        health_pool = ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="embcache-health")
        pools = (stream_pool, health_pool)
        options = [("grpc.max_send_message_length", s.max_message_bytes),
                   ("grpc.max_receive_message_length", s.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # two servers must never share a port silently
        interceptors = [TokenAuth(rw, ro, observe)] if rw or ro else []
        server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embcache-rpc"),
                             options=options, interceptors=interceptors)
        add_to_server(servicer, server, stream_pool)
        health_servicer = health.HealthServicer()
        add_health(health_servicer, server, health_pool)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
        try:
            port = (server.add_secure_port(s.listen, credentials) if credentials is not None
                    else server.add_insecure_port(s.listen))
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {s.listen}: {exc}") from None
        if not port:
            raise RuntimeError(f"cannot listen on {s.listen}")
        httpd, metrics_port = None, -1
        if s.metrics_port >= 0:
            httpd, _ = start_http_server(s.metrics_port, addr=s.metrics_host, registry=registry)
            metrics_port = int(httpd.server_port)
        server.start()
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        if servicer is not None:
            servicer.close()
        cache.close()
        raise
    return RunningServer(server, cache, servicer, health_servicer, durability, port, metrics_port,
                         s.grace_seconds, s.drain_seconds, httpd, pools)


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
        if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints every thread's stack to stderr
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        running = start_server(s)
    except (ConfigError, ValueError, RuntimeError) as exc:
        print(f"embcache-server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    host = s.listen.rsplit(":", 1)[0]
    metrics = f", metrics http://{s.metrics_host}:{running.metrics_port}/metrics" if running.metrics_port >= 0 else ""
    tls = " (mutual TLS)" if s.tls_client_ca else " (TLS)" if s.tls_cert else ""
    print(f"embcache-server {__version__}: serving {sorted(running.cache.tables())} from "
          f"{running.cache.config.path!r} on {host}:{running.port}{tls}{metrics}; "
          f"durability: {running.durability.describe()}", flush=True)
    if s.port_file:
        _write_port_file(s.port_file, running)
    # Short waits: CPython runs signal handlers on the main thread only, and a signal the kernel hands
    # to another thread (any of gRPC's or the store's may take a process-directed SIGTERM) does not
    # wake a main thread blocked in a long wait. With one wait of an hour, SIGTERM was answered only
    # when something else woke it (seen in tests: a server still up 60 s after SIGTERM).
    while not stop:
        time.sleep(_SIGNAL_POLL_SECONDS)
    t0 = time.perf_counter()
    print("embcache-server: shutting down (NOT_SERVING, draining calls, flushing)", flush=True)
    running.shutdown()
    print(f"embcache-server: stopped cleanly in {time.perf_counter() - t0:.2f} s", flush=True)
    logging.shutdown()
    # Everything is flushed and closed: skip the interpreter's teardown of torch, numba and gRPC
    # (about a second that restarts and rolling updates would wait for).
    os._exit(0)
