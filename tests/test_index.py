"""KeyIndex implementations against a dict reference, on extreme, random and adversarial keys."""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embcache import index as index_mod
from embcache.index import KeyIndex, NumbaIndex, TorchIndex, make_index, mix64, numba_index, unmix64

from .conftest import cuda_or_stand_in
from .fakecuda import fake_cuda

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EXTREME = [I64_MIN, I64_MIN + 1, -(2**53) - 1, -1, 0, 1, 2**53, 2**53 + 1, 2**62, I64_MAX - 1, I64_MAX]
HAS_CUDA = torch.cuda.is_available()

IMPLS = [
    pytest.param(("numba", "cpu"), id="numba-cpu"),
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    # without a GPU, TorchIndex's CUDA path (one-pass find) runs under the stand-in (tests/fakecuda.py)
    pytest.param(("torch", "cuda"), id="torch-cuda" if HAS_CUDA else "torch-fakecuda"),
]

Factory = Callable[[int], KeyIndex]


def _factory(kind: str, device: str) -> Factory:
    if kind == "numba":
        pytest.importorskip("numba")
        return lambda cap: NumbaIndex(cap, device)
    return lambda cap: TorchIndex(cap, device)


@pytest.fixture(params=IMPLS)
def make(request: pytest.FixtureRequest) -> Iterator[Factory]:
    """``make(capacity)`` -> an empty index of the parametrized kind on its device."""
    kind, device = request.param
    with fake_cuda() if device == "cuda" and not HAS_CUDA else contextlib.nullcontext():
        yield _factory(kind, device)


def t(values: object, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)


class Reference:
    """An index and a dict fed the same operations, compared after every step."""

    def __init__(self, index: KeyIndex) -> None:
        self.index = index
        self.d: dict[int, int] = {}
        self.dev = index.device

    def insert(self, keys: list[int], slots: list[int]) -> None:
        # A tier's slots are distinct and free (NumbaIndex keeps one key per slot): a slot that
        # is taken, or repeated, becomes the lowest free one.
        taken = set(self.d.values())
        free = (s for s in range(self.index.capacity) if s not in taken)
        fixed: list[int] = []
        for s in slots:
            if s in taken or not 0 <= s < self.index.capacity:
                s = next(x for x in free if x not in taken)
            taken.add(s)
            fixed.append(s)
        slots = fixed
        self.index.insert(t(keys, self.dev), t(slots, self.dev))
        self.d.update(zip(keys, slots, strict=True))
        assert len(self.index) == len(self.d)

    def erase(self, keys: list[int]) -> None:
        self.index.erase(t(keys, self.dev))
        for k in keys:
            del self.d[k]
        assert len(self.index) == len(self.d)

    def clear(self) -> None:
        self.index.clear()
        self.d.clear()
        assert len(self.index) == 0

    def check(self, queries: list[int]) -> torch.Tensor:
        got = self.index.find(t(queries, self.dev))
        assert got.dtype == torch.int64 and got.device.type == self.dev.type and got.shape == (len(queries),)
        want = [self.d.get(k, -1) for k in queries]
        assert got.cpu().tolist() == want
        return got


def random_ops(ref: Reference, capacity: int, steps: int, seed: int) -> None:
    """Random insert/erase/find batches (extreme keys included) checked against the dict."""
    rng = np.random.default_rng(seed)
    pool = list(dict.fromkeys(EXTREME + rng.integers(I64_MIN, I64_MAX, 4 * capacity, dtype=np.int64,
                                                     endpoint=True).tolist()
                              + rng.integers(-50, 50, 40).tolist()))
    for step in range(steps):
        op = rng.integers(0, 10)
        present = list(ref.d)
        absent_n = capacity - len(ref.d)
        if op < 4 and absent_n > 0:
            # Sometimes fill up exactly to capacity.
            n = absent_n if rng.random() < 0.15 else int(rng.integers(1, absent_n + 1))
            cand = [k for k in rng.permutation(np.array(pool, dtype=np.int64)).tolist() if k not in ref.d][:n]
            ref.insert(cand, rng.integers(0, capacity, len(cand)).tolist())
        elif op < 7 and present:
            n = int(rng.integers(1, len(present) + 1))
            ref.erase([present[i] for i in rng.permutation(len(present))[:n]])
        elif op == 7 and step % 5 == 0:
            ref.clear()
        # Find with duplicates, present and absent keys, extremes.
        q = rng.choice(np.array(pool, dtype=np.int64), 3 * capacity).tolist() + EXTREME + present[:5] * 2
        ref.check(q)


