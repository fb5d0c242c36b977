"""The compiled eviction scoring (embcache/score_kernels.py) against the torch operations it replaces."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from embcache import score_kernels
from embcache.policy import Clock, discounted_scores, idle_discount_rate, make_policy
from embcache.tier import MemoryTier, RowBatch
from embcache.types import Tier

pytestmark = pytest.mark.skipif(not score_kernels.available(), reason="numba is not installed")


def _records(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tier's record array with random ``freq`` and ``last`` columns (strided views, as the tiers keep them)."""
    g = torch.Generator().manual_seed(seed)
    meta = torch.zeros((n, 3), dtype=torch.int64)
    freq, last = meta.view(torch.float32)[:, 4], meta[:, 1]
    freq.copy_(torch.rand(n, generator=g) * 50)
    last.copy_(torch.randint(0, 120_000, (n,), generator=g))  # some after the clock's now: idle clamps to 0
    return meta, freq, last


@pytest.mark.parametrize("n", [1, 7, 20_000])
def test_compiled_scores_are_the_torch_scores_bit_for_bit(n: int) -> None:
    _, freq, last = _records(n, seed=n)
    clock = Clock(halflife=3_000.0)
    clock.advance(100_000)
    policy = make_policy("lrfu", admission=True)
    a = idle_discount_rate(clock, 2.5)
    slots = torch.randint(0, n, (3 * n,), generator=torch.Generator().manual_seed(1))  # repeats too
    want = discounted_scores(freq.index_select(0, slots), last.index_select(0, slots), clock.now, a)
    assert bool((want < freq.index_select(0, slots).double()).any())  # the discount applies
    got = policy.score_at(freq, last, slots, clock)  # the compiled gather, straight from the records
    assert torch.equal(got, want)
    for f in (freq.contiguous(), freq.double()):  # the compiled contiguous path, float32 and float64
        assert torch.equal(policy.score(f, last.contiguous(), clock), discounted_scores(f, last, clock.now, a))


def _lowest_of_a_tier(monkeypatch: pytest.MonkeyPatch, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(score_kernels, "_KERNELS", {"ok": False})
        n, cap = 6000, 8192
        tier = MemoryTier(Tier.DDR, cap, 4, 1, torch.float32, torch.device("cpu"))
        g = torch.Generator().manual_seed(5)
        freq = torch.rand(n, dtype=torch.float64, generator=g) * 20
        last = torch.randint(0, 50_000, (n,), generator=g)
        pins = (torch.arange(n) % 11 == 0).to(torch.int32)
        slots = tier.insert(RowBatch(torch.arange(n), torch.zeros(n, 4), torch.zeros(n, 1), freq, last,
                                     torch.zeros(n, dtype=torch.bool), pins))
        clock = Clock(halflife=2_000.0)
        clock.advance(50_000)
        policy = make_policy("lrfu", admission=True)

        def scores_of(s: torch.Tensor) -> torch.Tensor:
            return policy.score_at(tier.freq, tier.last, s, clock)

        out = []
        for k, sample in [(40, 16), (900, 4), (3000, 16)]:  # sampled, sampled, every evictable row
            gen = torch.Generator().manual_seed(k)
            out.append(tier.lowest(k, scores_of, sample, exclude=slots[:300], generator=gen))
        return torch.cat([v for v, _ in out]), torch.cat([s for _, s in out])


def test_a_tiers_victims_and_their_scores_are_those_of_the_torch_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    v_c, s_c = _lowest_of_a_tier(monkeypatch, compiled=True)
    v_t, s_t = _lowest_of_a_tier(monkeypatch, compiled=False)
    assert v_c.numel() == 40 + 900 + 3000
    assert torch.equal(v_c, v_t) and torch.equal(s_c, s_t)
    assert bool((s_c[:40].diff() >= 0).all())


def test_scoring_kernels_that_fail_to_build_warn_and_score_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("LLVM says no")

    monkeypatch.setattr(score_kernels, "_KERNELS", {})  # not tried yet in this test
    monkeypatch.setattr(score_kernels, "_build", broken)
    _, freq, last = _records(100, seed=3)
    clock = Clock(halflife=500.0)
    clock.advance(100_000)
    policy = make_policy("lrfu", admission=True)
    slots = torch.arange(0, 100, 3)
    with pytest.warns(UserWarning, match="eviction scoring's compiled kernels are unavailable.*LLVM says no"):
        got = policy.score_at(freq, last, slots, clock)
    assert not score_kernels.available()  # tried once: no second warning, no second try
    want = discounted_scores(freq[slots], last[slots], clock.now, idle_discount_rate(clock, 2.5))
    assert torch.equal(got, want)
