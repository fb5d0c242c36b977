"""embcache.server.leases: batch leases by id with a time-to-live, without a network (a fake clock)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from embcache import CacheConfig, EmbeddingCache, Keyset, TableConfig
from embcache.rpc.v1 import embcache_pb2 as pb
from embcache.server.leases import MIN_TTL_SECONDS, LeaseTable

State = pb.LeaseStatus.State


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[EmbeddingCache]:
    cfg = CacheConfig(path=str(tmp_path / "store"), hbm_bytes=200_000, ddr_bytes=400_000, device="cpu")
    with EmbeddingCache(cfg, [TableConfig(name="t", dim=8, seed=1)]) as c:
        yield c


def _pinned(cache: EmbeddingCache) -> int:
    s = cache.stats()["t"]
    return int(s["hbm"]["pinned_rows"] + s["ddr"]["pinned_rows"])


def _keys(n: int, start: int = 0) -> dict[str, Keyset]:
    return {"t": Keyset.from_keys(torch.arange(start, start + n))}


def _wait_done(table: LeaseTable, lease_id: str) -> pb.LeaseStatus:
    status = table.renew([lease_id], wait=5.0)[0]
    deadline = time.monotonic() + 60
    while status.state == State.STAGING and time.monotonic() < deadline:
        status = table.renew([lease_id], wait=5.0)[0]
    return status


def test_a_lease_pins_until_released_and_reports_its_staging(cache: EmbeddingCache) -> None:
    clock = _Clock()
    table = LeaseTable(cache, max_ttl=60, clock=clock, reaper=False)
    lease_id, ttl = table.open(_keys(100), ttl=10)
    assert ttl == 10
    status = _wait_done(table, lease_id)
    assert status.state == State.DONE and status.tables[0].table == "t"
    assert status.tables[0].staged_rows + status.tables[0].leased_rows == 100
    assert _pinned(cache) == 100
    released = table.release([lease_id, "no-such-lease"])
    assert [s.state for s in released] == [State.DONE, State.UNKNOWN]
    assert _pinned(cache) == 0
    assert table.release([lease_id])[0].state == State.DONE  # idempotent, still reported for a while
    clock.now += 6  # 5 s after its final state was reported, a released lease is forgotten
    assert table.expire() == 0 and len(table) == 0
    assert table.renew([lease_id])[0].state == State.UNKNOWN
    table.close()


def test_a_lease_without_renewal_expires_and_unpins(cache: EmbeddingCache) -> None:
    clock = _Clock()
    table = LeaseTable(cache, max_ttl=60, clock=clock, reaper=False)
    kept, _ = table.open(_keys(50), ttl=4)
    dropped, _ = table.open(_keys(50, start=1000), ttl=4)
    assert _wait_done(table, kept).state == State.DONE and _wait_done(table, dropped).state == State.DONE
    assert _pinned(cache) == 100
    for _ in range(3):  # renewed every 3 s: outlives its 4 s TTL
        clock.now += 3
        table.renew([kept])
        table.expire()
    assert _pinned(cache) == 50 and table.expired_total == 1
    assert [s.state for s in table.renew([kept, dropped])] == [State.DONE, State.UNKNOWN]
    clock.now += 4.5
    assert table.expire() == 1 and _pinned(cache) == 0 and len(table) == 0
    table.close()


def test_ttls_are_granted_within_bounds(cache: EmbeddingCache) -> None:
    table = LeaseTable(cache, max_ttl=100, default_ttl=30, reaper=False)
    assert table.grant(0) == 30 and table.grant(-1) == 30 and table.grant(float("nan")) == 30
    assert table.grant(0.01) == MIN_TTL_SECONDS and table.grant(1e9) == 100 and table.grant(7) == 7
    assert LeaseTable(cache, max_ttl=10, reaper=False).default_ttl == 10
    with pytest.raises(ValueError):
        LeaseTable(cache, max_ttl=0.1, reaper=False)
    table.close()


def test_cancel_stops_staging_and_close_cancels_every_lease(cache: EmbeddingCache) -> None:
    table = LeaseTable(cache, reaper=False)
    a, _ = table.open(_keys(3000), ttl=30)
    b, _ = table.open(_keys(3000, start=10_000), ttl=30)
    status = table.release([a], cancel=True)[0]
    assert status.state in (State.CANCELLED, State.DONE)  # DONE: staging had already finished
    assert _wait_done(table, b).state == State.DONE
    assert _pinned(cache) == 3000
    table.close()
    assert _pinned(cache) == 0 and len(table) == 0


def test_a_renewal_waits_for_staging_to_end_and_shutdown_wakes_it(cache: EmbeddingCache) -> None:
    table = LeaseTable(cache, reaper=False)
    lease_id, _ = table.open(_keys(2000), ttl=30)
    assert _wait_done(table, lease_id).state == State.DONE
    t0 = time.monotonic()
    assert table.renew([lease_id], wait=5.0)[0].state == State.DONE  # nothing staging: answers at once
    assert time.monotonic() - t0 < 4
    # a poll on a lease whose staging never ends returns when the server stops (interrupt)
    slow_id, _ = table.open(_keys(10, start=60_000), ttl=30)
    real = table._leases[slow_id].future
    table._leases[slow_id].future = _NeverDone()  # type: ignore[assignment]
    out: list[list[pb.LeaseStatus]] = []
    poller = threading.Thread(target=lambda: out.append(table.renew([slow_id], wait=10.0)))
    poller.start()
    time.sleep(0.5)
    assert not out, "the poll waits while staging runs"
    t1 = time.monotonic()
    table.interrupt()
    poller.join(10)
    assert out and out[0][0].state == State.STAGING and time.monotonic() - t1 < 5
    table._leases[slow_id].future = real
    table.close()
    assert _pinned(cache) == 0


class _NeverDone:
    """A staging job that never ends (for the long-poll test)."""

    def done(self) -> bool:
        return False

    def cancel(self) -> bool:
        return True
