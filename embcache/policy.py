"""Placement policy: aged access frequencies, eviction scores and a sketch for admission.

Every eviction policy reduces to one score per row (the larger, the longer it stays), computed
from two numbers the tiers keep for each resident row:

- ``freq``: the row's *aged* access frequency. Each access at tick ``t`` adds
  ``2 ** ((t - t0) / halflife)``; dividing by the current increment gives
  ``sum over accesses of 2 ** -((now - t_i) / halflife)``, i.e. LRFU's combined
  recency-frequency (Lee et al., 2001). With an infinite half-life it is a plain count (LFU).
  Growing the increment instead of decaying every row makes an access O(1); when the increment
  passes 2**40 every frequency is rescaled once (``Clock.renormalize``), like TinyLFU's halving.
- ``last``: the tick of the row's last access.

A tick is one key occurrence in a lookup, so half-lives are measured in accesses.

=========  ===========================================================  =========
policy     score                                                        admission
=========  ===========================================================  =========
lrfu       aged frequency, discounted by the accesses it has missed     yes
lfu        access count (no aging)                                      yes
lru        tick of the last access                                      no
callable   ``fn(freq, last, now)``                                      yes
=========  ===========================================================  =========

**The idle discount of ``lrfu``.** Aged frequency alone keeps a row that was hot for a while
(a burst, a finished phase of the data) long after its use ended: with a half-life long enough
to rank a stationary Zipf tail well, a row with 30 recent accesses needs several half-lives to
fall below the tail. But such a row gives itself away: its aged frequency ``F`` estimates an
access rate ``F * ln 2 / halflife`` per tick, so over the ``now - last`` ticks it has been idle
it should have been accessed ``missed = F * ln 2 * (now - last) / halflife`` times. A stationary
row has missed about one access (the wait for its next one); a row whose popularity ended has
missed many. The score is the aged frequency halved for every ``idle_halving`` missed
accesses::

    score = freq * 2 ** (-missed / idle_halving)

A row just accessed is not discounted, so a row coming up from below (scored by the sketch's
estimate) and a resident row are compared in the same units. Measured with the simulators of
``embcache.sim`` (access by access) on the six workloads of ``bench/bench_policy.py`` at
capacities of 0.25%, 1% and 4%, against Caffeine's W-TinyLFU, in points of hit ratio:

=================================================  ==============  ==============  ==============
policy                                             1M keys         100k, seed 0    100k, seed 1
=================================================  ==============  ==============  ==============
aged frequency, half-life 16x rows (the former)    -1.80 / +0.34   -1.42 / +0.41   -1.40 / +0.40
aged frequency, half-life 40x rows                 n/a             -6.16 / +0.04   n/a
with the idle discount (2.5), half-life 40x rows   +0.02 / +0.77   -0.05 / +0.91   +0.03 / +0.88
=================================================  ==============  ==============  ==============

(worst / mean of the 18 cells; 2M accesses for 1M keys, 250k for 100k). The discount needs the
longer half-life, which ranks the stationary tails better, and the half-life needs the
discount, without which finished bursts hold their slots far longer.

**Tuning.** No one setting suits every workload: user sessions want a half-life of a few times
the rows, a stationary Zipf a long one without the discount, a loop over more keys than memory
holds *strict admission* (a row from below must beat the victim without the access it is making,
so rows of equal standing do not churn), item and user sessions a *window* in front of HBM that
every row coming up enters (:mod:`embcache.engine.window`) and a batch's repeats of a row counted
as one access. With ``CacheConfig.tune_policy`` (on by default, unless
``halflife`` is set) the table's miss-ratio estimator also replays its sample of keys through
fourteen miniature caches, one per setting of :data:`embcache.sim.tuner.GRID`, and the table
switches to the setting whose miniature hit most recently (:meth:`Clock.retune` rescales the
frequencies, so past accesses keep their weights). See :mod:`embcache.sim.tuner` for the figures.

Rows outside memory keep their aged frequency in a count-min sketch (:class:`FrequencySketch`),
updated with the same increments, so a row coming up from the SSD is compared with the row it
would displace in the same units (TinyLFU-style admission, Einziger et al., 2017).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import score_kernels, sketch_kernels
from ._bits import mix64
from .config import ScoreFn
from .hostmem import host_zeros

__all__ = ["DEFAULT_HALFLIFE_ROWS", "DEFAULT_IDLE_HALVING", "Clock", "FrequencySketch", "Policy", "default_halflife",
           "discounted_scores", "idle_discount_rate", "make_policy"]

# Rescale all frequencies when the per-access increment passes this (float64 keeps ~2**-12
# relative precision of the oldest counts at that ratio, and never overflows).
_RENORMALIZE_AT = 2.0**40
# Defaults of CacheConfig.halflife (times the table's rows in memory) and .idle_halving; see
# the module docstring for how they were chosen.
DEFAULT_HALFLIFE_ROWS = 40
DEFAULT_IDLE_HALVING = 2.5
_LN2 = math.log(2.0)


def default_halflife(memory_rows: float, per_row: float = DEFAULT_HALFLIFE_ROWS) -> float:
    """The half-life, in ticks, of a table with ``memory_rows`` rows in memory: ``per_row`` ticks
    per row (the default's 40, or a tuned setting's), at least 1,024."""
    return float(max(per_row * memory_rows, 1024))


@dataclass(frozen=True)
class Policy:
    """How rows are scored for eviction and whether admission applies.

    ``score(freq, last, clock)`` gives the float64 scores of rows with aged frequencies ``freq``
    (float32, as the tiers keep them, or float64) and last-access ticks ``last`` at the table's
    ``clock`` (the larger, the longer a row stays). ``gathered``, where set, is the same score of
    the rows at ``slots`` of a tier's ``freq`` and ``last`` columns, read where they lie
    (:meth:`score_at` falls back to ``score`` of gathered copies).
    """

    name: str
    score: Callable[[torch.Tensor, torch.Tensor, Clock], torch.Tensor]
    admission: bool
    aging: bool
    gathered: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Clock], torch.Tensor | None] | None = None

    def score_at(self, freq: torch.Tensor, last: torch.Tensor, slots: torch.Tensor, clock: Clock) -> torch.Tensor:
        """Scores (float64 [n]) of the rows at ``slots`` (int64 [n]) of a tier's ``freq`` and ``last``."""
        if self.gathered is not None:
            out = self.gathered(freq, last, slots, clock)
            if out is not None:
                return out
        return self.score(freq.index_select(0, slots), last.index_select(0, slots), clock)


