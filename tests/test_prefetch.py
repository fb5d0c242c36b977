"""Pass protocol and background staging: prefetch, begin_pass / end_pass, batch leases, LookAhead.

Races are made deterministic by pausing the background worker right after it read the store
(outside the table's lock), changing the rows meanwhile, then letting it install its copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import pytest
import torch

import embcache.cache as cache_mod
from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.errors import PassStateError, StoreError, UnknownTableError
from embcache.keyset import Keyset
from embcache.prefetch import LookAhead

from .conftest import row_bytes

DIM = 8
CFG = TableConfig(name="t", dim=DIM, optimizer="adagrad", lr=0.1, seed=3)


@pytest.fixture
def ref_cache(tmp_path: Any, store: str) -> Iterator[EmbeddingCache]:
    """A cache large enough to hold every row in HBM: the in-memory reference."""
    c = EmbeddingCache(CacheConfig(hbm_bytes=5000 * row_bytes(DIM, "adagrad"), ddr_bytes=0,
                                   path=str(tmp_path / "ref"), store=store, device="cpu"), [CFG])
    yield c
    c.close()


def both(caches: list[EmbeddingCache], fn: Callable[[EmbeddingCache], Any]) -> None:
    for c in caches:
        fn(c)


def assert_same_rows(a: EmbeddingCache, b: EmbeddingCache, keys: torch.Tensor) -> None:
    torch.testing.assert_close(a.lookup("t", keys), b.lookup("t", keys), rtol=0, atol=0)


def train(caches: list[EmbeddingCache], keys: torch.Tensor, seed: int) -> None:
    grads = torch.randn(keys.numel(), DIM, generator=torch.Generator().manual_seed(seed))
    for c in caches:
        c.apply_gradients("t", keys, grads)


def pinned(c: EmbeddingCache) -> int:
    s = c.stats()["t"]
    return int(s["hbm"]["pinned_rows"] + s["ddr"]["pinned_rows"])


class PausedWorker:
    """Pause the prefetch worker after its first store read (outside the lock) until ``go()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read_done = threading.Event()
        self.resume = threading.Event()
        original = EmbeddingCache._decode_or_create
        state = {"first": True}

        def paused(t: Any, keys: torch.Tensor, found: np.ndarray, records: np.ndarray) -> Any:
            out = original(t, keys, found, records)
            if threading.current_thread().name.startswith("embcache-prefetch") and state["first"]:
                state["first"] = False
                self.read_done.set()
                assert self.resume.wait(30)
            return out

        monkeypatch.setattr(EmbeddingCache, "_decode_or_create", staticmethod(paused))

    def wait_read(self) -> None:
        assert self.read_done.wait(30)

    def go(self) -> None:
        self.resume.set()


def test_prefetch_stages_rows_and_begin_pass_pins_hottest_in_hbm(make_cache: Any, ref_cache: EmbeddingCache) -> None:
    c = make_cache(hbm_rows=20, ddr_rows=60)
    keys = torch.arange(400)
    train([c, ref_cache], keys, 0)  # 400 rows written, most now only on disk
    g = torch.Generator().manual_seed(1)
    stream = (torch.rand(2000, generator=g) ** 3 * 400).long()  # skewed counts
    ks = Keyset.from_keys(stream)
    assert len(ks) > 80  # larger than HBM + DDR: the most frequent are staged
    res = c.prefetch({"t": ks}).result(timeout=30)
    assert res["t"]["staged_rows"] + res["t"]["leased_rows"] == 80
    assert pinned(c) == 80
    report = c.begin_pass({"t": ks})
    assert report["t"] == {"keyset_rows": len(ks), "pinned_rows": 80}
    hottest = ks.hottest_first()
    assert set(c.resident_keys("t", "hbm").tolist()) == set(hottest[:20].tolist())
    assert set(c.resident_keys("t", "ddr").tolist()) == set(hottest[20:80].tolist())
    reads = c.stats()["t"]["ssd"]["reads"]
    c.lookup("t", hottest[:80])  # the pass's rows are served from memory: no store read
    assert c.stats()["t"]["ssd"]["reads"] == reads
    assert_same_rows(c, ref_cache, keys)


