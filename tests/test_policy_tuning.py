"""The policy tuned online: ARC as a reference, the new workloads, strict admission, the tuner's
miniature simulations, and the cache switching its setting without changing a value."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from bench import workloads as wl
from embcache.policy import Clock
from embcache.sim import AdaptiveLrfuSim, LrfuSim, arc_hits, opt_hits
from embcache.sim.tuner import GRID, Tuner, sample_keys


def _arc_reference(trace: np.ndarray, c: int) -> int:
    """ARC as the paper writes it (Megiddo and Modha, FAST 2003, Fig. 4), on ordered dicts."""
    t1: OrderedDict[int, None] = OrderedDict()
    t2: OrderedDict[int, None] = OrderedDict()
    b1: OrderedDict[int, None] = OrderedDict()
    b2: OrderedDict[int, None] = OrderedDict()
    p, hits = 0.0, 0

    def replace(x: int) -> None:
        if t1 and ((x in b2 and len(t1) == p) or len(t1) > p):
            b1[t1.popitem(last=False)[0]] = None
        else:
            b2[t2.popitem(last=False)[0]] = None

    for x in map(int, trace):
        if x in t1 or x in t2:
            hits += 1
            t1.pop(x, None)
            t2.pop(x, None)
            t2[x] = None
        elif x in b1:
            p = min(c, p + max(len(b2) / len(b1), 1))
            replace(x)
            del b1[x]
            t2[x] = None
        elif x in b2:
            p = max(0, p - max(len(b1) / len(b2), 1))
            replace(x)
            del b2[x]
            t2[x] = None
        else:
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    replace(x)
                else:
                    t1.popitem(last=False)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                    b2.popitem(last=False)
                replace(x)
            t1[x] = None
    return hits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arc_matches_the_papers_algorithm(seed: int) -> None:
    trace = wl.sessions_trace(6_000, 400, mean_session=5, items_per_session=3, seed=seed)
    trace = np.concatenate([trace, wl.zipf_trace(6_000, 400, 1.1, seed=seed)])
    for c in (1, 7, 60):
        assert arc_hits(trace, c) == _arc_reference(trace, c)
        assert arc_hits(trace, c) <= opt_hits(trace, c)


def test_new_workloads_are_seeded_and_shaped() -> None:
    for make in (lambda s: wl.sessions_trace(10_000, 1_000, seed=s),
                 lambda s: wl.sessions_trace(10_000, 1_000, items_per_session=4, seed=s),
                 lambda s: wl.loop_trace(10_000, 1_000, seed=s), lambda s: wl.switching_trace(10_000, 1_000, seed=s)):
        a, b = make(0), make(0)
        assert a.dtype == np.int64 and a.shape == (10_000,) and np.array_equal(a, b)
        assert not np.array_equal(a, make(1))
        assert a.min() >= 0 and a.max() < 1_000
    # sessions repeat recent keys: most accesses were seen within the last 64
    s = wl.sessions_trace(20_000, 5_000, mean_session=20, seed=0)
    recent = sum(int(s[i] in set(s[max(0, i - 64):i].tolist())) for i in range(1, 2_000))
    assert recent > 0.8 * 2_000
    # the loop's keys come back in a fixed order, loop_fraction of the keys
    loop = wl.loop_trace(20_000, 1_000, loop_fraction=0.1, loop_share=1.0, seed=0)
    assert np.array_equal(loop[:100], loop[100:200]) and np.unique(loop).size == 100
    with pytest.raises(ValueError, match="mean_session"):
        wl.sessions_trace(10, 10, mean_session=0.5)
    with pytest.raises(ValueError, match="loop_fraction"):
        wl.loop_trace(10, 10, loop_fraction=1.5)


def test_strict_admission_keeps_part_of_a_loop_larger_than_the_cache() -> None:
    loop = np.tile(np.arange(200, dtype=np.int64), 50)
    assert LrfuSim(100).access(loop) == 0  # every key displaces another and is gone before it returns
    assert LrfuSim(100, strict=True, idle_halving=float("inf"), halflife=float("inf")).access(loop) > 0.4 * loop.size


def test_retune_rescales_so_that_the_order_of_residents_is_kept() -> None:
    sim = LrfuSim(50, halflife=200.0)
    trace = wl.zipf_trace(5_000, 500, 1.0, seed=4)
    sim.access(trace)
    n = len(sim)
    before = np.argsort(sim._rf[:n], kind="stable")
    sim.retune(800.0, 2.5, True)
    assert np.array_equal(np.argsort(sim._rf[:n], kind="stable"), before)
    assert sim._clock[1] == sim._clock[0] and sim._clock[2] == 800.0
    with pytest.raises(ValueError, match="halflife"):
        sim.retune(0.0, 2.5, False)
    clock = Clock(100.0)
    clock.advance(250)
    factor = clock.retune(400.0)
    assert factor == pytest.approx(2.0**-2.5) and clock.increment() == 1.0 and clock.halflife == 400.0


def test_sample_keys_is_spatial_and_near_its_rate() -> None:
    keys = np.arange(200_000, dtype=np.int64)
    s = sample_keys(keys, 1 / 16)
    assert abs(s.size / keys.size - 1 / 16) < 0.005
    again = sample_keys(np.concatenate([keys, keys]), 1 / 16)
    assert again.size == 2 * s.size  # a key is in the sample every time or never
    assert sample_keys(keys, 1.0) is keys


def test_the_tuner_names_the_setting_each_workload_wants() -> None:
    sessions = wl.sessions_trace(100_000, 20_000, mean_session=30, items_per_session=5, seed=3)
    loop = wl.loop_trace(100_000, 20_000, seed=3)
    a = AdaptiveLrfuSim(200)
    tuned = a.access(sessions)
    assert a.setting is not None and a.setting.halflife_rows == 4.0  # sessions: a short memory
    assert tuned > LrfuSim(200).access(sessions) + 0.05 * sessions.size
    b = AdaptiveLrfuSim(800)
    tuned = b.access(loop)
    assert b.setting is not None and b.setting.strict  # a loop: strict admission
    assert tuned > LrfuSim(800).access(loop) + 0.05 * loop.size
    t = Tuner(800, 1.0)
    assert len(t.minis) == len(GRID) == 14 and t.best() == GRID[0]  # nothing seen: the first
    t.observe(loop[:50_000])
    assert t.observed == 50_000 and t.best().strict


def test_a_small_tiers_tuner_holds_its_choice_on_a_steady_workload() -> None:
    # Miniatures of 100 rows score over at least 4,096 sampled accesses: with a window of 4x
    # their rows (400) the choice flipped 28-45 times on this stream; the cache pays for each
    # flip (a new window starts empty, rows admitted under one rule are judged by another).
    sessions = wl.sessions_trace(200_000, 20_000, mean_session=30, items_per_session=5, seed=1)
    t = Tuner(100, 1.0)
    choices = []
    for lo in range(0, sessions.size, 256):
        part = sessions[lo:lo + 256]
        t.observe_batches(part, np.array([0, part.size]))
        choices.append(t.best())
    switches = sum(a != b for a, b in itertools.pairwise(choices))
    assert switches <= 5


def _trained(make_cache: Any, tmp_path: Any, tune: bool, trace: torch.Tensor) -> tuple[Any, torch.Tensor]:
    cache = make_cache(hbm_rows=800, ddr_rows=0, tune_policy=tune, mrc_sample_rate=1.0, path=str(tmp_path / str(tune)))
    for start in range(0, trace.numel(), 2_000):
        keys = trace[start:start + 2_000]
        rows = cache.lookup("t", keys)
        cache.apply_gradients("t", keys, torch.ones_like(rows) * 0.01)
        cache._tables["t"].mrc.drain()  # the tuner runs in the background: let it keep up, for a repeatable test
    return cache, cache.lookup("t", torch.arange(20_000))


def test_the_cache_retunes_itself_and_no_value_changes(make_cache: Any, tmp_path: Any) -> None:
    trace = torch.from_numpy(wl.loop_trace(100_000, 20_000, seed=3))
    fixed, fixed_rows = _trained(make_cache, tmp_path, False, trace)
    tuned, tuned_rows = _trained(make_cache, tmp_path, True, trace)
    assert torch.equal(fixed_rows, tuned_rows)  # placement only: every value is the same
    f, t = fixed.stats()["t"], tuned.stats()["t"]
    assert f["policy"]["tuned"] is False and f["policy"]["setting"] is None and f["policy"]["switches"] == 0
    assert t["policy"]["tuned"] is True and t["policy"]["switches"] >= 1
    assert t["policy"]["setting"]["strict"] is True
    assert t["hbm"]["hits"] > f["hbm"]["hits"] + 0.04 * f["lookups"]


def test_an_explicit_halflife_is_never_tuned(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=64, ddr_rows=0, halflife=5_000.0, mrc_sample_rate=1.0)
    for _ in range(50):
        cache.lookup("t", torch.arange(200))
    policy = cache.stats()["t"]["policy"]
    assert policy["tuned"] is False and policy["halflife"] == 5_000.0


def test_batched_counting_counts_only_keys_cached_when_their_batch_began() -> None:
    from embcache.sim import lfu_hits, lru_hits, wtinylfu_hits

    trace = wl.sessions_trace(4_000, 300, mean_session=8, seed=5)
    lru: OrderedDict[int, None] = OrderedDict()
    expected = 0
    for start in range(0, trace.size, 16):  # LRU by hand, hits counted against the batch's start
        at_start = set(lru)
        for k in map(int, trace[start:start + 16]):
            expected += k in at_start and k in lru
            lru.pop(k, None)
            lru[k] = None
            if len(lru) > 40:
                lru.popitem(last=False)
    assert lru_hits(trace, 40, batch=16) == expected
    for fn in (lru_hits, lfu_hits, arc_hits, wtinylfu_hits):
        assert fn(trace, 40, batch=16) < fn(trace, 40) == fn(trace, 40, batch=1)
        with pytest.raises(ValueError, match="batch"):
            fn(trace, 40, batch=0)