def _score_freq(freq: torch.Tensor, last: torch.Tensor, clock: Clock) -> torch.Tensor:
    return freq.to(torch.float64)


def _score_last(freq: torch.Tensor, last: torch.Tensor, clock: Clock) -> torch.Tensor:
    return last.to(torch.float64)


def idle_discount_rate(clock: Clock, idle_halving: float) -> float:
    """``a`` such that the discounted score is ``freq * exp(-a * freq * (now - last))`` (0: none).

    ``missed * ln 2 / idle_halving = (freq / increment) * ln 2 / halflife * idle * ln 2 / idle_halving``.
    """
    if math.isinf(idle_halving) or math.isinf(clock.halflife):
        return 0.0
    return _LN2 * _LN2 / (clock.halflife * idle_halving * clock.increment())


def discounted_scores(freq: torch.Tensor, last: torch.Tensor, now: int, a: float) -> torch.Tensor:
    """``freq * exp(-a * freq * max(now - last, 0))`` in float64, in torch operations (any device)."""
    freq = freq.to(torch.float64)  # the tiers keep float32
    if a == 0.0 or freq.numel() == 0:
        return freq
    idle = (now - last).to(torch.float64).clamp_(min=0)
    return freq * torch.exp(idle.mul_(freq).mul_(-a))


def _on_host(*tensors: torch.Tensor) -> bool:
    # the compiled scoring (embcache/score_kernels.py) applies: host tensors, numba present
    return all(t.device.type == "cpu" for t in tensors) and score_kernels.available()


def _score_discounted(idle_halving: float) -> Callable[[torch.Tensor, torch.Tensor, Clock], torch.Tensor]:
    def score(freq: torch.Tensor, last: torch.Tensor, clock: Clock) -> torch.Tensor:
        a = idle_discount_rate(clock, idle_halving)
        if a != 0.0 and freq.numel() and _on_host(freq, last):
            return score_kernels.discounted(freq.numpy(), last.numpy(), clock.now, a)
        return discounted_scores(freq, last, clock.now, a)
    return score


def _score_discounted_at(idle_halving: float) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Clock],
                                                          torch.Tensor | None]:
    def score_at(freq: torch.Tensor, last: torch.Tensor, slots: torch.Tensor, clock: Clock) -> torch.Tensor | None:
        a = idle_discount_rate(clock, idle_halving)
        if a == 0.0 or not _on_host(freq, last, slots):
            return None
        return score_kernels.discounted_at(freq.numpy(), last.numpy(), slots.to(torch.int64).contiguous().numpy(),
                                           clock.now, a)
    return score_at


