"""Behaviour of EmbeddingCache on real RocksDB and LMDB stores: tiers, placement, persistence, errors."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from embcache import (
    BatchTooLargeError,
    CacheClosedError,
    CacheConfig,
    CheckpointExistsError,
    ConfigError,
    EmbeddingCache,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    NonFiniteGradientError,
    PassStateError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    TableConfig,
    TableConflictError,
    UnknownTableError,
)
from embcache.init import init_rows

from .conftest import row_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTREME = [-(2**63), 2**63 - 1, -1, 0, 1, 2**53 + 1, -(2**53) - 1, 123456789012345]


@pytest.fixture
def make_cache(device: str, make_cache: Any) -> Any:
    """The caches under test, on each device: "cpu", then "cuda" under the CPU stand-in
    (tests/fakecuda.py). ``device`` comes first, so the caches close before the stand-in goes."""
    return functools.partial(make_cache, device=device)


def assert_close(got: Any, want: Any, **kw: Any) -> None:
    """torch's assert_close on the host: rows of a cache on "cuda" against host tensors."""
    torch.testing.assert_close(got.cpu(), want.cpu(), **kw)


def expected_init(cfg: TableConfig, keys: list[int] | torch.Tensor) -> torch.Tensor:
    keys = torch.as_tensor(keys, dtype=torch.int64)
    return init_rows(cfg.initializer, float(cfg.init_scale or 0), cfg.seed, keys, cfg.dim)


def assert_tiers_consistent(cache: EmbeddingCache) -> None:
    """Each tier within capacity; no key in two tiers."""
    for name, s in cache.stats().items():
        for tier in ("hbm", "ddr"):
            assert s[tier]["resident_rows"] <= s[tier]["capacity_rows"]
        hbm = set(cache.resident_keys(name, "hbm").tolist())
        ddr = set(cache.resident_keys(name, "ddr").tolist())
        assert not hbm & ddr
        assert len(hbm) == s["hbm"]["resident_rows"] and len(ddr) == s["ddr"]["resident_rows"]


def test_first_touch_uses_initializer_and_counts_created(make_cache: Any) -> None:
    cache = make_cache()
    cfg = cache.tables()["t"]
    keys = torch.tensor(EXTREME)
    rows = cache.lookup("t", keys)
    assert rows.shape == (len(EXTREME), 8) and rows.dtype == torch.float32
    assert_close(rows, expected_init(cfg, keys), rtol=0, atol=0)
    s = cache.stats()["t"]
    assert s["lookups"] == len(EXTREME) == s["ssd"]["created"]
    # the same keys again, now from memory, identical
    assert_close(cache.lookup("t", keys), rows, rtol=0, atol=0)


def test_stats_lookups_add_up(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=3, ddr_rows=5)
    rng = np.random.default_rng(1)
    for _ in range(30):
        keys = torch.from_numpy(rng.integers(0, 40, size=16))
        cache.lookup("t", keys)
        cache.apply_gradients("t", keys, torch.randn(16, 8))
    s = cache.stats()["t"]
    assert s["lookups"] == 30 * 16
    assert s["lookups"] == s["hbm"]["hits"] + s["ddr"]["hits"] + s["ssd"]["hits"] + s["ssd"]["created"]
    assert s["ssd"]["write_rows"] > 0 and s["ssd"]["read_rows"] > 0
    assert s["hbm"]["promotions"] > 0 and s["ddr"]["demotions"] > 0 and s["ddr"]["write_backs"] > 0


def test_stats_misses_complete_the_hits_of_each_tier(make_cache: Any) -> None:
    """Per tier, hits + misses = the occurrences that reached it: lookups for HBM, HBM's misses for DDR,
    DDR's misses for the store, whose misses are the rows it created. Counters never go down."""
    cache = make_cache(hbm_rows=3, ddr_rows=5)

    def misses() -> dict[str, int]:
        s = cache.stats()["t"]
        return {tier: s[tier]["misses"] for tier in ("hbm", "ddr", "ssd")}

    cache.lookup("t", torch.tensor([1, 1, 2]))  # new rows: every occurrence misses every tier
    assert misses() == {"hbm": 3, "ddr": 3, "ssd": 3} and cache.stats()["t"]["ssd"]["created"] == 3
    cache.lookup("t", torch.tensor([2, 1]))  # both now in HBM (it had free slots)
    assert misses() == {"hbm": 3, "ddr": 3, "ssd": 3} and cache.stats()["t"]["hbm"]["hits"] == 2
    rng = np.random.default_rng(4)
    seen = misses()
    for step in range(40):  # skewed lookups over 60 keys with updates, assigns, prefetches and a pass
        keys = torch.from_numpy(np.minimum(rng.zipf(1.3, size=24), 60))
        cache.lookup("t", keys)
        cache.apply_gradients("t", keys, torch.randn(24, 8))
        if step % 7 == 0:
            cache.assign("t", keys[:3], torch.randn(3, 8))
        if step == 10:
            cache.prefetch({"t": torch.arange(40, 48)}).result(timeout=30)
        if step == 20:
            cache.begin_pass({"t": torch.arange(1, 5)})
        if step == 30:
            cache.end_pass().result(timeout=30)
        now = misses()
        assert all(now[tier] >= seen[tier] for tier in now), (seen, now)
        seen = now
    s = cache.stats()["t"]
    assert s["lookups"] == 3 + 2 + 40 * 24
    assert s["hbm"]["hits"] + s["hbm"]["misses"] == s["lookups"]
    assert s["ddr"]["hits"] + s["ddr"]["misses"] == s["hbm"]["misses"]
    assert s["ssd"]["hits"] + s["ssd"]["misses"] == s["ddr"]["misses"]
    assert s["ssd"]["misses"] == s["ssd"]["created"]
    assert min(s[tier]["hits"] for tier in ("hbm", "ddr", "ssd")) > 0  # the workload used every tier
    assert min(s[tier]["misses"] for tier in ("hbm", "ddr", "ssd")) > 0


