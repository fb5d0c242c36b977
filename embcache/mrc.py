"""Online miss-ratio curve: what hit ratio HBM and DDR would give at other capacities.

A SHARDS-style estimator (Waldspurger et al., FAST 2015): keys are sampled *spatially* (a key
is in the sample iff a hash of it falls below ``rate``, so every access of a sampled key is
seen), and the sampled stream runs through small shadow caches of embcache's own policy
(:class:`embcache.sim.LrfuSim`) with ``rate`` times the capacities of interest. The hit ratio of
a shadow estimates the hit ratio of a real tier of ``factor`` times its capacity.

For each factor in ``FACTORS``:

- ``hbm``: the hit ratio of an HBM tier of ``factor x`` its capacity;
- ``ddr``: the share of lookups served from memory (HBM or DDR, i.e. not from the SSD) with both
  tiers at ``factor x`` their capacity. DDR's own hit ratio is that minus HBM's.

Ratios are over a sliding window: counts decay by half every ``window`` sampled accesses (so
every ``window / rate`` lookups: 51M at rate 1/256), and are corrected as in SHARDS-adj (the
difference between the expected and the actual number of sampled accesses counts as hits: it
comes from a few very hot keys the sample caught or missed).

Measured error (``.venv/bin/python bench/bench_mrc.py``, ``bench/results/mrc.md``): the estimate
against the exact replay (:class:`~embcache.sim.LrfuSim` at the full capacities, the same lookup
batches of 4096 keys and half-lives, decayed over the same window), in hit ratio over all ten
points. At the default rate, with HBM 40k / DDR 160k rows over 4M lookups of 2M keys (rate
1/256, smallest shadow 39 rows, 6k-15k keys sampled): at most 0.006 (Zipf 0.8), 0.005 (Zipf 1.05),
0.003 (Zipf 1.2) and 0.012 (drifting popularity); mean 0.001-0.008. The error grows as the
sample shrinks: with HBM 4k rows over 400k lookups (``--quick``: still 1/256, 4-row shadows,
0.4k-1.3k keys sampled) it reaches 0.05-0.08 (Zipf 0.8 and 1.05). A higher
``CacheConfig.mrc_sample_rate`` buys accuracy there: 1/16 brings that case to at most 0.018. In
the larger case every rate from 1/256 to 0.2 stays within 0.016: what remains does not shrink
with the rate. ``tests/test_mrc.py`` checks the default on the ``--quick`` case.

Cost: ``observe`` copies the batch's keys and hands them over: 43 us of the caller's time per
8,192-key batch (5 ns per key; an all-hot lookup of that batch takes ~0.9 ms), where hashing
them on the caller's thread took 98 us (``/tmp`` timing loop, 585K-row table, one torch thread).
The sampling hash then runs on a background thread, and so do the shadows (a few heap
operations per sampled key and shadow: 1-7 us of CPU per sampled key for all ten, measured by
the same benchmark on 2 shared cores). That thread wakes once per
``_WAKE_BATCHES`` batches (or every ``_WAKE_SECONDS``) and runs them all through each shadow in
one call: per batch, ten shadow calls and a thread wake-up cost more than the sampled keys
themselves (measured in the parameter server: 1.1-1.3 ms of CPU per lookup batch).
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np
import torch

from .policy import DEFAULT_IDLE_HALVING, default_halflife
from .sim import LrfuSim
from .sim.tuner import RATE_BITS, Tuner, sample_threshold, spatial_sample

__all__ = ["FACTORS", "MissRatioEstimator", "auto_sample_rate"]

FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
_SMALLEST_SHADOW = 512
_MAX_PENDING = 64
_MAX_PENDING_KEYS = 1 << 22  # 32 MiB of copied keys at most
_WAKE_BATCHES = 16
_WAKE_SECONDS = 0.5
# the tuner's miniatures: about this many rows each, sampling at most this share of the keys
_TUNER_ROWS = 1024
_TUNER_MAX_RATE = 1.0 / 16


def auto_sample_rate(hbm_rows: int) -> float:
    """A rate giving the smallest (0.25x HBM) shadow about 512 rows, and at most 1/256.

    The shadows cost about 0.1-0.7 us per sampled key and shadow on a background thread (measured:
    230 us of CPU per 8,192-key lookup at rate 1/90, 40% of the lookup itself; every key through
    the shadows, rate 1, halved a tiered lookup's throughput on 2 cores), so the rate is kept
    low. Its error, measured against exact replays over the same window by
    ``bench/bench_mrc.py`` (see the module docstring): at most 0.003-0.012 in hit ratio with HBM
    40k rows over 4M lookups, up to about 0.08 with HBM 4k rows over 400k lookups, where the sample is
    a thousand keys. With HBM under 524k rows the cap leaves the smallest shadow below 512 rows,
    so the curve is coarser there: set ``CacheConfig.mrc_sample_rate`` higher (1/16 brought the
    small case to 0.018), or size offline with ``embcache sizing``.
    """
    smallest = FACTORS[0] * max(hbm_rows, 1)
    return min(max(_SMALLEST_SHADOW / smallest, 2.0**-20), 1.0 / 256)


class MissRatioEstimator:
    """Shadow caches of sampled keys for one table.

    Args:
        hbm_rows, ddr_rows: the real tiers' capacities in rows.
        halflife: the table's half-life in ticks; None = the cache's default (40x the rows in
            memory, scaled with each shadow's capacity as the cache would scale it).
        rate: share of keys sampled (0 < rate <= 1); None picks :func:`auto_sample_rate`.
        window: sampled accesses after which past counts weigh half.
        idle_halving: the policy's idle discount (``CacheConfig.idle_halving``); the number of
            missed accesses does not change with sampling (idle ticks and half-life shrink alike).
        tune: also run a :class:`~embcache.sim.tuner.Tuner` of the memory's capacity (``tuner``),
            on a sample of its own rate (miniatures of about ``_TUNER_ROWS`` rows, at most
            ``_TUNER_MAX_RATE`` of the keys) that contains this estimator's (the same hash, a
            higher threshold).
    """

    def __init__(self, hbm_rows: int, ddr_rows: int, halflife: float | None = None, rate: float | None = None,
                 window: int = 200_000, idle_halving: float = DEFAULT_IDLE_HALVING, tune: bool = False) -> None:
        self.rate = float(rate) if rate is not None else auto_sample_rate(hbm_rows)
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"sample rate must be in (0, 1], got {self.rate}")
        self._threshold = sample_threshold(self.rate)
        self.tuner: Tuner | None = None
        self._tune_threshold = self._threshold
        if tune and hbm_rows + ddr_rows > 0:
            tune_rate = max(self.rate, min(_TUNER_ROWS / (hbm_rows + ddr_rows), _TUNER_MAX_RATE))
            self._tune_threshold = sample_threshold(tune_rate)
            self.tuner = Tuner(hbm_rows + ddr_rows, self._tune_threshold / 2**RATE_BITS)
        self._lock = threading.Lock()
        memory = hbm_rows + ddr_rows
        self._shadows: dict[tuple[str, float], LrfuSim] = {}
        for tier, rows in (("hbm", hbm_rows), ("ddr", memory)):
            for f in FACTORS:
                hl = halflife if halflife is not None else default_halflife(memory * f)
                self._shadows[(tier, f)] = LrfuSim(max(round(rows * f * self.rate), 0), hl * self.rate,
                                                   idle_halving=idle_halving)
        self._decay = 0.5 ** (1.0 / window)
        self._hits = {k: 0.0 for k in self._shadows}
        self._seen = 0.0
        self._expected = 0.0
        self._cond = threading.Condition()
        self._pending: deque[np.ndarray | _DeviceKeys] = deque()  # looked-up keys, not yet sampled
        self._pending_keys = 0
        self._thread: threading.Thread | None = None
        self._busy = False
        self._draining = 0
        self._closed = False
        self.dropped_batches = 0

    def observe(self, keys: torch.Tensor) -> None:
        """Count one lookup batch (int64 keys, any device; duplicates are accesses).

        Only a copy of the keys is made here (the caller may reuse its tensor); the sampling (one
        hash per key) and the shadows run on a background thread, off the lookup's path. When
        that thread falls more than ``_MAX_PENDING`` batches or ``_MAX_PENDING_KEYS`` keys
        behind, a batch is dropped whole (counted in ``dropped_batches``), which keeps the
        estimate unbiased. Keys on a GPU are copied to pinned host memory asynchronously; the
        background thread waits for the copy, so the caller does not synchronize with the device.
        """
        k: np.ndarray | _DeviceKeys
        if keys.device.type == "cpu":
            k = np.array(keys.numpy(), dtype=np.int64).reshape(-1)
        else:
            k = _DeviceKeys(keys)
        n = int(k.shape[0])
        with self._cond:
            if self._closed:
                return
            if len(self._pending) >= _MAX_PENDING or self._pending_keys + n > _MAX_PENDING_KEYS:
                self.dropped_batches += 1
                return
            self._pending.append(k)
            self._pending_keys += n
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="embcache-mrc", daemon=True)
                self._thread.start()
            if len(self._pending) in (1, _WAKE_BATCHES):  # wake the idle thread; the full batch
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()  # idle: no timer
                # then let batches gather for up to _WAKE_SECONDS
                self._cond.wait_for(lambda: len(self._pending) >= _WAKE_BATCHES or self._draining > 0
                                    or self._closed, _WAKE_SECONDS)
                if self._closed:
                    return
                batches = list(self._pending)
                self._pending.clear()
                self._pending_keys = 0
                self._busy = True
            try:
                self._process(batches)
            finally:
                # let go of the batches before waiting again: a GPU batch holds a pinned host
                # buffer, which a lingering reference would keep out of torch's pinned cache
                del batches
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _process(self, pending: list[np.ndarray | _DeviceKeys]) -> None:
        looked_up = [k.numpy() if isinstance(k, _DeviceKeys) else k for k in pending]
        looked_up_n = [k.shape[0] for k in looked_up]
        if self._tune_threshold < 2**RATE_BITS:
            looked_up = [spatial_sample(k, self._tune_threshold) for k in looked_up]
        if self.tuner is not None:
            t_sizes = np.array([k.shape[0] for k in looked_up], dtype=np.int64)
            self.tuner.observe_batches(np.concatenate(looked_up), np.concatenate([[0], np.cumsum(t_sizes)]))
        if self._threshold < self._tune_threshold:  # the estimator's sample within the tuner's
            looked_up = [spatial_sample(k, self._threshold) for k in looked_up]
        batches = list(zip(looked_up, looked_up_n, strict=True))
        sizes = np.array([b[0].shape[0] for b in batches], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        keys = np.concatenate([b[0] for b in batches])
        # after batch b, the counts of batches before it have decayed by decay ** n_b each
        later = np.concatenate([np.cumsum(sizes[::-1])[::-1][1:], [0]])  # sampled keys after batch b
        weights = self._decay ** later.astype(np.float64)
        total_decay = self._decay ** float(bounds[-1])
        n_all = np.array([b[1] for b in batches], dtype=np.float64)
        with self._lock:
            # shadows run in sampled ticks: a sampled key stands for 1/rate accesses
            for key, shadow in self._shadows.items():
                hits = shadow.access_batches(keys, bounds) if keys.shape[0] else np.zeros(len(batches))
                self._hits[key] = self._hits[key] * total_decay + float(weights @ hits)
            self._seen = self._seen * total_decay + float(weights @ sizes)
            self._expected = self._expected * total_decay + float(weights @ n_all) * self.rate

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every observed batch has been run through the shadows."""
        with self._cond:
            self._draining += 1
            self._cond.notify_all()
            try:
                self._cond.wait_for(lambda: (not self._pending and not self._busy) or self._closed, timeout)
            finally:
                self._draining -= 1

    def close(self) -> None:
        """Stop the background thread and wait for it (pending batches are dropped; a batch being
        sampled is finished first). Once closed, the estimator holds no batch: a GPU batch's
        pinned host buffer is back in torch's pinned cache."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._pending_keys = 0
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def hit_ratios(self) -> dict[str, dict[str, float]]:
        """``{"hbm": {"0.25": r, ...}, "ddr": {...}}``; NaN before anything was sampled."""
        with self._lock:
            out: dict[str, dict[str, float]] = {"hbm": {}, "ddr": {}}
            # SHARDS-adj: a sample that caught more (or fewer) accesses than rate x all accesses
            # owes it to a few very hot keys (in or out of it), which hit at every capacity:
            # add the difference to the hits and divide by the expected count.
            adjust = self._expected - self._seen
            for (tier, f), hits in self._hits.items():
                if self._expected:
                    out[tier][_label(f)] = min(max((hits + adjust) / self._expected, 0.0), 1.0)
                else:
                    out[tier][_label(f)] = math.nan
            return out


class _DeviceKeys:
    """A batch of GPU keys on its way to pinned host memory (``numpy()`` waits for the copy)."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.host = torch.empty(keys.numel(), dtype=torch.int64, pin_memory=True)
        self.host.copy_(keys.reshape(-1), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()  # on the caller's current stream, after the copy
        self.shape = (keys.numel(),)

    def numpy(self) -> np.ndarray:
        self.event.synchronize()  # on the sampler's thread, not the caller's
        return self.host.numpy()


def _label(factor: float) -> str:
    return f"{factor:g}"