def make_policy(spec: str | ScoreFn, admission: bool, idle_halving: float = DEFAULT_IDLE_HALVING) -> Policy:
    """Build the policy named by ``spec`` ("lrfu", "lfu", "lru") or wrap a user score function.

    ``idle_halving`` (``lrfu`` only): missed accesses that halve a row's score (``math.inf``: no
    discount, plain aged frequency).
    """
    if callable(spec):
        user = spec

        def _score_user(freq: torch.Tensor, last: torch.Tensor, clock: Clock) -> torch.Tensor:
            out = user(freq.to(torch.float64), last, clock.now)
            if not isinstance(out, torch.Tensor) or out.shape != freq.shape:
                raise TypeError(f"user score function must return a tensor of shape {tuple(freq.shape)}")
            return out.to(freq.device, torch.float64)  # a host result serves a GPU tier too

        return Policy("custom", _score_user, admission, aging=True)
    table = {
        "lrfu": Policy("lrfu", _score_discounted(idle_halving), admission, aging=True,
                       gathered=_score_discounted_at(idle_halving)),
        "lfu": Policy("lfu", _score_freq, admission, aging=False),
        "lru": Policy("lru", _score_last, False, aging=False),
    }
    return table[spec]


class Clock:
    """Per-table access counter and the aged-frequency increment.

    Args:
        halflife: accesses after which an access counts half; ``math.inf`` disables aging.
    """

    def __init__(self, halflife: float) -> None:
        self.halflife = halflife
        self.now = 0  # ticks (key occurrences looked up) so far
        self.t0 = 0  # tick at which the increment is 1

    def increment(self) -> float:
        """Weight of one access at the current tick."""
        if math.isinf(self.halflife):
            return 1.0
        return 2.0 ** ((self.now - self.t0) / self.halflife)

    def advance(self, n: int) -> float | None:
        """Move the clock ``n`` ticks on; returns a factor to rescale all frequencies by, or None."""
        self.now += n
        inc = self.increment()
        if inc < _RENORMALIZE_AT:
            return None
        self.t0 = self.now
        return 1.0 / inc

    def retune(self, halflife: float) -> float:
        """Use ``halflife`` from now on; returns the factor to rescale all frequencies by (so that
        the current increment is 1 and past accesses keep the weights they have now)."""
        factor = 1.0 / self.increment()
        self.t0 = self.now
        self.halflife = halflife
        return factor

    def state(self) -> dict[str, float]:
        """Serializable state."""
        return {"now": self.now, "t0": self.t0, "halflife": self.halflife}

    def load(self, state: dict[str, float]) -> None:
        """Restore from :meth:`state` (the half-life stays as configured, frequencies are rescaled)."""
        self.now = int(state["now"])
        self.t0 = int(state["t0"])


