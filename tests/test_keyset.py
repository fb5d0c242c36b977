"""Keysets: counting from batches and data-set files, save/load, and splitting a data set into passes."""

from __future__ import annotations

import itertools
import json
import os
import zipfile
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from embcache.errors import ConfigError, InvalidKeysError
from embcache.keyset import (
    KEYSET_FORMAT,
    KEYSET_VERSION,
    Keyset,
    KeysetBudgetWarning,
    KeysetFileError,
    keyset_file_meta,
    keysets_from_batches,
    keysets_from_file,
    load_keysets,
    save_keysets,
    split_passes,
)


def brute(columns: Mapping[str, list[np.ndarray]]) -> dict[str, dict[int, int]]:
    """Per-table {key: count} by a plain Python loop (the reference)."""
    out: dict[str, dict[int, int]] = {}
    for table, arrays in columns.items():
        c: Counter[int] = Counter()
        for a in arrays:
            c.update(int(k) for k in np.asarray(a).reshape(-1))
        out[table] = dict(c)
    return out


def as_dict(ks: Keyset) -> dict[int, int]:
    assert ks.keys.dtype == torch.int64 and ks.counts.dtype == torch.int64
    assert bool((ks.keys[1:] > ks.keys[:-1]).all()), "keys must be unique and ascending"
    return dict(zip(ks.keys.tolist(), ks.counts.tolist(), strict=True))


def zipf_ids(rng: np.random.Generator, shape: tuple[int, ...], n_ids: int) -> np.ndarray:
    """Skewed int64 ids spread over the whole int64 range (negatives included)."""
    ranks = np.minimum(rng.zipf(1.3, size=shape), n_ids) - 1
    return ((ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0x5DEECE66D)).view(np.int64)


@pytest.fixture
def dataset(tmp_path: Any) -> tuple[list[str], np.ndarray]:
    """Two .npy shards of int64 ids [samples, 3 columns] (the data-set file format) and all rows."""
    rng = np.random.default_rng(7)
    a = zipf_ids(rng, (700, 3), 500)
    b = zipf_ids(rng, (555, 3), 500)
    a[:, 2] = rng.integers(0, 5, 700)  # a tiny table
    b[:, 2] = rng.integers(0, 5, 555)
    paths = [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    np.save(paths[0], a)
    np.save(paths[1], b)
    return paths, np.concatenate([a, b])


# --------------------------------------------------------------------------- extraction
@pytest.mark.parametrize("chunk_keys", [1, 50, 1 << 22])
def test_from_batches_equals_brute_force(chunk_keys: int) -> None:
    rng = np.random.default_rng(1)
    batches = [{"user": torch.from_numpy(zipf_ids(rng, (int(rng.integers(0, 90)),), 300)),
                "item": zipf_ids(rng, (8, 4), 100)}  # numpy and 2-D keys are fine too
               for _ in range(40)]
    got = keysets_from_batches(batches, chunk_keys=chunk_keys, progress=False)
    want = brute({t: [b[t] for b in batches] for t in ("user", "item")})
    assert {t: as_dict(k) for t, k in got.items()} == want
    assert got["user"].accesses == sum(int(np.asarray(b["user"]).size) for b in batches)


def test_from_batches_with_keys_of_and_generator() -> None:
    rng = np.random.default_rng(2)
    raw = [(zipf_ids(rng, (64,), 50), rng.standard_normal(64)) for _ in range(10)]

    def gen() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        yield from raw

    got = keysets_from_batches(gen(), keys_of=lambda b: {"t": b[0]}, progress=False)
    assert as_dict(got["t"]) == brute({"t": [r[0] for r in raw]})["t"]
    empty = keysets_from_batches([{"t": torch.empty(0, dtype=torch.int64)}], progress=False)
    assert len(empty["t"]) == 0


def test_from_batches_rejects_bad_batches() -> None:
    with pytest.raises(InvalidKeysError, match="mapping"):
        keysets_from_batches([[1, 2, 3]], progress=False)
    with pytest.raises(InvalidKeysError, match="mapping"):
        keysets_from_batches([1], keys_of=lambda b: [b], progress=False)  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidKeysError, match="integer"):
        keysets_from_batches([{"t": torch.ones(3)}], progress=False)