def test_updates_survive_eviction_close_and_reopen(make_cache: Any, tmp_path: Any) -> None:
    cfg = TableConfig(name="t", dim=8, optimizer="sgd", lr=0.5, seed=7)
    cache = make_cache(hbm_rows=2, ddr_rows=3, tables=[cfg])
    keys = torch.tensor(EXTREME + list(range(100, 140)))
    grads = torch.randn(len(keys), 8)
    before = cache.lookup("t", keys).cpu()
    cache.apply_gradients("t", keys, grads)
    want = before - 0.5 * grads
    assert_close(cache.lookup("t", keys), want, rtol=0, atol=0)
    assert_tiers_consistent(cache)
    cache.close()
    again = make_cache(hbm_rows=5, ddr_rows=1, tables=[cfg])
    assert_close(again.lookup("t", keys), want, rtol=0, atol=0)


def test_duplicate_keys_sum_gradients(make_cache: Any) -> None:
    cfg = TableConfig(name="t", dim=4, optimizer="sgd", lr=1.0)
    cache = make_cache(tables=[cfg])
    base = cache.lookup("t", torch.tensor([5, 6])).cpu()
    g = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cache.apply_gradients("t", torch.tensor([5, 6, 5]), g)
    got = cache.lookup("t", torch.tensor([5, 6]))
    assert_close(got, torch.stack([base[0] - g[0] - g[2], base[1] - g[1]]))


def test_assign_overwrites_and_last_duplicate_wins(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=1, ddr_rows=1)
    rows = torch.randn(4, 8)
    cache.assign("t", torch.tensor([1, 2, 1, 3]), rows)
    got = cache.lookup("t", torch.tensor([1, 2, 3]))
    assert_close(got, rows[[2, 1, 3]], rtol=0, atol=0)


def test_assign_many_checks_every_table_before_changing_any(make_cache: Any) -> None:
    tables = [TableConfig(name="a", dim=4, optimizer="adam", seed=1), TableConfig(name="b", dim=8, seed=2)]
    cache = make_cache(hbm_rows=2, ddr_rows=2, tables=tables)
    ka, kb = torch.arange(10), torch.arange(10)
    before = {"a": cache.lookup("a", ka).cpu(), "b": cache.lookup("b", kb).cpu()}
    good_a, good_b = torch.randn(10, 4), torch.randn(10, 8)
    nan_b = good_b.clone()
    nan_b[7, 1] = float("nan")
    for bad, error in (({"a": (ka, good_a), "b": (kb, nan_b)}, InvalidRowsError),
                       ({"a": (ka, good_a), "b": (kb, torch.zeros(10, 4))}, InvalidRowsError),
                       ({"a": (ka, good_a), "nope": (kb, good_b)}, UnknownTableError)):
        with pytest.raises(error):
            cache.assign_many(bad)
        for name, k in (("a", ka), ("b", kb)):
            assert_close(cache.lookup(name, k), before[name], rtol=0, atol=0)  # table "a" untouched too
    cache.assign_many({"a": (ka, good_a), "b": (kb, good_b)})
    assert_close(cache.lookup("a", ka), good_a, rtol=0, atol=0)
    assert_close(cache.lookup("b", kb), good_b, rtol=0, atol=0)


def test_multiple_tables_of_different_dims(make_cache: Any) -> None:
    tables = [TableConfig(name="a", dim=4, optimizer="adam", seed=1),
              TableConfig(name="b", dim=16, optimizer="rowwise_adagrad", seed=2, dtype="float16")]
    cache = make_cache(tables=tables)
    ka, kb = torch.arange(20), torch.arange(20)
    ra, rb = cache.lookup("a", ka), cache.lookup("b", kb)
    assert ra.shape == (20, 4) and rb.shape == (20, 16) and rb.dtype == torch.float32
    assert not torch.equal(ra, rb[:, :4])  # different seeds
    cache.apply_gradients("b", kb, torch.ones(20, 16))
    assert not torch.equal(cache.lookup("b", kb), rb)
    assert_close(cache.lookup("a", ka), ra, rtol=0, atol=0)


def test_create_table_at_run_time_divides_memory_and_persists(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=8, ddr_rows=16)
    keys = torch.arange(24)
    cache.apply_gradients("t", keys, torch.ones(24, 8))
    before = cache.lookup("t", keys).clone()
    new = TableConfig(name="u", dim=8, optimizer="adagrad", lr=0.1, seed=9)
    assert cache.create_table(new) is True
    assert cache.create_table(new) is False  # idempotent for the same definition
    assert cache.capacity_rows("t") == {"hbm": 4, "ddr": 8}  # equal shares of the same bytes
    assert cache.capacity_rows("u") == {"hbm": 4, "ddr": 8}
    assert_close(cache.lookup("t", keys), before, rtol=0, atol=0)  # shrunk, nothing lost
    cache.apply_gradients("u", keys, torch.ones(24, 8))
    with pytest.raises(TableConflictError, match="lr"):
        cache.create_table(TableConfig(name="u", dim=8, optimizer="adagrad", lr=0.5, seed=9))
    with pytest.raises(ConfigError):
        cache.create_table({"name": "v", "dim": 8})  # type: ignore[arg-type]
    cache.begin_pass({"t": keys[:4]})
    with pytest.raises(PassStateError):
        cache.create_table(TableConfig(name="v", dim=4))
    cache.end_pass()
    u_rows = cache.lookup("u", keys).clone()
    cfg = cache.config
    cache.close()
    reopened = EmbeddingCache(cfg)
    try:
        assert set(reopened.tables()) == {"t", "u"}
        assert_close(reopened.lookup("u", keys), u_rows, rtol=0, atol=0)
        assert_close(reopened.lookup("t", keys), before, rtol=0, atol=0)
    finally:
        reopened.close()


