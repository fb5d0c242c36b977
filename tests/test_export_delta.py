"""Delta export of an embedded cache: every change lands in the next delta and only there, the
folded versions equal the cache's own rows, nothing is missed across a crash, imports round-trip."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.engine.changes import marks_table
from embcache.errors import CacheClosedError, TableConflictError, UnknownTableError
from embcache.export import ExportFormatError, from_tensor, latest_version, list_versions, load_model, read_table
from embcache.export.format import weights_tensor

SMALL = 1 << 16  # tier bytes of the caches a test opens by hand (the default sizes from RAM take long to allocate)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = [TableConfig(name="t", dim=8, optimizer="adagrad", lr=0.1, seed=3),
          TableConfig(name="u", dim=4, optimizer="sgd", lr=0.5, seed=4, dtype="float16")]


def _train(cache: EmbeddingCache, table: str, keys: np.ndarray, value: float) -> None:
    k = torch.from_numpy(keys)
    cache.lookup(table, k)
    cache.apply_gradients(table, k, torch.full((k.numel(), cache.tables()[table].dim), value, device=cache.device))


def _rows(cache: EmbeddingCache, table: str, keys: np.ndarray) -> torch.Tensor:
    """The cache's rows of ``keys`` (on the CPU) in the table's storage dtype (what an export holds)."""
    return cache.lookup(table, torch.from_numpy(keys)).cpu().to(cache.tables()[table].torch_dtype)


def _folded(directory: Path, table: str, with_state: bool = False) -> tuple[np.ndarray, torch.Tensor, Any]:
    _, model = load_model(str(directory), with_state=with_state)
    rows = model[table]
    return rows.keys, weights_tensor(rows.weights, rows.dtype), rows.state


def test_changed_and_deleted_keys_land_in_the_next_delta_only(device: str, make_cache: Any, tmp_path: Path) -> None:
    # most rows live in the store; "fakecuda": the CUDA branches under the CPU stand-in (tests/fakecuda.py)
    cache = make_cache(hbm_rows=4, ddr_rows=8, tables=TABLES, device=device)
    out = tmp_path / "exports"
    first = np.arange(0, 40, dtype=np.int64)
    _train(cache, "t", first, 1.0)
    _train(cache, "u", first[:10], 1.0)
    r1 = cache.export_delta(out)
    assert (r1.version, r1.kind, r1.tables["t"]["rows"], r1.tables["u"]["rows"]) == (1, "full", 40, 10)

    changed = np.array([3, 5, 100, 101], dtype=np.int64)  # two old keys, two new ones
    _train(cache, "t", changed, 2.0)
    cache.delete_rows("t", np.array([7, 8], dtype=np.int64))
    r2 = cache.export_delta(out)
    assert (r2.version, r2.kind) == (2, "delta")
    v2 = latest_version(str(out))
    assert v2 is not None and v2.base_version == 1
    part = read_table(v2, "t")
    assert sorted(part["keys"].tolist()) == changed.tolist()
    assert sorted(part["deleted"].tolist()) == [7, 8]
    assert read_table(v2, "u")["keys"].size == 0  # nothing changed there
    order = np.argsort(part["keys"])
    assert torch.equal(weights_tensor(part["weights"], "float32")[torch.from_numpy(order)],
                       _rows(cache, "t", part["keys"][order]))

    r3 = cache.export_delta(out)  # nothing changed since: an empty delta
    assert (r3.version, r3.kind, r3.rows, r3.deleted) == (3, "delta", 0, 0)

    keys, weights, _ = _folded(out, "t")  # full + deltas = the cache's rows, exactly
    assert keys.tolist() == sorted(set(first.tolist()) - {7, 8} | {100, 101})
    assert torch.equal(weights, _rows(cache, "t", keys))
    keys_u, weights_u, _ = _folded(out, "u")
    assert torch.equal(weights_u, _rows(cache, "u", keys_u))


def test_with_state_exports_the_optimizer_state(make_cache: Any, tmp_path: Path) -> None:
    cache = make_cache(hbm_rows=2, ddr_rows=2, tables=TABLES[:1])
    keys = np.arange(10, dtype=np.int64)
    _train(cache, "t", keys, 1.0)
    cache.export_delta(tmp_path / "e", with_state=True)
    _train(cache, "t", keys[:3], 3.0)
    cache.export_delta(tmp_path / "e", with_state=True)
    _, _, state = _folded(tmp_path / "e", "t", with_state=True)
    assert state is not None and state.shape == (10, 8)
    # adagrad's accumulator: the sum of squared gradients
    want = np.full((10, 8), 1.0, dtype=np.float32)
    want[:3] += 9.0
    assert np.array_equal(state, want)
    # the next cache takes the state along: one more step there equals one more step here
    other = EmbeddingCache(CacheConfig(path=str(tmp_path / "other"), store=cache.config.store, device="cpu",
                                       hbm_bytes=SMALL, ddr_bytes=SMALL))
    try:
        assert other.import_version(tmp_path / "e") == {"t": 10}
        for c in (cache, other):
            _train(c, "t", keys, 0.5)
        assert torch.equal(other.lookup("t", torch.from_numpy(keys)), cache.lookup("t", torch.from_numpy(keys)))
    finally:
        other.close()


def test_a_failed_version_write_leaves_no_version_and_keeps_the_marks(make_cache: Any, tmp_path: Path) -> None:
    cache = make_cache(tables=TABLES[:1])
    out = tmp_path / "e"
    _train(cache, "t", np.arange(20, dtype=np.int64), 1.0)
    cache.export_delta(out)
    _train(cache, "t", np.array([1, 2], dtype=np.int64), 5.0)
    # the temporary directory of version 2 cannot be made: the write fails half-way
    (out / f"v00000002.tmp-{os.getpid()}").write_text("in the way")
    with pytest.raises(OSError):
        cache.export_delta(out)
    assert list_versions(str(out)) == [1]
    os.remove(out / f"v00000002.tmp-{os.getpid()}")
    stale = out / "v00000002.tmp-999999999"  # what a writer killed half-way leaves: ignored
    stale.mkdir()
    (stale / "t0000.npz").write_bytes(b"half")
    _train(cache, "t", np.array([3], dtype=np.int64), 5.0)
    r = cache.export_delta(out)
    v = latest_version(str(out))
    assert v is not None and (r.version, r.kind) == (2, "delta")
    assert sorted(read_table(v, "t")["keys"].tolist()) == [1, 2, 3]


def test_another_directory_or_a_lost_version_gets_a_full_version(make_cache: Any, tmp_path: Path) -> None:
    cache = make_cache(tables=TABLES[:1])
    _train(cache, "t", np.arange(10, dtype=np.int64), 1.0)
    assert cache.export_delta(tmp_path / "a").kind == "full"
    assert cache.export_delta(tmp_path / "a").kind == "delta"
    b = cache.export_delta(tmp_path / "b")  # a delta there would miss what went to "a"
    assert (b.kind, b.rows) == ("full", 10)
    assert cache.export_delta(tmp_path / "a").kind == "full"  # "a" did not get b's changes
    assert cache.export_delta(tmp_path / "a", full=True).kind == "full"


def test_marks_and_state_travel_with_a_checkpoint_into_the_other_backend(make_cache: Any, tmp_path: Path,
                                                                          store: str) -> None:
    cache = make_cache(tables=TABLES[:1])
    _train(cache, "t", np.arange(10, dtype=np.int64), 1.0)
    cache.export_delta(tmp_path / "e")
    _train(cache, "t", np.array([4, 50], dtype=np.int64), 2.0)
    cache.flush()
    cache.checkpoint(tmp_path / "ckpt")
    other = "lmdb" if store == "rocksdb" else "rocksdb"
    restored = EmbeddingCache.restore(tmp_path / "ckpt", CacheConfig(path=str(tmp_path / "r"), store=other,
                                                                     hbm_bytes=SMALL, ddr_bytes=SMALL, device="cpu"))
    try:
        r = restored.export_delta(tmp_path / "e")
        v = latest_version(str(tmp_path / "e"))
        assert v is not None and (r.kind, sorted(read_table(v, "t")["keys"].tolist())) == ("delta", [4, 50])
    finally:
        restored.close()


def test_changes_flushed_before_a_kill_are_in_the_next_export(tmp_path: Path, store: str) -> None:
    path, out = tmp_path / "crash", tmp_path / "e"
    script = textwrap.dedent(f"""
        import os, sys, numpy as np, torch
        sys.path.insert(0, {ROOT!r})
        from embcache import EmbeddingCache, CacheConfig, TableConfig
        cfg = CacheConfig(hbm_bytes=4 * 300, ddr_bytes=8 * 300, path={str(path)!r}, store={store!r}, device="cpu")
        cache = EmbeddingCache(cfg, [TableConfig(name="t", dim=8, optimizer="adagrad", lr=0.1)])
        keys = torch.arange(0, 100)
        cache.lookup("t", keys)
        cache.apply_gradients("t", keys, torch.ones(100, 8))
        cache.export_delta({str(out)!r})
        changed = torch.tensor([5, 17, 99, 1000])
        cache.lookup("t", changed)
        cache.apply_gradients("t", changed, torch.full((4, 8), 2.0))
        cache.delete_rows("t", torch.tensor([40, 41]))
        cache.flush()
        np.save({str(tmp_path / "want.npy")!r}, cache.lookup("t", changed).numpy())
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    cfg = CacheConfig(hbm_bytes=0, ddr_bytes=0, path=str(path), store=store, device="cpu")
    with EmbeddingCache(cfg) as cache:
        r = cache.export_delta(out)
        assert (r.version, r.kind) == (2, "delta")
        v = latest_version(str(out))
        assert v is not None
        part = read_table(v, "t")
        assert sorted(part["keys"].tolist()) == [5, 17, 99, 1000]
        assert sorted(part["deleted"].tolist()) == [40, 41]
        order = np.argsort(part["keys"])
        want = torch.from_numpy(np.load(tmp_path / "want.npy"))
        assert torch.equal(torch.from_numpy(part["weights"][order]), want)


