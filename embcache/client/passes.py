"""The pass protocol over the shards: prefetch, begin and end a pass on every shard at once.

Each shard gets the keys of a pass's keyset it owns (:func:`embcache.client.routing.keyset_calls`).
:class:`Passes` begins a pass on every shard or on none (a shard that refuses has the others
ended again), remembers which server process holds each shard's pass, and at the end of the pass
tells a pass lost by a restart (:class:`ShardRestartedError`) from one never begun.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import grpc

from ..errors import EmbcacheError, PassStateError
from ..keyset import Keyset
from ..rpc.errors import ShardRestartedError
from ..rpc.v1 import embcache_pb2 as pb
from .merge import combine_begin_pass, combine_prefetch
from .routing import keyset_calls
from .transport import Call, RemoteFuture, Reply, Transport

__all__ = ["Passes"]


class Passes:
    """A client's passes on its shards (the methods of :class:`~embcache.Client` of the same names)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._incarnations: dict[str, int] = {}  # shard name -> the process that holds this client's pass

    def prefetch(self, keysets: Mapping[str, Keyset | Any]) -> RemoteFuture:
        """Start staging the keysets on every shard; the future of the summed staging results."""
        t = self._transport
        calls = keyset_calls(t, keysets, "Prefetch", lambda p: pb.PrefetchRequest(keysets=p, wait=True))
        streams = t.open_streams(calls, t.long_timeout)
        return t.finish_streams(streams, calls, combine_prefetch)

    def begin(self, keysets: Mapping[str, Keyset | Any]) -> dict[str, dict[str, int]]:
        """Begin the pass on every shard, or end it again on those that began when one refuses."""
        t = self._transport
        calls = keyset_calls(t, keysets, "BeginPass", lambda p: pb.BeginPassRequest(keysets=p))
        outcomes = t.fanout_outcomes(calls, idempotent=False, timeout=t.long_timeout)
        failure = t.failure(calls, outcomes, idempotent=False)
        if failure is not None:
            for (shard, _, _), o in zip(calls, outcomes, strict=True):
                if isinstance(o, grpc.RpcError):
                    continue
                try:  # undo: best effort, the original error is what the caller needs
                    t.open_streams([(shard, "EndPass", pb.EndPassRequest(wait=False))], t.timeout)
                except EmbcacheError:
                    pass
            raise failure
        with self._lock:
            self._incarnations = {shard.name: reply.incarnation for (shard, _, _), reply in
                                  zip(calls, outcomes, strict=True)}
        return combine_begin_pass(outcomes)

    def end(self) -> RemoteFuture:
        """End the pass on every shard; the future of the rows written back, summed.

        Raises:
            ShardRestartedError: a shard's process is not the one that began the pass.
        """
        t = self._transport
        calls: list[Call] = [(s, "EndPass", pb.EndPassRequest(wait=True)) for s in t.topology.shards]
        with self._lock:
            began, self._incarnations = self._incarnations, {}
        firsts: list[Reply] = []
        try:
            streams = t.open_streams(calls, t.long_timeout, firsts)
        except PassStateError as exc:
            address, now = getattr(exc, "address", ""), getattr(exc, "incarnation", 0)
            shard = next((s for s in t.topology.shards if s.address == address), None)
            before = began.get(shard.name, 0) if shard is not None else 0
            if before and now and now != before:
                raise ShardRestartedError(f"end_pass: server {address} restarted since begin_pass (process "
                                          f"{before:016x} -> {now:016x}) and its new process holds no pass",
                                          address, before, now) from exc
            raise
        for (shard, _, _), first in zip(calls, firsts, strict=True):
            before = began.get(shard.name, 0)
            if before and first.incarnation and first.incarnation != before:
                raise ShardRestartedError(f"end_pass: server {shard.address} restarted since begin_pass (process "
                                          f"{before:016x} -> {first.incarnation:016x}); the pass it ended there "
                                          f"was another's", shard.address, before, first.incarnation)
        return t.finish_streams(streams, calls, lambda finals: sum(int(f.written_rows) for f in finals))
