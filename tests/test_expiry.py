"""Expiry of rows (TableConfig.ttl_steps / ttl_seconds) and explicit deletion (EmbeddingCache.delete).

Real RocksDB and LMDB stores under tmp_path. A row that expired or was deleted is gone from the
tiers and the store, and a later lookup gets the initializer's row (compared with a fresh cache of
the same seed); a row touched within the TTL keeps its trained value.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.errors import CacheClosedError, ConfigError, InvalidKeysError, UnknownTableError
from embcache.metrics import register_metrics
from embcache.rpc.codec import table_from_proto, table_to_proto

from .conftest import row_bytes

TTL = 1000
DIM = 8


def _table(ttl_steps: int = TTL, ttl_seconds: float = 0.0) -> TableConfig:
    return TableConfig(name="t", dim=DIM, optimizer="adagrad", lr=0.5, seed=3, ttl_steps=ttl_steps,
                       ttl_seconds=ttl_seconds)


def _config(path: Path, store: str, hbm_rows: int = 8, ddr_rows: int = 8, **kw: Any) -> CacheConfig:
    rb = row_bytes(DIM, "adagrad")
    kw.setdefault("expiry_interval", 3600.0)  # sweeps run when the test says (expire_now)
    kw.setdefault("device", "cpu")
    return CacheConfig(path=str(path), store=store, hbm_bytes=hbm_rows * rb, ddr_bytes=ddr_rows * rb, **kw)


def _init_rows(tmp_path: Path, keys: Any) -> torch.Tensor:
    """The initializer's rows of ``keys`` (a fresh cache with the same seed)."""
    with EmbeddingCache(_config(tmp_path / "fresh", "lmdb"), [_table(0)]) as fresh:
        return fresh.lookup("t", keys)


def _stored(cache: EmbeddingCache, table: str = "t") -> int:
    return int(cache._store.count(table))  # type: ignore[union-attr]


def _train(cache: EmbeddingCache, keys: torch.Tensor) -> None:
    for k in keys.split(4):
        cache.lookup("t", k)
        cache.apply_gradients("t", k, torch.ones(k.numel(), DIM))


def _advance(cache: EmbeddingCache, steps: int, key: int = 10_000) -> None:
    """Move the table's clock ``steps`` ticks on, touching only ``key``."""
    cache.lookup("t", torch.full((steps,), key, dtype=torch.int64))


def test_untouched_rows_expire_from_every_tier_and_the_store(tmp_path: Path, store: str, device: str) -> None:
    trained = torch.arange(40)
    with EmbeddingCache(_config(tmp_path / "c", store, device=device), [_table()]) as cache:
        _train(cache, trained)
        cache.flush()
        where = {tier: set(cache.resident_keys("t", tier).tolist()) for tier in ("hbm", "ddr")}
        assert where["hbm"] and where["ddr"] and _stored(cache) == 40  # some in each tier, all stored
        kept = int(sorted(set(range(40)) - where["hbm"] - where["ddr"])[0])  # a row only in the store
        _advance(cache, 600)
        value = cache.lookup("t", [kept])  # touched again: it stays
        cache.expire_now()
        assert _stored(cache) == 40  # nothing is older than the TTL yet
        _advance(cache, 500)  # the others were last touched over 1,100 ticks ago, kept 500
        cache.expire_now()
        s = cache.stats()["t"]["expiry"]
        assert s["expired_hbm"] >= 1 and s["expired_ddr"] >= 1 and s["expired_store"] >= 1
        assert s["expired_hbm"] + s["expired_ddr"] + s["expired_store"] == 39 and s["sweeps"] == 2
        resident = set(cache.resident_keys("t", "hbm").tolist()) | set(cache.resident_keys("t", "ddr").tolist())
        assert not resident & (set(range(40)) - {kept})
        assert _stored(cache) == 1 and _stored(cache, "~touch/t") <= 2  # kept's row; its touch (and 10000's)
        torch.testing.assert_close(cache.lookup("t", [kept]).cpu(), value.cpu(), rtol=0, atol=0)
        gone = torch.tensor([k for k in range(40) if k != kept])
        torch.testing.assert_close(cache.lookup("t", gone).cpu(), _init_rows(tmp_path, gone), rtol=0, atol=0)