def test_a_plain_embedding_bag_imports_with_identical_lookups(tmp_path: Path, store: str) -> None:
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(50, 8, mode="sum")
    opt = torch.optim.SGD(bag.parameters(), lr=0.1)
    for _ in range(5):
        idx = torch.randint(0, 50, (32, 3))
        opt.zero_grad()
        bag(idx).pow(2).sum().backward()
        opt.step()
    cfg = TableConfig(name="items", dim=8, optimizer="sgd", lr=0.1)
    ids = torch.arange(50) * 7 + 3  # the ids the rows stand for
    from_tensor(tmp_path / "e", cfg, ids, bag.weight)
    with EmbeddingCache(CacheConfig(path=str(tmp_path / "c"), store=store, device="cpu", hbm_bytes=1000,
                                        ddr_bytes=SMALL)) as cache:
        assert cache.import_version(tmp_path / "e") == {"items": 50}
        assert cache.tables()["items"] == cfg
        assert torch.equal(cache.lookup("items", ids), bag.weight.detach())
        idx = torch.randint(0, 50, (16, 3))
        assert_close(cache.lookup("items", ids[idx].flatten()).view(16, 3, 8).sum(1), bag(idx).detach())


def test_bad_input_errors_clearly(make_cache: Any, tmp_path: Path) -> None:
    cache = make_cache(tables=TABLES[:1])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportFormatError, match="not a directory"):
        cache.export_delta(tmp_path / "file")
    with pytest.raises(UnknownTableError):
        cache.export_delta(tmp_path / "e", tables=["nope"])
    assert not (tmp_path / "e").exists()
    with pytest.raises(ExportFormatError, match="no complete version"):
        cache.import_version(tmp_path / "e")
    conflicting = TableConfig(name="t", dim=4)
    from_tensor(tmp_path / "x", conflicting, np.arange(3), torch.zeros(3, 4))
    with pytest.raises(TableConflictError, match="dim"):
        cache.import_version(tmp_path / "x")
    with pytest.raises(ExportFormatError, match="unique"):
        from_tensor(tmp_path / "x", conflicting, np.array([1, 1, 2]), torch.zeros(3, 4))
    with pytest.raises(ExportFormatError, match="weight"):
        from_tensor(tmp_path / "x", conflicting, np.arange(3), torch.zeros(3, 5))
    cache.close()
    with pytest.raises(CacheClosedError):
        cache.export_delta(tmp_path / "e")


