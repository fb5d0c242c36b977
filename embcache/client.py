"""embcache.Client: the methods of EmbeddingCache, served by one embcache-server or a fleet of shards.

    from embcache import Client
    with Client(["10.0.0.1:50051", "10.0.0.2:50051"], timeout=30) as cache:
        rows = cache.lookup("user", keys)               # float32 [n, dim] on the CPU
        cache.apply_gradients("user", keys, grads)

Keys are spread over the shards by a consistent hash (a 64-bit mix of the key placed on a ring
of virtual nodes per shard: adding a shard moves about 1/N of the keys). A call sends one
request per shard carrying every table (``lookup_many`` and ``apply_gradients_many`` cost one
round trip per step), all shards in parallel. Batches beyond the message size limit are split:
lookups into several requests, writes into a client stream that the server applies as one
request (atomic per table and shard).

Deadlines: every call has one (``timeout``, or ``long_timeout`` for passes, flush and
checkpoint); by default a call waits for a shard that is down or restarting until its deadline
(``wait_for_ready``), which never sends a request twice. Retries: a call that fails with
UNAVAILABLE (or CANCELLED by a server stopping as it arrived) is retried with exponential backoff,
within its deadline, only when it is idempotent: ``lookup`` (idempotent for the values it returns,
though the retried attempt counts its accesses again in the server's statistics and placement),
``tables``, ``create_table``, ``flush``, ``stats``. Writes (``apply_gradients``, ``assign``),
checkpoints and pass calls are never resent, unless the server said it refused them before they
had any effect (UNAVAILABLE with ``embcache-not-applied: 1``: a server draining at shutdown).
Only the failed shards' calls are resent; each resend is logged (logger ``embcache.client``, INFO).

Shards from DNS (``"dns:///name:port"``) are resolved when the client is made; ``expected_shards``
makes it wait until the name gives that many, and :meth:`Client.refresh_shards` resolves again.

Errors: the server's typed errors come back as the same :mod:`embcache.errors` types; failures
without one are :class:`~embcache.rpc.errors.RemoteError` subclasses (UnavailableError,
DeadlineExceededError, UnauthenticatedError, PermissionDeniedError). Input that is wrong
whatever the server (key dtype, gradient shape, NaN) is refused here before anything is sent,
so a multi-shard write never half-applies bad input; a shard failing for another reason (down,
disk full) can leave the other shards' part applied.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from .config import TableConfig
from .errors import (
    CacheClosedError,
    ConfigError,
    EmbcacheError,
    InvalidGradientError,
    InvalidRowsError,
    NonFiniteGradientError,
    UnknownTableError,
)
from .keys import as_key_tensor
from .keyset import Keyset, as_keysets
from .rpc import codec, wire
from .rpc.errors import (
    DeadlineExceededError,
    PermissionDeniedError,
    RemoteError,
    UnauthenticatedError,
    UnavailableError,
    error_from_rpc,
    not_applied,
)
from .rpc.v1 import embcache_pb2 as pb
from .rpc.v1 import embcache_pb2_grpc as pb_grpc

__all__ = [
    "Client",
    "DeadlineExceededError",
    "HashRing",
    "PermissionDeniedError",
    "RemoteError",
    "RemoteFuture",
    "UnauthenticatedError",
    "UnavailableError",
]

log = logging.getLogger("embcache.client")

_MESSAGE_MARGIN = 1 << 16  # bytes kept free in each message for framing and table names
_U64 = np.uint64


def mix64(keys: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over int64 keys (vectorized): a 64-bit hash that spreads consecutive ids."""
    z = keys.astype(np.int64, copy=False).view(np.uint64) + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


class HashRing:
    """Consistent hashing of int64 keys onto named shards, with virtual nodes.

    Each shard owns ``vnodes`` points on a 64-bit ring (hashes of ``"name#i"``); a key belongs to
    the first point at or after its :func:`mix64` hash. Adding a shard to N moves about 1/(N+1)
    of the keys, all of them to the new shard.

    Args:
        names: shard names (their identity on the ring: keep them stable across restarts).
        vnodes: points per shard (default 256: shard loads within a few percent).

    Raises:
        ValueError: no names, duplicates, or ``vnodes < 1``.
    """

    def __init__(self, names: Sequence[str], vnodes: int = 256) -> None:
        if not names or len(set(names)) != len(names) or vnodes < 1:
            raise ValueError(f"HashRing needs unique shard names and vnodes >= 1, got {list(names)}, {vnodes}")
        self.names = list(names)
        points = np.array([int.from_bytes(hashlib.blake2b(f"{name}#{i}".encode(), digest_size=8).digest(), "little")
                           for name in names for i in range(vnodes)], dtype=np.uint64)
        owners = np.repeat(np.arange(len(names), dtype=np.int64), vnodes)
        order = np.argsort(points, kind="stable")
        self._points, self._owners = points[order], owners[order]

    def owners(self, keys: np.ndarray) -> np.ndarray:
        """Shard index (int64 [n]) of each key (int64 [n])."""
        if len(self.names) == 1:
            return np.zeros(keys.shape[0], dtype=np.int64)
        idx = np.searchsorted(self._points, mix64(keys), side="left")
        idx[idx == self._points.shape[0]] = 0  # past the last point: wrap to the first
        return self._owners[idx]

    def split(self, keys: np.ndarray) -> list[np.ndarray]:
        """Positions (int64, ascending) of the keys each shard owns, one array per shard."""
        owners = self.owners(keys)
        order = np.argsort(owners, kind="stable")
        bounds = np.cumsum(np.bincount(owners, minlength=len(self.names)))[:-1]
        return np.split(order, bounds)


