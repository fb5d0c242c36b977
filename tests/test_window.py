"""HBM's window and counting once per tick (tuned settings of the policy): what a session's rows
gain, what the window never does (hold more than its rows, give up a pinned row, change a value),
and the once-per-tick count of a batch's repeats."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from bench import workloads as wl
from embcache.engine.window import Window
from embcache.sim import LrfuSim
from embcache.sim.tuner import GRID, WINDOW_SHARE, Setting

WINDOWED = Setting(64.0, math.inf, False, 0.1, True)  # a 10% window, counting once per tick
PLAIN = Setting(64.0, math.inf, False)


def _table(cache: Any) -> Any:
    return cache._tables["t"]


def _fill_main_with_hot_rows(cache: Any, rows: int) -> None:
    hot = torch.arange(rows, dtype=torch.int64)
    for _ in range(30):  # the hot rows are counted many times: a new key cannot outscore them
        cache.lookup("t", hot)


def test_a_sessions_row_enters_through_the_window_and_hits_from_its_second_batch(device: str, make_cache: Any,
                                                                              tmp_path: Any) -> None:
    hits = {}
    for setting in (PLAIN, WINDOWED):
        cache = make_cache(hbm_rows=100, ddr_rows=0, tune_policy=False, device=device,
                           path=str(tmp_path / str(setting.window)))
        _table(cache).retune(setting)
        _fill_main_with_hot_rows(cache, 100)
        before = cache.stats()["t"]["hbm"]["hits"]
        session = torch.full((4,), 10_000, dtype=torch.int64)
        for _ in range(5):  # one user's key, batch after batch
            cache.lookup("t", session)
        hits[setting.window] = cache.stats()["t"]["hbm"]["hits"] - before
    assert hits[0.0] == 0  # no counts yet: never beats main's hot rows, misses all session long
    assert hits[0.1] == 16  # in the window at its first miss: every later batch hits


def test_the_window_holds_its_rows_and_main_never_gives_up_a_window_row(device: str, make_cache: Any) -> None:
    cache = make_cache(hbm_rows=200, ddr_rows=0, tune_policy=False, device=device)
    t = _table(cache)
    t.retune(WINDOWED)
    assert t.window is not None and t.window.rows == 20
    trace = torch.from_numpy(wl.sessions_trace(30_000, 5_000, mean_session=20, seed=4))
    for start in range(0, trace.numel(), 256):
        window_keys = t.hbm.keys.index_select(0, t.window.live(t.hbm)).cpu()
        cache.lookup("t", trace[start:start + 256])
        live = t.window.live(t.hbm)
        assert 0 < live.numel() <= 20 and len(t.hbm) <= 200
        assert torch.unique(live).numel() == live.numel()
        # a row leaves the window only when pushed out, oldest first: the rows still in it are
        # the newest of those that were, in the same order
        now_keys = t.hbm.keys.index_select(0, live).cpu()
        stayed = now_keys[torch.isin(now_keys, window_keys)]
        assert torch.equal(stayed, window_keys[window_keys.numel() - stayed.numel():])
    assert len(t.window) == 20


def test_a_pinned_window_row_stays_when_pushed_out(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=50, ddr_rows=0, tune_policy=False)
    t = _table(cache)
    t.retune(WINDOWED)  # 5 window rows
    _fill_main_with_hot_rows(cache, 45)
    leased = torch.arange(1_000, 1_005)
    cache.lookup("t", leased)  # they enter the window
    lease = cache.prefetch_batch({"t": leased})
    lease.result()
    for start in range(2_000, 2_400, 10):  # new keys push the leased rows out of the window
        cache.lookup("t", torch.arange(start, start + 10))
    assert bool((t.hbm.find(leased) >= 0).all())  # pinned: they joined main, never left
    assert len(t.hbm) <= 50
    lease.release()


def test_values_through_the_window_equal_the_in_memory_table(device: str, make_cache: Any, tmp_path: Any) -> None:
    # placement only: the window and once change which rows stay, never a value
    trace = torch.from_numpy(wl.sessions_trace(20_000, 3_000, mean_session=20, items_per_session=4, seed=7))
    results = []
    for setting in (None, WINDOWED):
        cache = make_cache(hbm_rows=150, ddr_rows=150, tune_policy=False, device=device,
                           path=str(tmp_path / str(setting)))
        if setting is not None:
            _table(cache).retune(setting)
        for start in range(0, trace.numel(), 500):
            keys = trace[start:start + 500]
            rows = cache.lookup("t", keys)
            cache.apply_gradients("t", keys, torch.ones_like(rows) * 0.01)
        results.append(cache.lookup("t", torch.arange(3_000)).cpu())
        assert len(_table(cache).hbm) <= 150
    assert torch.equal(results[0], results[1])


def test_once_counts_a_batchs_repeats_of_a_row_as_one_access(device: str, make_cache: Any, tmp_path: Any) -> None:
    freq = {}
    for once in (False, True):
        cache = make_cache(hbm_rows=10, ddr_rows=10, tune_policy=False, device=device, path=str(tmp_path / str(once)))
        t = _table(cache)
        t.retune(Setting(64.0, math.inf, False, 0.0, once))
        cache.lookup("t", torch.tensor([1, 2]))  # both enter HBM
        cache.lookup("t", torch.tensor([1] * 9 + [2]))
        slots = t.hbm.find(torch.tensor([1, 2]))
        f = t.hbm.freq.index_select(0, slots).cpu()
        freq[once] = (f[0] / f[1]).item()
        assert cache.stats()["t"]["hbm"]["hits"] == 10  # every occurrence is a hit either way
    assert freq[False] > 4.0  # nine accesses against one
    assert freq[True] == 1.0  # one each


def test_once_counts_a_prefetched_rows_first_lookup(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=10, ddr_rows=0, tune_policy=False)
    t = _table(cache)
    t.retune(Setting(64.0, math.inf, False, 0.0, True))
    cache.prefetch({"t": torch.tensor([5])}).result()  # staged at the current tick
    slot = t.hbm.find(torch.tensor([5]))
    before = float(t.hbm.freq[slot])
    cache.lookup("t", torch.tensor([5]))
    assert float(t.hbm.freq[slot]) > before  # the lookup's access counts (the clock moved on first)


def test_a_windows_size_is_its_share_of_the_tier() -> None:
    w = Window.of_share(0.01, 1_000, torch.device("cpu"))
    assert w is not None and w.rows == 10 and len(w) == 0
    assert Window.of_share(0.0, 1_000, torch.device("cpu")) is None
    assert Window.of_share(0.01, 0, torch.device("cpu")) is None
    assert Window.of_share(0.0001, 10, torch.device("cpu")).rows == 1  # type: ignore[union-attr]


def test_the_grid_tries_the_window_with_once_and_the_sim_follows_a_setting() -> None:
    windowed = [s for s in GRID if s.window > 0]
    assert len(GRID) == 14 and len(windowed) == 2
    assert all(s.window == WINDOW_SHARE and s.once for s in windowed)
    assert windowed[0].to_dict()["window"] == WINDOW_SHARE
    # item sessions: the window's setting beats the same half-life without it, in the simulator
    trace = wl.sessions_trace(200_000, 50_000, mean_session=30, items_per_session=5, seed=3)
    plain, windowed_sim = LrfuSim(250, halflife=64 * 250), LrfuSim(250, halflife=64 * 250, window=0.01, once=True)
    bounds = np.arange(0, trace.size + 1, 256)
    assert windowed_sim.access_batches(trace, bounds).sum() > plain.access_batches(trace, bounds).sum()