def test_no_marks_are_written_before_the_first_export(make_cache: Any) -> None:
    cache = make_cache(tables=TABLES[:1])
    _train(cache, "t", np.arange(30, dtype=np.int64), 1.0)
    cache.flush()
    store = cache._store
    assert store is not None and marks_table("t") not in store.tables()


def test_cli_export_and_import_round_trip(make_cache: Any, tmp_path: Path, store: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from embcache.cli import main

    cache = make_cache(tables=TABLES, path=str(tmp_path / "src"))
    keys = np.arange(0, 60, dtype=np.int64)
    _train(cache, "t", keys, 1.0)
    _train(cache, "u", keys[:20], 1.0)
    want_t, want_u = _rows(cache, "t", keys), _rows(cache, "u", keys[:20])
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "e")]) == 1  # the trainer holds it
    assert "held by another process" in capsys.readouterr().err
    cache.checkpoint(tmp_path / "ckpt")
    cache.close()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "e"), "--table", "t"]) == 0  # a checkpoint
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "e"), "--with-state"]) == 0  # a closed path
    assert "wrote version 2 (full)" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "e"), "--table", "nope"]) == 1
    assert "no table 'nope'" in capsys.readouterr().err
    _, model = load_model(str(tmp_path / "e"), 1)
    assert list(model) == ["t"]

    assert main(["import", str(tmp_path / "e"), str(tmp_path / "dst"), "--store", store]) == 0
    assert "imported 80 rows" in capsys.readouterr().out
    with EmbeddingCache(CacheConfig(path=str(tmp_path / "dst"), store=store, device="cpu", hbm_bytes=SMALL,
                                    ddr_bytes=SMALL)) as back:
        assert back.tables() == {c.name: c for c in TABLES}
        assert torch.equal(_rows(back, "t", keys), want_t)
        assert torch.equal(_rows(back, "u", keys[:20]), want_u)
        back.lookup("t", torch.from_numpy(keys))  # the state came along: the same step gives the same rows
        back.apply_gradients("t", torch.from_numpy(keys), torch.ones(60, 8))
        after = back.lookup("t", torch.from_numpy(keys))
    with EmbeddingCache(CacheConfig(path=str(tmp_path / "src"), store=store, device="cpu", hbm_bytes=SMALL,
                                    ddr_bytes=SMALL)) as again:
        again.lookup("t", torch.from_numpy(keys))
        again.apply_gradients("t", torch.from_numpy(keys), torch.ones(60, 8))
        assert torch.equal(again.lookup("t", torch.from_numpy(keys)), after)
    (tmp_path / "x").mkdir()
    assert main(["export", str(tmp_path / "x"), str(tmp_path / "e")]) == 1
    assert "holds no embcache store" in capsys.readouterr().err