@pytest.mark.parametrize("chunk_rows", [1, 97, 1 << 16])
def test_from_file_equals_brute_force(dataset: tuple[list[str], np.ndarray], chunk_rows: int) -> None:
    paths, rows = dataset
    got = keysets_from_file(paths, ["u", "i", "small"], chunk_rows=chunk_rows, progress=False)
    want = brute({"u": [rows[:, 0]], "i": [rows[:, 1]], "small": [rows[:, 2]]})
    assert {t: as_dict(k) for t, k in got.items()} == want


def test_from_file_shared_tables_ranges_and_dtypes(tmp_path: Any, dataset: tuple[list[str], np.ndarray]) -> None:
    paths, rows = dataset
    # two columns feeding one table are counted together; a range may cross the file boundary
    got = keysets_from_file(paths, ["x", "x", "small"], start=650, stop=800, chunk_rows=33, progress=False)
    assert as_dict(got["x"]) == brute({"x": [rows[650:800, :2]]})["x"]
    # default names c0.., and an int32 file
    p32 = str(tmp_path / "i32.npy")
    np.save(p32, rows[:, 2:].astype(np.int32))
    assert as_dict(keysets_from_file(p32, progress=False)["c0"]) == brute({"c0": [rows[:, 2]]})["c0"]


def test_from_file_errors(tmp_path: Any, dataset: tuple[list[str], np.ndarray]) -> None:
    paths, _ = dataset
    with pytest.raises(KeysetFileError, match="does not exist"):
        keysets_from_file(str(tmp_path / "nope.npy"), progress=False)
    floats = str(tmp_path / "f.npy")
    np.save(floats, np.zeros((4, 3)))
    with pytest.raises(KeysetFileError, match="integer ids"):
        keysets_from_file(floats, progress=False)
    garbage = str(tmp_path / "g.npy")
    with open(garbage, "wb") as f:
        f.write(b"not a numpy file")
    with pytest.raises(KeysetFileError, match="readable"):
        keysets_from_file(garbage, progress=False)
    other = str(tmp_path / "two.npy")
    np.save(other, np.zeros((4, 2), dtype=np.int64))
    with pytest.raises(KeysetFileError, match="columns"):
        keysets_from_file([paths[0], other], progress=False)
    with pytest.raises(KeysetFileError, match="3 columns but 2"):
        keysets_from_file(paths, ["a", "b"], progress=False)
    with pytest.raises(ConfigError, match="outside"):
        keysets_from_file(paths, start=10, stop=5000, progress=False)


def test_progress_without_a_tty(capsys: pytest.CaptureFixture[str], dataset: tuple[list[str], np.ndarray]) -> None:
    paths, rows = dataset
    got = keysets_from_file(paths, chunk_rows=100, progress=True, desc="counting")
    batches = ({"t": rows[i:i + 10, 0]} for i in range(0, 100, 10))  # a generator: no len for the bar
    got_b = keysets_from_batches(batches, progress=True, desc="batches")
    err = capsys.readouterr().err
    assert "counting" in err and "100%" in err and "batches" in err  # the bars went to a non-TTY stream
    assert as_dict(got["c0"]) == brute({"c0": [rows[:, 0]]})["c0"]
    assert as_dict(got_b["t"]) == brute({"t": [rows[:100, 0]]})["t"]


# --------------------------------------------------------------------------- files
def test_save_load_round_trip(tmp_path: Any, dataset: tuple[list[str], np.ndarray]) -> None:
    paths, _ = dataset
    ks = keysets_from_file(paths, ["u", "i", "small"], progress=False)
    ks["empty"] = Keyset.from_keys([])
    path = str(tmp_path / "pass_000.npz")
    save_keysets(path, ks, meta={"pass": 0, "range": [0, 1255]})
    loaded = load_keysets(path, tables=["u", "i", "small", "empty"])
    assert set(loaded) == set(ks)
    for t in ks:
        assert torch.equal(loaded[t].keys, ks[t].keys) and torch.equal(loaded[t].counts, ks[t].counts)
    assert keyset_file_meta(path) == {"pass": 0, "range": [0, 1255]}
    assert [f for f in os.listdir(tmp_path) if ".tmp" in f] == []  # written atomically, nothing left over
    # raw keys are counted on save
    save_keysets(path, {"t": [5, 5, -1]})
    assert as_dict(load_keysets(path)["t"]) == {-1: 1, 5: 2}


