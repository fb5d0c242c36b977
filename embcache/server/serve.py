"""Starting and stopping a server: :func:`start_server` opens the cache and serves it,
:class:`RunningServer` stops it gracefully.

Start-up builds, from :class:`~embcache.server.settings.ServerSettings`: the cache, its write
ledger and flush policy, the servicer with its batch leases, shard gate and stream watchdog, the
thread pools (unary calls, streams, health checks), the token check, TLS, health and
reflection, and the Prometheus metrics server. The shutdown's order (NOT_SERVING, drain, stop
listening, let calls finish, flush, close) is described in ``embcache-server --help``.
"""

from __future__ import annotations

import faulthandler
import glob
import logging
import os
import shutil
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from .. import __version__
from ..cache import EmbeddingCache
from ..config import CacheConfig, TableConfig
from ..engine.durability import PathLock
from ..errors import ConfigError, StoreLockedError
from ..rpc.v1 import embcache_pb2 as pb
from .auth import TokenAuth, read_tokens
from .durability import Durability
from .handlers import SERVICE_NAME, add_to_server
from .leases import LeaseTable
from .ledger import WriteLedger
from .overload import HEALTH_THREADS, StreamWatchdog, add_health
from .procmetrics import register_process_metrics
from .rpcmetrics import RpcMetrics
from .servicer import EmbeddingCacheServicer
from .serving import ReadOnlyGuard, ServedModel, register_serving_metrics, serving_tables
from .settings import ServerSettings
from .sharding import ShardGate
from .stacks import dump_stacks

__all__ = ["RunningServer", "start_server"]