def test_marked_keys_answer_like_a_set() -> None:
    from embcache.engine.changes import MarkedKeys

    rng = np.random.default_rng(0)
    marked, want = MarkedKeys(limit=5000), set()
    for _ in range(200):
        keys = rng.integers(-3000, 3000, size=int(rng.integers(0, 60))).astype(np.int64)
        missing = marked.missing(keys)
        assert missing.tolist() == [k not in want for k in keys.tolist()]
        marked.add(keys[missing])
        if marked.size == len(want | set(keys[missing].tolist())):
            want |= set(keys[missing].tolist())
        else:  # the limit was reached: nothing is remembered, so the keys are marked again later
            assert marked.size == len(want)
    assert len(marked.runs) <= 12  # runs merge: few binary searches per lookup
    marked.clear()
    assert marked.missing(np.array([1, 2], dtype=np.int64)).all()


def test_a_key_rewritten_after_an_export_is_marked_again(make_cache: Any, tmp_path: Path) -> None:
    cache = make_cache(hbm_rows=2, ddr_rows=2, tables=TABLES[:1])  # every step writes rows back
    keys = np.arange(8, dtype=np.int64)
    for _ in range(3):
        _train(cache, "t", keys, 1.0)  # written back several times in one epoch: marked once
    cache.export_delta(tmp_path / "e")
    for _ in range(3):
        _train(cache, "t", keys[:4], 1.0)
    cache.export_delta(tmp_path / "e")
    _train(cache, "t", keys[:2], 1.0)
    r = cache.export_delta(tmp_path / "e")
    assert (r.kind, r.tables["t"]["rows"]) == ("delta", 2)
    keys_f, weights, _ = _folded(tmp_path / "e", "t")
    assert torch.equal(weights, _rows(cache, "t", keys_f))


def test_expired_and_deleted_rows_are_the_next_deltas_deleted_keys(make_cache: Any, tmp_path: Path) -> None:
    # the lifecycle end to end: rows the sweeper expires (from memory and from the store) and rows
    # deleted by hand reach serving as deleted keys of the next delta; what stays is exported as is
    table = TableConfig(name="t", dim=4, optimizer="sgd", lr=0.5, seed=9, ttl_steps=500)
    cache = make_cache(hbm_rows=8, ddr_rows=8, tables=[table], expiry_interval=3600.0)
    out = tmp_path / "exports"
    old, kept = np.arange(0, 60, dtype=np.int64), np.arange(1000, 1010, dtype=np.int64)
    _train(cache, "t", old, 1.0)
    _train(cache, "t", kept, 1.0)
    assert cache.export_delta(out).kind == "full"
    for _ in range(60):  # 600 steps that touch only `kept`: `old` goes past its 500 steps
        _train(cache, "t", kept, 0.1)
    assert cache.delete("t", kept[:2]) == 2
    cache.expire_now()
    result = cache.export_delta(out)
    assert result.kind == "delta"
    version = latest_version(str(out))
    assert version is not None
    part = read_table(version, "t")
    assert set(part["deleted"].tolist()) == set(old.tolist()) | set(kept[:2].tolist())
    assert sorted(part["keys"].tolist()) == kept[2:].tolist()
    keys, weights, _ = _folded(out, "t")
    assert keys.tolist() == kept[2:].tolist()
    assert torch.equal(weights, _rows(cache, "t", kept[2:]))