class _Done:
    """A finished call in the shape of a grpc future: ``result()`` returns the reply or raises its error."""

    def __init__(self, outcome: Any) -> None:
        self._outcome = outcome

    def result(self) -> Any:
        if isinstance(self._outcome, grpc.RpcError):
            raise self._outcome
        return self._outcome


class RemoteFuture(Future):  # type: ignore[type-arg]
    """A background job on the servers (prefetch staging, end-of-pass write-back); ``cancel()`` stops it."""

    def __init__(self) -> None:
        super().__init__()
        self._calls: list[Any] = []

    def cancel(self) -> bool:
        """Cancel the calls (the servers stop staging and release its rows); True unless already finished."""
        for call in self._calls:
            call.cancel()
        return super().cancel()


@dataclass
class _Shard:
    name: str
    address: str
    channel: grpc.Channel
    stub: pb_grpc.EmbeddingCacheServiceStub
    raw: dict[str, Any]  # the hot calls with bytes in and out (encoded by embcache.rpc.wire)


def _identity(data: bytes) -> bytes:
    return data


_SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].full_name


def _raw_calls(channel: grpc.Channel) -> dict[str, Any]:
    """Lookup (bytes both ways), ApplyGradients and Assign (bytes out): no copies through generated classes."""
    return {
        "Lookup": channel.unary_unary(f"/{_SERVICE}/Lookup", request_serializer=_identity,
                                      response_deserializer=_identity),
        "ApplyGradients": channel.unary_unary(f"/{_SERVICE}/ApplyGradients", request_serializer=_identity,
                                              response_deserializer=pb.ApplyGradientsResponse.FromString),
        "Assign": channel.unary_unary(f"/{_SERVICE}/Assign", request_serializer=_identity,
                                      response_deserializer=pb.AssignResponse.FromString),
    }


@dataclass(frozen=True)
class _Topology:
    """The shards and the ring that maps keys onto them; replaced as a whole by :meth:`Client.refresh_shards`."""

    shards: list[_Shard]
    ring: HashRing


@dataclass
class _Part:
    """One table's slice in one request: keys[start:end] of the shard's positions."""

    table: str
    positions: np.ndarray | None  # positions in the caller's batch; None: the whole batch, in order
    keys: np.ndarray
    values: np.ndarray | None