class FrequencySketch:
    """Count-min sketch of aged access frequencies for rows that are not in memory.

    Args:
        width: columns per row (power of two).
        depth: independent hash rows (estimates take the minimum).
        device: where the counters live (the device of the keys passed in).

    Counters receive the same increments as resident rows, so estimates are upper bounds of the
    true aged frequency, comparable with resident scores. Updates are *conservative* (Estan and
    Varghese, 2002): a key's counters are raised only to its new estimate (the minimum plus the
    increment), not each incremented, which keeps cold keys that share counters with hot ones
    from looking hot. Counters are float32: an estimate needs its order of magnitude, not 53 bits,
    and half the bytes buy twice the width, which decides the error (measured with the exact
    simulators of ``embcache.sim``: at 1% capacity on Zipf 0.8, conservative update plus 8 columns
    per row in memory took the hit ratio from 0.303 to 0.324).

    On the host with numba, :meth:`add_and_estimate`, :meth:`estimate` and :meth:`raise_to` run
    as compiled kernels (:mod:`embcache.sketch_kernels`: the same counters, bit for bit, about 5x
    faster where a tiered lookup stages its rows); elsewhere as torch operations.
    """

    _SEEDS = (0x1F123BB5, 0x5A5A5A5A, 0x2545F491, 0x6C8E9CF5)

    def __init__(self, width: int, depth: int = 4, device: torch.device | None = None) -> None:
        if width & (width - 1):
            raise ValueError(f"sketch width must be a power of two, got {width}")
        self.width = width
        self.depth = depth
        self.device = device or torch.device("cpu")
        # on the host on huge pages: each key's counters are read at random in up to 128 MiB
        self.counts = (host_zeros((depth * width,), torch.float32) if self.device.type == "cpu"
                       else torch.zeros(depth * width, dtype=torch.float32, device=self.device))
        self._offsets = (torch.arange(depth, device=self.device) * width).unsqueeze(1)
        # what each row's hash xors a key with: the compiled kernels take the array, _cells its rows
        self._salts = np.array([s * 0x9E3779B9 for s in self._SEEDS[:depth]], dtype=np.int64)
        self._salt_rows = torch.from_numpy(self._salts).to(self.device).unsqueeze(1)

    def _compiled(self) -> bool:
        # the compiled kernels (embcache/sketch_kernels.py): counters on the host, numba present
        return self.device.type == "cpu" and sketch_kernels.available()

    def _keys(self, keys: torch.Tensor) -> np.ndarray:
        return keys.to("cpu", torch.int64).contiguous().numpy()

    def _cells(self, keys: torch.Tensor) -> torch.Tensor:
        """Flat counter positions [depth, n] of ``keys``."""
        keys = keys.to(self.device)
        h = mix64(keys.unsqueeze(0) ^ self._salt_rows)
        return (h & (self.width - 1)) + self._offsets

    def add(self, keys: torch.Tensor, amounts: torch.Tensor) -> None:
        """Add ``amounts`` (float64 [n]) to the estimates of ``keys`` (int64 [n], unique)."""
        self.add_and_estimate(keys, amounts)

    def add_and_estimate(self, keys: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
        """:meth:`add`, then the new estimates (float64 [n]) of the same (unique) keys, hashing them once."""
        if self._compiled():
            return torch.from_numpy(sketch_kernels.add_and_estimate(
                self.counts.numpy(), self._keys(keys), amounts.to("cpu", torch.float64).contiguous().numpy(),
                self._salts, self.width))
        return self._add_at(self._cells(keys), amounts)

    def _add_at(self, cells: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
        # Conservative update: every counter of a key becomes at least min(counters) + amount.
        # Keys of one call that share a counter take the larger of their raises (amax).
        new = self._min_at(cells) + amounts.to(self.device, torch.float64)
        self.counts.scatter_reduce_(0, cells.reshape(-1), new.to(torch.float32).repeat(self.depth), reduce="amax")
        return self._min_at(cells)

    def _min_at(self, cells: torch.Tensor) -> torch.Tensor:
        # The smallest counter of each key (float64 [n]); index_select is 4-6x faster on CPU than
        # advanced indexing (counts[cells]).
        return self.counts.index_select(0, cells.reshape(-1)).view(cells.shape).amin(dim=0).to(torch.float64)

    def estimate(self, keys: torch.Tensor) -> torch.Tensor:
        """Upper-bound estimates (float64 [n]) of the aged frequency of ``keys``."""
        if self._compiled():
            return torch.from_numpy(sketch_kernels.estimate(self.counts.numpy(), self._keys(keys), self._salts,
                                                            self.width))
        return self._min_at(self._cells(keys))

    def raise_to(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make every counter of ``keys`` at least ``values`` (rows leaving memory keep their score)."""
        if self._compiled():
            sketch_kernels.raise_to(self.counts.numpy(), self._keys(keys),
                                    values.to("cpu", torch.float32).contiguous().numpy(), self._salts, self.width)
            return
        cells = self._cells(keys).reshape(-1)
        vals = values.to(self.device, torch.float32).repeat(self.depth)
        self.counts.scatter_reduce_(0, cells, vals, reduce="amax")

    def scale(self, factor: float) -> None:
        """Multiply every counter by ``factor`` (renormalization)."""
        self.counts.mul_(factor)

    def to_bytes(self) -> bytes:
        """Serialize the counters (npy format), copying them once (a table's sketch is up to 128 MiB:
        ``np.save`` into a growing buffer, then ``getvalue()``, held two to three copies at once)."""
        arr = np.ascontiguousarray(self.counts.cpu().numpy())
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(arr))
        return b"".join((header.getvalue(), arr.data.cast("B")))

    def load_bytes(self, data: bytes) -> None:
        """Load counters from :meth:`to_bytes`; a sketch of another width is folded or ignored."""
        arr = np.load(io.BytesIO(data))
        if arr.shape == (self.depth * self.width,):
            self.counts.copy_(torch.from_numpy(arr))  # a float64 sketch of an older version casts