def test_an_update_touches_a_resident_row(tmp_path: Path, store: str, device: str) -> None:
    with EmbeddingCache(_config(tmp_path / "c", store, hbm_rows=64, device=device), [_table()]) as cache:
        _train(cache, torch.arange(4))
        _advance(cache, TTL - 10)
        cache.apply_gradients("t", [2], torch.ones(1, DIM))  # no lookup: the update alone touches row 2
        _advance(cache, 20)
        cache.expire_now()
        assert set(cache.resident_keys("t", "hbm").tolist()) == {2, 10_000}


def test_ttl_seconds_expires_by_wall_time(tmp_path: Path, store: str) -> None:
    with EmbeddingCache(_config(tmp_path / "c", store), [_table(0, ttl_seconds=0.5)]) as cache:
        _train(cache, torch.arange(20))
        cache.expire_now()
        assert cache.stats()["t"]["expiry"]["expired_store"] == 0
        time.sleep(0.7)
        value = cache.lookup("t", [3])  # touched after the others' TTL ran out
        cache.expire_now()
        s = cache.stats()["t"]["expiry"]
        assert s["expired_hbm"] + s["expired_ddr"] + s["expired_store"] == 19
        torch.testing.assert_close(cache.lookup("t", [3]), value, rtol=0, atol=0)


def test_the_background_sweeper_runs_every_interval(tmp_path: Path, store: str) -> None:
    with EmbeddingCache(_config(tmp_path / "c", store, expiry_interval=0.05), [_table()]) as cache:
        _train(cache, torch.arange(20))
        _advance(cache, TTL + 1)
        deadline = time.monotonic() + 10
        while _stored(cache) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stored(cache) == 0 and cache.stats()["t"]["expiry"]["sweeps"] >= 1
    # a table without a TTL starts no sweeper thread
    with EmbeddingCache(_config(tmp_path / "d", store), [_table(0)]) as cache:
        assert not cache._sweeper.running


def test_touches_survive_close_and_reopen(tmp_path: Path, store: str) -> None:
    path = tmp_path / "c"
    with EmbeddingCache(_config(path, store), [_table()]) as cache:
        _train(cache, torch.arange(40))
        _advance(cache, TTL - 100)
        before = cache.lookup("t", torch.arange(40))
    with EmbeddingCache(_config(path, store)) as cache:  # the stored definition keeps the TTL
        cache.expire_now()
        assert _stored(cache) == 40
        torch.testing.assert_close(cache.lookup("t", torch.arange(40)), before, rtol=0, atol=0)
        _advance(cache, TTL + 1)
        cache.expire_now()
        assert _stored(cache) == 0


_CRASH = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
from embcache import CacheConfig, EmbeddingCache, TableConfig
rb = {rb}
cache = EmbeddingCache(CacheConfig(path={path!r}, store={store!r}, hbm_bytes=8 * rb, ddr_bytes=8 * rb, device="cpu",
                                   expiry_interval=3600.0),
                       [TableConfig(name="t", dim=8, optimizer="adagrad", lr=0.5, seed=3, ttl_steps={ttl})])
