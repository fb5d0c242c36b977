"""The client's wire: channels to the shards, the calls on them, deadlines, resends and rerouting.

:class:`Transport` holds a channel per shard and the shard map the client routes by
(:class:`Topology`: replaced whole when a newer map is adopted, :meth:`Transport.adopt`), and
makes every call the client makes: unary and client-streaming calls fanned out over shards in
parallel (:meth:`Transport.fanout`, :meth:`Transport.fanout_outcomes`) and server-streaming ones
(:meth:`Transport.open_streams`, :meth:`Transport.finish_streams`), each within its deadline.
The resend rules: what failed with UNAVAILABLE (or CANCELLED by a stopping server) is sent again,
with backoff, when the call is idempotent or the server said it was not applied
(:meth:`Transport.resendable`); a write a migration holds back is sent again until its deadline;
a call a shard refused as routed by another map is made again by the newest one
(:meth:`Transport.rerouting`; keyed batches: :func:`embcache.client.routing.send`).

It also keeps what the servers said about themselves: their tables and limits
(:meth:`Transport.refresh_tables`), and makes the client's shard list the fleet's map on servers
that hold none (:meth:`Transport.install_map`). The reshard coordinator (:mod:`embcache.reshard`)
drives the servers through it as well (:meth:`Transport.reach`, :meth:`Transport.direct`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message

from ..config import TableConfig
from ..errors import ConfigError, EmbcacheError, ReadOnlyError, UnknownTableError, WrongShardError
from ..ring import HashRing, ShardMap
from ..rpc import codec
from ..rpc.errors import ERROR_TYPE_KEY, MAP_VERSION_KEY, SHARD_MAP_KEY, error_from_rpc, not_applied, trailer
from ..rpc.v1 import embcache_pb2 as pb
from ..rpc.v1 import embcache_pb2_grpc as pb_grpc
from ..validate import check_open
from .tls import TLSSettings

__all__ = ["Call", "RemoteFuture", "Reply", "ReplyStream", "Request", "Shard", "Topology", "Transport", "log"]

log = logging.getLogger("embcache.client")
R = TypeVar("R")
MAX_REROUTES = 8  # a call routed again after this many map changes in a row gives up (WrongShardError)

#: A request: a message, bytes (the raw Lookup, ApplyGradients and Assign), or a list of
#: messages (sent as a client stream, or a bidirectional one for a server-streaming method).
Request: TypeAlias = "bytes | Message | list[Message]"
#: A reply: the method's response message (bytes for the raw Lookup).
Reply: TypeAlias = Any
#: A reply, or the ``grpc.RpcError`` its call failed with.
Outcome: TypeAlias = Any


class ReplyStream(Protocol):
    """A server-streaming call: its messages in order (a failure raises ``grpc.RpcError``), and ``cancel()``."""

    def __iter__(self) -> Iterator[Reply]:
        ...

    def __next__(self) -> Reply:
        ...

    def cancel(self) -> bool:
        ...


@dataclass
class Shard:
    """One shard: its name on the ring, the address this client reaches it at, and its channel."""

    name: str
    address: str
    channel: grpc.Channel
    stub: pb_grpc.EmbeddingCacheServiceStub
    raw: dict[str, grpc.UnaryUnaryMultiCallable]  # the hot calls with bytes in and out (embcache.rpc.wire)


#: ``(shard, method, request)``: one call of a fan-out.
Call: TypeAlias = "tuple[Shard, str, Request]"


def _identity(data: bytes) -> bytes:
    return data


_SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].full_name


def _raw_calls(channel: grpc.Channel) -> dict[str, grpc.UnaryUnaryMultiCallable]:
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
class Topology:
    """The shards and the ring that maps keys onto them, from one shard map; replaced as a whole when it changes."""

    shards: list[Shard]
    ring: HashRing
    map: ShardMap  # version 0: the client's own list (a fleet never resharded)


class _Done:
    """A finished call in the shape of a grpc future: ``result()`` returns the reply or raises its error."""

    def __init__(self, outcome: Outcome) -> None:
        self._outcome = outcome

    def result(self) -> Reply:
        if isinstance(self._outcome, grpc.RpcError):
            raise self._outcome
        return self._outcome


class RemoteFuture(Future):  # type: ignore[type-arg]
    """A background job on the servers (prefetch staging, end-of-pass write-back); ``cancel()`` stops it."""

    def __init__(self) -> None:
        super().__init__()
        self._calls: list[ReplyStream] = []

    def cancel(self) -> bool:
        """Cancel the calls (the servers stop staging and release its rows); True unless already finished."""
        for call in self._calls:
            call.cancel()
        return super().cancel()


def migrating(err: grpc.RpcError) -> bool:
    """The server refused a write to rows a reshard is moving (not applied: resend after the migration)."""
    return trailer(err, ERROR_TYPE_KEY) == "MigratingError"


def wrong_shard(outcome: Outcome) -> str:
    """The server's shard map (JSON) when ``outcome`` is a WrongShardError refusal ("{}" if it sent none), else ""."""
    if not isinstance(outcome, grpc.RpcError) or trailer(outcome, ERROR_TYPE_KEY) != "WrongShardError":
        return ""
    return trailer(outcome, SHARD_MAP_KEY) or "{}"