def test_capacity_never_exceeded_and_tiers_disjoint(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=5, ddr_rows=7, policy="lrfu")
    rng = np.random.default_rng(0)
    for step in range(60):
        keys = torch.from_numpy(rng.zipf(1.3, size=32) % 97)
        cache.lookup("t", keys)
        if step % 3 == 0:
            cache.apply_gradients("t", keys, torch.randn(32, 8))
        assert_tiers_consistent(cache)
    s = cache.stats()["t"]
    assert s["hbm"]["resident_rows"] == 5 and s["ddr"]["resident_rows"] == 7


@pytest.mark.parametrize("policy,halflife", [("lrfu", 100_000.0), ("lfu", None)])
def test_hbm_holds_most_frequent_keys(make_cache: Any, policy: str, halflife: float | None) -> None:
    # stationary skew, half-life longer than the run: the HBM tier must hold the exact top keys
    hbm = 64
    cache = make_cache(hbm_rows=hbm, ddr_rows=128, policy=policy, halflife=halflife, eviction_sample=64)
    rng = np.random.default_rng(42)
    perm = rng.permutation(5000)
    counts: Counter[int] = Counter()
    for _ in range(150):
        keys = perm[np.minimum(rng.zipf(1.2, size=512) - 1, 4999)]
        counts.update(keys.tolist())
        cache.lookup("t", torch.from_numpy(keys))
    top = {k for k, _ in counts.most_common(hbm)}
    resident = set(cache.resident_keys("t", "hbm").tolist())
    assert len(resident & top) >= 0.9 * hbm, f"{len(resident & top)} of the top {hbm} keys in HBM"


def test_lru_policy_keeps_recent_keys(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=8, ddr_rows=0, policy="lru")
    for k in range(100):
        cache.lookup("t", torch.tensor([k]))
    assert set(cache.resident_keys("t", "hbm").tolist()) == set(range(92, 100))


def test_resident_keys_names_the_memory_tiers_it_serves(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=8, ddr_rows=8)
    cache.lookup("t", torch.arange(4))
    for tier in ("ssd", "HBM", ""):
        with pytest.raises(ConfigError, match="tier must be 'hbm' or 'ddr'"):
            cache.resident_keys("t", tier)
    assert set(cache.resident_keys("t", "hbm").tolist()) == {0, 1, 2, 3}
    assert cache.resident_keys("t", "ddr").numel() == 0


def test_user_score_function(make_cache: Any) -> None:
    # evict the largest keys first: the score is minus the key's last access... here: prefer small ids
    def score(freq: torch.Tensor, last: torch.Tensor, now: int) -> torch.Tensor:
        return -last.to(torch.float64)  # most recent evicted first (MRU)
    cache = make_cache(hbm_rows=4, ddr_rows=0, policy=score, admission=False)
    for k in range(10):
        cache.lookup("t", torch.tensor([k]))
    assert set(cache.resident_keys("t", "hbm").tolist()) == {0, 1, 2, 9}


@pytest.mark.parametrize("admission", [True, False])
def test_admission_keeps_a_one_off_row_from_displacing_hot_rows(make_cache: Any, admission: bool) -> None:
    # A full HBM tier of rows each looked up 10 times, no DDR; then a new row is looked up once.
    # With admission it loses to every resident row and stays out of memory (served all the same);
    # without, it takes a hot row's place.
    cache = make_cache(hbm_rows=4, ddr_rows=0, admission=admission)
    hot = torch.tensor([10, 11, 12, 13])
    for _ in range(10):
        cache.lookup("t", hot)
    assert set(cache.resident_keys("t", "hbm").tolist()) == set(hot.tolist())
    cfg = cache.tables()["t"]
    assert_close(cache.lookup("t", torch.tensor([99])), expected_init(cfg, [99]), rtol=0, atol=0)
    resident = set(cache.resident_keys("t", "hbm").tolist())
    assert len(resident) == 4
    if admission:
        assert resident == set(hot.tolist())
        hits = cache.stats()["t"]["hbm"]["hits"]
        cache.lookup("t", hot)
        assert cache.stats()["t"]["hbm"]["hits"] == hits + 4  # the hot rows are all still served from HBM
    else:
        assert 99 in resident and len(resident & set(hot.tolist())) == 3


@pytest.mark.parametrize("how", ["reopen", "restore"])
def test_access_frequencies_survive_reopen_and_restore(make_cache: Any, tmp_path: Any, store: str,
                                                       how: str) -> None:
    # Keys looked up 20 times before a close (or a checkpoint) are still known as hot after the
    # reopen (restore), when memory starts empty: newcomers looked up 3 times fill HBM, and one
    # lookup of each old hot key takes HBM back from them. A cache without that history keeps the
    # newcomers (3 lookups beat 1), so the history, i.e. the saved frequencies, makes the difference.
    hot, new = torch.arange(100, 104), torch.arange(200, 204)
    cfg = TableConfig(name="t", dim=8, optimizer="adagrad", lr=0.1, seed=3)
    first = make_cache(hbm_rows=4, ddr_rows=0, tables=[cfg], path=str(tmp_path / "first"))
    for _ in range(20):
        first.lookup("t", hot)
    if how == "reopen":
        first.close()
        cache = make_cache(hbm_rows=4, ddr_rows=0, tables=[cfg], path=str(tmp_path / "first"))
    else:
        first.checkpoint(str(tmp_path / "ckpt"))
        first.close()
        cache = EmbeddingCache.restore(str(tmp_path / "ckpt"), CacheConfig(
            hbm_bytes=4 * row_bytes(8, "adagrad"), ddr_bytes=0, path=str(tmp_path / "restored"), store=store,
            device="cpu"))
    control = make_cache(hbm_rows=4, ddr_rows=0, tables=[cfg], path=str(tmp_path / "control"))
    try:
        for c in (cache, control):
            assert len(c.resident_keys("t", "hbm")) == 0  # nothing in memory: only the frequencies came back
            for _ in range(3):
                c.lookup("t", new)
            assert set(c.resident_keys("t", "hbm").tolist()) == set(new.tolist())
            c.lookup("t", hot)
        assert set(cache.resident_keys("t", "hbm").tolist()) == set(hot.tolist())
        assert set(control.resident_keys("t", "hbm").tolist()) == set(new.tolist())
    finally:
        cache.close()


