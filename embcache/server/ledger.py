"""Which acknowledged writes a server has made durable, across its restarts.

A server process draws a random 64-bit *incarnation* when it starts and numbers the write
requests it acknowledges 1, 2, 3, ... (the *sequence*). Every write reply carries both (a
``WriteReceipt``), so a client knows which process acknowledged each of its writes. A flush
records, for the running incarnation, the sequence up to which every acknowledged write is
durable; the record is kept in a small file beside the store
(``<path>/server-incarnations.json``), so a later process on the same path can still answer for
the earlier ones:

- the running incarnation: after this flush, everything it acknowledged is durable;
- an earlier one: durable up to the sequence its last recorded flush (or its clean shutdown)
  covered; under ``--sync`` every acknowledged write of it;
- one the file does not know (another path, a deleted file): nothing proven durable;
- one of a shard that left the fleet: the reshard that moved its rows here flushed it and handed
  its record over (:meth:`WriteLedger.records` and :meth:`WriteLedger.adopt`), so the shards
  that keep its rows answer for the writes it acknowledged.

A client asks, in each Flush and Checkpoint, about the incarnations it holds receipts of, and
compares: a receipt above its incarnation's durable sequence is an acknowledged write that may be
lost (``DataLossError``). The record errs one way only: it may say a durable write is not proven
(a crash between a flush and the file's update), never the reverse, because the sequence is read
before the flush starts and written only after it succeeded.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..stores.base import write_durably

__all__ = ["LEDGER_FILE", "Durable", "WriteLedger", "merge_records", "raised"]

log = logging.getLogger("embcache.server")

#: The record's file name, in the cache's ``path``.
LEDGER_FILE = "server-incarnations.json"
_KEEP = 256  # incarnations remembered (a client that slept through 256 restarts hears "unknown": loss)
_ALL = (1 << 64) - 1  # durable_seq of a --sync incarnation: every acknowledged write


_Record = dict[str, float | int | bool]  # {"durable_seq", "started", "clean"} of one incarnation


def raised(mine: Mapping[int, _Record], theirs: Mapping[int, _Record]) -> dict[int, _Record]:
    """The records of ``theirs`` that ``mine`` lacks or holds with a lower durable sequence.

    The one rule for taking another ledger's records: a record never goes down, the higher
    durable sequence of the two wins (:meth:`WriteLedger.adopt`, :func:`merge_records`).
    """
    return {inc: rec for inc, rec in theirs.items()
            if inc not in mine or rec["durable_seq"] > mine[inc]["durable_seq"]}


@dataclass(frozen=True)
class Durable:
    """The answer for one incarnation: every write it acknowledged up to ``seq`` is durable.

    ``known`` is False for an incarnation this path has no record of (then ``seq`` is 0).
    """

    incarnation: int
    seq: int
    known: bool


class WriteLedger:
    """The running server's incarnation, its write sequence, and the durable record of its predecessors.

    Args:
        directory: the cache's path (the store's directory), where the record lives.
        sync: every write is flushed before it is acknowledged (``--sync``): all of this
            incarnation's acknowledged writes are durable by construction.

    Raises:
        OSError: the record cannot be written (the start-up fails rather than promise nothing).
    """

    def __init__(self, directory: str, sync: bool = False) -> None:
        self._path = os.path.join(directory, LEDGER_FILE)
        self._lock = threading.Lock()
        self._io = threading.Lock()  # one writer of the file at a time, in order of the records
        self.incarnation = secrets.randbits(64) or 1
        self._sync = sync
        self._seq = 0
        self._records = self._load()
        self._records[self.incarnation] = {"durable_seq": _ALL if sync else 0, "started": time.time(),
                                           "clean": False}
        self._save()

    @staticmethod
    def _parse(raw: bytes | str) -> dict[int, _Record]:
        data = json.loads(raw)
        return {int(k): {"durable_seq": int(v["durable_seq"]), "started": float(v.get("started", 0.0)),
                         "clean": bool(v.get("clean", False))} for k, v in data["incarnations"].items()}

    def _load(self) -> dict[int, _Record]:
        try:
            with open(self._path, "rb") as f:
                return self._parse(f.read())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # unreadable: every earlier incarnation becomes unknown, which reports their unflushed writes lost
            log.warning("ignoring unreadable %s (%s): earlier incarnations' writes count as not durable",
                        self._path, exc)
            return {}

    def _save(self) -> None:
        with self._io:
            with self._lock:
                # the newest records, and always this process's own (adopted ones may be newer)
                others = sorted((kv for kv in self._records.items() if kv[0] != self.incarnation),
                                key=lambda kv: kv[1]["started"])[-(_KEEP - 1):]
                keep = [*others, (self.incarnation, self._records[self.incarnation])]
                self._records = dict(keep)
                body = json.dumps({"incarnations": {str(k): v for k, v in keep}}, indent=1).encode()
            write_durably(self._path, body)

    def acknowledge(self) -> int:
        """The sequence number of a write request about to be acknowledged (call after it was applied)."""
        with self._lock:
            self._seq += 1
            return self._seq

    def flush(self, flush: Callable[[], None]) -> int:
        """Run ``flush`` (the cache's) and record what it made durable; returns that sequence.

        Every write acknowledged before this call was applied before ``flush`` started, so it is
        covered. The record is written after ``flush`` returned; if ``flush`` raises, nothing is.

        Raises:
            Whatever ``flush`` raises; OSError from writing the record (the rows are durable,
            the record still says less).
        """
        with self._lock:
            mark = self._seq
        flush()
        self.durable(mark)
        return mark

    def durable(self, seq: int) -> None:
        """Record that every write acknowledged up to ``seq`` is durable (e.g. after a clean close)."""
        with self._lock:
            own = self._records[self.incarnation]
            if seq <= own["durable_seq"]:  # (under --sync it is every sequence already)
                return
            own["durable_seq"] = seq
        self._save()

    def close(self) -> None:
        """The cache closed cleanly (flushed everything): every write acknowledged so far is durable."""
        with self._lock:
            seq = self._seq
            self._records[self.incarnation]["clean"] = True
        self.durable(seq)
        if self._sync or seq == 0:
            self._save()  # durable() wrote nothing: keep the clean mark anyway

    def records(self) -> str:
        """Every incarnation this ledger knows, with what is durable of each, as JSON (for :meth:`adopt`)."""
        with self._lock:
            return json.dumps({"incarnations": {str(k): dict(v) for k, v in self._records.items()}})

    def adopt(self, records: str) -> int:
        """Keep the records of another server's ledger (a shard that left the fleet): how many were new or raised.

        A record never goes down: the higher durable sequence of the two wins.

        Raises:
            ValueError: ``records`` is not what :meth:`records` writes.
        """
        try:
            theirs = self._parse(records)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed ledger records: {exc}") from None
        with self._lock:
            new = raised(self._records, theirs)
            new.pop(self.incarnation, None)  # this process's own record is kept by this process alone
            self._records.update(new)
            changed = len(new)
        if changed:
            self._save()
        return changed

    def answer(self, incarnations: Iterable[int]) -> list[Durable]:
        """What is durable of each asked incarnation (the running one: what its last flush covered)."""
        out = []
        with self._lock:
            for inc in dict.fromkeys(int(i) for i in incarnations):
                if inc in self._records:
                    out.append(Durable(inc, int(self._records[inc]["durable_seq"]), True))
                else:
                    out.append(Durable(inc, 0, False))
        return out


def merge_records(ledgers: Iterable[str]) -> str:
    """Several ledgers' records (:meth:`WriteLedger.records`; "" for none) as one, by the rule of :func:`raised`.

    A reshard hands the merged records of the shards that leave to the shards that stay ("" when
    there are none).
    """
    merged: dict[int, _Record] = {}
    for text in ledgers:
        if text:
            merged.update(raised(merged, WriteLedger._parse(text)))
    return json.dumps({"incarnations": {str(k): v for k, v in merged.items()}}) if merged else ""