@pytest.mark.parametrize("capacity", [1, 7, 64, 300])
def test_random_ops_match_dict(make: Factory, capacity: int) -> None:
    for seed in range(3):
        random_ops(Reference(make(capacity)), capacity, steps=40, seed=seed)


def test_extreme_keys_and_reinsert(make: Factory) -> None:
    ref = Reference(make(len(EXTREME)))
    ref.check(EXTREME)
    ref.insert(EXTREME, list(range(len(EXTREME))))  # exactly at capacity
    ref.check(EXTREME + EXTREME[::-1] + [2, -2, 2**53 - 1])
    ref.erase(EXTREME[::2])
    ref.check(EXTREME)
    # Erase then reinsert under new slots.
    ref.insert(EXTREME[::2], [100 + i for i in range(len(EXTREME[::2]))])
    ref.check(EXTREME)
    ref.clear()
    ref.check(EXTREME)
    ref.insert(EXTREME[:3], [5, 6, 7])
    ref.check(EXTREME)


def test_empty_batches(make: Factory) -> None:
    index = make(4)
    dev = index.device
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    assert index.find(empty).shape == (0,)
    index.insert(empty, empty)
    index.erase(empty)
    assert len(index) == 0


def test_over_capacity_raises_and_changes_nothing(make: Factory) -> None:
    index = make(5)
    dev = index.device
    index.insert(t([1, 2, 3], dev), t([0, 1, 2], dev))
    with pytest.raises(RuntimeError):
        index.insert(t([4, 5, 6], dev), t([3, 4, 5], dev))
    assert len(index) == 3
    assert index.find(t([1, 2, 3, 4], dev)).tolist() == [0, 1, 2, -1]


def test_noncontiguous_input(make: Factory) -> None:
    index = make(16)
    dev = index.device
    keys = torch.arange(32, dtype=torch.int64, device=dev) * 7 - 50
    index.insert(keys[::2], torch.arange(16, device=dev))
    assert index.find(keys[::2]).tolist() == list(range(16))
    assert (index.find(keys[1::2]) == -1).all()


def test_unmix64_inverts_mix64() -> None:
    keys = t(EXTREME + list(range(-5, 5)), torch.device("cpu"))
    assert torch.equal(unmix64(mix64(keys)), keys)
    assert torch.equal(mix64(unmix64(keys)), keys)


def _colliding_keys(n: int) -> list[int]:
    """``n`` (<= 256) keys whose hashes differ only below bit 24 of each 32-bit half: the high
    half is ``2**32 - 1 - (j << 16)``, the low half ``j << 16``.

    Both indexes map a half ``x`` to ``(x * size) >> 32``. For TorchIndex (fewer than 2**8
    buckets) that is one first bucket (the last) and one second bucket (the first) for all of
    them; for NumbaIndex (fewer than 2**8 entries per 2**24 of the high half) the last one or two
    entries, so one long cluster that wraps around the end of the table.
    """
    j = torch.arange(n, dtype=torch.int64)
    return unmix64(((((1 << 32) - 1) - (j << 16)) << 32) | (j << 16)).tolist()