def test_checkpoint_restore_into_other_capacities_and_backend(make_cache: Any, tmp_path: Any, store: str) -> None:
    cfg = TableConfig(name="t", dim=8, optimizer="adam", lr=0.01, seed=5)
    cache = make_cache(hbm_rows=3, ddr_rows=4, tables=[cfg])
    keys = torch.tensor(EXTREME + list(range(50)))
    for _ in range(3):
        cache.lookup("t", keys)
        cache.apply_gradients("t", keys, torch.randn(len(keys), 8))
    ckpt = tmp_path / "ckpt"
    cache.checkpoint(str(ckpt))
    want = cache.lookup("t", keys)
    g = torch.randn(len(keys), 8)
    cache.apply_gradients("t", keys, g)  # after the checkpoint: not in it
    want_next = cache.lookup("t", keys)  # the next step from the checkpointed rows and Adam state
    # The same step from the same rows but fresh optimizer state (assign resets it) lands elsewhere,
    # so the comparison below tells restored state from lost state.
    fresh = make_cache(hbm_rows=20, ddr_rows=0, tables=[cfg], path=str(tmp_path / "fresh-state"))
    fresh.assign("t", keys, want)
    fresh.apply_gradients("t", keys, g)
    without_state = fresh.lookup("t", keys)
    assert (without_state - want_next).abs().max() > 1e-3
    other = "lmdb" if store == "rocksdb" else "rocksdb"
    for kind in (store, other):
        rb = row_bytes(8, "adam")
        restored = EmbeddingCache.restore(str(ckpt), CacheConfig(
            hbm_bytes=20 * rb, ddr_bytes=0, path=str(tmp_path / f"restored-{kind}"), store=kind, device="cpu"))
        with restored:
            assert restored.tables()["t"] == cfg
            assert_close(restored.lookup("t", keys), want, rtol=0, atol=0)
            # optimizer state came along: the same next step gives the same rows
            restored.apply_gradients("t", keys, g)
            assert_close(restored.lookup("t", keys), want_next, rtol=1e-6, atol=1e-7)
    with pytest.raises(CheckpointExistsError):
        cache.checkpoint(str(ckpt))