class Transport:
    """The channels to a fleet's shards and every call on them (see the module docstring).

    Args:
        named: shard name -> address, the client's list (the shard map of version 0 until a
            server hands over a newer one).
        The others: as :class:`~embcache.Client` takes them.
    """

    def __init__(self, named: Mapping[str, str], *, timeout: float, long_timeout: float, retries: int,
                 backoff: float, max_backoff: float, wait_for_ready: bool, token: str | None, tls: TLSSettings,
                 max_message_bytes: int, vnodes: int) -> None:
        self.timeout, self.long_timeout = timeout, long_timeout
        self.retries, self._backoff, self._max_backoff = retries, backoff, max_backoff
        self.wait = wait_for_ready
        self.auth: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._options: list[tuple[str, str | int]] = [("grpc.max_send_message_length", max_message_bytes),
                                                ("grpc.max_receive_message_length", max_message_bytes),
                                                *tls.channel_options]
        self._credentials = tls.credentials
        self.vnodes = vnodes
        self.closed = False
        first = ShardMap(0, dict(named), vnodes)
        self.topology = Topology([self.connect(name, address) for name, address in named.items()], first.ring, first)
        self._retired: list[Shard] = []  # shards a map change removed (or the coordinator reached): closed with us
        self._lock = threading.Lock()
        # what the servers said about themselves (refresh_tables)
        self.tables: dict[str, TableConfig] = {}
        self.max_message = max_message_bytes
        self.max_batch_keys = 1 << 24
        self.reject_nonfinite = True

    # ------------------------------------------------------------------ shards and the map
    def connect(self, name: str, address: str) -> Shard:
        """A new channel to ``address``, as shard ``name``."""
        channel = (grpc.secure_channel(address, self._credentials, options=self._options)
                   if self._credentials is not None else grpc.insecure_channel(address, options=self._options))
        return Shard(name, address, channel, pb_grpc.EmbeddingCacheServiceStub(channel), _raw_calls(channel))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Every routed call's metadata: the token, and the shard map version the call is routed by."""
        version = self.topology.map.version
        return (*self.auth, (MAP_VERSION_KEY, str(version))) if version else self.auth

    @property
    def retired(self) -> list[Shard]:
        """Shards this client reached that its map no longer has (their writes' receipts may still be held)."""
        with self._lock:
            return list(self._retired)

    def adopt(self, shard_map: str | ShardMap) -> bool:
        """Route by ``shard_map`` (JSON or a map) from now on if it is newer than the current one; True if adopted.

        Shards still present keep their channels; new ones are connected; removed ones stop getting
        calls (their channels close with the client).
        """
        new = ShardMap.from_json(shard_map) if isinstance(shard_map, str) else shard_map
        with self._lock:
            old = self.topology
            if new.version <= old.map.version:
                return False
            # a shard this client knows keeps its channel (and the address this client reaches it at)
            kept = {s.name: s for s in [*old.shards, *self._retired]}
            if len(new.shards) == 1 and len(old.shards) == 1 and next(iter(new.shards)) not in kept:
                # the one server this client reached holds a one-shard map naming it otherwise (the
                # address it was first reached at): it is that shard
                only = old.shards[0]
                kept[next(iter(new.shards))] = Shard(next(iter(new.shards)), only.address, only.channel, only.stub,
                                                     only.raw)
            shards = [kept.pop(n) if n in kept else self.connect(n, a) for n, a in new.shards.items()]
            self._retired = [s for s in kept.values()]
            self.topology = Topology(shards, new.ring, new)
        log.info("routing by shard map version %d: %s", new.version, sorted(new.shards.values()))
        return True

    def reach(self, named: Mapping[str, str]) -> dict[str, Shard]:
        """The shards of the current map and those of ``named``, by name (for the reshard coordinator).

        A shard of the current map is reached where this client reaches it; one new to it is
        connected, and its channel closes with the client (or is kept by a map adopted later).
        """
        shards = {s.name: s for s in self.topology.shards}
        for name, address in named.items():
            if name not in shards:
                shards[name] = self.connect(name, address)
                with self._lock:
                    self._retired.append(shards[name])
        return shards

    def direct(self, shard: Shard, method: str, request: Message, deadline: float) -> Reply:
        """Call ``method`` on ``shard`` once, routed by no shard map (the token only; for the reshard coordinator).

        Waits for the shard as every call does (``wait_for_ready``); never resent. A
        server-streaming method returns its stream, whose errors are raised as it is read.

        Raises:
            The embcache error of a failed unary call.
        """
        try:
            return getattr(shard.stub, method)(request, **self._per_call(deadline, routed=False))
        except grpc.RpcError as err:
            raise error_from_rpc(err, shard.address) from None

    def install_map(self, timeout: float) -> None:
        """Make this client's shard list the fleet's map (version 1) on servers that hold none.

        From then on the servers refuse requests routed by any other list, so two clients that
        resolved the fleet differently can never write one key on two shards. A server that
        already holds a map (another client's, installed meanwhile) keeps it; this client then
        routes by the newest map the servers hold.

        Raises:
            ConfigError: the servers hold maps that contradict each other.
        """
        first = ShardMap(1, dict(self.topology.map.shards), self.vnodes)
        calls: list[Call] = [(s, "SetShardMap", pb.SetShardMapRequest(name=s.name, current=first.to_json()))
                             for s in self.topology.shards]
        outcomes = self.fanout_outcomes(calls, idempotent=True, timeout=timeout)
        held = []
        for (shard, _, _), o in zip(calls, outcomes, strict=True):
            if isinstance(o, grpc.RpcError):
                if (o.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)
                        or trailer(o, ERROR_TYPE_KEY) == ReadOnlyError.__name__):
                    return  # a read-only token or server (nothing is written), or a server older than shard maps
                if trailer(o, ERROR_TYPE_KEY) != "ConfigError":  # ConfigError: it holds another map (read below)
                    raise error_from_rpc(o, shard.address) from None
                o = self.fanout([(shard, "GetShardMap", pb.GetShardMapRequest())], idempotent=True,
                                timeout=timeout)[0]
            held.append(ShardMap.from_json(o.current) if o.current else first)
        newest = max(held, key=lambda m: m.version)
        if newest == first:
            self.adopt(first)
            return
        if self.adopt(newest):
            self.refresh_tables(timeout=timeout)
        if any(m.version == newest.version and m != newest for m in held):
            raise ConfigError(f"the servers hold different shard maps of version {newest.version}: "
                              f"{sorted({m.to_json() for m in held if m.version == newest.version})}")

    # ------------------------------------------------------------------ tables and limits
    def refresh_tables(self, timeout: float | None = None) -> dict[str, TableConfig]:
        """The tables the servers serve (fetched now), and their limits; a newer shard map they hold is adopted."""
        replies = self.fanout([(s, "ListTables", pb.ListTablesRequest()) for s in self.topology.shards],
                              idempotent=True, timeout=timeout)
        tables: dict[str, TableConfig] = {}
        for reply in replies:
            for t in reply.tables:
                tables.setdefault(t.name, codec.table_from_proto(t))
        info = [r.server for r in replies]
        maps = [ShardMap.from_json(i.shard_map) for i in info if i.shard_map]
        if maps and self.adopt(max(maps, key=lambda m: m.version)):
            return self.refresh_tables(timeout)  # the tables of the shards of the new map
        with self._lock:
            self.tables = tables
            self.max_batch_keys = min(i.max_batch_keys for i in info) or self.max_batch_keys
            self.reject_nonfinite = any(i.reject_nonfinite for i in info)
            limits = [v for i in info for v in (i.max_receive_message_bytes, i.max_send_message_bytes) if v]
            self.max_message = min([self.max_message, *limits])
        return dict(tables)

    def remember(self, cfg: TableConfig) -> None:
        """Know table ``cfg`` from now on (this client created it)."""
        with self._lock:
            self.tables[cfg.name] = cfg

    def table(self, name: str) -> TableConfig:
        """The definition of table ``name`` (the list is fetched again when the name is new to this client).

        Raises:
            UnknownTableError, CacheClosedError.
        """
        return self.known(name)[name]

    def known(self, *names: str) -> dict[str, TableConfig]:
        """The definitions of the named tables (fetched again when a name is new to this client).

        Raises:
            UnknownTableError, CacheClosedError.
        """
        self.check_open()
        with self._lock:
            known = dict(self.tables)
        if any(n not in known for n in names):
            known = self.refresh_tables()
        for n in names:
            if n not in known:
                raise UnknownTableError(f"unknown table {n!r}; tables: {sorted(known)}")
        return {n: known[n] for n in names}

    # ------------------------------------------------------------------ calls, retries, deadlines
    def check_open(self) -> None:
        """Raise CacheClosedError once the client is closed."""
        check_open(self.closed, "client")

    @staticmethod
    def _rpc(shard: Shard, method: str, request: Request) -> tuple[Any, Any]:
        """The multi-callable for ``request`` (raw for bytes) and the request as it is sent (a list: streamed)."""
        rpc = shard.raw[method] if isinstance(request, bytes) else getattr(shard.stub, method)
        return rpc, iter(request) if isinstance(request, list) else request

    def _per_call(self, deadline: float, routed: bool = True) -> dict[str, Any]:
        """A call's keyword arguments: what is left of ``deadline``, its metadata (``routed``: with the shard map
        version it is routed by), and whether it waits for a shard that is down."""
        return {"timeout": max(deadline - time.monotonic(), 0.001), "metadata": self.metadata if routed else self.auth,
                "wait_for_ready": self.wait}

    def _start(self, shard: Shard, method: str, request: Request, deadline: float) -> grpc.Future:
        rpc, body = self._rpc(shard, method, request)
        return rpc.future(body, **self._per_call(deadline))

    def _call(self, shard: Shard, method: str, request: Request, deadline: float) -> Outcome:
        """A blocking call; returns the reply or the RpcError it failed with."""
        rpc, body = self._rpc(shard, method, request)
        try:
            return rpc(body, **self._per_call(deadline))
        except grpc.RpcError as err:
            return err

    def stream(self, shard: Shard, method: str, request: Request, deadline: float) -> ReplyStream:
        """Start a server-streaming call (a list of requests: a bidirectional stream of them); its message iterator."""
        rpc, body = self._rpc(shard, method, request)
        return rpc(body, **self._per_call(deadline))

    def sleep_backoff(self, attempt: int, deadline: float) -> bool:
        """Sleep the backoff of retry ``attempt`` (jittered); False, not sleeping, when it would pass ``deadline``."""
        delay = min(self._max_backoff, self._backoff * 2 ** attempt) * (0.5 + random.random() / 2)
        if time.monotonic() + delay >= deadline:
            return False
        time.sleep(delay)
        return True

    def fanout(self, calls: Sequence[Call], idempotent: bool, timeout: float | None = None) -> list[Reply]:
        """Run unary (or client-streaming: a list of requests) calls on shards in parallel; replies in order.

        Raises:
            The embcache error of the first call that failed for good.
        """
        outcomes = self.fanout_outcomes(calls, idempotent, timeout, stop_on_failure=True)
        failure = self.failure(calls, outcomes, idempotent)
        if failure is not None:
            raise failure from None
        return outcomes

    def failure(self, calls: Sequence[Call], outcomes: Sequence[Outcome], idempotent: bool) -> EmbcacheError | None:
        """The embcache error of the failed call that says most, or None when every call succeeded.

        A failure for good says more than one that was still being resent when time or retries ran out.
        """
        errors = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, grpc.RpcError)]
        if not errors:
            return None
        i, err = next(((i, e) for i, e in errors if not self.resendable(e, idempotent)), errors[0])
        return error_from_rpc(err, calls[i][0].address)

    def resendable(self, err: grpc.RpcError, idempotent: bool) -> bool:
        """Whether a failed call is safe to send again.

        UNAVAILABLE: not reached, or refused; CANCELLED (by this client only when it is closed): a
        server that stopped as the call arrived. Safe only when the call is idempotent, or when the
        server said it had no effect (UNAVAILABLE marked not applied: a draining server).
        """
        code = err.code()
        return not self.closed and (
            (idempotent and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED))
            or (code == grpc.StatusCode.UNAVAILABLE and not_applied(err)))

    def _log_resend(self, shard: Shard, method: str, attempt: int, why: grpc.RpcError) -> None:
        log.info("resending %s to %s (retry %d of %d) after %s%s: %s", method, shard.address, attempt + 1,
                 self.retries, why.code().name, " (not applied)" if not_applied(why) else "", why.details())

    def fanout_outcomes(self, calls: Sequence[Call], idempotent: bool, timeout: float | None = None,
                        stop_on_failure: bool = False) -> list[Outcome]:
        """Run calls as :meth:`fanout` does, resending what is safe; each call's reply or its final ``RpcError``.

        With ``stop_on_failure``, a call failing for good ends the resending of the others (the
        caller raises); otherwise every call is resent while it is safe and time and retries allow.

        Raises:
            CacheClosedError: the client is closed.
        """
        self.check_open()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        results: list[Outcome] = [None] * len(calls)
        todo = list(range(len(calls)))
        attempt = 0
        while True:
            futures: list[tuple[int, _Done | grpc.Future]]
            if len(todo) == 1:  # one call: a blocking call skips the future's hand-off between threads
                futures = [(todo[0], _Done(self._call(*calls[todo[0]], deadline)))]
            else:
                futures = [(i, self._start(*calls[i], deadline)) for i in todo]
            retry: dict[int, grpc.RpcError] = {}
            failed = False
            for i, fut in futures:
                try:
                    results[i] = fut.result()
                except grpc.RpcError as err:
                    results[i] = err
                    # a migration's refusal is resent until the deadline, whatever the retries
                    if self.resendable(err, idempotent) and (attempt < self.retries or migrating(err)):
                        retry[i] = err
                    else:
                        failed = True
            if retry and not (failed and stop_on_failure) and self.sleep_backoff(attempt, deadline):
                for i, why in retry.items():
                    self._log_resend(calls[i][0], calls[i][1], attempt, why)
                todo, attempt = list(retry), attempt + 1
                continue
            return results

    def open_streams(self, calls: Sequence[Call], timeout: float,
                     firsts: list[Reply] | None = None) -> list[ReplyStream]:
        """Start server-streaming calls and read each one's first message (errors raise here; ``firsts`` gets them).

        A call the server refused before it had any effect (UNAVAILABLE marked not applied, as a
        draining server refuses) is started again, with backoff, within ``retries`` and the
        deadline; any other failure cancels every stream and raises.
        """
        self.check_open()
        deadline = time.monotonic() + timeout
        streams = [self.stream(*call, deadline) for call in calls]
        try:
            for i, (shard, method, request) in enumerate(calls):
                attempt = 0
                while True:
                    try:
                        first = next(streams[i])
                        if firsts is not None:
                            firsts.append(first)
                        break
                    except grpc.RpcError as err:
                        if (attempt < self.retries and self.resendable(err, idempotent=False)
                                and self.sleep_backoff(attempt, deadline)):
                            self._log_resend(shard, method, attempt, err)
                            attempt += 1
                            streams[i] = self.stream(shard, method, request, deadline)
                            continue
                        raise error_from_rpc(err, shard.address) from None
        except BaseException:
            for other in streams:
                other.cancel()
            raise
        return streams

    @staticmethod
    def finish_streams(streams: list[ReplyStream], calls: Sequence[Call],
                       combine: Callable[[list[Reply]], object]) -> RemoteFuture:
        """A future resolved, on a background thread, by ``combine`` of each stream's second message."""
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

    def rerouting(self, fn: Callable[[], R]) -> R:
        """Run a keyset call (its undo on failure is its own); again, by the new map, when a shard refused it
        as routed by another (WrongShardError: nothing applied there)."""
        deadline = time.monotonic() + self.timeout
        for attempt in range(MAX_REROUTES):
            try:
                return fn()
            except WrongShardError as exc:
                shard_map = getattr(exc, "shard_map", "")
                adopted = bool(shard_map) and self.adopt(shard_map)
                if not adopted and not self.sleep_backoff(attempt, deadline):  # the shard is behind: wait
                    raise
        return fn()

    def close(self) -> None:
        """Close every channel (idempotent); calls after it raise CacheClosedError."""
        self.closed = True
        for shard in [*self.topology.shards, *self.retired]:
            shard.channel.close()