def _write_npz(path: str, header: dict[str, Any] | None, **arrays: np.ndarray) -> None:
    if header is not None:
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(path, **arrays)  # type: ignore[arg-type]


def test_load_rejects_damaged_or_mismatched_files(tmp_path: Any) -> None:
    good = str(tmp_path / "good.npz")
    save_keysets(good, {"t": Keyset.from_keys([1, 2, 2])})
    with pytest.raises(KeysetFileError, match="holds keysets of tables"):
        load_keysets(good, tables=["t", "other"])
    with pytest.raises(KeysetFileError, match="does not exist"):
        load_keysets(str(tmp_path / "missing.npz"))
    truncated = str(tmp_path / "truncated.npz")
    with open(good, "rb") as f:
        data = f.read()
    with open(truncated, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(KeysetFileError):
        load_keysets(truncated)
    plain = str(tmp_path / "plain.npz")
    _write_npz(plain, None, keys=np.arange(3))
    with pytest.raises(KeysetFileError, match="not an embcache keyset file"):
        load_keysets(plain)
    header = {"format": KEYSET_FORMAT, "version": KEYSET_VERSION, "tables": ["t"], "meta": {}}
    cases = {
        "version": ({**header, "version": KEYSET_VERSION + 1}, {"keys_0": np.arange(2), "counts_0": np.ones(2, int)},
                    "version"),
        "format": ({**header, "format": "other"}, {}, "not an embcache keyset file"),
        "missing": (header, {"keys_0": np.arange(2)}, "missing"),
        "unsorted": (header, {"keys_0": np.array([3, 1]), "counts_0": np.ones(2, np.int64)}, "ascending"),
        "dupes": (header, {"keys_0": np.array([1, 1]), "counts_0": np.ones(2, np.int64)}, "ascending"),
        "zero": (header, {"keys_0": np.array([1, 2]), "counts_0": np.array([1, 0])}, ">= 1"),
        "dtype": (header, {"keys_0": np.array([1.0, 2.0]), "counts_0": np.ones(2, np.int64)}, "int64"),
        "length": (header, {"keys_0": np.array([1, 2]), "counts_0": np.ones(3, np.int64)}, "same"),
    }
    for name, (hdr, arrays, match) in cases.items():
        p = str(tmp_path / f"{name}.npz")
        _write_npz(p, hdr, **arrays)
        with pytest.raises(KeysetFileError, match=match):
            load_keysets(p)
    assert issubclass(KeysetFileError, InvalidKeysError)
    with zipfile.ZipFile(good) as z:  # the good file really is what load read
        assert "header.npy" in z.namelist()


def test_save_rejects_bad_input(tmp_path: Any) -> None:
    path = str(tmp_path / "k.npz")
    with pytest.raises(ConfigError, match="JSON"):
        save_keysets(path, {"t": [1]}, meta={"x": object()})
    bad = Keyset(torch.tensor([2, 1]), torch.tensor([1, 1]))
    with pytest.raises(InvalidKeysError, match="ascending"):
        save_keysets(path, {"t": bad})
    with pytest.raises(InvalidKeysError, match="mapping"):
        save_keysets(path, [1, 2])  # type: ignore[arg-type]
    assert not os.path.exists(path)


# --------------------------------------------------------------------------- passes
def _check_spans(passes: list[Any], rows: np.ndarray, names: list[str]) -> None:
    assert passes[0].start == 0 and passes[-1].stop == len(rows)
    for a, b in itertools.pairwise(passes):
        assert a.stop == b.start
    for i, p in enumerate(passes):
        assert p.index == i
        want = brute({t: [rows[p.start:p.stop, j]] for j, t in enumerate(names)})
        assert {t: as_dict(k) for t, k in p.keysets.items()} == want


def test_split_by_sample_count(dataset: tuple[list[str], np.ndarray]) -> None:
    paths, rows = dataset
    names = ["u", "i", "s"]
    passes = split_passes(paths, names, samples_per_pass=300, chunk_rows=128, progress=False)
    assert [p.samples for p in passes] == [300, 300, 300, 300, 55]
    assert all(p.within_budget for p in passes)
    _check_spans(passes, rows, names)


@pytest.mark.parametrize("budget", ["rows", "rows_per_table", "bytes_total", "bytes_per_table"])
def test_split_by_budget_is_greedy_and_within_budget(dataset: tuple[list[str], np.ndarray], budget: str) -> None:
    paths, rows = dataset
    names = ["u", "i", "s"]
    row_bytes = {"u": 100, "i": 60, "s": 10}
    kw: dict[str, Any] = {
        "rows": {"max_rows": 60},
        "rows_per_table": {"max_rows": {"u": 70, "i": 50, "s": 5}},
        "bytes_total": {"max_bytes": 9_000, "row_bytes": row_bytes},
        "bytes_per_table": {"max_bytes": {"u": 7_000, "i": 3_000, "s": 50}, "row_bytes": row_bytes},
    }[budget]
    chunk = 50

    def fits(sizes: dict[str, int]) -> bool:
        if "max_rows" in kw:
            lim = kw["max_rows"]
            return all(sizes[t] <= (lim[t] if isinstance(lim, dict) else lim) for t in names)
        lim = kw["max_bytes"]
        if isinstance(lim, dict):
            return all(sizes[t] * row_bytes[t] <= lim[t] for t in names)
        return sum(sizes[t] * row_bytes[t] for t in names) <= lim

    passes = split_passes(paths, names, chunk_rows=chunk, progress=False, **kw)
    assert len(passes) > 2
    _check_spans(passes, rows, names)
    for p in passes[:-1]:
        assert p.within_budget and fits(p.rows())
        # greedy: the pass stopped because its next chunk would not have fitted
        grown = {t: len(np.unique(rows[p.start:min(p.stop + chunk, len(rows)), j])) for j, t in enumerate(names)}
        assert not fits(grown)
        assert (p.stop - p.start) % chunk == 0
    assert fits(passes[-1].rows())


def test_split_chunk_over_budget_is_a_pass_of_its_own(dataset: tuple[list[str], np.ndarray]) -> None:
    paths, rows = dataset
    names = ["u", "i", "s"]
    with pytest.warns(KeysetBudgetWarning, match="alone exceed"):
        passes = split_passes(paths, names, max_rows=20, chunk_rows=64, progress=False)
    over = [p for p in passes if not p.within_budget]
    assert over, "a 64-sample chunk of Zipf ids holds more than 20 unique keys"
    for p in over:
        assert p.samples == 64 or p.stop == len(rows)  # never split, never merged with a neighbour
        assert max(p.rows().values()) > 20
    for p in passes:
        if p.within_budget:
            assert max(p.rows().values()) <= 20
    _check_spans(passes, rows, names)
    # both limits at once: the sample count caps passes that the budget would let grow
    both = split_passes(paths, names, samples_per_pass=100, max_rows=10_000, chunk_rows=64, progress=False)
    assert [p.samples for p in both[:-1]] == [100] * (len(both) - 1)


def test_split_errors(dataset: tuple[list[str], np.ndarray]) -> None:
    paths, _ = dataset
    with pytest.raises(ConfigError, match="needs samples_per_pass"):
        split_passes(paths, progress=False)
    with pytest.raises(ConfigError, match="row_bytes"):
        split_passes(paths, max_bytes=1000, progress=False)
    with pytest.raises(ConfigError, match="no value for tables"):
        split_passes(paths, ["a", "b", "c"], max_rows={"a": 1}, progress=False)
    with pytest.raises(ConfigError, match="samples_per_pass"):
        split_passes(paths, samples_per_pass=0, progress=False)
    with pytest.raises(ConfigError, match="chunk_rows"):
        split_passes(paths, samples_per_pass=5, chunk_rows=0, progress=False)