def test_flushed_updates_survive_sigkill(tmp_path: Any, store: str) -> None:
    path = tmp_path / "crash"
    script = textwrap.dedent(f"""
        import os, sys, numpy as np, torch
        sys.path.insert(0, {ROOT!r})
        from embcache import EmbeddingCache, CacheConfig, TableConfig
        cfg = CacheConfig(hbm_bytes=4 * 300, ddr_bytes=8 * 300, path={str(path)!r}, store={store!r}, device="cpu")
        cache = EmbeddingCache(cfg, [TableConfig(name="t", dim=8, optimizer="adagrad", lr=0.1)])
        keys = torch.arange(-50, 50) * 1_000_003
        for step in range(5):
            cache.lookup("t", keys)
            cache.apply_gradients("t", keys, torch.full((100, 8), float(step + 1)))
        cache.flush()
        np.save({str(tmp_path / "want.npy")!r}, cache.lookup("t", keys).numpy())
        cache.apply_gradients("t", keys[:10], torch.ones(10, 8))  # unflushed: may be lost
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    want = torch.from_numpy(np.load(tmp_path / "want.npy"))
    cfg = CacheConfig(hbm_bytes=0, ddr_bytes=0, path=str(path), store=store, device="cpu")
    with EmbeddingCache(cfg) as cache:
        got = cache.lookup("t", torch.arange(-50, 50) * 1_000_003)
        assert_close(got[10:], want[10:], rtol=0, atol=0)


def test_sigkill_during_overlapped_lookups_loses_no_flushed_update(tmp_path: Any, store: str) -> None:
    # A training loop whose every lookup misses memory for >= _OVERLAP_READ_MIN keys: each one reads
    # on a reader thread while it moves rows (dirty ones written back first, staged ones entering
    # with placeholder values). Killed at an arbitrary moment, the store holds for every key its
    # flushed value or a later one, never less, and never a placeholder (SGD lr 1, gradient 1:
    # a row is -k in every column after k updates).
    path, flushed = tmp_path / "crash", tmp_path / "flushed.npy"
    script = textwrap.dedent(f"""
        import os, sys, numpy as np, torch
        sys.path.insert(0, {ROOT!r})
        from embcache import EmbeddingCache, CacheConfig, TableConfig
        cfg = CacheConfig(hbm_bytes=8 * 200, ddr_bytes=16 * 200, path={str(path)!r}, store={store!r}, device="cpu")
        cache = EmbeddingCache(cfg, [TableConfig(name="t", dim=4, optimizer="sgd", lr=1.0, initializer="zeros")])
        counts = np.zeros(400, dtype=np.int64)
        gen = torch.Generator().manual_seed(0)
        for step in range(100_000):
            keys = torch.randperm(400, generator=gen)[:150]
            cache.lookup("t", keys)
            cache.apply_gradients("t", keys, torch.ones(150, 4))
            counts[keys.numpy()] += 1
            if step % 7 == 6:
                cache.flush()
                np.save({str(tmp_path / "tmp.npy")!r}, counts)
                os.replace({str(tmp_path / "tmp.npy")!r}, {str(flushed)!r})
                if step == 6:
                    print("flushed", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"flushed", proc.stderr
        time.sleep(1.5)  # some flushes, then mid-loop
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -9
    acked = np.load(flushed)
    cfg = CacheConfig(hbm_bytes=0, ddr_bytes=0, path=str(path), store=store, device="cpu")
    with EmbeddingCache(cfg) as cache:
        got = cache.lookup("t", torch.arange(400))
    k = -got[:, 0]
    assert torch.equal(got, got[:, :1].expand(-1, 4)) and torch.equal(k, k.round())  # no placeholder bits
    assert bool((k.numpy() >= acked).all()), int((k.numpy() < acked).sum())
    assert int(acked.sum()) > 0


def test_concurrent_threads_lose_no_update(make_cache: Any) -> None:
    # SGD with lr 1 and gradients that are small powers of two: sums are exact in any order
    tables = [TableConfig(name="a", dim=4, optimizer="sgd", lr=1.0, initializer="zeros"),
              TableConfig(name="b", dim=4, optimizer="sgd", lr=1.0, initializer="zeros")]
    cache = make_cache(hbm_rows=8, ddr_rows=8, tables=tables)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                keys = torch.from_numpy(rng.integers(0, 60, size=16))
                table = "a" if rng.random() < 0.5 else "b"
                cache.lookup(table, keys)
                cache.apply_gradients(table, keys, torch.full((16, 4), 0.25))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    expected = {"a": Counter[int](), "b": Counter[int]()}
    for seed in range(4):
        rng = np.random.default_rng(seed)
        for _ in range(40):
            keys = rng.integers(0, 60, size=16)
            table = "a" if rng.random() < 0.5 else "b"
            expected[table].update(keys.tolist())
    for table in ("a", "b"):
        got = cache.lookup(table, torch.arange(60))
        want = torch.tensor([-0.25 * expected[table][k] for k in range(60)]).unsqueeze(1).expand(60, 4)
        assert_close(got, want, rtol=0, atol=0)
    assert_tiers_consistent(cache)


# ---------------------------------------------------------------------------- bad input
def snapshot(cache: EmbeddingCache, keys: torch.Tensor) -> torch.Tensor:
    return cache.lookup("t", keys).clone()


@pytest.fixture
def filled(make_cache: Any) -> tuple[EmbeddingCache, torch.Tensor, torch.Tensor]:
    cache = make_cache(hbm_rows=2, ddr_rows=3)
    keys = torch.arange(12)
    cache.apply_gradients("t", keys, torch.randn(12, 8))
    return cache, keys, snapshot(cache, keys)


def test_unknown_table(filled: Any) -> None:
    cache, keys, before = filled
    with pytest.raises(UnknownTableError, match=r"unknown table 'nope'.*'t'"):
        cache.lookup("nope", keys)
    with pytest.raises(KeyError):
        cache.apply_gradients("nope", keys, torch.zeros(12, 8))
    assert_close(snapshot(cache, keys), before, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1.0, 2.0]),
                                 torch.tensor([True, False]), np.array([1.5]), "abc"])
def test_keys_not_1d_or_not_integer(filled: Any, bad: Any) -> None:
    cache, keys, before = filled
    with pytest.raises(InvalidKeysError):
        cache.lookup("t", bad)
    with pytest.raises(ValueError):
        cache.apply_gradients("t", bad, torch.zeros(2, 8))
    assert_close(snapshot(cache, keys), before, rtol=0, atol=0)


def test_other_integer_dtypes_are_accepted(filled: Any) -> None:
    cache, keys, before = filled
    assert_close(cache.lookup("t", keys.to(torch.int32)), before, rtol=0, atol=0)
    assert_close(cache.lookup("t", keys.numpy().astype(np.uint16)), before, rtol=0, atol=0)
    assert_close(cache.lookup("t", keys.tolist()), before, rtol=0, atol=0)