cache.lookup("t", [7]); cache.apply_gradients("t", [7], torch.ones(1, 8))
cache.lookup("t", torch.arange(100, 140))     # row 7 leaves memory: stored with its touch (tick 1)
cache.lookup("t", torch.full(({ttl} + 500,), 10_000))
cache.lookup("t", [7])                        # touched again; resident, its new touch only in memory
cache.flush()                                 # ... until this flush makes it durable
cache.lookup("t", torch.full((200,), 10_000))  # lost with the process: the clock goes back to the flush
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_crash_never_expires_a_row_whose_touch_was_flushed(tmp_path: Path, store: str) -> None:
    path = tmp_path / "c"
    root = str(Path(__file__).resolve().parents[1])
    script = _CRASH.format(root=root, rb=row_bytes(DIM, "adagrad"), path=str(path), store=store, ttl=TTL)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    with EmbeddingCache(_config(path, store)) as cache:
        cache.expire_now()
        assert _stored(cache) == 1  # row 7: its stored touch is the flushed one, not tick 1
        _advance(cache, TTL + 1)
        cache.expire_now()
        assert _stored(cache) == 0


def test_rows_stored_before_the_ttl_was_on_are_adopted_not_deleted(tmp_path: Path, store: str) -> None:
    path = tmp_path / "c"
    with EmbeddingCache(_config(path, store), [_table(0)]) as cache:
        _train(cache, torch.arange(30))
        _advance(cache, 5 * TTL)  # long ago, but nothing tracked it
    with EmbeddingCache(_config(path, store), [_table()]) as cache:
        cache.expire_now()
        s = cache.stats()["t"]["expiry"]
        assert s["adopted_rows"] == 30 and _stored(cache) == 30  # touched "now" at the first sweep
        _advance(cache, TTL + 1)
        cache.expire_now()
        assert _stored(cache) == 0
    # off, then on again: rows touched while it was off are adopted again, not judged by stale touches
    with EmbeddingCache(_config(path, store), [_table(0)]) as cache:
        _train(cache, torch.arange(10))
        _advance(cache, 3 * TTL)
    with EmbeddingCache(_config(path, store), [_table()]) as cache:
        cache.expire_now()
        assert _stored(cache) == 10 and cache.stats()["t"]["expiry"]["adopted_rows"] == 10


def test_checkpoint_restored_into_the_other_backend_keeps_the_touches(tmp_path: Path, store: str) -> None:
    other = "lmdb" if store == "rocksdb" else "rocksdb"
    with EmbeddingCache(_config(tmp_path / "c", store), [_table()]) as cache:
        _train(cache, torch.arange(30))
        cache.checkpoint(tmp_path / "ck")
    with EmbeddingCache.restore(tmp_path / "ck", _config(tmp_path / "r", other)) as cache:
        cache.expire_now()
        assert _stored(cache) == 30 and cache.stats()["t"]["expiry"]["adopted_rows"] == 0
        _advance(cache, TTL + 1)
        cache.expire_now()
        assert _stored(cache) == 0


def test_delete_removes_rows_everywhere_even_mid_pass(tmp_path: Path, store: str) -> None:
    path = tmp_path / "c"
    keys = torch.arange(12)
    with EmbeddingCache(_config(path, store), [_table(0)]) as cache:
        _train(cache, keys)
        cache.flush()
        cache.begin_pass({"t": keys[:8]})
        cache.apply_gradients("t", keys[:8], torch.ones(8, DIM))  # dirty, pinned rows
        fut = cache.prefetch({"t": keys[8:]})  # staged copies of 8..11, read while deleting
        assert cache.delete("t", [0, 1, 1, 9, 500]) == 3  # 500 never had a row
        assert cache.delete("t", [0]) == 0
        cache.end_pass().result()
        fut.result()
        cache.begin_pass({"t": keys[8:]})  # adopts the prefetch: 9 must not come back from its copy
        got = cache.lookup("t", keys)
        cache.end_pass().result()
        s = cache.stats()["t"]
        assert s["expiry"]["deleted"] == 3 and s["pass"]["pinned_rows"] == 0
    dead = torch.tensor([0, 1, 9])
    torch.testing.assert_close(got[dead], _init_rows(tmp_path, dead), rtol=0, atol=0)
    assert not torch.equal(got[2], _init_rows(tmp_path, [2])[0])  # the others kept their training
    with EmbeddingCache(_config(path, store)) as cache:  # nothing came back from a write-back either
        torch.testing.assert_close(cache.lookup("t", dead), _init_rows(tmp_path, dead), rtol=0, atol=0)


