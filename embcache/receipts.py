"""A client's receipts of its acknowledged writes, per shard, until a flush shows them durable.

Every write reply of an ``embcache-server`` carries a receipt: the server process's incarnation
(a random id drawn when it started) and the write's sequence number in that process (see
:mod:`embcache.server.ledger`). :class:`Receipts` keeps them per shard. A flush (or checkpoint)
asks each shard about the incarnations it holds receipts of and gets back, for each, the
sequence up to which the shard can prove every acknowledged write durable; receipts at or below
it are settled, receipts above it belong to writes that a crashed process acknowledged and never
made durable: :class:`~embcache.rpc.errors.DataLossError`.

Only the receipts taken before a flush was sent are settled by it: a write acknowledged while the
flush is in flight waits for the next one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .rpc.errors import DataLossError

__all__ = ["Loss", "Receipts", "loss_error"]


@dataclass
class _Held:
    """Receipts of one incarnation on one shard: sequence numbers and when each was acknowledged."""

    seqs: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Loss:
    """Acknowledged writes of one shard's incarnation that its successor cannot prove durable."""

    address: str
    incarnation: int
    writes: int
    since: float  # unix time the oldest was acknowledged
    known: bool  # the shard has a record of that incarnation (False: another path, a lost record)


class Receipts:
    """Write receipts per shard (by shard name), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, dict[int, _Held]] = {}

    def add(self, shard: str, incarnation: int, seq: int) -> None:
        """Keep the receipt of a write ``shard`` acknowledged (a reply without one, from an old server, is ignored)."""
        if not incarnation:
            return
        now = time.time()
        with self._lock:
            held = self._held.setdefault(shard, {}).setdefault(incarnation, _Held())
            held.seqs.append(seq)
            held.times.append(now)

    def pending(self, shard: str) -> dict[int, int]:
        """``{incarnation: receipts held}`` of ``shard``: what a flush sent now must settle."""
        with self._lock:
            return {inc: len(h.seqs) for inc, h in self._held.get(shard, {}).items()}

    def settle(self, shard: str, address: str, sent: dict[int, int],
               durable: Iterable[tuple[int, int, bool]]) -> list[Loss]:
        """Settle the receipts a flush was sent with (``sent``, from :meth:`pending`) by the shard's answer.

        Args:
            shard: the shard's name.
            address: its address (for the report).
            sent: what :meth:`pending` returned before the flush was sent.
            durable: the answer: ``(incarnation, durable_seq, known)`` per asked incarnation.

        Returns:
            The losses: per incarnation, the receipts above its durable sequence (they are
            forgotten: a loss is reported once).
        """
        answers = {inc: (seq, known) for inc, seq, known in durable}
        losses = []
        with self._lock:
            held = self._held.get(shard, {})
            for inc, n in sent.items():
                h = held.get(inc)
                if h is None:
                    continue
                seq, known = answers.get(inc, (0, False))  # not answered: nothing proven
                seqs = np.asarray(h.seqs[:n], dtype=np.uint64)
                lost = seqs > np.uint64(seq)
                if lost.any():
                    since = min(t for t, gone in zip(h.times[:n], lost, strict=True) if gone)
                    losses.append(Loss(address, inc, int(lost.sum()), since, known))
                del h.seqs[:n], h.times[:n]
                if not h.seqs:
                    del held[inc]
        return losses


def loss_error(losses: Sequence[Loss], what: str, also: BaseException | None = None) -> DataLossError:
    """The error a flush or checkpoint raises for ``losses`` (at least one); ``also``: another shard's failure."""
    parts = []
    for loss in losses:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(loss.since))
        why = ("restarted before making them durable" if loss.known
               else "has no record of the process that acknowledged them (another --path, or its record was lost)")
        parts.append(f"{loss.writes} write request(s) acknowledged by server {loss.address} since {when} "
                     f"(process {loss.incarnation:016x}) may be lost: the server {why}")
    total = sum(loss.writes for loss in losses)
    return DataLossError(f"{what}: {total} acknowledged write request(s) may be lost; " + "; ".join(parts)
                         + (f". Another shard failed too: {also}" if also is not None
                            else ". Every other shard's part succeeded."),
                         [(loss.address, loss.incarnation, loss.writes, loss.since) for loss in losses])