log = logging.getLogger("embcache.server")
# How long shutdown waits, past the grace period, for gRPC to report every call ended.
_STOP_SLACK_SECONDS = 10.0
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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
    serving: ServedModel | None = None  # serving mode (--serve): the export served

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
            # gRPC cancels what still runs after the grace period and reports the stop once its core
            # has cancelled the calls, whether or not their handler threads have returned (a handler
            # waiting for a table lock is still waiting): the flush below takes the table locks, so
            # a handler inside the cache finishes first. The wait is bounded for a gRPC whose own
            # stop never completes (tests/test_server_stacks.py).
            if not self.server.stop(self.grace_seconds).wait(self.grace_seconds + _STOP_SLACK_SECONDS):
                log.warning("shutdown: gRPC calls still not finished %.0f s after the grace period; flushing "
                            "anyway (their stacks follow on stderr)", _STOP_SLACK_SECONDS)
                dump_stacks()  # every thread, named: faulthandler's dump stops at 100, fewer than the gRPC workers
            log.info("shutdown: calls finished after %.2f s", time.perf_counter() - t0)
            if self.serving is not None:
                self.serving.stop()
            self.durability.stop()
            for pool in self._pools:  # the stream and health threads: their calls ended with the server
                pool.shutdown(wait=False, cancel_futures=True)
            self.servicer.close()  # cancels the batch leases: nothing pinned is left to the cache's close
            self.cache.close()
            self.durability.ledger.close()  # every write this process acknowledged is durable: say so on disk
            if self.serving is not None:  # the serving store is the export's copy: nothing to keep
                shutil.rmtree(self.cache.config.path, ignore_errors=True)
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
    from prometheus_client import CollectorRegistry, start_http_server

    from ..metrics import register_metrics

    # The servicer hands the library read-only tensors over request bytes; the cache never writes its inputs.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    config = s.cache_config()
    tables = s.tables
    if s.serve:
        config, tables = _serving_cache(s, config)
    if s.torch_threads > 0:
        import torch

        torch.set_num_threads(s.torch_threads)
    rw = read_tokens(s.auth_token_files)
    ro = read_tokens(s.auth_readonly_token_files)
    env_token = os.environ.get("EMBCACHE_AUTH_TOKEN", "").strip()
    if env_token:
        rw.add(env_token)
    credentials = _credentials(s)
    cache = EmbeddingCache(config, tables)
    servicer: EmbeddingCacheServicer | None = None
    serving: ServedModel | None = None
    try:
        registry = CollectorRegistry()
        register_metrics(cache, registry)
        if s.serve:
            serving = ServedModel(s.serve, cache, s.unknown_rows, float(s.follow_interval_seconds))
            serving.load()
        register_serving_metrics(registry, serving)
        # embcache_rpc_request_duration_seconds and the grpc_server_* names, from one count
        rpc_metrics = RpcMetrics(pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"], _LATENCY_BUCKETS)
        registry.register(rpc_metrics)
        durability = Durability(cache, WriteLedger(config.path, s.sync), s.flush_every_updates,
                                s.flush_interval_seconds, s.sync)
        info = pb.ServerInfo(version=__version__, max_batch_keys=config.max_batch_keys,
                             reject_nonfinite=config.reject_nonfinite, max_receive_message_bytes=s.max_message_bytes,
                             max_send_message_bytes=s.max_message_bytes, device=str(cache.device),
                             durability=durability.describe(), max_lease_seconds=float(s.max_lease_seconds),
                             incarnation=durability.ledger.incarnation,
                             serving_directory=s.serve or "")
        gate = ShardGate(config.path, cache)
        gate.register_metrics(registry)
        register_process_metrics(registry, __version__)
        servicer = EmbeddingCacheServicer(cache, durability, info, rpc_metrics,
                                          s.checkpoint_root or os.path.join(config.path, "checkpoints"),
                                          LeaseTable(cache, float(s.max_lease_seconds)), gate,
                                          StreamWatchdog(float(s.stream_idle_seconds)), serving)
        workers = s.workers or max(8, 4 * (os.cpu_count() or 1))
        stream_pool = ThreadPoolExecutor(max_workers=s.stream_workers or max(2, workers // 2),
                                         thread_name_prefix="embcache-stream")
        health_pool = ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="embcache-health")
        pools = (stream_pool, health_pool)
        options = [("grpc.max_send_message_length", s.max_message_bytes),
                   ("grpc.max_receive_message_length", s.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # two servers must never share a port silently
        interceptors: list[grpc.ServerInterceptor] = [TokenAuth(rw, ro, rpc_metrics)] if rw or ro else []
        if serving is not None:  # after the token check: a caller without a valid token learns nothing
            interceptors.append(ReadOnlyGuard(serving, rpc_metrics))
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
        if serving is not None and s.follow:
            serving.follow()
    except BaseException:
        if serving is not None:
            serving.stop()
        if servicer is not None:
            servicer.close()
        cache.close()
        if s.serve:
            shutil.rmtree(config.path, ignore_errors=True)
        raise
    return RunningServer(server, cache, servicer, health_servicer, durability, port, metrics_port,
                         s.grace_seconds, s.drain_seconds, httpd, pools, serving=serving)


def _serving_cache(s: ServerSettings, config: CacheConfig) -> tuple[CacheConfig, list[TableConfig]]:
    """Serving mode: the cache's config (a fresh store under ``config.path``, lookups creating no
    rows) and tables (the export's, weights only).

    Stores that earlier serving processes left under the path (killed before they removed them)
    are removed first, when no process holds them.

    Raises:
        ConfigError: the export directory is missing. ExportFormatError: it holds no complete version.
    """
    assert s.serve is not None
    if not os.path.isdir(s.serve):
        raise ConfigError(f"--serve {s.serve!r}: no such directory")
    tables = serving_tables(s.serve, s.unknown_rows)
    os.makedirs(config.path, exist_ok=True)
    for stale in glob.glob(os.path.join(config.path, "serving-*")):
        try:
            PathLock(stale).release()
        except (StoreLockedError, OSError):
            continue  # another serving process's store
        shutil.rmtree(stale, ignore_errors=True)
    path = tempfile.mkdtemp(prefix="serving-", dir=config.path)
    options = dict(config.store_options)
    if config.store == "rocksdb":  # a copy thrown away at every start: no WAL (a version's switch writes half as long)
        options.setdefault("write_ahead_log", False)
    return replace(config, path=path, lookups_create_rows=False, store_options=options), tables