def test_bad_input_is_refused_and_changes_nothing(tmp_path: Path, store: str) -> None:
    cache = EmbeddingCache(_config(tmp_path / "c", store), [_table()])
    _train(cache, torch.arange(8))
    with pytest.raises(UnknownTableError):
        cache.delete("nope", [1])
    with pytest.raises(InvalidKeysError):
        cache.delete("t", torch.tensor([1.5, 2.0]))
    with pytest.raises(InvalidKeysError):
        cache.delete("t", [[1, 2]])
    assert cache.stats()["t"]["expiry"]["deleted"] == 0 and cache.delete("t", []) == 0
    cache.close()
    with pytest.raises(CacheClosedError):
        cache.delete("t", [1])
    with pytest.raises(CacheClosedError):
        cache.expire_now()
    for bad in ({"ttl_steps": -1}, {"ttl_steps": 1.5}, {"ttl_steps": True}, {"ttl_seconds": -1.0},
                {"ttl_seconds": float("nan")}, {"ttl_seconds": float("inf")}):
        with pytest.raises(ConfigError):
            TableConfig(name="t", dim=4, **bad)
    for interval in (0, -1.0, float("nan"), True):
        with pytest.raises(ConfigError):
            CacheConfig(path=str(tmp_path / "x"), expiry_interval=interval)


def test_expiry_is_in_the_metrics_and_on_the_wire(tmp_path: Path, store: str) -> None:
    cfg = _table(123, ttl_seconds=4.5)
    assert table_from_proto(table_to_proto(cfg)) == cfg
    with EmbeddingCache(_config(tmp_path / "c", store), [_table()]) as cache:
        _train(cache, torch.arange(20))
        cache.delete("t", [0, 1])
        _advance(cache, TTL + 1)
        cache.expire_now()
        registry = CollectorRegistry()
        register_metrics(cache, registry)
        m = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
        e = cache.stats()["t"]["expiry"]
    t = (("table", "t"),)
    for tier, field in (("hbm", "expired_hbm"), ("ddr", "expired_ddr"), ("ssd", "expired_store")):
        assert m[("embcache_expired_rows_total", (("table", "t"), ("tier", tier)))] == e[field]
    # the 18 trained rows not deleted, and 10000: its batch touched it at the tick the batch began
    assert sum(e[f] for f in ("expired_hbm", "expired_ddr", "expired_store")) == 19
    assert m[("embcache_deleted_rows_total", t)] == e["deleted"] == 2
    assert m[("embcache_expiry_sweeps_total", t)] == e["sweeps"] == 1
    assert m[("embcache_expiry_last_sweep_seconds", t)] == e["last_sweep_seconds"] > 0


def test_a_stream_of_new_ids_reaches_a_plateau(tmp_path: Path) -> None:
    """200k distinct IDs, 4,000 new ones per step (assigned: stored rows; a lookup of 4,000 keys
    moves the clock), a sweep every 5 steps: the store holds about ttl_steps rows, not the 200k it
    would without a TTL (bench/bench_expiry.py runs 10M, with lookups and updates)."""
    ttl, batch, every = 40_000, 4000, 5
    rb = row_bytes(DIM, "adagrad")
    cfg = CacheConfig(path=str(tmp_path / "c"), store="rocksdb", hbm_bytes=1000 * rb, ddr_bytes=1000 * rb,
                      device="cpu", expiry_interval=3600.0)
    sizes = []
    with EmbeddingCache(cfg, [_table(ttl)]) as cache:
        rows = torch.ones(batch, DIM)
        for step in range(50):
            cache.assign("t", torch.arange(step * batch, (step + 1) * batch), rows)
            _advance(cache, batch, key=-1)
            if step % every == every - 1:
                cache.expire_now()
                sizes.append(_stored(cache))
    # rows touched within the TTL (10 steps) stay, and at most the 5 steps since the last sweep
    assert all(n <= ttl + every * batch for n in sizes), sizes
    assert min(sizes[3:]) >= ttl // 2 and max(sizes[-5:]) <= max(sizes[2:7])  # level, not growing


