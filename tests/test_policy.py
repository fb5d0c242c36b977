"""Aged frequencies, the count-min sketch and the policy table."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from embcache import CacheConfig
from embcache.errors import ConfigError
from embcache.policy import Clock, FrequencySketch, make_policy


def test_sketch_estimates_are_upper_bounds_and_exact_without_collisions() -> None:
    sketch = FrequencySketch(1 << 16)
    rng = np.random.default_rng(0)
    keys = torch.from_numpy(rng.integers(-(2**62), 2**62, size=5000))
    counts = torch.from_numpy(rng.integers(1, 50, size=5000)).to(torch.float64)
    sketch.add(keys, counts)
    est = sketch.estimate(keys)
    assert bool((est >= counts).all())
    assert float((est == counts).double().mean()) > 0.99  # 5k keys in 64k columns x 4 rows


def test_add_and_estimate_equals_add_then_estimate() -> None:
    a, b = FrequencySketch(256), FrequencySketch(256)
    keys = torch.arange(100) * 7919
    amounts = torch.rand(100, dtype=torch.float64)
    a.add(keys, amounts)
    torch.testing.assert_close(b.add_and_estimate(keys, amounts), a.estimate(keys), rtol=0, atol=0)


@pytest.mark.parametrize("width", [64, 1 << 16])
def test_the_compiled_sketch_gives_the_torch_sketchs_counters_bit_for_bit(width: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # embcache/sketch_kernels.py (the CPU's, with numba) against the torch operations (the
    # sketch without numba): the same calls, every counter and estimate equal. A narrow sketch
    # makes keys of one call share counters (the largest raise wins); keys span all 64 bits.
    from embcache import sketch_kernels

    if not sketch_kernels.available():
        pytest.skip("numba is not installed")
    compiled, plain = FrequencySketch(width), FrequencySketch(width)
    assert compiled._compiled()
    monkeypatch.setattr(plain, "_compiled", lambda: False)
    rng = np.random.default_rng(3)
    for step in range(60):
        n = int(rng.integers(0, 2000))
        if step % 2:
            keys = torch.from_numpy(rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64))
        else:  # a hot set seen again and again
            keys = torch.from_numpy(rng.choice(5000, size=min(n, 5000), replace=False).astype(np.int64))
        amounts = torch.from_numpy(rng.random(keys.numel()) * 2.0 ** int(rng.integers(-20, 40)))
        got, want = compiled.add_and_estimate(keys, amounts), plain.add_and_estimate(keys, amounts)
        assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)
        assert torch.equal(compiled.estimate(keys), plain.estimate(keys))
        leaving = torch.from_numpy(rng.random(keys.numel()) * 2.0 ** int(rng.integers(-20, 40)))
        compiled.raise_to(keys, leaving)
        plain.raise_to(keys, leaving)
        assert torch.equal(compiled.counts, plain.counts), step
    assert float(compiled.counts.max()) > 0


def test_conservative_update_bounds_each_estimate_between_truth_and_plain_count_min() -> None:
    # A narrow sketch, so keys share counters: plain count-min adds every amount to every counter
    # of a key; the conservative update raises a key's counters only to its own new estimate.
    sketch = FrequencySketch(64)
    rng = np.random.default_rng(1)
    keys = torch.from_numpy(rng.choice(2**40, size=200, replace=False))
    truth = torch.zeros(200, dtype=torch.float64)
    plain = torch.zeros(sketch.depth * sketch.width, dtype=torch.float64)
    cells = sketch._cells(keys)
    for _ in range(30):
        pick = torch.from_numpy(rng.choice(200, size=40, replace=False))
        amounts = torch.from_numpy(rng.zipf(1.5, size=40).astype(np.float64))
        sketch.add(keys[pick], amounts)
        truth[pick] += amounts
        plain.index_add_(0, cells[:, pick].reshape(-1), amounts.repeat(sketch.depth))
    est = sketch.estimate(keys)
    plain_est = plain[cells].amin(dim=0)
    assert bool((est >= truth * (1 - 1e-6)).all())  # still an upper bound (float32 counters)
    assert bool((est <= plain_est * (1 + 1e-6)).all())
    assert float((plain_est - est).sum()) > 0.2 * float((plain_est - truth).sum())  # and much tighter


def test_raise_to_keeps_the_larger_value_and_bytes_round_trip() -> None:
    sketch = FrequencySketch(1024)
    keys = torch.tensor([1, 2, 3])
    sketch.add(keys, torch.tensor([5.0, 1.0, 0.0], dtype=torch.float64))
    sketch.raise_to(keys, torch.tensor([2.0, 4.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(sketch.estimate(keys), torch.tensor([5.0, 4.0, 0.5], dtype=torch.float64))
    other = FrequencySketch(1024)
    other.load_bytes(sketch.to_bytes())
    torch.testing.assert_close(other.estimate(keys), sketch.estimate(keys))


def test_clock_ages_and_renormalizes_without_changing_order() -> None:
    clock = Clock(halflife=10.0)
    assert clock.increment() == 1.0
    clock.advance(10)
    assert clock.increment() == pytest.approx(2.0)  # an access now weighs twice one 10 ticks ago
    factor = None
    while factor is None:
        factor = clock.advance(50)
    assert factor < 1e-11 and clock.increment() == 1.0  # rescaled: frequencies times factor
    assert Clock(math.inf).advance(10**9) is None


def _clock_at(now: int, halflife: float = 100.0) -> Clock:
    clock = Clock(halflife)
    clock.advance(now)
    return clock


def test_policy_table() -> None:
    freq = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)
    last = torch.tensor([5, 9, 1])
    clock = _clock_at(10)
    assert make_policy("lrfu", True, idle_halving=math.inf).score(freq, last, clock).tolist() == [3.0, 1.0, 2.0]
    assert make_policy("lfu", True).aging is False
    assert make_policy("lfu", True).score(freq, last, clock).tolist() == [3.0, 1.0, 2.0]
    lru = make_policy("lru", True)
    assert lru.admission is False and lru.score(freq, last, clock).tolist() == [5.0, 9.0, 1.0]
    custom = make_policy(lambda f, la, now: -f * now, True)
    assert custom.score(freq, last, clock).tolist() == [-30.0, -10.0, -20.0]  # fn(freq, last, now)
    bad = make_policy(lambda f, la, now: f[:1], True)
    with pytest.raises(TypeError, match="shape"):
        bad.score(freq, last, clock)


def test_lrfu_score_is_aged_frequency_halved_per_idle_halving_missed_accesses() -> None:
    # missed = (freq / increment) * ln 2 / halflife * (now - last); score = freq * 2 ** -(missed / m)
    clock = _clock_at(300, halflife=100.0)  # increment 8
    freq = torch.tensor([80.0, 80.0, 8.0, 0.5], dtype=torch.float64)
    last = torch.tensor([300, 200, 0, 300])
    got = make_policy("lrfu", True, idle_halving=2.0).score(freq, last, clock)
    missed = (freq / 8.0) * math.log(2.0) / 100.0 * (300 - last).to(torch.float64)
    torch.testing.assert_close(got, freq * 2.0 ** -(missed / 2.0), rtol=1e-12, atol=0)
    assert got[0] == 80.0 and got[3] == 0.5  # just accessed: no discount
    # 10 aged accesses, idle 100 ticks: ~6.9 missed, so 2**-3.47 of its score is left
    assert float(got[1]) == pytest.approx(80.0 * 2.0 ** (-10 * math.log(2.0) / 2.0))


def test_a_finished_burst_ranks_below_a_steady_row_only_with_the_discount() -> None:
    # Two rows at tick 20,000 (half-life 1,000): a steady one accessed every 50 ticks (about 29
    # aged accesses, last one 10 ticks ago) and one that took 400 accesses in a burst that ended
    # 2,000 ticks ago (400 / 4 = 100 aged accesses left, but ~140 accesses missed since).
    clock = _clock_at(20_000, halflife=1_000.0)
    inc = clock.increment()
    steady_ticks = np.arange(0, 20_000, 50) + 40
    steady = float(np.sum(2.0 ** ((steady_ticks - 20_000) / 1_000.0))) * inc
    burst = 400 * 2.0 ** (-2_000 / 1_000.0) * inc
    freq = torch.tensor([steady, burst], dtype=torch.float64)
    last = torch.tensor([19_990, 18_000])
    plain = make_policy("lrfu", True, idle_halving=math.inf).score(freq, last, clock)
    assert plain[1] > plain[0]  # aged frequency alone keeps the finished burst
    discounted = make_policy("lrfu", True).score(freq, last, clock)
    assert discounted[1] < discounted[0]
    assert discounted[0] > 0.7 * steady  # the steady row loses little


@pytest.mark.parametrize("idle_halving", [2.5, math.inf])
def test_cache_drops_a_finished_burst_for_rows_in_use(make_cache: Any, idle_halving: float) -> None:
    # HBM of 16 rows, no DDR. 8 steady keys are looked up in every batch; 8 burst keys are
    # hammered for a while, then never again; then 8 new keys are looked up once per batch. With
    # the idle discount the burst keys leave HBM to the new keys within 60 batches; with plain
    # aged frequency they still outscore the new keys and hold their slots.
    cache = make_cache(hbm_rows=16, ddr_rows=0, halflife=2_000.0, idle_halving=idle_halving, mrc_sample_rate=0)
    steady, burst, new = torch.arange(8), torch.arange(100, 108), torch.arange(200, 208)
    for _ in range(100):
        cache.lookup("t", steady)
    for _ in range(50):
        cache.lookup("t", torch.cat([steady, burst.repeat(4)]))
    assert set(cache.resident_keys("t", "hbm").tolist()) == set(range(8)) | set(range(100, 108))
    for _ in range(60):
        cache.lookup("t", torch.cat([steady, new]))
    resident = set(cache.resident_keys("t", "hbm").tolist())
    assert set(range(8)) <= resident  # the rows in steady use stay either way
    if math.isinf(idle_halving):
        assert resident == set(range(8)) | set(range(100, 108))
    else:
        assert resident == set(range(8)) | set(range(200, 208))


def test_idle_halving_is_validated(tmp_path: Any) -> None:
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="idle_halving"):
            CacheConfig(path=str(tmp_path), idle_halving=bad, validate_memory=False)
    assert CacheConfig(path=str(tmp_path), idle_halving=math.inf, validate_memory=False).idle_halving == math.inf


def test_sketch_bytes_are_npy_and_a_close_saves_the_same_sketch_in_chunks(tmp_path: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The sketch is serialized with one copy, in np.save's format; resident rows are raised into it
    a chunk of slots at a time (a big table's all at once was the peak of its close), to the same
    counters as all at once."""
    import io

    import numpy as np

    from embcache import CacheConfig, EmbeddingCache, TableConfig
    from embcache.engine import table as table_mod

    sketch = FrequencySketch(1024)
    sketch.add(torch.arange(300), torch.rand(300, dtype=torch.float64))
    buf = io.BytesIO()
    np.save(buf, sketch.counts.numpy())
    assert sketch.to_bytes() == buf.getvalue()

    def saved(chunk: int, path: str) -> torch.Tensor:
        monkeypatch.setattr(table_mod, "_SAVE_CHUNK", chunk)
        cfg = CacheConfig(hbm_bytes=100 * 1024, ddr_bytes=400 * 1024, path=path)
        with EmbeddingCache(cfg, [TableConfig(name="t", dim=8, optimizer="sgd", lr=0.1, seed=1)]) as cache:
            g = torch.Generator().manual_seed(3)
            for _ in range(20):
                cache.lookup("t", torch.randint(0, 5000, (400,), generator=g) ** 2 // 5000)
            t = cache._tables["t"]
            assert t.hbm.capacity > 7 and len(t.hbm.occupied_slots()) > 7 and len(t.ddr.occupied_slots()) > 7
            t.save_frequencies()
            return t.sketch.counts.clone()

    whole, chunked = saved(1 << 20, str(tmp_path / "a")), saved(7, str(tmp_path / "b"))
    assert bool(whole.any()) and torch.equal(whole, chunked)


def test_a_sketch_whose_kernels_fail_to_build_warns_and_counts_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from embcache import sketch_kernels

    def broken() -> dict[str, Any]:
        raise RuntimeError("LLVM says no")

    monkeypatch.setattr(sketch_kernels, "_KERNELS", {})  # not tried yet in this test
    monkeypatch.setattr(sketch_kernels, "_build", broken)
    sketch = FrequencySketch(1 << 10)
    keys = torch.tensor([5, 6, 7])
    with pytest.warns(UserWarning, match="compiled kernels are unavailable.*LLVM says no"):
        got = sketch.add_and_estimate(keys, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert not sketch._compiled()  # tried once: no second warning, no second try
    assert torch.equal(got, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
