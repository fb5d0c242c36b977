"""Pass protocol and background staging: prefetch, begin_pass / end_pass, batch leases, LookAhead.

Races are made deterministic by pausing the background worker right after it read the store
(outside the table's lock), changing the rows meanwhile, then letting it install its copy.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, wait
from typing import Any

import numpy as np
import pytest
import torch

import embcache.engine.passes as passes_mod
import embcache.hostmem as hostmem
from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.engine.rows import RecordCodec
from embcache.errors import PassStateError, StoreError, UnknownTableError
from embcache.keyset import Keyset
from embcache.prefetch import LookAhead, PrefetchFuture

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


@pytest.fixture
def make_cache(device: str, make_cache: Any) -> Any:
    """The caches under test, on each device: "cpu", then "cuda" under the CPU stand-in
    (tests/fakecuda.py); ``ref_cache`` stays on the CPU. ``device`` comes first, so the caches
    close before the stand-in goes."""
    return functools.partial(make_cache, device=device)


def assert_same_rows(a: EmbeddingCache, b: EmbeddingCache, keys: torch.Tensor) -> None:
    assert_rows(a.lookup("t", keys), b.lookup("t", keys))


def assert_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise on one device; across devices within float rounding (an update on a GPU runs
    torch's ops, on the CPU the fused kernel: their square roots round differently)."""
    exact = got.device == want.device
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0 if exact else 1e-5, atol=0 if exact else 1e-7)


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
        original = RecordCodec.decode_or_create
        state = {"first": True}

        def paused(codec: RecordCodec, keys: torch.Tensor, found: np.ndarray, records: np.ndarray) -> Any:
            out = original(codec, keys, found, records)
            if threading.current_thread().name.startswith("embcache-prefetch") and state["first"]:
                state["first"] = False
                self.read_done.set()
                assert self.resume.wait(30)
            return out

        monkeypatch.setattr(RecordCodec, "decode_or_create", paused)

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
    assert_rows(c.lookup("t", outside), ref_cache.lookup("t", outside))
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
    monkeypatch.setattr(passes_mod, "STAGE_CHUNK", 4)  # many chunks, interleaved with lookups
    pause = PausedWorker(monkeypatch)
    fut = c.prefetch({"t": torch.arange(150, 200)})
    pause.wait_read()
    got = c.lookup("t", torch.arange(140, 200))
    assert_rows(got, ref_cache.lookup("t", torch.arange(140, 200)))
    pause.go()
    for i in range(20):
        k = torch.arange(150 + i, 160 + i)
        train([c, ref_cache], k, 100 + i)
        assert_rows(c.lookup("t", k), ref_cache.lookup("t", k))
    fut.result(timeout=30)
    assert_same_rows(c, ref_cache, torch.arange(0, 200))