def test_pinned_rows_never_evicted_within_a_pass(make_cache: Any, ref_cache: EmbeddingCache) -> None:
    c = make_cache(hbm_rows=10, ddr_rows=20)
    ks = Keyset.from_keys(torch.arange(1000, 1025))
    c.begin_pass({"t": ks})
    for i in range(30):  # traffic outside the keyset, hot enough to displace anything unpinned
        k = torch.randint(0, 200, (64,), generator=torch.Generator().manual_seed(i))
        train([c, ref_cache], k, i)
        c.lookup("t", k)
        ref_cache.lookup("t", k)
    resident = set(c.resident_keys("t", "hbm").tolist()) | set(c.resident_keys("t", "ddr").tolist())
    assert set(range(1000, 1025)) <= resident
    # HBM holds only pinned keyset rows, so every one of these lookups went below HBM and counted
    assert c.stats()["t"]["pass"]["outside_keyset"] == 30 * 64
    c.end_pass().result(timeout=30)
    assert pinned(c) == 0
    assert_same_rows(c, ref_cache, torch.arange(0, 1100))


def test_lookups_outside_the_keyset_work_and_are_counted(make_cache: Any, ref_cache: EmbeddingCache) -> None:
    c = make_cache(hbm_rows=4, ddr_rows=4)
    c.begin_pass({"t": torch.arange(8)})  # fills HBM and DDR, all pinned
    outside = torch.tensor([100, 101, 100, 5])
    torch.testing.assert_close(c.lookup("t", outside), ref_cache.lookup("t", outside), rtol=0, atol=0)
    assert c.stats()["t"]["pass"]["outside_keyset"] == 3
    c.end_pass()