@pytest.mark.parametrize("pattern", ["same-hash-bits", "multiples-of-2^40"])
def test_adversarial_collisions(make: Factory, pattern: str) -> None:
    capacity = 250  # tables of 500 entries (NumbaIndex), 53 buckets (TorchIndex): no powers of two
    if pattern == "same-hash-bits":
        # TorchIndex: 16 fit in the two buckets, the stash overflows, the table must grow until
        # lower hash bits separate the keys. NumbaIndex: home = one of the last two entries, so
        # the cluster wraps around the end of the table.
        keys = _colliding_keys(capacity)
    else:
        keys = [(i + 1) << 40 for i in range(capacity // 2)] + [-(i + 1) << 40 for i in range(capacity // 2)]
    ref = Reference(make(capacity))
    ref.insert(keys[: capacity // 2], list(range(capacity // 2)))
    ref.insert(keys[capacity // 2:], list(range(capacity // 2, capacity)))
    ref.check([*keys, keys[0] + 1, 0])
    # Erase from the middle of the cluster, check, reinsert.
    ref.erase(keys[10:200:3])
    ref.check(keys)
    ref.insert(keys[10:200:3], list(range(len(keys[10:200:3]))))
    ref.check(keys)
    ref.erase(keys)
    ref.check(keys)
    if isinstance(ref.index, TorchIndex) and pattern == "same-hash-bits":
        assert ref.index.n_buckets > TorchIndex(capacity).n_buckets  # it had to grow
        ref.clear()
        assert ref.index.n_buckets == TorchIndex(capacity).n_buckets  # clear undoes growth


@pytest.mark.parametrize("width", [8, 16])
def test_torch_stash(width: int) -> None:
    # 40 keys for the same two buckets: 2 * width fit there, the rest go to the stash, no growth.
    index = TorchIndex(256, bucket_width=width)
    nb = index.n_buckets
    keys = _colliding_keys(40)
    ref = Reference(index)
    ref.insert(keys[:30], list(range(30)))
    ref.insert(keys[30:], list(range(30, 40)))
    assert index.n_stashed == 40 - 2 * width and index.n_buckets == nb
    ref.check([*keys, *keys[::-1], 12345])
    # The one-pass (sync-free, CUDA) find must agree, stash included.
    q = t([*keys, 12345, -1], index.device)
    assert torch.equal(index._find_one_pass(q, mix64(q)), index.find(q))
    ref.erase(keys[::3])  # from the buckets and the stash
    ref.check(keys)
    ref.insert(keys[::3], [7] * len(keys[::3]))
    ref.check(keys)
    assert index.n_buckets == nb
    ref.clear()
    assert index.n_stashed == 0
    ref.check(keys)


def test_torch_one_pass_find_matches_two_pass() -> None:
    # The CUDA find path (both buckets in one gather), exercised on the CPU.
    rng = np.random.default_rng(3)
    index = TorchIndex(5000)
    keys = torch.from_numpy(np.unique(rng.integers(I64_MIN, I64_MAX, 5000, dtype=np.int64, endpoint=True)))
    index.insert(keys, torch.arange(keys.numel()))
    q = torch.cat((keys, keys[:100], t(EXTREME, torch.device("cpu"))))
    h = mix64(q)
    assert torch.equal(index._find_one_pass(q, h), index._find_two_pass(q, h))
    assert torch.equal(index.find(keys), torch.arange(keys.numel()))


def test_numba_and_torch_agree() -> None:
    pytest.importorskip("numba")
    rng = np.random.default_rng(7)
    capacity = 2000
    indexes = [NumbaIndex(capacity), TorchIndex(capacity)]
    present: list[int] = []
    d: dict[int, int] = {}
    for _ in range(20):
        new = rng.integers(I64_MIN, I64_MAX, 600, dtype=np.int64, endpoint=True)
        new = new[~np.isin(new, present)][: capacity - len(present)]
        used = set(d[k] for k in present)
        slots = rng.permutation(np.array([s for s in range(capacity) if s not in used], dtype=np.int64))[:new.shape[0]]
        for ix in indexes:
            ix.insert(torch.from_numpy(new), torch.from_numpy(slots))
        present += new.tolist()
        d.update(zip(new.tolist(), slots.tolist(), strict=True))
        gone = rng.permutation(np.array(present, dtype=np.int64))[: len(present) // 3]
        for ix in indexes:
            ix.erase(torch.from_numpy(gone))
        gone_set = set(gone.tolist())
        present = [k for k in present if k not in gone_set]
        q = torch.from_numpy(np.concatenate([rng.choice(np.array(present + EXTREME), 3000), gone]))
        a, b = (ix.find(q) for ix in indexes)
        assert torch.equal(a, b)
        assert int((a >= 0).sum()) > 2000
        assert len(indexes[0]) == len(indexes[1]) == len(present)
    # A batch large enough for NumbaIndex to share it with helper threads (uneven last chunk).
    big = torch.from_numpy(rng.choice(np.array(present + EXTREME), 5 * index_mod._CHUNK + 123))
    a, b = (ix.find(big) for ix in indexes)
    assert torch.equal(a, b)
    alive = set(present)
    assert a.tolist() == [d[k] if k in alive else -1 for k in big.tolist()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "erase", "find", "clear"]),
                              st.lists(st.one_of(st.sampled_from(EXTREME),
                                                 st.integers(I64_MIN, I64_MAX),
                                                 st.integers(-3, 3)), max_size=12)),
                    max_size=12))
def test_hypothesis_ops(make: Factory, ops: list[tuple[str, list[int]]]) -> None:
    capacity = 16
    ref = Reference(make(capacity))
    for op, keys in ops:
        if op == "insert":
            fresh = [k for k in dict.fromkeys(keys) if k not in ref.d][: capacity - len(ref.d)]
            ref.insert(fresh, [abs(k) % capacity for k in fresh])
        elif op == "erase":
            ref.erase([k for k in dict.fromkeys(keys) if k in ref.d])
        elif op == "clear":
            ref.clear()
        ref.check(keys + keys)


def test_mix64_is_deterministic_and_spreads() -> None:
    keys = torch.arange(1 << 16, dtype=torch.int64) << 40  # all low 40 bits zero
    h = mix64(keys)
    assert torch.equal(h, mix64(keys.clone()))
    assert torch.unique(h & 1023).numel() == 1024  # low bits (bucket choice) well spread
    assert mix64(t(EXTREME, torch.device("cpu"))).tolist() == mix64(t(EXTREME, torch.device("cpu"))).tolist()
    # Known value: splitmix64 finalizer of 1 (computed with Python ints).
    x = 1
    x = ((x ^ (x >> 30)) * index_mod._M1) % 2**64
    x = ((x ^ (x >> 27)) * index_mod._M2) % 2**64
    x ^= x >> 31
    assert mix64(t([1], torch.device("cpu"))).item() == x - 2**64 * (x >= 2**63)


def test_make_index_picks_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    if index_mod.numba_available():
        assert isinstance(make_index(10, torch.device("cpu")), NumbaIndex)
    if HAS_CUDA:
        assert isinstance(make_index(10, torch.device("cuda")), TorchIndex)
    # Without numba (an import of it fails), CPU falls back to TorchIndex.
    monkeypatch.setitem(sys.modules, "numba", None)
    assert not index_mod.numba_available()
    assert isinstance(make_index(10, torch.device("cpu")), TorchIndex)


def test_numba_rejects_cuda() -> None:
    pytest.importorskip("numba")
    with pytest.raises(ValueError):
        NumbaIndex(4, torch.device("cuda"))


def test_numba_big_table_on_huge_pages() -> None:
    # Capacity 2**18: a 6 MiB table, allocated through the huge-page path where there is one.
    pytest.importorskip("numba")
    index = NumbaIndex(1 << 18)
    assert index.table_size == math.ceil((1 << 18) / numba_index.LOAD)
    assert index.nbytes == 4 * index.table_size <= NumbaIndex.ROW_BYTES << 18
    keys = torch.from_numpy(np.random.default_rng(5).permutation(1 << 20)[: 1 << 18].astype(np.int64)) - (1 << 19)
    index.insert(keys, torch.arange(keys.numel()))
    assert torch.equal(index.find(keys), torch.arange(keys.numel()))
    index.erase(keys[::2])
    assert len(index) == keys.numel() // 2
    want = torch.where(torch.arange(keys.numel()) % 2 == 0, -1, torch.arange(keys.numel()))
    assert torch.equal(index.find(keys), want)
    index.clear()
    assert len(index) == 0 and bool((index.find(keys) == -1).all())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_numba_find_after_fork() -> None:
    # Helper threads do not survive a fork; a child must get fresh ones, not wait on dead ones.
    pytest.importorskip("numba")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # CUDA does not survive a fork either: on the H200 this child hung (the worker had run CUDA tests)
        pytest.skip("fork after CUDA was initialized in this process is unsupported by CUDA")
    index = NumbaIndex(1 << 16)
    keys = torch.arange(1 << 16, dtype=torch.int64) * 3
    index.insert(keys, torch.arange(1 << 16))
    q = keys.repeat(2)
    want = np.tile(np.arange(1 << 16), 2)
    assert (index.find(q).numpy() == want).all()  # the parent starts its helpers
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        # Only numpy and numba here: torch's own OpenMP pool is not usable after a fork.
        faulthandler.dump_traceback_later(20, exit=True)
        os._exit(0 if (index.find(q).numpy() == want).all() else 1)
    deadline = time.monotonic() + 60  # a hung child fails the test instead of hanging the run
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish within 60 s")
    status = done[1]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("n", [1000, 40_000])  # one pass, and the parallel find + serial touch
def test_find_touch_equals_find_then_touch(n: int) -> None:
    rng = np.random.default_rng(3)
    stored = torch.from_numpy(rng.choice(2**62, size=5000, replace=False))
    indexes = [make_index(5000, "cpu"), TorchIndex(5000, "cpu")]
    keys = torch.cat([stored[torch.from_numpy(rng.integers(0, 5000, n))],
                      torch.from_numpy(rng.integers(-(2**62), 0, n // 10))])  # repeats and misses
    want_slots = None
    for index in indexes:
        index.insert(stored, torch.arange(5000))
        freq = torch.zeros(5000, dtype=torch.float32)
        last = torch.zeros(5000, dtype=torch.int64)
        slots, hits = index.find_touch(keys, freq, last, 0.5, 7)
        assert torch.equal(slots, index.find(keys))
        found = slots[slots >= 0]
        assert hits == found.numel() == n
        counts = torch.bincount(found, minlength=5000).to(torch.float32)
        torch.testing.assert_close(freq, 0.5 * counts, rtol=0, atol=0)  # every occurrence counted
        assert torch.equal(last, torch.where(counts > 0, 7, 0))
        want_slots = slots if want_slots is None else want_slots
        assert torch.equal(slots, want_slots)


@pytest.mark.parametrize("threads", [1, 2])  # NumbaIndex: the compiled pass, and probe-then-gather
@pytest.mark.parametrize("n", [1000, 40_000])  # one pass, and the parallel find + serial touch
def test_once_counts_a_row_at_most_once_per_tick(n: int, threads: int) -> None:
    # a batch's repeats of a row count one access, and a row already counted at this tick none
    rng = np.random.default_rng(5)
    stored = torch.from_numpy(rng.choice(2**62, size=5000, replace=False))
    keys = torch.cat([stored[torch.from_numpy(rng.integers(0, 5000, n))],
                      torch.from_numpy(rng.integers(-(2**62), 0, n // 10))])  # repeats and misses
    last0 = torch.from_numpy(rng.integers(5, 8, 5000))  # a third of the rows already touched at tick 7
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for index in [make_index(5000, "cpu"), TorchIndex(5000, "cpu")]:
            index.insert(stored, torch.arange(5000))
            for gather in (False, True):
                freq, last = torch.full((5000,), 3.0), last0.clone()
                if gather:
                    rows, out = torch.randn(5000, 4), torch.zeros(keys.numel(), 4)
                    slots, hits = index.find_touch_gather(keys, freq, last, 0.5, 7, rows, out, once=True)
                    found = slots >= 0
                    assert torch.equal(out[found], rows[slots[found]])
                else:
                    slots, hits = index.find_touch(keys, freq, last, 0.5, 7, once=True)
                assert torch.equal(slots, index.find(keys)) and hits == n
                seen = torch.bincount(slots[slots >= 0], minlength=5000) > 0
                want = 3.0 + 0.5 * (seen & (last0 != 7)).to(torch.float32)
                assert torch.equal(freq, want), type(index).__name__
                assert torch.equal(last, torch.where(seen, 7, last0))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])  # NumbaIndex: the compiled pass, and probe-then-gather
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # float16: the gather in torch
# 3 and 20: shorter than the compiled pass's pipeline; 1000: one pass; 40,000: parallel find + serial touch
@pytest.mark.parametrize("n", [3, 20, 1000, 40_000])
def test_find_touch_gather_copies_found_rows_and_counts_like_find_touch(n: int, dtype: torch.dtype,
                                                                         threads: int) -> None:
    rng = np.random.default_rng(4)
    stored = torch.from_numpy(rng.choice(2**62, size=5000, replace=False))
    rows = torch.randn(5000, 13, generator=torch.Generator().manual_seed(1)).to(dtype)  # 52-byte rows straddle lines
    keys = torch.cat([stored[torch.from_numpy(rng.integers(0, 5000, n))],
                      torch.from_numpy(rng.integers(-(2**62), 0, n // 10))])  # repeats and misses
    keys = keys[torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(2))]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for index in [make_index(5000, "cpu"), TorchIndex(5000, "cpu")]:
            index.insert(stored, torch.arange(5000))
            counters = [(torch.zeros(5000, dtype=torch.float32), torch.zeros(5000, dtype=torch.int64))
                        for _ in range(2)]
            want_slots, want_hits = index.find_touch(keys, *counters[0], 0.5, 7)
            out = torch.full((keys.numel(), 13), -3.0)
            slots, hits = index.find_touch_gather(keys, *counters[1], 0.5, 7, rows, out)
            assert torch.equal(slots, want_slots) and hits == want_hits == n
            assert torch.equal(counters[1][0], counters[0][0]) and torch.equal(counters[1][1], counters[0][1])
            found = slots >= 0
            assert torch.equal(out[found], rows[slots[found]].float())
            assert bool((out[~found] == -3.0).all())  # a miss's row is left as it was
            every = stored[:300]  # all found: one gather straight into out
            out = torch.empty(300, 13)
            assert index.find_touch_gather(every, *counters[1], 0.5, 8, rows, out)[1] == 300
            assert torch.equal(out, rows[:300].float())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("capacity", [1024, 3000, 4100, 4400, 65537, 70000, 262145])
def test_indexes_stay_within_the_tiers_index_budget(capacity: int) -> None:
    # The tiers count ROW_BYTES of key index per row (tier.py). Rounding TorchIndex's buckets
    # up to a power of two once took it past the count; both are sized to their load now.
    index = TorchIndex(capacity)
    assert index.nbytes <= TorchIndex.ROW_BYTES * capacity
    keys = torch.randperm(10 * capacity, generator=torch.Generator().manual_seed(capacity))[:capacity] * 7919 - 5
    slots = torch.arange(capacity)
    index.insert(keys, slots)  # full: at most 55% load, no growth
    assert index.n_buckets == TorchIndex(capacity).n_buckets and index.nbytes <= TorchIndex.ROW_BYTES * capacity
    assert torch.equal(index.find(keys), slots)
    if index_mod.numba_available():
        assert NumbaIndex(capacity).nbytes <= NumbaIndex.ROW_BYTES * capacity


def test_torch_index_stash_stays_small_under_churn_at_full_load() -> None:
    # A tier's index is full and churns: every batch of misses evicts as many keys as it admits.
    # Filling first buckets to the brim (the placement before) stashed up to 0.3% of keys here
    # (60 of the stash's 78; 0.6% and a doubled table at 60% load); now at most 0.015%.
    capacity, batch = 20_000, 2_000
    rng = np.random.default_rng(11)
    index = TorchIndex(capacity)
    nb = index.n_buckets
    live = rng.choice(2**62, size=capacity, replace=False)
    index.insert(torch.from_numpy(live), torch.arange(capacity))
    fresh = iter(rng.choice(2**62, size=4 * capacity, replace=False) - 2**62)  # disjoint from live
    most = 0
    for _ in range(4 * capacity // batch):
        out = rng.choice(capacity, size=batch, replace=False)  # positions in live: evicted
        index.erase(torch.from_numpy(live[out]))
        live[out] = [next(fresh) for _ in range(batch)]
        index.insert(torch.from_numpy(live[out]), torch.from_numpy(out))
        most = max(most, index.n_stashed)
    assert index.n_buckets == nb and most <= capacity // 1000
    assert torch.equal(index.find(torch.from_numpy(live)), torch.arange(capacity))
    # Most keys still sit in their first bucket: the CPU find reads one bucket for them.
    first = index._bucket(mix64(index._keys), False) == torch.arange(nb)[:, None]
    assert int((first & (index._slots >= 0)).sum()) > 0.8 * capacity


def test_torch_index_gpu_insert_and_erase_sync_once_and_match_the_cpu_path() -> None:
    # The GPU path of insert and erase masks the keys already placed (or not found) instead of
    # selecting the rest with boolean masks, which cost a host sync each (5 per insert, 4 per
    # erase before): one sync each now, and the same table entry for entry as the CPU path.
    rng = np.random.default_rng(5)
    keys = torch.from_numpy(np.unique(rng.integers(I64_MIN, I64_MAX, 3000, dtype=np.int64, endpoint=True)))
    cpu = TorchIndex(4000)
    cpu.insert(keys, torch.arange(keys.numel()))
    cpu.erase(keys[::3])
    cpu.insert(keys[::3], torch.arange(keys[::3].numel()))
    with cuda_or_stand_in() as fc:
        gpu = TorchIndex(4000, "cuda")
        for op in ("insert", "erase", "insert"):
            k = keys if gpu._len == 0 else keys[::3]
            k, v = k.cuda(), torch.arange(k.numel()).cuda()  # outside the window: a pageable copy is a sync
            with fc.count() as c:
                if op == "insert":
                    gpu.insert(k, v)
                else:
                    gpu.erase(k)
            assert len(c.syncs) == 1, (op, c.syncs)
        assert len(gpu) == len(cpu) == keys.numel()
        for name in ("_keys", "_slots"):
            assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
        assert torch.equal(gpu.find(keys.cuda()).cpu(), cpu.find(keys))


@pytest.mark.parametrize("capacity", [3, 250, 5000])
def test_torch_index_filler_keys_are_ordinary_keys(capacity: int) -> None:
    # Empty entries hold one of two filler keys (buckets 0 and 1 each hold the other's); as keys
    # of their own they must be found only once inserted, on both find paths.
    index = TorchIndex(capacity)
    fill = t([index._fill0, index._fill1], index.device)
    h = mix64(fill)
    assert index._bucket(h, False).tolist() == index._bucket(h, True).tolist() == [0, 1]
    index.insert(t([12345], index.device), t([0], index.device))  # not empty: find searches
    assert index.find(fill).tolist() == [-1, -1] and index._find_one_pass(fill, h).tolist() == [-1, -1]
    index.insert(fill, t([1, 2], index.device))
    assert index.find(fill).tolist() == [1, 2] and index._find_one_pass(fill, h).tolist() == [1, 2]
    index.erase(fill[:1])
    assert index.find(fill).tolist() == [-1, 2] and index._find_one_pass(fill, h).tolist() == [-1, 2]
    assert index.find(t([12345], index.device)).tolist() == [0]


@pytest.mark.parametrize("threads", [1, 2])  # 1: the compiled gather pass; 2: find, then torch's gather
def test_numba_keys_with_one_home_and_one_tag_are_told_apart_by_the_key(threads: int) -> None:
    # NumbaIndex's entries hold a slot and a tag of the key's hash, no key: keys whose hashes
    # share the high 32 bits (one home) and the low 32 - b bits (one tag) match each other's
    # entries, and only the tier's key of the slot tells them apart. Every probe here walks such
    # false matches, in find, erase (the backward shift re-homes entries through their keys),
    # the counting find and the gathering one.
    pytest.importorskip("numba")
    capacity = 1000
    b = capacity.bit_length()  # slot bits; the tag is the hash's low 32 - b bits
    h = torch.arange(300, dtype=torch.int64) << (32 - b)  # bits above the tag only (b of them: 300 < 2**b)
    keys = unmix64((0x9E3779B9 << 32) | h | 0x155)
    assert torch.unique(keys).numel() == 300
    index = NumbaIndex(capacity)
    slots = torch.randperm(capacity, generator=torch.Generator().manual_seed(1))[:200]
    index.insert(keys[:200], slots)
    assert torch.equal(index.find(keys[:200]), slots)
    assert bool((index.find(keys[200:]) == -1).all())  # same home and tag, absent
    index.erase(keys[50:150:2])
    kept = torch.ones(200, dtype=torch.bool)
    kept[50:150:2] = False
    want = torch.where(kept, slots, -1)
    assert torch.equal(index.find(keys[:200]), want)
    freq = torch.zeros(capacity, dtype=torch.float32)
    last = torch.zeros(capacity, dtype=torch.int64)
    rows = torch.randn(capacity, 5, generator=torch.Generator().manual_seed(2))
    out = torch.full((300, 5), -1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, hits = index.find_touch_gather(keys, freq, last, 2.0, 9, rows, out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, torch.cat((want, torch.full((100,), -1))))
    assert hits == int(kept.sum())
    assert torch.equal(out[:200][kept], rows[slots[kept]]) and bool((out[200:] == -1.0).all())
    assert torch.equal(freq[slots[kept]], torch.full((hits,), 2.0)) and int(freq.sum()) == 2 * hits
    assert bool((last[slots[kept]] == 9).all())
    got, hits = index.find_touch(keys, freq, last, 1.0, 10)
    assert torch.equal(got[:200], want) and hits == int(kept.sum())


def test_numba_refuses_slots_outside_its_capacity() -> None:
    pytest.importorskip("numba")
    index = NumbaIndex(10)
    with pytest.raises(ValueError, match=r"slots must be in \[0, 10\)"):
        index.insert(torch.tensor([1, 2]), torch.tensor([3, 10]))
    assert len(index) == 0 and bool((index.find(torch.tensor([1, 2])) == -1).all())
