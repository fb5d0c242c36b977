"""The server's RPC metrics: embcache's own histogram and the grpc-ecosystem names, from one count.

Every call of ``embcache.rpc.v1.EmbeddingCacheService`` is counted once, refused and failed calls
included (a malformed request, a missing or read-only token, a server shutting down, an error of
the library, a stream the client cancelled). Health checks (``grpc.health.v1.Health``) and
reflection are not counted, in either family.

Exported (one collector, so one lock-held snapshot per scrape: the families never disagree):

* ``embcache_rpc_request_duration_seconds{method,code}``: histogram of the time to serve a call.
* the names of go-grpc-prometheus / grpc-ecosystem's ``grpc_server_*``, with the labels
  ``grpc_type`` (``unary``, ``client_stream``, ``server_stream``, ``bidi_stream``),
  ``grpc_service`` (``embcache.rpc.v1.EmbeddingCacheService``) and ``grpc_method``:

  - ``grpc_server_started_total``: calls started (counted as the handler begins, or as the
    token check refuses the call);
  - ``grpc_server_handled_total{...,grpc_code}``: calls ended, by status code name (``OK``,
    ``NOT_FOUND``, ...); a stream is counted when it ends. Equal, per method and code, to
    ``embcache_rpc_request_duration_seconds_count{method,code}``;
  - ``grpc_server_handling_seconds``: histogram of the same durations, all codes together (its
    ``_count`` per method is the sum of ``handled_total`` over the codes);
  - ``grpc_server_msg_received_total``: request messages: 1 per call with a single request, each
    message read of a request stream;
  - ``grpc_server_msg_sent_total``: reply messages: 1 per call with a single reply that ended OK,
    each message of a reply stream that gRPC took to send.

``started - handled`` (summed over codes) is the calls in flight; every snapshot has
``started >= handled``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["GRPC_TYPES", "RpcMetrics"]

#: ``grpc_type`` by (client streams, server streams), as go-grpc-prometheus names them.
GRPC_TYPES = {(False, False): "unary", (True, False): "client_stream", (False, True): "server_stream",
              (True, True): "bidi_stream"}
_LABELS = ["grpc_type", "grpc_service", "grpc_method"]


class RpcMetrics:
    """Counts the calls of one gRPC service; a Prometheus collector (``registry.register(metrics)``).

    Args:
        service: the service's descriptor (its methods' streaming kinds give ``grpc_type``).
        buckets: the histograms' upper bounds in seconds (sorted, finite; ``+Inf`` is added).
    """

    def __init__(self, service: Any, buckets: Sequence[float]) -> None:
        self.service: str = service.full_name
        self._types = {m.name: GRPC_TYPES[(bool(m.client_streaming), bool(m.server_streaming))]
                       for m in service.methods}
        self._bounds = tuple(float(b) for b in buckets)
        if list(self._bounds) != sorted(set(self._bounds)) or not all(map(math.isfinite, self._bounds)):
            raise ValueError(f"buckets must be sorted, distinct and finite, got {buckets}")
        self._lock = threading.Lock()
        self._started = dict.fromkeys(self._types, 0)
        self._received = dict.fromkeys(self._types, 0)
        self._sent = dict.fromkeys(self._types, 0)
        # (method, code) -> [count per bucket (not cumulative; the last is +Inf's), sum of seconds]
        self._handled: dict[tuple[str, str], tuple[list[int], list[float]]] = {}

    def grpc_type(self, method: str) -> str:
        """``grpc_type`` of ``method`` (a name not in the service: ``unary``)."""
        return self._types.get(method, "unary")

    def started(self, method: str) -> None:
        """A call began; with a single request, that request was received."""
        kind = self.grpc_type(method)
        with self._lock:
            self._started[method] = self._started.get(method, 0) + 1
            if kind in ("unary", "server_stream"):
                self._received[method] = self._received.get(method, 0) + 1

    def received(self, method: str) -> None:
        """A message of a request stream was read."""
        with self._lock:
            self._received[method] = self._received.get(method, 0) + 1

    def sent(self, method: str) -> None:
        """A message of a reply stream was taken by gRPC to send."""
        with self._lock:
            self._sent[method] = self._sent.get(method, 0) + 1

    def handled(self, method: str, code: str, seconds: float) -> None:
        """A call ended with status ``code`` (its name, e.g. ``OK``) after ``seconds`` (a single reply if OK: sent)."""
        single_reply = self.grpc_type(method) in ("unary", "client_stream")
        i = bisect.bisect_left(self._bounds, seconds)  # le: the first bound >= seconds
        with self._lock:
            entry = self._handled.get((method, code))
            if entry is None:
                entry = self._handled[(method, code)] = ([0] * (len(self._bounds) + 1), [0.0])
            entry[0][i] += 1
            entry[1][0] += seconds
            if single_reply and code == "OK":
                self._sent[method] = self._sent.get(method, 0) + 1

    # ------------------------------------------------------------------ Prometheus collector
    def _labels(self, method: str) -> list[str]:
        return [self.grpc_type(method), self.service, method]

    def _buckets(self, counts: Sequence[int]) -> list[tuple[str, float]]:
        from prometheus_client.utils import floatToGoString

        out, total = [], 0
        for bound, n in zip((*self._bounds, math.inf), counts, strict=True):
            total += n
            out.append((floatToGoString(bound), float(total)))
        return out

    def collect(self) -> Iterator[Any]:
        """Every family, from one snapshot taken under the lock."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        with self._lock:
            started, received, sent = dict(self._started), dict(self._received), dict(self._sent)
            handled = {k: (list(c), s[0]) for k, (c, s) in self._handled.items()}
        own = HistogramMetricFamily("embcache_rpc_request_duration_seconds",
                                    "Time to serve a call, by method and status code", labels=["method", "code"])
        codes = CounterMetricFamily("grpc_server_handled", "Total number of RPCs completed on the server, "
                                    "regardless of success or failure", labels=[*_LABELS, "grpc_code"])
        per_method: dict[str, tuple[list[int], float]] = {}
        for (method, code), (counts, seconds) in sorted(handled.items()):
            own.add_metric([method, code], self._buckets(counts), seconds)
            codes.add_metric([*self._labels(method), code], float(sum(counts)))
            merged = per_method.setdefault(method, ([0] * len(counts), 0.0))
            per_method[method] = ([a + b for a, b in zip(merged[0], counts, strict=True)], merged[1] + seconds)
        seconds_hist = HistogramMetricFamily(
            "grpc_server_handling_seconds",
            "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server",
            labels=_LABELS)
        for method, (counts, seconds) in sorted(per_method.items()):
            seconds_hist.add_metric(self._labels(method), self._buckets(counts), seconds)
        yield own
        for name, doc, values in (
                ("grpc_server_started", "Total number of RPCs started on the server", started),
                ("grpc_server_msg_received", "Total number of RPC stream messages received on the server", received),
                ("grpc_server_msg_sent", "Total number of gRPC stream messages sent by the server", sent)):
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            for method, n in sorted(values.items()):
                family.add_metric(self._labels(method), float(n))
            yield family
        yield codes
        yield seconds_hist
