"""Overload isolation: no client can take the threads that other clients and the health probes need.

gRPC's synchronous server runs every call on a thread of one pool, and a call holds its thread
until it ends. A client stream that sends one chunk and stalls therefore holds a thread for as
long as it stalls: eight of them held every thread of an 8-thread server, and other clients'
lookups and the health probe waited for their deadlines. Here:

* Health checks (``grpc.health.v1.Health/Check``) run on their own small pool
  (:data:`HEALTH_THREADS` threads): they are answered while every other thread is busy.
* Calls that stream (either way: the ``*Stream`` writes and keyset calls, Prefetch, EndPass,
  ResidentKeys) run on their own pool of ``stream_workers`` threads, so they never take the
  threads of unary calls (Lookup, ApplyGradients, Assign, ...); when all of them are busy, further
  streams wait in that pool's queue (holding no thread) until one is free.
* A client stream is cut once the server has waited ``idle_seconds`` for its next message
  (:class:`StreamWatchdog`): the call is cancelled (the client sees CANCELLED), nothing of it was
  applied (a stream's chunks are collected first and applied as one request), and its thread is
  free again.

Both pools use gRPC's ``experimental_thread_pool`` attribute of a method handler's behaviour.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from ..rpc.errors import StreamIdleError

__all__ = ["HEALTH_THREADS", "StreamWatchdog", "add_health", "on_pool"]

#: Threads reserved for health checks.
HEALTH_THREADS = 2


def on_pool(behavior: Callable[..., Any], pool: ThreadPoolExecutor) -> Callable[..., Any]:
    """``behavior`` (a method handler's function), run by gRPC on ``pool`` instead of the server's pool."""
    def run(request: Any, context: grpc.ServicerContext) -> Any:
        return behavior(request, context)
    run.experimental_thread_pool = pool  # type: ignore[attr-defined]  # read by grpc._server
    return run


_MALFORMED = object()  # not None: gRPC answers a deserializer's None, like its raise, with INTERNAL


def _parse_health(data: bytes) -> Any:
    """A HealthCheckRequest, or ``_MALFORMED`` for bytes that are none."""
    try:
        return health_pb2.HealthCheckRequest.FromString(data)
    except Exception:
        return _MALFORMED


def _valid(behavior: Callable[..., Any]) -> Callable[..., Any]:
    def run(request: Any, context: grpc.ServicerContext) -> Any:
        if request is _MALFORMED:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed HealthCheckRequest")
        return behavior(request, context)
    return run


def add_health(servicer: health.HealthServicer, server: grpc.Server, pool: ThreadPoolExecutor) -> None:
    """Register the health service with Check on ``pool`` (Watch, a long-lived stream, stays on the server's).

    Malformed request bytes get INVALID_ARGUMENT, as on the cache service.
    """
    handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(
            on_pool(_valid(servicer.Check), pool), request_deserializer=_parse_health,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            _valid(servicer.Watch), request_deserializer=_parse_health,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
    }
    name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


class _Watched:
    __slots__ = ("context", "cut", "method", "since", "waiting")

    def __init__(self, context: grpc.ServicerContext, method: str) -> None:
        self.context, self.method = context, method
        self.since = time.monotonic()
        self.waiting = False
        self.cut = False


class StreamWatchdog:
    """Cancels client streams that keep the server waiting for their next message longer than ``idle_seconds``.

    Only the time the handler waits for the client counts: time the server spends on the
    chunks it has does not. One background thread checks every stream a few times per
    ``idle_seconds`` (at most once a second).
    """

    def __init__(self, idle_seconds: float) -> None:
        if not idle_seconds > 0:
            raise ValueError(f"idle_seconds must be > 0, got {idle_seconds}")
        self.idle_seconds = float(idle_seconds)
        self._tick = min(1.0, self.idle_seconds / 4)
        self._lock = threading.Lock()
        self._streams: set[_Watched] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Iterator[Any]:
        """``requests``, cut (StreamIdleError, the call cancelled) after ``idle_seconds`` without a message."""
        entry = _Watched(context, method)
        with self._lock:
            self._streams.add(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="embcache-stream-watchdog", daemon=True)
                self._thread.start()
        try:
            it = iter(requests)
            while True:
                entry.since, entry.waiting = time.monotonic(), True
                try:
                    request = next(it)
                except StopIteration:
                    # gRPC may end the requests of a call it cancelled as if the client had closed them:
                    # a cut stream must not look complete, or its chunks would be applied.
                    if entry.cut:
                        raise self._idle_error(method) from None
                    return
                except grpc.RpcError:  # the call was cancelled: by us, or the client went away
                    if entry.cut:
                        raise self._idle_error(method) from None
                    raise
                finally:
                    entry.waiting = False
                yield request
        finally:
            with self._lock:
                self._streams.discard(entry)

    def _idle_error(self, method: str) -> StreamIdleError:
        return StreamIdleError(f"{method}: no message from the client for {self.idle_seconds:g} s "
                               "(--stream-idle-seconds); the stream was cut and nothing of it was applied")

    def _loop(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            with self._lock:
                idle = [e for e in self._streams if e.waiting and not e.cut and now - e.since > self.idle_seconds]
                for e in idle:
                    e.cut = True
            for e in idle:
                e.context.cancel()

    def close(self) -> None:
        """Stop the background thread (streams still running are no longer cut)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