def test_cancel_stops_staging_and_releases_pins(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_cache(hbm_rows=8, ddr_rows=64)
    c.lookup("t", torch.arange(0, 4))
    monkeypatch.setattr(passes_mod, "STAGE_CHUNK", 8)
    pause = PausedWorker(monkeypatch)
    fut = c.prefetch({"t": torch.arange(0, 60)})
    pause.wait_read()
    assert pinned(c) == 4  # the already resident rows are leased at once
    assert fut.cancel()
    pause.go()
    with pytest.raises(CancelledError):
        fut.result(timeout=30)
    c._passes.stop()  # wait until the worker is idle
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
    assert t.hbm.dirty_slots().numel() == 0 and t.ddr.dirty_slots().numel() == 0
    found, _ = c._store.get_many("t", np.arange(16, dtype=np.int64))  # type: ignore[union-attr]
    assert found.all()


def pins_and_total(c: EmbeddingCache, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Pin count (int32 [n]) of each key's row (0 if not resident) and the table's pinned rows, at one instant."""
    t = c._tables["t"]
    with t.lock:  # the worker pins under this lock: both figures are of the same moment
        out = torch.zeros(keys.numel(), dtype=torch.int32)
        for tier in (t.hbm, t.ddr):
            slots = tier.find(keys).cpu()
            out[slots >= 0] += tier.pins_at(slots[slots >= 0]).cpu()
        return out, t.hbm.pinned_count() + t.ddr.pinned_count()


def pins_of(c: EmbeddingCache, keys: torch.Tensor) -> torch.Tensor:
    """Pin count (int32 [n]) of each key's row: how many holders keep it in memory (0 if not resident)."""
    return pins_and_total(c, keys)[0]


def disjoint_batches(n: int, size: int = 16, seed: int = 0) -> list[torch.Tensor]:
    """``n`` batches of ``size`` keys, no key in two batches: a row's pins tell whose lease holds it."""
    perm = torch.randperm(n * size, generator=torch.Generator().manual_seed(seed))
    return [perm[i * size:(i + 1) * size] for i in range(n)]


def record_leases(monkeypatch: pytest.MonkeyPatch, c: EmbeddingCache) -> list[PrefetchFuture]:
    """Keep every lease ``c.prefetch_batch`` hands out (to LookAhead), in order."""
    leases: list[PrefetchFuture] = []
    original = c.prefetch_batch

    def recording(keysets: Any) -> PrefetchFuture:
        leases.append(original(keysets))
        return leases[-1]

    monkeypatch.setattr(c, "prefetch_batch", recording)
    return leases


def keys_of(b: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"t": b}


def test_batch_leases_are_held_while_their_batch_is_used_and_released_after(
        make_cache: Any, ref_cache: EmbeddingCache) -> None:
    depth = 3
    c = make_cache(hbm_rows=8, ddr_rows=64)  # 72 rows: room for the depth + 1 leased batches of 16 keys
    batches = disjoint_batches(12)
    ones = torch.ones(16, dtype=torch.int32)
    seen = 0
    for i, b in enumerate(LookAhead(c, batches, keys_of, depth=depth, wait=True)):
        assert torch.equal(b, batches[i])
        # staged (wait=True) and held by exactly this batch's lease while the loop works on it
        assert torch.equal(pins_of(c, b), ones)
        # the leases of the batches before it were released once the next batch was yielded
        for j in range(i):
            assert not pins_of(c, batches[j]).any(), f"batch {j}'s lease leaked into batch {i}"
        # the only pins are those of this batch and the next `depth` ones (staged or staging)
        pins, total = pins_and_total(c, torch.cat(batches))
        held = pins.view(len(batches), 16) > 0
        assert not held[i + depth + 1:].any()  # batches beyond the window are not leased yet
        assert total == int(held.sum()) <= (depth + 1) * 16
        train([c, ref_cache], b, i)
        # traffic outside the window evicts every unpinned row; this batch's rows stay, pinned
        other = torch.arange(1000 + 100 * i, 1100 + 100 * i)
        c.lookup("t", other)
        ref_cache.lookup("t", other)
        assert torch.equal(pins_of(c, b), ones)
        seen += 1
    assert seen == 12
    assert pinned(c) == 0
    lease = c.prefetch_batch({"t": batches[0]})
    lease.result(timeout=30)
    assert torch.equal(pins_of(c, batches[0]), ones)
    lease.release()
    assert pinned(c) == 0
    assert_same_rows(c, ref_cache, torch.arange(2300))


def test_skipped_batches_and_early_exits_leave_nothing_pinned(make_cache: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_cache(hbm_rows=8, ddr_rows=64)
    batches = disjoint_batches(10)
    leases = record_leases(monkeypatch, c)
    for i, b in enumerate(LookAhead(c, batches, keys_of, depth=2, wait=True)):
        if i == 1:
            assert pins_of(c, b).all()
            continue  # skipped: never looked up
        if i == 2:
            assert not pins_of(c, batches[1]).any()  # the skipped batch's lease was released all the same
        if i == 4:
            wait(leases[4:7], timeout=30)  # batch 4 and the two staged ahead hold their rows now
            assert all(pins_of(c, batches[j]).all() for j in (4, 5, 6)) and pinned(c) == 48
            break
        c.lookup("t", b)
    # the break released batch 4's lease and cancelled the two ahead, at once
    assert pinned(c) == 0
    assert all(lease.done() for lease in leases) and len(leases) == 7  # batches 7.. were never leased
    # an exception in the loop's body, and an iterator closed by hand, leak nothing either
    with pytest.raises(RuntimeError, match="boom"):
        for i, _ in enumerate(LookAhead(c, batches, keys_of, depth=2, wait=True)):
            if i == 3:
                assert pinned(c) > 0
                raise RuntimeError("boom")
    assert pinned(c) == 0
    it = iter(LookAhead(c, batches, keys_of, depth=3, wait=True))
    next(it)
    next(it)
    assert pinned(c) >= 16
    it.close()  # type: ignore[attr-defined]
    assert pinned(c) == 0


class FailingStagingRead:
    """The prefetch worker's first store read of some of ``keys`` waits for ``go()``, then fails.

    The cache's own lookups (on the caller's thread) read the store normally.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, c: EmbeddingCache, keys: torch.Tensor) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        store = c._store
        assert store is not None
        original = store.get_many
        armed = {"on": True}
        target = keys.numpy()

        def flaky(table: str, ks: np.ndarray) -> Any:
            if (armed["on"] and threading.current_thread().name.startswith("embcache-prefetch")
                    and np.isin(ks, target).any()):
                armed["on"] = False
                self.entered.set()
                self.gate.wait(30)
                raise StoreError("simulated read failure")
            return original(table, ks)

        monkeypatch.setattr(store, "get_many", flaky)

    def wait_entered(self) -> None:
        """Until the worker is inside the read (its lease can no longer stop before it)."""
        assert self.entered.wait(30)

    def go(self) -> None:
        self.gate.set()


@pytest.fixture
def failing_read(monkeypatch: pytest.MonkeyPatch, make_cache: Any) -> Iterator[Callable[..., FailingStagingRead]]:
    """Factory of FailingStagingRead; opens every gate at teardown, before the caches close."""
    made: list[FailingStagingRead] = []

    def factory(c: EmbeddingCache, keys: torch.Tensor) -> FailingStagingRead:
        made.append(FailingStagingRead(monkeypatch, c, keys))
        return made[-1]

    yield factory
    for f in made:
        f.go()


def stored_cache(make_cache: Any, tmp_path: Any) -> EmbeddingCache:
    """A cache whose rows 0..199 are in the store and none in memory (closed and reopened)."""
    path = str(tmp_path / "stored")
    c = make_cache(hbm_rows=8, ddr_rows=64, path=path)
    c.apply_gradients("t", torch.arange(200), torch.ones(200, DIM))
    c.close()
    return make_cache(hbm_rows=8, ddr_rows=64, path=path)


def test_lookahead_without_wait_raises_a_late_staging_error_at_the_next_batch(
        make_cache: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        failing_read: Callable[..., FailingStagingRead]) -> None:
    c = stored_cache(make_cache, tmp_path)
    batches = disjoint_batches(6)
    failing = failing_read(c, batches[0])
    leases = record_leases(monkeypatch, c)
    it = iter(LookAhead(c, batches, keys_of, depth=2))
    b0 = next(it)
    failing.wait_entered()
    assert torch.equal(b0, batches[0]) and not leases[0].done()  # yielded while its staging runs
    failing.go()
    wait(leases[:1], timeout=30)
    assert isinstance(leases[0].exception(), StoreError)  # the staging failed after the yield
    c.apply_gradients("t", b0, torch.ones(16, DIM))  # the batch itself trains: its reads are its own
    with pytest.raises(StoreError, match="simulated"):
        next(it)  # the loop asks for batch 1: the error comes instead
    assert pinned(c) == 0 and all(lease.done() for lease in leases)
    with pytest.raises(StopIteration):
        next(it)  # the loop is over


def test_lookahead_without_wait_raises_an_error_of_staging_released_while_running(
        make_cache: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        failing_read: Callable[..., FailingStagingRead]) -> None:
    c = stored_cache(make_cache, tmp_path)
    batches = disjoint_batches(4)
    failing = failing_read(c, batches[0])
    leases = record_leases(monkeypatch, c)
    it = iter(LookAhead(c, batches, keys_of, depth=1))
    next(it)
    failing.wait_entered()
    assert torch.equal(next(it), batches[1])  # batch 0's lease released while its staging still runs
    assert not leases[0].done()
    failing.go()
    wait(leases[:1], timeout=30)
    with pytest.raises(StoreError, match="simulated"):
        next(it)  # raised at the first request after the staging failed
    assert pinned(c) == 0


def test_lookahead_without_wait_raises_a_pending_staging_error_when_batches_run_out(
        make_cache: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        failing_read: Callable[..., FailingStagingRead]) -> None:
    c = stored_cache(make_cache, tmp_path)
    batches = disjoint_batches(2)
    failing = failing_read(c, batches[0])
    leases = record_leases(monkeypatch, c)
    seen = []
    with pytest.raises(StoreError, match="simulated"):
        for b in LookAhead(c, batches, keys_of, depth=1):
            seen.append(b)
            if len(seen) == 1:
                failing.wait_entered()
            if len(seen) == 2:
                assert not leases[0].done()
                failing.go()  # fails while the loop finishes: the iterator waits for it at the end
    assert len(seen) == 2
    assert pinned(c) == 0


def test_close_during_prefetch_does_not_hang_or_lose_updates(make_cache: Any, tmp_path: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_cache(hbm_rows=4, ddr_rows=4)
    c.apply_gradients("t", torch.arange(100), torch.ones(100, DIM))
    monkeypatch.setattr(passes_mod, "STAGE_CHUNK", 2)
    fut = c.prefetch({"t": torch.arange(100)})
    c.close()
    assert fut.done()
    c2 = EmbeddingCache(c.config)
    rows = c2.lookup("t", torch.arange(100))
    c2.close()
    assert torch.isfinite(rows).all()
    assert not torch.equal(rows[0], rows[1])


def test_background_jobs_return_freed_memory_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each staging or write-back job asks for a heap trim; trimming after every job made the
    # next one fault its buffers in again, so trims are spaced out, and a request inside the
    # interval is served when the interval ends (an idle process still returns its memory).
    trims: list[float] = []
    served = threading.Event()

    def trim() -> None:
        trims.append(1.0)
        if len(trims) == 2:
            served.set()

    monkeypatch.setattr(hostmem, "_malloc_trim", trim)
    monkeypatch.setattr(hostmem, "_TRIM_INTERVAL", 0.3)
    monkeypatch.setattr(hostmem, "_TRIM_STATE", {"last": float("-inf"), "timer": None})
    for _ in range(5):
        hostmem.trim_heap()
    assert len(trims) == 1  # the first at once, the other four folded into one deferred trim
    assert served.wait(5.0)
    assert len(trims) == 2
    assert hostmem._TRIM_STATE["timer"] is None