def test_a_row_touched_while_the_sweep_reads_its_old_touch_is_kept(tmp_path: Path, store: str) -> None:
    """The sweep reads touches without the lock: a row touched (and moved out of memory again) after
    its chunk was read must not be deleted on the stale touch."""
    with EmbeddingCache(_config(tmp_path / "c", store), [_table()]) as cache:
        _train(cache, torch.arange(40))
        _advance(cache, TTL + 1)  # every trained row has expired
        t = cache._tables["t"]
        read = t.rows.scan_touches

        def read_then_touch(start: int, limit: int) -> Any:
            out = read(start, limit)
            if start == -(2**63):  # meanwhile, another thread looks up row 5, then 40 others push it out
                value.append(cache.lookup("t", [5]))
                cache.lookup("t", torch.arange(100, 140).repeat(4))
                assert 5 not in set(cache.resident_keys("t", "hbm").tolist()) | set(
                    cache.resident_keys("t", "ddr").tolist())
            return out

        value: list[torch.Tensor] = []
        t.rows.scan_touches = read_then_touch  # type: ignore[method-assign]
        t.expiry.due.drop()  # as after a restart: this sweep walks the side namespace
        cache.expire_now()
        t.rows.scan_touches = read
        assert _stored(cache) == 1  # row 5, touched after its chunk was read
        torch.testing.assert_close(cache.lookup("t", [5]), value[0], rtol=0, atol=0)


def test_sweeps_read_only_the_touches_due_and_walk_once_after_a_restart(tmp_path: Path, store: str) -> None:
    """A sweep's cost follows what expires: it reads the touches of the buckets whose newest touch
    has expired, never the whole side namespace, except for one walk after a restart (the touches
    stored before it are in no bucket); rows touched since their bucket was written are kept."""
    def no_walk(start: int, limit: int) -> Any:
        raise AssertionError("the sweep walked the side namespace")

    with EmbeddingCache(_config(tmp_path / "c", store), [_table()]) as cache:
        t = cache._tables["t"]
        _train(cache, torch.arange(40))  # 40 rows, most of them stored (16 in memory)
        cache.expire_now()  # seals the bucket of these touches
        _advance(cache, 600)
        before = cache.lookup("t", torch.arange(30, 40))
        _train(cache, torch.arange(30, 40))  # rows 30..39 touched again, in a later bucket
        after = cache.lookup("t", torch.arange(30, 40))
        _advance(cache, 500)  # rows 0..29 are past their TTL, 30..39 are not
        cache.expire_now()  # seals the second bucket; the first is due
        t.rows.scan_touches = no_walk  # type: ignore[method-assign]
        cache.expire_now()
        assert cache.stats()["t"]["expiry"]["walks"] == 0
        assert cache.stats()["t"]["expiry"]["expired_store"] + cache.stats()["t"]["expiry"]["expired_hbm"] + \
            cache.stats()["t"]["expiry"]["expired_ddr"] == 30
        assert not torch.equal(before, after)
        torch.testing.assert_close(cache.lookup("t", torch.arange(30, 40)), after, rtol=0, atol=0)  # kept
    with EmbeddingCache(_config(tmp_path / "c", store), [_table()]) as cache:
        _advance(cache, TTL + 1)
        cache.expire_now()  # after the restart: one walk
        assert cache.stats()["t"]["expiry"]["walks"] == 1
        assert _stored(cache) <= 1  # everything expired (the key that moved the clock may be stored)
        cache._tables["t"].rows.scan_touches = no_walk  # type: ignore[method-assign]
        _train(cache, torch.arange(200, 210))
        cache.expire_now()
        assert cache.stats()["t"]["expiry"]["walks"] == 1
