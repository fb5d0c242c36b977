"""Aged frequencies, the count-min sketch and the policy table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

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


def test_policy_table() -> None:
    freq = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)
    last = torch.tensor([5, 9, 1])
    assert make_policy("lrfu", True).score(freq, last, 10).tolist() == [3.0, 1.0, 2.0]
    assert make_policy("lfu", True).aging is False
    lru = make_policy("lru", True)
    assert lru.admission is False and lru.score(freq, last, 10).tolist() == [5.0, 9.0, 1.0]
    custom = make_policy(lambda f, la, now: -f, True)
    assert custom.score(freq, last, 10).tolist() == [-3.0, -1.0, -2.0]
    bad = make_policy(lambda f, la, now: f[:1], True)
    with pytest.raises(TypeError, match="shape"):
        bad.score(freq, last, 10)