def test_update_during_prefetch_is_not_overwritten_by_the_staged_copy(
        make_cache: Any, ref_cache: EmbeddingCache, monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_cache(hbm_rows=8, ddr_rows=16)
    keys = torch.arange(64)
    train([c, ref_cache], keys, 0)  # most rows on disk now
    target = torch.tensor([k for k in range(64) if k not in set(c.resident_keys("t", "hbm").tolist())
                           and k not in set(c.resident_keys("t", "ddr").tolist())][:10])
    pause = PausedWorker(monkeypatch)
    fut = c.prefetch({"t": target})
    pause.wait_read()  # the worker holds copies of `target` read from disk
    # Update them, then push them out of memory again (written back with the update) and back in
    train([c, ref_cache], target, 1)
    for i in range(5):
        train([c, ref_cache], torch.arange(100 + 24 * i, 124 + 24 * i), 10 + i)
    train([c, ref_cache], target[:3], 2)  # these three are resident again when the worker installs
    pause.go()
    fut.result(timeout=30)
    assert_same_rows(c, ref_cache, torch.cat([target, keys]))
    # and the same rows after everything was flushed and re-read from disk
    c.flush()
    assert_same_rows(c, ref_cache, torch.arange(0, 300))


def test_lookup_during_a_running_prefetch_returns_the_right_rows(
        make_cache: Any, ref_cache: EmbeddingCache, monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_cache(hbm_rows=8, ddr_rows=16)
    train([c, ref_cache], torch.arange(200), 0)
    monkeypatch.setattr(cache_mod, "_STAGE_CHUNK", 4)  # many chunks, interleaved with lookups
    pause = PausedWorker(monkeypatch)
    fut = c.prefetch({"t": torch.arange(150, 200)})
    pause.wait_read()
    got = c.lookup("t", torch.arange(140, 200))
    torch.testing.assert_close(got, ref_cache.lookup("t", torch.arange(140, 200)), rtol=0, atol=0)
    pause.go()
    for i in range(20):
        k = torch.arange(150 + i, 160 + i)
        train([c, ref_cache], k, 100 + i)
        torch.testing.assert_close(c.lookup("t", k), ref_cache.lookup("t", k), rtol=0, atol=0)
    fut.result(timeout=30)
    assert_same_rows(c, ref_cache, torch.arange(0, 200))


def test_cancel_stops_staging_and_releases_pins(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_cache(hbm_rows=8, ddr_rows=64)
    c.lookup("t", torch.arange(0, 4))
    monkeypatch.setattr(cache_mod, "_STAGE_CHUNK", 8)
    pause = PausedWorker(monkeypatch)
    fut = c.prefetch({"t": torch.arange(0, 60)})
    pause.wait_read()
    assert pinned(c) == 4  # the already resident rows are leased at once
    assert fut.cancel()
    pause.go()
    with pytest.raises(CancelledError):
        fut.result(timeout=30)
    c._stop_worker()  # wait until the worker is idle
    assert pinned(c) == 0
    assert c.stats()["t"]["prefetch"]["staged_rows"] == 0
    c.begin_pass({"t": torch.arange(0, 60)})  # a cancelled prefetch does not stop the pass
    c.end_pass()


def test_prefetch_error_surfaces_in_future_and_at_begin_pass(make_cache: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_cache(hbm_rows=4, ddr_rows=8)
    c.apply_gradients("t", torch.arange(50), torch.ones(50, DIM))
    store = c._store
    assert store is not None
    original = store.get_many
    fail = {"on": True}

    def flaky(table: str, keys: np.ndarray) -> Any:
        if fail["on"] and threading.current_thread().name.startswith("embcache-prefetch"):
            raise StoreError("simulated read failure")
        return original(table, keys)

    monkeypatch.setattr(store, "get_many", flaky)
    fut = c.prefetch({"t": torch.arange(20, 50)})
    with pytest.raises(StoreError, match="simulated"):
        fut.result(timeout=30)
    with pytest.raises(StoreError, match="simulated"):
        c.begin_pass({"t": torch.arange(20, 50)})
    assert pinned(c) == 0
    fail["on"] = False
    c.begin_pass({"t": torch.arange(20, 50)})  # surfaced once; the retry stages synchronously
    assert pinned(c) == 12
    c.end_pass()


def test_pass_state_errors_and_unknown_tables(make_cache: Any) -> None:
    c = make_cache()
    with pytest.raises(PassStateError):
        c.end_pass()
    with pytest.raises(UnknownTableError):
        c.prefetch({"nope": [1, 2]})
    with pytest.raises(UnknownTableError):
        c.begin_pass({"nope": [1, 2]})
    c.begin_pass({"t": [1, 2]})
    with pytest.raises(PassStateError):
        c.begin_pass({"t": [1, 2]})
    c.end_pass()
    assert pinned(c) == 0


def test_end_pass_writes_dirty_rows_back_in_the_background(make_cache: Any) -> None:
    c = make_cache(hbm_rows=8, ddr_rows=8)
    c.begin_pass({"t": torch.arange(16)})
    c.apply_gradients("t", torch.arange(16), torch.ones(16, DIM))
    written = c.end_pass().result(timeout=30)
    assert written == 16
    t = c._tables["t"]
    assert int(t.hbm.dirty.sum()) == 0 and int(t.ddr.dirty.sum()) == 0
    found, _ = c._store.get_many("t", np.arange(16, dtype=np.int64))  # type: ignore[union-attr]
    assert found.all()


def test_batch_leases_are_released(make_cache: Any, ref_cache: EmbeddingCache) -> None:
    c = make_cache(hbm_rows=8, ddr_rows=64)  # room for depth + 1 leased batches of 16 keys
    batches = [torch.randint(0, 500, (16,), generator=torch.Generator().manual_seed(i)) for i in range(12)]
    seen = 0
    for i, b in enumerate(LookAhead(c, batches, lambda b: {"t": b}, depth=3, wait=True)):
        assert pinned(c) >= b.unique().numel()  # this batch (and the next ones) are leased
        train([c, ref_cache], b, i)
        seen += 1
    assert seen == 12
    c._stop_worker()
    assert pinned(c) == 0
    # a loop that stops early, and a skipped batch, leak nothing either
    for i, b in enumerate(LookAhead(c, batches, lambda b: {"t": b}, depth=4)):
        if i == 1:
            continue
        if i == 5:
            break
        train([c, ref_cache], b, 100 + i)
    c._stop_worker()
    assert pinned(c) == 0
    lease = c.prefetch_batch({"t": batches[0]})
    lease.result(timeout=30)
    assert pinned(c) > 0
    lease.release()
    assert pinned(c) == 0
    assert_same_rows(c, ref_cache, torch.arange(500))


def test_close_during_prefetch_does_not_hang_or_lose_updates(make_cache: Any, tmp_path: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_cache(hbm_rows=4, ddr_rows=4)
    c.apply_gradients("t", torch.arange(100), torch.ones(100, DIM))
    monkeypatch.setattr(cache_mod, "_STAGE_CHUNK", 2)
    fut = c.prefetch({"t": torch.arange(100)})
    c.close()
    assert fut.done()
    c2 = EmbeddingCache(c.config)
    rows = c2.lookup("t", torch.arange(100))
    c2.close()
    assert torch.isfinite(rows).all()
    assert not torch.equal(rows[0], rows[1])