@pytest.mark.parametrize("grads,match", [
    (torch.zeros(12, 7), "shape"),
    (torch.zeros(11, 8), "shape"),
    (torch.zeros(12, 8, dtype=torch.int64), "floating"),
    (torch.zeros(12, 8, device="meta"), "allowed: cpu"),
    ([[0.0] * 8] * 12, "tensor"),
])
def test_bad_gradients(filled: Any, grads: Any, match: str) -> None:
    cache, keys, before = filled
    with pytest.raises(InvalidGradientError, match=match):
        cache.apply_gradients("t", keys, grads)
    assert_close(snapshot(cache, keys), before, rtol=0, atol=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradients_rejected(filled: Any, value: float) -> None:
    cache, keys, before = filled
    g = torch.zeros(12, 8)
    g[5, 3] = value
    with pytest.raises(NonFiniteGradientError, match="NaN or inf"):
        cache.apply_gradients("t", keys, g)
    assert_close(snapshot(cache, keys), before, rtol=0, atol=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradients_pass_when_not_rejected(make_cache: Any, value: float) -> None:
    # reject_nonfinite=False: no error; the row takes IEEE arithmetic's result (SGD: w - lr * g, so
    # NaN or -/+inf in that element only), keeps it through eviction and a reopen; other rows are unharmed.
    cfg = TableConfig(name="t", dim=8, optimizer="sgd", lr=0.5, seed=3)
    cache = make_cache(hbm_rows=2, ddr_rows=3, tables=[cfg], reject_nonfinite=False)
    keys = torch.arange(12)
    before = cache.lookup("t", keys).cpu()
    g = torch.ones(12, 8)
    g[5, 3] = value
    cache.apply_gradients("t", keys, g)
    want = before - 0.5 * g
    assert not torch.isfinite(want[5, 3]) and bool(torch.isfinite(want[5, [0, 1, 2, 4, 5, 6, 7]]).all())
    assert_close(cache.lookup("t", keys), want, rtol=0, atol=0, equal_nan=True)
    cache.lookup("t", torch.arange(100, 120).repeat(3))  # push key 5 out of memory (written back)
    assert 5 not in set(cache.resident_keys("t", "hbm").tolist()) | set(cache.resident_keys("t", "ddr").tolist())
    cache.close()
    again = make_cache(hbm_rows=2, ddr_rows=3, tables=[cfg], reject_nonfinite=False)
    assert_close(again.lookup("t", keys), want, rtol=0, atol=0, equal_nan=True)


def test_bad_assign_rows(filled: Any) -> None:
    cache, keys, before = filled
    with pytest.raises(InvalidRowsError):
        cache.assign("t", keys, torch.zeros(12, 3))
    with pytest.raises(InvalidRowsError, match="NaN"):
        cache.assign("t", keys, torch.full((12, 8), float("nan")))
    assert_close(snapshot(cache, keys), before, rtol=0, atol=0)


def test_empty_batch(filled: Any) -> None:
    cache, keys, before = filled
    out = cache.lookup("t", torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, 8)
    cache.apply_gradients("t", torch.empty(0, dtype=torch.int64), torch.empty(0, 8))
    assert cache.lookup("t", []).shape == (0, 8)
    assert_close(snapshot(cache, keys), before, rtol=0, atol=0)


def test_oversized_batch(make_cache: Any) -> None:
    cache = make_cache(max_batch_keys=10)
    with pytest.raises(BatchTooLargeError, match="max_batch_keys=10"):
        cache.lookup("t", torch.arange(11))
    assert cache.lookup("t", torch.arange(10)).shape == (10, 8)


def test_use_after_close(filled: Any, tmp_path: Any) -> None:
    cache, keys, before = filled
    cache.close()
    cache.close()  # idempotent
    never = tmp_path / "never"
    calls = (lambda: cache.lookup("t", keys), lambda: cache.apply_gradients("t", keys, torch.ones(12, 8)),
             cache.flush, lambda: cache.checkpoint(str(never)), lambda: cache.assign("t", keys, torch.zeros(12, 8)),
             lambda: cache.lookup_many({"t": keys}),
             lambda: cache.apply_gradients_many({"t": (keys, torch.ones(12, 8))}),
             lambda: cache.prefetch({"t": keys}), lambda: cache.begin_pass({"t": keys}),
             lambda: cache.create_table(TableConfig(name="u", dim=4)))
    for call in calls:
        with pytest.raises(CacheClosedError):
            call()
    assert not never.exists()
    # the stored rows are what they were before the refused calls
    with EmbeddingCache(cache.config) as again:
        assert set(again.tables()) == {"t"}
        assert_close(again.lookup("t", keys), before, rtol=0, atol=0)


def test_context_manager_closes_on_exit_and_on_error(tmp_path: Any, store: str) -> None:
    cfg = CacheConfig(hbm_bytes=2 * row_bytes(8), ddr_bytes=2 * row_bytes(8), path=str(tmp_path / "s"),
                      store=store, device="cpu")
    table = TableConfig(name="t", dim=8, optimizer="sgd", lr=1.0, initializer="zeros")
    keys = torch.arange(10)
    with EmbeddingCache(cfg, [table]) as c:
        c.apply_gradients("t", keys, torch.ones(10, 8))
    assert c.closed
    with pytest.raises(CacheClosedError):
        c.lookup("t", keys)
    with pytest.raises(CacheClosedError):
        c.apply_gradients("t", keys, torch.ones(10, 8))
    with pytest.raises(RuntimeError, match="boom"), EmbeddingCache(cfg) as d:  # the path was released
        d.apply_gradients("t", keys, torch.ones(10, 8))
        raise RuntimeError("boom")
    assert d.closed  # closed on the way out of the error too, with its updates written
    with pytest.raises(CacheClosedError):
        d.lookup("t", keys)
    with EmbeddingCache(cfg) as e:
        assert_close(e.lookup("t", keys), torch.full((10, 8), -2.0), rtol=0, atol=0)


def test_checkpoint_into_nonempty_directory(filled: Any, tmp_path: Any) -> None:
    cache, keys, before = filled
    d = tmp_path / "occupied"
    d.mkdir()
    (d / "something").write_text("x")
    with pytest.raises(CheckpointExistsError, match="not empty"):
        cache.checkpoint(str(d))
    assert os.listdir(d) == ["something"]
    assert_close(snapshot(cache, keys), before, rtol=0, atol=0)


def test_store_path_held_by_another_cache_or_process(filled: Any, store: str) -> None:
    cache, keys, before = filled
    cfg = cache.config
    with pytest.raises(StoreLockedError, match="held by another"):
        EmbeddingCache(cfg)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from embcache import EmbeddingCache, CacheConfig, StoreLockedError
        try:
            EmbeddingCache(CacheConfig(hbm_bytes=0, ddr_bytes=0, path={cfg.path!r}, store={store!r}, device="cpu"))
        except StoreLockedError as exc:
            print("locked:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "locked: store path" in proc.stdout, proc.stderr
    assert_close(snapshot(cache, keys), before, rtol=0, atol=0)


def test_table_conflict_on_reopen(make_cache: Any, tmp_path: Any) -> None:
    cache = make_cache(tables=[TableConfig(name="t", dim=8)])
    cache.lookup("t", torch.arange(3))
    cache.close()
    with pytest.raises(TableConflictError, match="dim: stored 8, given 16"):
        make_cache(tables=[TableConfig(name="t", dim=16)])
    reopened = make_cache(tables=[TableConfig(name="t", dim=8, lr=0.5)])  # lr may change
    assert reopened.tables()["t"].lr == 0.5


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="optimizer='adamw'"):
        TableConfig(name="t", dim=4, optimizer="adamw")
    with pytest.raises(ConfigError, match="dim"):
        TableConfig(name="t", dim=0)
    with pytest.raises(ConfigError, match="store='redis'"):
        CacheConfig(store="redis")
    with pytest.raises(ConfigError, match="exceed 90%"):
        CacheConfig(hbm_bytes=1 << 50, ddr_bytes=0, device="cpu")


@pytest.fixture
def small_disk(tmp_path: Any) -> Any:
    """An 8 MiB tmpfs: a real filesystem that fills up."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {proc.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_write_back_loses_nothing(small_disk: Any, store: str) -> None:
    options = {"write_buffer_bytes": 1 << 20} if store == "rocksdb" else {}
    cfg = CacheConfig(hbm_bytes=4 * 300, ddr_bytes=4 * 300, path=str(small_disk / "s"), store=store,
                      device="cpu", store_options=options)
    table = TableConfig(name="t", dim=64, optimizer="sgd", lr=1.0, seed=9)
    cache = EmbeddingCache(cfg, [table])
    filler = small_disk / "filler"

    def fill_disk() -> None:
        with open(filler, "ab", buffering=0) as f:  # unbuffered: nothing left to fail at close
            try:
                while True:
                    f.write(b"\0" * (1 << 12))
            except OSError:
                pass

    fill_disk()  # fill the disk, then leave 1 MB for the store
    os.truncate(filler, os.path.getsize(filler) - 1_000_000)
    applied = 0
    with pytest.raises(StoreFullError, match=r"No space left|disk is still full"):
        for _ in range(1000):
            cache.apply_gradients("t", torch.arange(applied, applied + 64), torch.ones(64, 64))
            applied += 64
    assert applied > 0
    # The failed batch changed nothing, every acknowledged update is there, lookups keep working.
    keys = torch.arange(applied + 64)
    want = expected_init(table, keys)
    want[:applied] -= 1.0
    # The rows not in memory are looked up 4 times each: hot enough to displace the dirty resident
    # rows, whose write-back the (now completely) full disk refuses; the lookup still serves every row.
    fill_disk()
    resident = torch.cat([cache.resident_keys("t", "hbm"), cache.resident_keys("t", "ddr")])
    cold = ~torch.isin(keys, resident)
    batch = torch.cat([keys, keys[cold].repeat(3)])
    with pytest.warns(UserWarning, match="could not be cached"):
        assert_close(cache.lookup("t", batch), torch.cat([want, want[cold].repeat(3, 1)]), rtol=0, atol=0)
    os.remove(filler)  # room again: writes, flush and close go through
    cache.apply_gradients("t", keys[applied:], torch.ones(64, 64))
    want[applied:] -= 1.0
    cache.close()
    with EmbeddingCache(cfg) as again:
        assert_close(again.lookup("t", keys), want, rtol=0, atol=0)


def test_exit_without_close_writes_back_and_exits_cleanly(tmp_path: Any, store: str) -> None:
    path = tmp_path / "atexit"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {ROOT!r})
        from embcache import EmbeddingCache, CacheConfig, TableConfig
        cache = EmbeddingCache(CacheConfig(hbm_bytes=600, ddr_bytes=600, path={str(path)!r}, store={store!r},
                                           device="cpu"), [TableConfig(name="t", dim=8, lr=1.0, initializer="zeros")])
        cache.apply_gradients("t", torch.arange(50), torch.ones(50, 8))
    """)  # no close(): the atexit hook must write the dirty rows back
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with EmbeddingCache(CacheConfig(hbm_bytes=0, ddr_bytes=0, path=str(path), store=store, device="cpu")) as cache:
        assert_close(cache.lookup("t", torch.arange(50)), torch.full((50, 8), -1.0))


def test_stats_report_the_age_of_an_unfinished_prefetch(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A prefetch blocked in its store read (a gate around the real RocksDB read) is reported by
    # its age, for the table it stages and not for the other; once it finishes, 0 again.
    tables = [TableConfig(name="a", dim=4), TableConfig(name="b", dim=4)]
    cache = EmbeddingCache(CacheConfig(hbm_bytes=1 << 16, ddr_bytes=1 << 16, path=str(tmp_path / "s"), device="cpu"),
                           tables)
    cache.assign("a", torch.arange(100), torch.ones(100, 4))
    cache.flush()
    cache.close()
    cache = EmbeddingCache(CacheConfig(hbm_bytes=1 << 16, ddr_bytes=1 << 16, path=str(tmp_path / "s"), device="cpu"))
    store = cache._store
    assert store is not None
    real, gate = store.get_many, threading.Event()

    def gated(table: str, keys: Any) -> Any:
        gate.wait(30)
        return real(table, keys)

    monkeypatch.setattr(store, "get_many", gated)
    assert cache.stats()["a"]["prefetch"]["running_seconds"] == 0.0
    fut = cache.prefetch({"a": torch.arange(100)})
    time.sleep(0.3)
    stats = cache.stats()
    assert stats["a"]["prefetch"]["running_seconds"] >= 0.25
    assert stats["b"]["prefetch"]["running_seconds"] == 0.0
    gate.set()
    fut.result(timeout=30)
    assert cache.stats()["a"]["prefetch"]["running_seconds"] == 0.0
    cache.close()


def test_failed_overlapped_store_read_fails_the_lookup_and_loses_nothing(make_cache: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A lookup missing memory for >= _OVERLAP_READ_MIN keys reads them on a reader thread while it
    # plans and makes its moves (writing back first the dirty rows it displaces; the rows being
    # read take their slots with placeholder values). When that read fails, the lookup raises
    # the store's error, the rows it was reading are not cached, and every update is still there.
    cfg = TableConfig(name="t", dim=8, optimizer="sgd", lr=1.0, seed=3)
    cache = make_cache(hbm_rows=4, ddr_rows=8, tables=[cfg])
    keys = torch.arange(300)
    cache.apply_gradients("t", keys, torch.ones(300, 8))  # the last 12 stay in memory, dirty
    want = expected_init(cfg, keys) - 1.0
    resident = {tier: set(cache.resident_keys("t", tier).tolist()) for tier in ("hbm", "ddr")}
    cold = keys[~torch.isin(keys, torch.tensor(sorted(resident["hbm"] | resident["ddr"])))][:100]
    store = cache._store
    assert store is not None
    real, threads = store.get_many, []

    def failing(table: str, k: Any) -> Any:
        threads.append(threading.current_thread().name)
        raise StoreError("injected read failure")

    monkeypatch.setattr(store, "get_many", failing)
    with pytest.raises(StoreError, match="injected read failure"):
        cache.lookup("t", cold.repeat(3))  # hot enough to displace every resident row
    assert threads and threads[0].startswith("embcache-read")
    now = {tier: set(cache.resident_keys("t", tier).tolist()) for tier in ("hbm", "ddr")}
    assert not (now["hbm"] | now["ddr"]) & set(cold.tolist())  # no placeholder stayed
    assert now["hbm"] | now["ddr"] <= resident["hbm"] | resident["ddr"]
    assert_tiers_consistent(cache)
    monkeypatch.setattr(store, "get_many", real)
    assert_close(cache.lookup("t", cold.repeat(3)), want[cold].repeat(3, 1), rtol=0, atol=0)
    assert_close(cache.lookup("t", keys), want, rtol=0, atol=0)
    assert_tiers_consistent(cache)


def test_misses_never_go_down_when_a_lookup_fails(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A lookup that found rows in DDR and then failed in its store read counts neither its lookups
    # nor those DDR hits; the exported misses are counters (Prometheus reads a drop as a restart).
    cache = make_cache(hbm_rows=4, ddr_rows=8)
    cache.lookup("t", torch.arange(12))
    cache.lookup("t", torch.arange(4).repeat(5))
    in_ddr = cache.resident_keys("t", "ddr")
    assert len(in_ddr) > 0
    before = cache.stats()["t"]
    store = cache._store
    assert store is not None

    def failing(table: str, k: Any) -> Any:
        raise StoreError("injected read failure")

    monkeypatch.setattr(store, "get_many", failing)
    with pytest.raises(StoreError):
        cache.lookup("t", torch.cat([in_ddr, torch.arange(100, 200)]))
    after = cache.stats()["t"]
    for tier in ("hbm", "ddr", "ssd"):
        assert after[tier]["misses"] >= before[tier]["misses"], tier
        assert after[tier]["hits"] == before[tier]["hits"], tier  # a failed lookup served nothing
    assert after["lookups"] == before["lookups"]


def test_update_after_lookup_reuses_the_rows_the_lookup_read(make_cache: Any) -> None:
    # A training step looks rows up, then updates them. Rows the lookup read from the store but
    # did not cache are kept for that update, which then reads nothing; a store write in between
    # (here of assigned rows) voids them, and the update reads the store again.
    cfg = TableConfig(name="t", dim=8, optimizer="sgd", lr=1.0, seed=3)
    cache = make_cache(hbm_rows=4, ddr_rows=8, tables=[cfg])
    keys = torch.arange(200)
    cache.apply_gradients("t", keys, torch.ones(200, 8))
    cache.flush()
    want = expected_init(cfg, keys) - 1.0

    def store_rows_read() -> int:
        return int(cache.stats()["t"]["ssd"]["read_rows"])

    batch = torch.arange(100, 200)
    assert_close(cache.lookup("t", batch), want[100:], rtol=0, atol=0)
    before = store_rows_read()
    cache.apply_gradients("t", batch, torch.ones(100, 8))
    want[100:] -= 1.0
    assert store_rows_read() == before
    assert_close(cache.lookup("t", batch), want[100:], rtol=0, atol=0)

    cache.lookup("t", batch)
    cache.assign("t", torch.arange(4), torch.full((4, 8), 5.0))
    want[:4] = 5.0
    cache.flush()  # the assigned rows reach the store here at the latest: what the lookup kept is void
    before = store_rows_read()
    cache.apply_gradients("t", batch, torch.ones(100, 8))
    want[100:] -= 1.0
    assert store_rows_read() > before
    assert_close(cache.lookup("t", keys), want, rtol=0, atol=0)


def test_rows_without_state_whose_weights_are_not_whole_words_round_trip_the_store(make_cache: Any) -> None:
    """float16 dim 3 with sgd: a 6-byte record and no state. Decoding once failed on viewing the
    empty state slice (at byte offset 6) as float32."""
    cache = make_cache(hbm_rows=0, ddr_rows=0, tables=[TableConfig(name="h", dim=3, dtype="float16")])
    keys = torch.arange(5)
    cache.assign("h", keys, torch.full((5, 3), 1.5))
    assert_close(cache.lookup("h", keys), torch.full((5, 3), 1.5))