def _read_pem(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def _as_keys(keys: Any, max_batch_keys: int) -> np.ndarray:
    """int64 [n] numpy keys, checked like EmbeddingCache checks them."""
    return as_key_tensor(keys, max_batch_keys).cpu().numpy()


def _as_values(what: str, values: Any, n: int, dim: int,
               error: type[InvalidGradientError] | type[InvalidRowsError]) -> np.ndarray:
    """float32 [n, dim] numpy values, checked like EmbeddingCache checks them."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if not isinstance(values, torch.Tensor):
        raise error(f"{what} must be a float tensor of shape [{n}, {dim}], got {type(values).__name__}")
    if not values.dtype.is_floating_point:
        raise error(f"{what} must be floating point (float32 preferred), got dtype {values.dtype}")
    if tuple(values.shape) != (n, dim):
        raise error(f"{what} must have shape [{n}, {dim}] (one row per key, dim {dim}), got {tuple(values.shape)}")
    return values.detach().to("cpu", torch.float32).contiguous().numpy()


def _finite(values: np.ndarray) -> bool:
    # torch's sum is about twice as fast as numpy's here; a sum that overflows is checked element-wise
    return bool(torch.isfinite(torch.from_numpy(values).sum())) or bool(np.isfinite(values).all())


def _merge_stats(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum per-shard stats (same dict shape); flags are OR-ed, miss-ratio estimates averaged by lookups."""
    out: dict[str, Any] = {}
    for table in sorted({t for s in shards for t in s}):
        parts = [s[table] for s in shards if table in s]
        merged = _merge_values([{k: v for k, v in p.items() if k != "mrc"} for p in parts])
        mrcs = [(float(p.get("lookups", 0)), p["mrc"]) for p in parts if p.get("mrc")]
        if mrcs:
            total = sum(w for w, _ in mrcs)
            merged["mrc"] = _weighted([(w / total if total else 1 / len(mrcs), m) for w, m in mrcs])
        elif parts and "mrc" in parts[0]:
            merged["mrc"] = None
        out[table] = merged
    return out


def _merge_values(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        keys = [k for v in values for k in v]
        return {k: _merge_values([v[k] for v in values if k in v]) for k in dict.fromkeys(keys)}
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, (int, float)):
        return sum(values)
    return first


def _weighted(items: list[tuple[float, Any]]) -> Any:
    first = items[0][1]
    if isinstance(first, dict):
        return {k: _weighted([(w, m[k]) for w, m in items if k in m]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return float(sum(w * v for w, v in items))
    return first


#: A name resolver with getaddrinfo's shape:
#: ``resolver(host, port, type=socket.SOCK_STREAM)`` -> ``[(family, type, proto, canonname, sockaddr), ...]``.
Resolver = Callable[..., Sequence[tuple[Any, ...]]]


def resolve_shards(target: str, resolver: Resolver = socket.getaddrinfo) -> dict[str, str]:
    """The shards behind a DNS name, e.g. a Kubernetes headless Service: ``{shard name: "host:port"}``.

    Args:
        target: ``"dns:///name:port"`` (or ``"name:port"``). Every address the name resolves to
            is a shard, named by its reverse-DNS name: for a StatefulSet behind a headless
            Service that is the pod's stable ``embcache-0.embcache.<ns>.svc.cluster.local``, so
            a shard keeps its place on the hash ring when its pod comes back with another IP.
            An address without a reverse name is named by its IP; addresses that would share a
            name (several ports of one host) are named by their ``ip:port``.
        resolver: a callable with the shape of :func:`socket.getaddrinfo` (the default), called
            as ``resolver(host, port, type=socket.SOCK_STREAM)``; each result's sockaddr gives the
            address (its port too, so a resolver may return SRV-style ports).

    Raises:
        ValueError: no port, or the name does not resolve.
    """
    hostport = target.removeprefix("dns:///")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected 'dns:///name:port', got {target!r}")
    try:
        infos = resolver(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{host!r} does not resolve: {exc}") from None
    if not infos:
        raise ValueError(f"{host!r} does not resolve: no addresses")
    named: list[tuple[str, str]] = []
    for ip, p in sorted({(str(info[4][0]), int(info[4][1])) for info in infos}):
        try:
            name = socket.gethostbyaddr(ip)[0]
        except OSError:
            name = ip
        named.append((name, f"[{ip}]:{p}" if ":" in ip else f"{ip}:{p}"))
    counts = {n: sum(1 for m, _ in named if m == n) for n, _ in named}
    return {name if counts[name] == 1 else address: address for name, address in named}


class Client:
    """The methods of :class:`~embcache.EmbeddingCache`, served by ``embcache-server`` shards.

    Args:
        servers: ``"host:port"``, a list of them, or ``{shard name: "host:port"}``. Names place
            the shards on the hash ring (for a list, the address is the name): keep them stable
            when a shard moves, or its keys move with it. ``"dns:///name:port"`` takes every
            address a DNS name resolves to (a Kubernetes headless Service), each named by its
            reverse-DNS name (:func:`resolve_shards`).
        timeout: deadline of a data call in seconds, retries included (default 60).
        long_timeout: deadline of pass, flush and checkpoint calls (default 3600).
        connect_timeout: how long the constructor waits for every shard (default 30).
        retries: resends of an idempotent call after UNAVAILABLE (default 5; backoff from
            ``backoff`` seconds, doubling, at most ``max_backoff``, with jitter).
        wait_for_ready: a call to a shard that is down waits (until its deadline) for it to come
            back instead of failing at once (default True).
        token: bearer token sent as ``authorization: Bearer <token>``.
        tls_ca: PEM (bytes, or a file path) of the CA that signed the servers' certificates;
            setting it (or ``tls_cert``) switches to TLS.
        tls_cert, tls_key: client certificate and key (PEM bytes or paths) for mutual TLS.
        tls_server_name: name to check the server certificates against, when it differs from the host.
        max_message_bytes: largest message this client sends or receives (default 64 MiB; the
            servers' own limits are honoured too).
        vnodes: virtual nodes per shard on the ring (default 256).
        resolver: for a ``dns:///`` target, the name resolver, with the shape of
            :func:`socket.getaddrinfo` (the default; see :func:`resolve_shards`).
        expected_shards: for a ``dns:///`` target, the number of shards the name must resolve to:
            the constructor resolves again (every 0.2 s, up to ``connect_timeout``) until it does,
            and :meth:`refresh_shards` keeps the current shards while it does not. Without it
            the shards are whatever the name gives at that moment, and the key-to-shard map
            with them. For a list or mapping, a different count is a ValueError.

    DNS targets are resolved when the client is made, not on every call; :meth:`refresh_shards`
    resolves again (e.g. after a shard was added) and moves keys to the new map.

    Raises:
        UnavailableError, DeadlineExceededError: a shard could not be reached within ``connect_timeout``,
            or a ``dns:///`` name did not resolve to ``expected_shards`` addresses in that time.
        UnauthenticatedError, PermissionDeniedError: the servers refused the credentials.
        ValueError: a malformed target, a name that does not resolve, or a list of the wrong length.
    """

    def __init__(self, servers: str | Sequence[str] | Mapping[str, str], *, timeout: float = 60.0,
                 long_timeout: float = 3600.0, connect_timeout: float = 30.0, retries: int = 5,
                 backoff: float = 0.05, max_backoff: float = 2.0, wait_for_ready: bool = True,
                 token: str | None = None, tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None, tls_server_name: str | None = None,
                 max_message_bytes: int = 64 << 20, vnodes: int = 256, resolver: Resolver = socket.getaddrinfo,
                 expected_shards: int | None = None) -> None:
        if expected_shards is not None and expected_shards < 1:
            raise ValueError(f"expected_shards must be >= 1, got {expected_shards}")
        self._dns_target = servers if isinstance(servers, str) and servers.startswith("dns:///") else None
        self._resolver, self._expected_shards = resolver, expected_shards
        if self._dns_target is not None:
            servers = self._resolve(time.monotonic() + connect_timeout)
        elif isinstance(servers, str):
            servers = [servers]
        named = dict(servers) if isinstance(servers, Mapping) else {a: a for a in servers}
        if not named or len(named) != len(servers):
            raise ValueError(f"servers must be one or more distinct addresses, got {servers!r}")
        if expected_shards is not None and len(named) != expected_shards:
            raise ValueError(f"expected {expected_shards} shards, got {len(named)}: {list(named)}")
        self._timeout, self._long_timeout = timeout, long_timeout
        self._retries, self._backoff, self._max_backoff = retries, backoff, max_backoff
        self._wait = wait_for_ready
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._options: list[tuple[str, Any]] = [("grpc.max_send_message_length", max_message_bytes),
                                                ("grpc.max_receive_message_length", max_message_bytes)]
        self._creds = None
        if tls_ca is not None or tls_cert is not None:
            self._creds = grpc.ssl_channel_credentials(root_certificates=_read_pem(tls_ca),
                                                       private_key=_read_pem(tls_key),
                                                       certificate_chain=_read_pem(tls_cert))
            if tls_server_name:
                self._options.append(("grpc.ssl_target_name_override", tls_server_name))
        self._vnodes = vnodes
        self._topo = _Topology([self._connect(name, address) for name, address in named.items()],
                               HashRing(list(named), vnodes))
        self._retired: list[_Shard] = []  # shards a refresh removed: closed with the client
        self._lock = threading.Lock()
        self._tables: dict[str, TableConfig] = {}
        self._max_message = max_message_bytes
        self._max_batch_keys = 1 << 24
        self._reject_nonfinite = True
        self._closed = False
        try:
            self._refresh_tables(timeout=connect_timeout)
        except BaseException:
            self.close()
            raise

    def _connect(self, name: str, address: str) -> _Shard:
        channel = (grpc.secure_channel(address, self._creds, options=self._options) if self._creds is not None
                   else grpc.insecure_channel(address, options=self._options))
        return _Shard(name, address, channel, pb_grpc.EmbeddingCacheServiceStub(channel), _raw_calls(channel))

    def _resolve(self, deadline: float) -> dict[str, str]:
        """Resolve the dns:/// target, again every 0.2 s until it gives ``expected_shards`` addresses."""
        assert self._dns_target is not None
        while True:
            shards = resolve_shards(self._dns_target, self._resolver)
            if self._expected_shards is None or len(shards) == self._expected_shards:
                return shards
            if time.monotonic() + 0.2 >= deadline:
                raise UnavailableError(f"{self._dns_target} resolves to {len(shards)} addresses "
                                       f"({sorted(shards.values())}), expected {self._expected_shards}",
                                       grpc.StatusCode.UNAVAILABLE)
            time.sleep(0.2)

    def refresh_shards(self) -> bool:
        """Resolve the ``dns:///`` target again and use the shards it gives now.

        Shards still present keep their channels; new ones are connected and given every table
        the others have; removed ones stop getting calls (their channels close with the client).
        Keys then follow the new ring: about 1/N of the keys move per shard added or removed, and
        their rows stay on the shard that had them (nothing is migrated). Calls already running
        finish on the old shards.

        Returns:
            True when the shards changed.

        Raises:
            ValueError: the client was not made from a ``dns:///`` target, or the name does not resolve.
            UnavailableError: the name does not resolve to ``expected_shards`` addresses now
                (the current shards are kept).
        """
        self._check_open()
        if self._dns_target is None:
            raise ValueError("refresh_shards() needs a client made from a 'dns:///name:port' target")
        named = self._resolve(time.monotonic())
        with self._lock:
            old = self._topo
            if {s.name: s.address for s in old.shards} == named:
                return False
            kept = {(s.name, s.address): s for s in old.shards}
            shards = [kept.pop((n, a)) if (n, a) in kept else self._connect(n, a) for n, a in named.items()]
            self._retired.extend(kept.values())
            self._topo = _Topology(shards, HashRing(list(named), self._vnodes))
        log.info("shards of %s changed: %s -> %s", self._dns_target, sorted(s.address for s in old.shards),
                 sorted(named.values()))
        # a new shard gets the tables the others have (those made by create_table are on the old shards only)
        replies = self._fanout([(s, "ListTables", pb.ListTablesRequest()) for s in shards], idempotent=True)
        tables = {t.name: t for r in replies for t in r.tables}
        missing = [(s, "CreateTable", pb.CreateTableRequest(table=t)) for s, r in zip(shards, replies, strict=True)
                   for name, t in tables.items() if name not in {have.name for have in r.tables}]
        if missing:
            self._fanout(missing, idempotent=True)
        self._refresh_tables()
        return True

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the channels (the servers keep running). Idempotent."""
        self._closed = True
        for shard in [*self._topo.shards, *self._retired]:
            shard.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def device(self) -> torch.device:
        """Where returned rows live: the CPU."""
        return torch.device("cpu")

    @property
    def servers(self) -> dict[str, str]:
        """Shard name -> address."""
        return {s.name: s.address for s in self._topo.shards}

    def shard_of(self, keys: Any) -> np.ndarray:
        """Index (into :attr:`servers`) of the shard that owns each key: int64 [n]."""
        return self._topo.ring.owners(_as_keys(keys, self._max_batch_keys))

    # ------------------------------------------------------------------ calls, retries, deadlines
    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the client is closed; create a new Client to continue")

    def _start(self, shard: _Shard, method: str, request: Any, deadline: float) -> Any:
        rpc = shard.raw[method] if isinstance(request, bytes) else getattr(shard.stub, method)
        body = iter(request) if isinstance(request, list) else request
        return rpc.future(body, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata,
                          wait_for_ready=self._wait)

    def _call(self, shard: _Shard, method: str, request: Any, deadline: float) -> Any:
        """A blocking call; returns the reply or the RpcError it failed with."""
        rpc = shard.raw[method] if isinstance(request, bytes) else getattr(shard.stub, method)
        body = iter(request) if isinstance(request, list) else request
        try:
            return rpc(body, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata,
                       wait_for_ready=self._wait)
        except grpc.RpcError as err:
            return err

    def _sleep_backoff(self, attempt: int, deadline: float) -> bool:
        delay = min(self._max_backoff, self._backoff * 2 ** attempt) * (0.5 + random.random() / 2)
        if time.monotonic() + delay >= deadline:
            return False
        time.sleep(delay)
        return True

    def _fanout(self, calls: list[tuple[_Shard, str, Any]], idempotent: bool,
                timeout: float | None = None) -> list[Any]:
        """Run unary (or client-streaming: a list of requests) calls on shards in parallel; results in order.

        Raises:
            The embcache error of the first call that failed for good.
        """
        self._check_open()
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        attempt = 0
        while True:
            if len(todo) == 1:  # one call: a blocking call skips the future's hand-off between threads
                futures = [(todo[0], _Done(self._call(*calls[todo[0]], deadline)))]
            else:
                futures = [(i, self._start(*calls[i], deadline)) for i in todo]
            retry: dict[int, grpc.RpcError] = {}
            failed: tuple[int, grpc.RpcError] | None = None
            for i, fut in futures:
                try:
                    results[i] = fut.result()
                except grpc.RpcError as err:
                    code = err.code()
                    # UNAVAILABLE: not reached, or refused; CANCELLED (by this client only when it is
                    # closed): a server that stopped as the call arrived. Only safe to resend when
                    # idempotent, or when the server said the call had no effect.
                    resend = not self._closed and (
                        (idempotent and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED))
                        or (code == grpc.StatusCode.UNAVAILABLE and not_applied(err)))
                    if resend and attempt < self._retries:
                        retry[i] = err
                    elif failed is None:
                        failed = (i, err)
            if failed is None and retry:
                if self._sleep_backoff(attempt, deadline):
                    for i, why in retry.items():
                        shard, method, _ = calls[i]
                        log.info("resending %s to %s (retry %d of %d) after %s%s: %s", method, shard.address,
                                 attempt + 1, self._retries, why.code().name,
                                 " (not applied)" if not_applied(why) else "", why.details())
                    todo, attempt = list(retry), attempt + 1
                    continue
                failed = next(iter(retry.items()))
            if failed is not None:
                raise error_from_rpc(failed[1], calls[failed[0]][0].address) from None
            return results

    def _open_streams(self, calls: list[tuple[_Shard, str, Any]], timeout: float) -> list[Any]:
        """Start server-streaming calls and read each one's first message (errors raise here)."""
        self._check_open()
        streams = [getattr(shard.stub, method)(request, timeout=timeout, metadata=self._metadata,
                                               wait_for_ready=self._wait) for shard, method, request in calls]
        for (shard, _, _), call in zip(calls, streams, strict=True):
            try:
                next(call)
            except grpc.RpcError as err:
                for other in streams:
                    other.cancel()
                raise error_from_rpc(err, shard.address) from None
        return streams

    def _finish_streams(self, streams: list[Any], calls: list[tuple[_Shard, str, Any]],
                        combine: Callable[[list[Any]], Any]) -> RemoteFuture:
        """A future resolved, on a background thread, from each stream's second message."""
        fut = RemoteFuture()
        fut._calls = streams
        fut.set_running_or_notify_cancel()

        def wait() -> None:
            finals = []
            try:
                for (shard, _, _), call in zip(calls, streams, strict=True):
                    try:
                        finals.append(next(call))
                    except grpc.RpcError as err:
                        if err.code() == grpc.StatusCode.CANCELLED and fut.cancelled():
                            return
                        raise error_from_rpc(err, shard.address) from None
                if not fut.cancelled():
                    fut.set_result(combine(finals))
            except BaseException as exc:
                if not fut.cancelled():
                    fut.set_exception(exc)

        threading.Thread(target=wait, name="embcache-client-wait", daemon=True).start()
        return fut

    # ------------------------------------------------------------------ tables
    def _refresh_tables(self, timeout: float | None = None) -> dict[str, TableConfig]:
        replies = self._fanout([(s, "ListTables", pb.ListTablesRequest()) for s in self._topo.shards], idempotent=True,
                               timeout=timeout)
        tables: dict[str, TableConfig] = {}
        for reply in replies:
            for t in reply.tables:
                tables.setdefault(t.name, codec.table_from_proto(t))
        info = [r.server for r in replies]
        with self._lock:
            self._tables = tables
            self._max_batch_keys = min(i.max_batch_keys for i in info) or self._max_batch_keys
            self._reject_nonfinite = any(i.reject_nonfinite for i in info)
            limits = [v for i in info for v in (i.max_receive_message_bytes, i.max_send_message_bytes) if v]
            self._max_message = min([self._max_message, *limits])
        return dict(tables)

    def _dims(self, names: Sequence[str]) -> dict[str, int]:
        """Dims of the named tables (the list is fetched again when a name is new to this client)."""
        self._check_open()
        with self._lock:
            known = dict(self._tables)
        if any(n not in known for n in names):
            known = self._refresh_tables()
        for n in names:
            if n not in known:
                raise UnknownTableError(f"unknown table {n!r}; tables: {sorted(known)}")
        return {n: known[n].dim for n in names}

    def tables(self) -> dict[str, TableConfig]:
        """The tables the servers serve, by name (fetched now)."""
        self._check_open()
        return self._refresh_tables()

    def create_table(self, cfg: TableConfig) -> bool:
        """Add a table on every shard; idempotent for an equal definition.

        Returns:
            True if some shard created it, False if every shard had an equal one.

        Raises:
            TableConflictError: a table of that name exists with another definition.
            PassStateError: rows are pinned on a shard. ConfigError: ``cfg`` is not a TableConfig.
        """
        if not isinstance(cfg, TableConfig):
            raise ConfigError(f"create_table takes a TableConfig, got {type(cfg).__name__}")
        req = pb.CreateTableRequest(table=codec.table_to_proto(cfg))
        replies = self._fanout([(s, "CreateTable", req) for s in self._topo.shards], idempotent=True)
        with self._lock:
            self._tables[cfg.name] = cfg
        return any(r.created for r in replies)

    # ------------------------------------------------------------------ request building
    @staticmethod
    def _parts_by_shard(batch: Mapping[str, tuple[np.ndarray, np.ndarray | None]],
                        topo: _Topology) -> list[list[_Part]]:
        """Split each table's keys (and values) over the shards."""
        per_shard: list[list[_Part]] = [[] for _ in topo.shards]
        for table, (keys, values) in batch.items():
            if len(topo.shards) == 1:
                per_shard[0].append(_Part(table, None, keys, values))
                continue
            for i, pos in enumerate(topo.ring.split(keys)):
                if pos.size:
                    per_shard[i].append(_Part(table, pos, keys[pos], None if values is None else values[pos]))
        return per_shard

    def _chunks(self, parts: list[_Part], row_bytes: Mapping[str, int]) -> list[list[_Part]]:
        """Group parts into requests of at most the message limit, cutting a table's part where needed."""
        budget = max(self._max_message - _MESSAGE_MARGIN, 1 << 15)
        chunks: list[list[_Part]] = [[]]
        room = budget
        for part in parts:
            start, n, per_row = 0, part.keys.shape[0], row_bytes[part.table]
            while start < n:
                take = min(n - start, max(room // per_row, 0))
                if take == 0:
                    chunks.append([])
                    room = budget
                    take = min(n - start, max(budget // per_row, 1))
                end = start + take
                whole = start == 0 and end == n
                chunks[-1].append(part if whole else _Part(
                    part.table, (part.positions if part.positions is not None else np.arange(n))[start:end],
                    part.keys[start:end], None if part.values is None else part.values[start:end]))
                room -= take * per_row
                start = end
        return [c for c in chunks if c]

    # ------------------------------------------------------------------ lookups
    def lookup(self, table: str, keys: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``keys``: float32 [n, dim] on the CPU.

        Args:
            table: table name.
            keys: int64 [n] (any integer dtype; tensor, numpy array or sequence); duplicates allowed.
            out: optional float32 [n, dim] CPU tensor to write into.

        Raises:
            UnknownTableError, InvalidKeysError, BatchTooLargeError, InvalidRowsError (bad ``out``),
            StoreError, UnavailableError, DeadlineExceededError.
        """
        return self._lookup({table: keys}, {table: out} if out is not None else {})[table]

    def lookup_many(self, keys: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Rows of several tables in one round trip per shard: ``{table: keys [n]} -> {table: float32 [n, dim]}``.

        Raises:
            The errors of :meth:`lookup`.
        """
        return self._lookup(keys, {})

    def _lookup(self, keys: Mapping[str, Any], outs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dims = self._dims(list(keys))
        batch = {t: (_as_keys(k, self._max_batch_keys), None) for t, k in keys.items()}
        filled: dict[str, torch.Tensor] = {}
        for t, (k, _) in batch.items():
            out = outs.get(t)
            if out is not None:
                n, dim = k.shape[0], dims[t]
                if out.shape != (n, dim) or out.dtype != torch.float32 or out.device.type != "cpu":
                    raise InvalidRowsError(f"out must be float32 [{n}, {dim}] on cpu")
                filled[t] = out
        row_bytes = {t: 4 * d + 8 for t, d in dims.items()}
        calls: list[tuple[_Shard, str, Any]] = []
        layouts: list[list[_Part]] = []
        topo = self._topo
        for shard, parts in zip(topo.shards, self._parts_by_shard(batch, topo), strict=True):
            for chunk in self._chunks([p for p in parts if p.keys.size], row_bytes):
                calls.append((shard, "Lookup", wire.encode_lookup_request([(p.table, p.keys) for p in chunk])))
                layouts.append(chunk)
        replies = self._fanout(calls, idempotent=True)
        for reply, chunk, (shard, _, _) in zip(replies, layouts, calls, strict=True):
            tables = wire.parse_lookup_response(reply)
            if len(tables) != len(chunk):
                raise RemoteError(f"server {shard.address} answered {len(tables)} tables for {len(chunk)}")
            for part, rows_msg in zip(chunk, tables, strict=True):
                rows = codec.decode_tensor(rows_msg.rows, f"rows of table {part.table!r} from {shard.address}",
                                           InvalidRowsError, ("float32",), 2)
                n, dim = batch[part.table][0].shape[0], dims[part.table]
                if rows.shape != (part.keys.shape[0], dim):
                    raise RemoteError(f"server {shard.address} sent rows {rows.shape} for "
                                      f"{part.keys.shape[0]} keys of dim {dim}")
                out = filled.get(part.table)
                if out is None and part.positions is None:  # the whole batch in one reply: its rows, in place
                    filled[part.table] = wire.as_tensor(reply, rows)
                    continue
                if out is None:
                    out = filled[part.table] = torch.empty(n, dim, dtype=torch.float32)
                if part.positions is None:
                    out.numpy()[:] = rows
                else:
                    out.numpy()[part.positions] = rows
        return {t: filled[t] if t in filled else torch.empty(0, dims[t], dtype=torch.float32) for t in batch}

    # ------------------------------------------------------------------ writes
    def apply_gradients(self, table: str, keys: Any, grads: Any) -> None:
        """Apply the table's optimizer to the rows of ``keys``; gradients of duplicate keys are summed.

        Never resent after a failure that may have reached the server (not idempotent).

        Args:
            table: table name.
            keys: int64 [n] (duplicates allowed).
            grads: floating [n, dim] (any device; sent as float32).

        Raises:
            UnknownTableError, InvalidKeysError, InvalidGradientError, NonFiniteGradientError,
            BatchTooLargeError, StoreError, UnavailableError (may or may not be applied),
            DeadlineExceededError.
        """
        self.apply_gradients_many({table: (keys, grads)})

    def apply_gradients_many(self, updates: Mapping[str, tuple[Any, Any]]) -> None:
        """Apply gradients to several tables in one round trip per shard: ``{table: (keys [n], grads [n, dim])}``.

        Every table's input is checked before anything is sent.

        Raises:
            The errors of :meth:`apply_gradients`.
        """
        batch = self._values_batch(updates, "gradients", InvalidGradientError)
        if self._reject_nonfinite:
            for t, (_, g) in batch.items():
                if not _finite(g):
                    raise NonFiniteGradientError(f"gradients of table {t!r} contain NaN or inf; nothing was applied")
        self._write("ApplyGradients", batch, pb.ApplyGradientsRequest)

    def assign(self, table: str, keys: Any, rows: Any) -> None:
        """Overwrite the rows of ``keys`` and reset their optimizer state; the last duplicate wins.

        Raises:
            UnknownTableError, InvalidKeysError, InvalidRowsError, BatchTooLargeError, StoreError,
            UnavailableError (may or may not be applied), DeadlineExceededError.
        """
        batch = self._values_batch({table: (keys, rows)}, "rows", InvalidRowsError)
        if not _finite(batch[table][1]):
            raise InvalidRowsError("rows contain NaN or inf; nothing was assigned")
        self._write("Assign", batch, pb.AssignRequest)

    def _values_batch(self, updates: Mapping[str, tuple[Any, Any]], what: str,
                      error: type[InvalidGradientError] | type[InvalidRowsError]) -> dict[str, tuple[np.ndarray, Any]]:
        dims = self._dims(list(updates))
        batch: dict[str, tuple[np.ndarray, Any]] = {}
        for t, (k, v) in updates.items():
            keys = _as_keys(k, self._max_batch_keys)
            batch[t] = (keys, _as_values(what, v, keys.shape[0], dims[t], error))
        return batch

    def _write(self, method: str, batch: Mapping[str, tuple[np.ndarray, Any]], request_type: Any) -> None:
        dims = {t: v.shape[1] for t, (_, v) in batch.items()}
        row_bytes = {t: 4 * d + 8 for t, d in dims.items()}
        calls: list[tuple[_Shard, str, Any]] = []
        topo = self._topo
        for shard, parts in zip(topo.shards, self._parts_by_shard(batch, topo), strict=True):
            chunks = self._chunks([p for p in parts if p.keys.size], row_bytes)
            if len(chunks) == 1:
                calls.append((shard, method, wire.encode_values_request(
                    [(p.table, p.keys, p.values) for p in chunks[0]])))  # type: ignore[misc]
            elif chunks:  # above the message limit: one client stream, applied by the server as one request
                calls.append((shard, f"{method}Stream", [request_type(tables=[
                    pb.TableValues(table=p.table, keys=codec.encode_tensor(p.keys),
                                   values=codec.encode_tensor(p.values))  # type: ignore[arg-type]
                    for p in chunk]) for chunk in chunks]))
        if calls:
            self._fanout(calls, idempotent=False)

    # ------------------------------------------------------------------ passes
    def _keyset_calls(self, keysets: Mapping[str, Any], method: str, make: Callable[[list[pb.TableKeyset]], Any]
                      ) -> list[tuple[_Shard, str, Any]]:
        ks = as_keysets(keysets)
        self._dims(list(ks))
        topo = self._topo
        per_shard: list[list[pb.TableKeyset]] = [[] for _ in topo.shards]
        for table, keyset in ks.items():
            keys, counts = keyset.keys.numpy(), keyset.counts.numpy()
            positions = [None] if len(topo.shards) == 1 else topo.ring.split(keys)
            for i, pos in enumerate(positions):
                k, c = (keys, counts) if pos is None else (keys[pos], counts[pos])
                per_shard[i].append(pb.TableKeyset(table=table, keys=codec.encode_tensor(k),
                                                   counts=codec.encode_tensor(c)))
        return [(s, method, make(parts)) for s, parts in zip(topo.shards, per_shard, strict=True)]

    def prefetch(self, keysets: Mapping[str, Keyset | Any]) -> RemoteFuture:
        """Stage the rows of the next pass on every shard in the background.

        Returns once every shard has started staging (bad input raises here); the future's
        result is ``{table: {"staged_rows", "leased_rows", "seconds"}}`` summed over shards.
        ``cancel()`` stops the staging and releases its rows. The next :meth:`begin_pass`
        adopts what was staged.

        Raises:
            UnknownTableError, InvalidKeysError, UnavailableError, DeadlineExceededError.
        """
        calls = self._keyset_calls(keysets, "Prefetch", lambda p: pb.PrefetchRequest(keysets=p, wait=True))
        streams = self._open_streams(calls, self._long_timeout)

        def combine(finals: list[pb.PrefetchResponse]) -> dict[str, dict[str, float]]:
            out: dict[str, dict[str, float]] = {}
            for final in finals:
                for r in final.tables:
                    acc = out.setdefault(r.table, {"staged_rows": 0, "leased_rows": 0, "seconds": 0.0})
                    acc["staged_rows"] += r.staged_rows
                    acc["leased_rows"] += r.leased_rows
                    acc["seconds"] = max(acc["seconds"], r.seconds)  # shards stage in parallel
            return out

        return self._finish_streams(streams, calls, combine)

    def begin_pass(self, keysets: Mapping[str, Keyset | Any]) -> dict[str, dict[str, int]]:
        """Make a pass's keyset resident and pinned on every shard (each gets the keys it owns).

        If some shard refuses, the shards that began are ended again, so no pass is left half begun.

        Returns:
            ``{table: {"keyset_rows": n, "pinned_rows": m}}`` summed over shards.

        Raises:
            PassStateError, UnknownTableError, InvalidKeysError, StoreError, UnavailableError.
        """
        calls = self._keyset_calls(keysets, "BeginPass", lambda p: pb.BeginPassRequest(keysets=p))
        self._check_open()
        deadline = time.monotonic() + self._long_timeout
        futures = [self._start(shard, method, req, deadline) for shard, method, req in calls]
        replies: list[Any] = []
        failed: EmbcacheError | None = None
        began: list[_Shard] = []
        for (shard, _, _), fut in zip(calls, futures, strict=True):
            try:
                replies.append(fut.result())
                began.append(shard)
            except grpc.RpcError as err:
                failed = failed or error_from_rpc(err, shard.address)
        if failed is not None:
            for shard in began:  # undo: best effort, the original error is what the caller needs
                try:
                    self._open_streams([(shard, "EndPass", pb.EndPassRequest(wait=False))], self._timeout)
                except EmbcacheError:
                    pass
            raise failed
        out: dict[str, dict[str, int]] = {}
        for reply in replies:
            for r in reply.tables:
                acc = out.setdefault(r.table, {"keyset_rows": 0, "pinned_rows": 0})
                acc["keyset_rows"] += r.keyset_rows
                acc["pinned_rows"] += r.pinned_rows
        return out

    def end_pass(self) -> RemoteFuture:
        """Unpin the pass's rows on every shard (done when this returns); write-back goes on in the background.

        Returns:
            A future of the number of rows written back, summed over shards.

        Raises:
            PassStateError: no pass is active. UnavailableError, DeadlineExceededError.
        """
        calls = [(s, "EndPass", pb.EndPassRequest(wait=True)) for s in self._topo.shards]
        streams = self._open_streams(calls, self._long_timeout)
        return self._finish_streams(streams, calls, lambda finals: sum(int(f.written_rows) for f in finals))

    # ------------------------------------------------------------------ durability and inspection
    def flush(self) -> None:
        """Make every acknowledged update durable on every shard (survives kill -9).

        Raises:
            StoreError, UnavailableError, DeadlineExceededError.
        """
        self._fanout([(s, "Flush", pb.FlushRequest()) for s in self._topo.shards], idempotent=True,
                     timeout=self._long_timeout)

    def checkpoint(self, directory: str | os.PathLike[str]) -> list[str]:
        """Checkpoint every shard: ``directory`` (one shard) or ``directory/shard-<i>``, under each server's root.

        Args:
            directory: a name relative to the servers' checkpoint root (``--checkpoint-root``).

        Returns:
            The absolute paths the servers wrote, per shard.

        Raises:
            CheckpointExistsError, PermissionDeniedError (outside the root), StoreError, UnavailableError.
        """
        directory = os.fspath(directory)
        shards = self._topo.shards
        names = [directory] if len(shards) == 1 else [os.path.join(directory, f"shard-{i}")
                                                      for i in range(len(shards))]
        calls = [(s, "Checkpoint", pb.CheckpointRequest(directory=d)) for s, d in zip(shards, names, strict=True)]
        replies = self._fanout(calls, idempotent=False, timeout=self._long_timeout)
        return [r.directory for r in replies]

    def stats(self) -> dict[str, dict[str, Any]]:
        """``EmbeddingCache.stats()`` summed over shards (same shape; miss-ratio estimates averaged by lookups)."""
        replies = self._fanout([(s, "Stats", pb.StatsRequest()) for s in self._topo.shards], idempotent=True)
        return _merge_stats([json.loads(r.json) for r in replies])

    def shard_stats(self) -> list[dict[str, dict[str, Any]]]:
        """``stats()`` of each shard, in :attr:`servers` order."""
        replies = self._fanout([(s, "Stats", pb.StatsRequest()) for s in self._topo.shards], idempotent=True)
        return [json.loads(r.json) for r in replies]

