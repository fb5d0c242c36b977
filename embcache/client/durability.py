"""Flush and checkpoint over the shards, settling the write receipts the client holds (:mod:`embcache.receipts`).

Every write reply carries a receipt (the server process's incarnation and the write's number
there). :func:`settle` sends a Flush or Checkpoint to every shard asking about the incarnations
it holds receipts of, and raises :class:`DataLossError` for acknowledged writes no shard can
prove durable: those of a process that crashed, and those of a shard that left the fleet which
none of the shards that took its rows answers for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import Message

from ..receipts import Receipts, loss_error
from .transport import Call, Reply, Shard, Transport

__all__ = ["settle"]


def settle(transport: Transport, receipts: Receipts, method: str, shards: Sequence[Shard],
           make: Callable[[Shard, list[int]], Message], idempotent: bool) -> list[Reply]:
    """Send a Flush or Checkpoint per shard, carrying the incarnations it holds receipts of; settle them.

    ``make(shard, incarnations)`` makes the request of a shard; the replies are returned in order.

    Raises:
        DataLossError: a shard cannot prove durable some write it acknowledged (the call
            succeeded everywhere else, or another shard's failure is named in the message).
        The embcache error of the first call that failed for good otherwise.
    """
    sent = [receipts.pending(s.name) for s in shards]
    # receipts of shards that left the fleet: the shards that took their rows hold their ledgers
    gone = [s for s in transport.retired if s.name not in {c.name for c in shards}]
    orphans = {s.name: (s, p) for s in gone if (p := receipts.pending(s.name))}
    asked = sorted({inc for _, p in orphans.values() for inc in p})
    calls: list[Call] = [(s, method, make(s, sorted({*p, *asked}))) for s, p in zip(shards, sent, strict=True)]
    outcomes = transport.fanout_outcomes(calls, idempotent, timeout=transport.long_timeout)
    losses = []
    best: dict[int, int] = {}  # an orphan incarnation: the highest durable sequence any shard knows of it
    for (shard, _, _), pending, reply in zip(calls, sent, outcomes, strict=True):
        if isinstance(reply, grpc.RpcError):
            continue
        answers = [(d.incarnation, d.durable_seq, d.known) for d in reply.durable]
        losses += receipts.settle(shard.name, shard.address, pending, answers)
        for inc, seq, known in answers:
            if known and inc in asked:
                best[inc] = max(seq, best.get(inc, 0))
    failure = transport.failure(calls, outcomes, idempotent)
    if failure is None:  # every shard answered: what none of them knows cannot be proven durable
        for name, (shard, pending) in orphans.items():
            losses += receipts.settle(name, shard.address, pending,
                                      [(inc, best.get(inc, 0), inc in best) for inc in pending])
    if losses:
        raise loss_error(losses, method.lower(), failure)
    if failure is not None:
        raise failure from None
    return outcomes
