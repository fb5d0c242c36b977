"""Tests of the cold-tier stores: every test runs against real RocksDB and LMDB databases under tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embcache.errors import (
    CheckpointExistsError,
    InvalidKeysError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    TableConflictError,
    UnknownTableError,
)
from embcache.stores import LMDBStore, RocksDBStore, Store, open_store

KINDS = ["rocksdb", "lmdb"]
REPO = Path(__file__).resolve().parents[1]
I64 = np.iinfo(np.int64)
EXTREME_KEYS = np.array(
    [I64.min, I64.min + 1, -(2**53) - 1, -1, 0, 1, 2**53 + 1, 2**62, I64.max - 1, I64.max], dtype=np.int64
)

# Child processes import only embcache.stores: a stub parent package skips embcache/__init__.py,
# which imports torch and would cost seconds per child.
CHILD_PRELUDE = textwrap.dedent(
    """
    import os, sys, types
    import numpy as np
    pkg = types.ModuleType("embcache")
    pkg.__path__ = [os.path.join(os.environ["EMBCACHE_REPO"], "embcache")]
    sys.modules["embcache"] = pkg
    from embcache.stores import open_store
    kind, path = sys.argv[1], sys.argv[2]
    """
)


def records_for(keys: np.ndarray, width: int, salt: int = 0) -> np.ndarray:
    """Deterministic, key-dependent uint8 records [n, width] (different salt -> different bytes)."""
    salt_bits = np.uint64((salt * 0x5851F42D4C957F2D + 1) % 2**64)
    mixed = (keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ salt_bits
    cols = np.arange(width, dtype=np.uint64)
    return ((mixed[:, None] >> (cols % np.uint64(57))) + cols * np.uint64(salt + 1)).astype(np.uint8)


def run_child(code: str, kind: str, path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EMBCACHE_REPO": str(REPO), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), kind, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def all_rows(store: Store, table: str) -> tuple[np.ndarray, np.ndarray]:
    parts = list(store.scan(table))
    width = store.record_bytes(table)
    if not parts:
        return np.zeros(0, np.int64), np.zeros((0, width), np.uint8)
    return np.concatenate([k for k, _ in parts]), np.concatenate([r for _, r in parts])


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(kind: str, tmp_path: Path) -> Iterator[Store]:
    s = open_store(kind, str(tmp_path / "db"))
    yield s
    s.close()


def test_open_store_kinds_and_errors(tmp_path: Path) -> None:
    with open_store("rocksdb", str(tmp_path / "r")) as r, open_store("lmdb", str(tmp_path / "l")) as m:
        assert isinstance(r, RocksDBStore) and isinstance(m, LMDBStore)
    with pytest.raises(ValueError, match="allowed: lmdb, rocksdb"):
        open_store("leveldb", str(tmp_path / "x"))
    with pytest.raises(ValueError, match="map_size"):
        open_store("lmdb", str(tmp_path / "y"), block_cache_bytes=1)


def test_round_trip_extreme_keys(store: Store) -> None:
    store.open_table("t", 13)
    recs = records_for(EXTREME_KEYS, 13)
    store.put_many("t", EXTREME_KEYS[::-1].copy(), recs[::-1].copy())
    found, got = store.get_many("t", EXTREME_KEYS)
    assert found.dtype == np.bool_ and found.all()
    assert got.dtype == np.uint8 and got.shape == (len(EXTREME_KEYS), 13)
    np.testing.assert_array_equal(got, recs)
    got[:] = 0  # returned arrays are the caller's to modify
    assert store.count("t") == len(EXTREME_KEYS)


def test_duplicates_and_missing_keys(store: Store) -> None:
    store.open_table("t", 8)
    present = np.array([3, -3, I64.max], dtype=np.int64)
    store.put_many("t", present, records_for(present, 8))
    query = np.array([I64.max, 4, 3, 3, I64.min, -3, 4, 3], dtype=np.int64)
    found, got = store.get_many("t", query)
    expect_found = np.isin(query, present)
    np.testing.assert_array_equal(found, expect_found)
    np.testing.assert_array_equal(got[expect_found], records_for(query[expect_found], 8))
    assert not got[~expect_found].any()
    empty_found, empty = store.get_many("t", np.zeros(0, np.int64))
    assert empty_found.shape == (0,) and empty.shape == (0, 8)
    none_found, none = store.get_many("t", np.array([10, 11]))
    assert not none_found.any() and not none.any()


def test_overwrite_and_delete(store: Store) -> None:
    store.open_table("t", 5)
    keys = np.arange(-50, 50, dtype=np.int64) * 1_000_003
    store.put_many("t", keys, records_for(keys, 5, salt=1))
    store.put_many("t", keys[::2], records_for(keys[::2], 5, salt=2))
    found, got = store.get_many("t", keys)
    assert found.all()
    np.testing.assert_array_equal(got[::2], records_for(keys[::2], 5, salt=2))
    np.testing.assert_array_equal(got[1::2], records_for(keys[1::2], 5, salt=1))
    # Deleting absent keys (and repeats) is fine.
    store.delete_many("t", np.concatenate([keys[:10], keys[:3], np.array([7, 8], np.int64)]))
    found, got = store.get_many("t", keys)
    assert not found[:10].any() and found[10:].all()
    assert not got[:10].any()
    assert store.count("t") == len(keys) - 10
    store.delete_many("t", np.zeros(0, np.int64))
    assert store.count("t") == len(keys) - 10


@pytest.mark.parametrize("batch_rows", [1, 7, 64, 500, 65536])
def test_scan_order_and_completeness(store: Store, batch_rows: int) -> None:
    rng = np.random.default_rng(batch_rows)
    keys = np.unique(np.concatenate([rng.integers(I64.min, I64.max, 490, dtype=np.int64, endpoint=True), EXTREME_KEYS]))
    store.open_table("t", 6)
    shuffled = rng.permutation(keys)
    store.put_many("t", shuffled, records_for(shuffled, 6))
    batches = list(store.scan("t", batch_rows=batch_rows))
    assert all(1 <= len(k) <= batch_rows and r.shape == (len(k), 6) for k, r in batches)
    got_keys = np.concatenate([k for k, _ in batches])
    got_recs = np.concatenate([r for _, r in batches])
    np.testing.assert_array_equal(got_keys, keys)  # ascending numeric order, negatives first
    np.testing.assert_array_equal(got_recs, records_for(keys, 6))
    assert store.count("t") == len(keys)


def test_scan_from_resumes_where_a_cursor_left_off(store: Store) -> None:
    rng = np.random.default_rng(3)
    keys = np.unique(np.concatenate([rng.integers(I64.min, I64.max, 300, dtype=np.int64, endpoint=True),
                                     EXTREME_KEYS]))
    store.open_table("t", 6)
    store.put_many("t", keys, records_for(keys, 6))
    got, start = [], int(I64.min)
    while True:
        k, r = store.scan_from("t", start, 37)
        assert k.size <= 37 and r.shape == (k.size, 6) and (k >= start).all()
        np.testing.assert_array_equal(r, records_for(k, 6))
        got.append(k)
        if k.size < 37 or k[-1] == I64.max:
            break
        start = int(k[-1]) + 1
    np.testing.assert_array_equal(np.concatenate(got), keys)
    mid = int(keys[len(keys) // 2])
    np.testing.assert_array_equal(store.scan_from("t", mid, 5)[0], keys[len(keys) // 2:len(keys) // 2 + 5])
    with pytest.raises(ValueError):
        store.scan_from("t", 0, 0)
    with pytest.raises(UnknownTableError):
        store.scan_from("nope", 0, 1)


def test_scan_empty_table_and_bad_batch(store: Store) -> None:
    store.open_table("t", 3)
    assert list(store.scan("t")) == []
    assert store.count("t") == 0
    with pytest.raises(ValueError):
        store.scan("t", batch_rows=0)


def test_tables_are_independent(store: Store) -> None:
    store.open_table("a", 3)
    store.open_table("b", 7)
    store.open_table("a", 3)  # idempotent
    assert store.tables() == ["a", "b"]
    keys = np.array([1, 2, 3], dtype=np.int64)
    store.put_many("a", keys, records_for(keys, 3, salt=1))
    store.put_many("b", keys[:2], records_for(keys[:2], 7, salt=2))
    store.delete_many("b", keys[:1])
    found_a, rec_a = store.get_many("a", keys)
    found_b, rec_b = store.get_many("b", keys)
    assert found_a.all() and found_b.tolist() == [False, True, False]
    np.testing.assert_array_equal(rec_a, records_for(keys, 3, salt=1))
    np.testing.assert_array_equal(rec_b[1], records_for(keys[1:2], 7, salt=2)[0])
    assert (store.count("a"), store.count("b")) == (3, 1)
    assert store.record_bytes("b") == 7
    with pytest.raises(TableConflictError):
        store.open_table("a", 4)


def test_table_name_and_width_validation(store: Store) -> None:
    for bad in ["", "__meta__", "default", "x" * 256]:
        with pytest.raises(ValueError):
            store.open_table(bad, 4)
    for width in [0, -1, True, 2.5]:
        with pytest.raises(ValueError):
            store.open_table("t", width)  # type: ignore[arg-type]
    with pytest.raises(UnknownTableError, match="open_table"):
        store.get_many("missing", np.array([1]))
    with pytest.raises(KeyError):
        store.put_many("missing", np.array([1]), np.zeros((1, 4), np.uint8))
    assert store.tables() == []


def test_wrong_records_or_keys_raise_and_write_nothing(store: Store) -> None:
    store.open_table("t", 4)
    keys = np.array([1, 2], dtype=np.int64)
    store.put_many("t", keys, records_for(keys, 4))
    new = np.array([1, 9], dtype=np.int64)
    bad_inputs: list[tuple[np.ndarray, np.ndarray]] = [
        (new, np.zeros((2, 5), np.uint8)),  # wrong width
        (new, np.zeros((3, 4), np.uint8)),  # wrong count
        (new, np.zeros((2, 4), np.float32)),  # wrong dtype
        (new, np.zeros(8, np.uint8)),  # flat
        (new.reshape(2, 1), np.zeros((2, 4), np.uint8)),  # keys not 1-D
        (new.astype(np.uint64), np.zeros((2, 4), np.uint8)),  # uint64 cannot round-trip
        (new.astype(np.float64), np.zeros((2, 4), np.uint8)),
    ]
    for bad_keys, bad_records in bad_inputs:
        with pytest.raises(ValueError):
            store.put_many("t", bad_keys, bad_records)
    with pytest.raises(InvalidKeysError):
        store.get_many("t", np.array([1.5]))
    found, got = store.get_many("t", np.array([1, 2, 9], dtype=np.int64))
    assert found.tolist() == [True, True, False]
    np.testing.assert_array_equal(got[:2], records_for(keys, 4))
    # Narrower integer keys are accepted and widened.
    store.put_many("t", np.array([9], dtype=np.int32), np.full((1, 4), 7, np.uint8))
    assert store.get_many("t", np.array([9], dtype=np.int16))[1].tolist() == [[7, 7, 7, 7]]


def test_meta_round_trip(store: Store) -> None:
    assert store.get_meta("cfg") is None
    store.put_meta("cfg", b"v1")
    store.put_meta("cfg", b"v2")
    big = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    store.put_meta("sketch", big)
    store.put_meta("empty", b"")
    store.put_meta("t:looks-like-a-table", b"x")  # user names cannot reach the table registry
    assert store.get_meta("cfg") == b"v2"
    assert store.get_meta("sketch") == big
    assert store.get_meta("empty") == b""
    assert store.tables() == []
    with pytest.raises(TypeError):
        store.put_meta("cfg", "not bytes")  # type: ignore[arg-type]


def test_reopen_keeps_tables_and_data(kind: str, tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    keys = np.arange(300, dtype=np.int64) * -7919
    with open_store(kind, path) as s:
        s.open_table("a", 9)
        s.open_table("b", 2)
        s.put_many("a", keys, records_for(keys, 9))
        s.put_meta("m", b"meta")
        pending = s.scan("a", batch_rows=10)
        next(pending)
    s.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        s.get_many("a", keys)
    with pytest.raises(StoreError, match="closed"):
        next(pending)  # a scan still running when the store closed
    with open_store(kind, path) as s2:
        assert s2.tables() == ["a", "b"]
        assert s2.record_bytes("a") == 9
        found, got = s2.get_many("a", keys)
        assert found.all()
        np.testing.assert_array_equal(got, records_for(keys, 9))
        assert s2.count("b") == 0 and s2.get_meta("m") == b"meta"
        with pytest.raises(TableConflictError):
            s2.open_table("a", 10)


def test_compact_keeps_every_row(kind: str, tmp_path: Path) -> None:
    keys = np.arange(-3000, 3000, dtype=np.int64) * 7919
    with open_store(kind, str(tmp_path / "db")) as s:
        s.open_table("a", 6)
        for part in np.array_split(keys, 6):  # several memtables' worth of separate writes
            s.put_many("a", part, records_for(part, 6))
            s.flush()
        s.delete_many("a", keys[:10])
        s.compact()
        found, got = s.get_many("a", keys)
        assert not found[:10].any() and found[10:].all()
        np.testing.assert_array_equal(got[10:], records_for(keys[10:], 6))
    s2 = open_store(kind, str(tmp_path / "db"))
    s2.close()
    with pytest.raises(StoreError, match="closed"):
        s2.compact()


def test_checkpoint_is_a_consistent_store(kind: str, tmp_path: Path) -> None:
    keys = np.arange(-400, 400, dtype=np.int64) * 104729
    with open_store(kind, str(tmp_path / "db")) as s:
        s.open_table("a", 11)
        s.open_table("b", 3)
        s.put_many("a", keys, records_for(keys, 11))
        s.put_many("b", keys[:5], records_for(keys[:5], 3))
        s.put_meta("m", b"before")
        (tmp_path / "empty").mkdir()
        s.checkpoint(str(tmp_path / "empty"))  # an existing empty directory is allowed
        s.checkpoint(str(tmp_path / "nested" / "cp"))
        # Writes after the checkpoint must not leak into it.
        s.put_many("a", keys[:3], records_for(keys[:3], 11, salt=5))
        s.delete_many("b", keys[:5])
        s.put_meta("m", b"after")
        expect_a = all_rows(s, "a")
    for cp in ("empty", "nested/cp"):
        with open_store(kind, str(tmp_path / cp)) as c:
            assert c.tables() == ["a", "b"]
            got_keys, got_recs = all_rows(c, "a")
            np.testing.assert_array_equal(got_keys, keys)
            np.testing.assert_array_equal(got_recs, records_for(keys, 11))
            assert not np.array_equal(got_recs, expect_a[1])
            assert c.count("b") == 5 and c.get_meta("m") == b"before"


def test_checkpoint_into_nonempty_dir_raises(store: Store, tmp_path: Path) -> None:
    store.open_table("t", 4)
    target = tmp_path / "cp"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(CheckpointExistsError):
        store.checkpoint(str(target))
    with pytest.raises(FileExistsError):  # CheckpointExistsError is a FileExistsError
        store.checkpoint(str(target / "keep.txt"))
    assert os.listdir(target) == ["keep.txt"]


def test_disk_usage_grows(store: Store) -> None:
    store.open_table("t", 256)
    before = store.disk_usage_bytes()
    keys = np.arange(4000, dtype=np.int64)
    store.put_many("t", keys, records_for(keys, 256))
    store.flush()
    assert store.disk_usage_bytes() > before > 0


def test_opening_the_other_kind_fails(kind: str, tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    open_store(kind, path).close()
    other = "lmdb" if kind == "rocksdb" else "rocksdb"
    with pytest.raises(StoreError, match=kind):
        open_store(other, path)
    open_store(kind, path).close()  # the failed open left the path usable


def test_same_process_second_open_is_locked(kind: str, tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    with open_store(kind, path):
        with pytest.raises(StoreLockedError):
            open_store(kind, path)
    open_store(kind, path).close()  # released by close()


def test_lmdb_map_full_raises_store_full_and_keeps_data(tmp_path: Path) -> None:
    store = open_store("lmdb", str(tmp_path / "db"), map_size=1 << 20)
    store.open_table("t", 300)
    keys = np.arange(500, dtype=np.int64)
    store.put_many("t", keys, records_for(keys, 300))
    big = np.arange(10_000, 20_000, dtype=np.int64)
    with pytest.raises(StoreFullError, match="put_many"):
        store.put_many("t", big, records_for(big, 300))
    assert store.count("t") == 500
    found, got = store.get_many("t", np.concatenate([keys, big[:50]]))
    assert found[:500].all() and not found[500:].any()  # the failed batch wrote nothing
    np.testing.assert_array_equal(got[:500], records_for(keys, 300))
    np.testing.assert_array_equal(all_rows(store, "t")[0], keys)
    store.put_many("t", keys[:2], records_for(keys[:2], 300, salt=3))  # small writes still fit
    store.close()


def test_crash_durability_kill_9(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "db"
    child = run_child(
        """
        s = open_store(kind, path)
        s.open_table("t", 320)
        s.open_table("u", 17)
        keys = np.arange(-5000, 5000, dtype=np.int64) * 7
        recs = (keys % 200).astype(np.uint8)[:, None] + np.arange(320, dtype=np.uint8)
        s.put_many("t", keys, recs)
        s.put_many("u", keys[:100], np.full((100, 17), 9, np.uint8))
        s.put_meta("m", b"meta")
        s.flush()
        # Committed after the last flush: must survive kill -9 (it is in the OS page cache).
        s.put_many("u", keys[100:200], np.full((100, 17), 8, np.uint8))
        print("flushed", flush=True)
        os.kill(os.getpid(), 9)
        """,
        kind,
        path,
    )
    assert child.returncode == -9, child.stderr
    assert "flushed" in child.stdout
    keys = np.arange(-5000, 5000, dtype=np.int64) * 7
    with open_store(kind, str(path)) as s:
        assert s.tables() == ["t", "u"]
        found, got = s.get_many("t", keys)
        assert found.all()
        expect = (keys % 200).astype(np.uint8)[:, None] + np.arange(320, dtype=np.uint8)
        np.testing.assert_array_equal(got, expect)
        found_u, got_u = s.get_many("u", keys[:200])
        assert found_u.all() and (got_u[:100] == 9).all() and (got_u[100:] == 8).all()
        assert s.count("t") == len(keys) and s.get_meta("m") == b"meta"


def test_rocksdb_without_wal_keeps_what_flush_covered_through_kill_9(tmp_path: Path) -> None:
    """write_ahead_log=False (serving mode's throw-away store): rows live in memtables until a
    flush writes them to table files; what the flush covered survives kill -9."""
    path = tmp_path / "db"
    child = run_child(
        """
        s = open_store(kind, path, write_ahead_log=False)
        s.open_table("t", 8)
        keys = np.arange(1000, dtype=np.int64)
        s.put_many("t", keys, np.full((1000, 8), 5, np.uint8))
        s.put_meta("m", b"meta")
        s.flush()
        print("flushed", flush=True)
        os.kill(os.getpid(), 9)
        """,
        "rocksdb",
        path,
    )
    assert child.returncode == -9 and "flushed" in child.stdout, child.stderr
    with open_store("rocksdb", str(path)) as s:
        found, got = s.get_many("t", np.arange(1000, dtype=np.int64))
        assert found.all() and (got == 5).all() and s.get_meta("m") == b"meta"


def test_rocksdb_second_process_gets_store_locked(tmp_path: Path) -> None:
    path = tmp_path / "db"
    with open_store("rocksdb", str(path)) as s:
        s.open_table("t", 4)
        child = run_child(
            """
            try:
                open_store(kind, path)
                print("opened")
            except Exception as exc:
                print(type(exc).__name__, exc)
            """,
            "rocksdb",
            path,
        )
        assert child.stdout.startswith("StoreLockedError"), child.stdout + child.stderr
        assert str(path) in child.stdout


def test_lmdb_is_multi_process(tmp_path: Path) -> None:
    # LMDB is multi-process by design: another process may open the same path while we hold it.
    path = tmp_path / "db"
    with open_store("lmdb", str(path)) as s:
        s.open_table("t", 4)
        s.put_many("t", np.array([5], np.int64), np.full((1, 4), 3, np.uint8))
        child = run_child(
            """
            s = open_store(kind, path)
            found, recs = s.get_many("t", np.array([5, 6]))
            s.put_many("t", np.array([6], np.int64), np.full((1, 4), 4, np.uint8))
            print(found.tolist(), recs[0].tolist())
            s.close()
            """,
            "lmdb",
            path,
        )
        assert child.stdout.strip() == "[True, False] [3, 3, 3, 3]", child.stderr
        found, recs = s.get_many("t", np.array([6]))
        assert found.all() and recs.tolist() == [[4, 4, 4, 4]]


def test_lmdb_disk_full_raises_store_full(tmp_path: Path) -> None:
    """A real ENOSPC (writing to /dev/full), as LMDB reports it (DiskError), is a StoreFullError."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    store = open_store("lmdb", str(tmp_path / "db"))
    store.open_table("t", 300)
    keys = np.arange(500, dtype=np.int64)
    store.put_many("t", keys, records_for(keys, 300))
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(StoreFullError, match="No space left"), store._guard("copy"):
            store._env.copyfd(fd)  # the data file's pages, written to a device that is always full
    finally:
        os.close(fd)
    assert store.count("t") == 500
    store.close()
