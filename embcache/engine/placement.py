"""Placement: which rows enter, stay in and leave HBM and DDR, planned as data, carried out once.

Planning works on scores (the policy's aged frequencies) and returns a :class:`Plan`; it
changes nothing. :func:`commit` carries a plan out, the same way for every caller:

1. the dirty rows that leave memory are written to the store in one atomic batch (a failing
   write, e.g. a full disk, raises here and nothing has moved);
2. rows still being read from the store (a lookup's :class:`~.rows.StagedRead`) are waited for;
3. the moves: HBM and DDR give up their victims, promoted rows move up, staged and demoted
   rows are inserted;
4. the frequencies of the rows that left go to the sketch, and the moves are counted.

Two planners feed it: :func:`plan_access` after a lookup or an update (rows just accessed
compete for HBM on their scores, the losers and displaced rows for DDR: admission), and
:func:`plan_arrange` for a pass or a prefetch (the caller names which keys go where; rows of a
pass's keyset are evicted last). A resize rebuilds the tiers and uses :func:`write_leaving` /
:func:`forget_leaving`, the first and last steps of a commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..keyset import Keyset
from ..tier import MemoryTier, RowBatch, ScoreOf, to_device
from . import expiry
from .rows import StagedRead, merge_in_order
from .window import Window

if TYPE_CHECKING:
    from .table import TableEngine

__all__ = ["Plan", "WindowAdmission", "admit", "admit_windowed", "commit", "forget_leaving", "plan_access",
           "plan_arrange", "write_leaving"]

# the fewest victims admit() asks a tier for at first
_MIN_VICTIMS = 64
# Scores of rows a pass wants (begin_pass): above any policy score, ordered by the pass's counts.
_WANTED_SCORE, _WANTED_STEP = 1e30, 1e15


@dataclass
class Plan:
    """Moves between tiers, as data (see the module docstring).

    Rows entering DDR and rows leaving memory are indices into ``demoted + staged`` (the HBM
    victims' rows, then the staged rows).
    """

    up: torch.Tensor  # DDR slots whose rows move up to HBM
    hbm_victims: torch.Tensor  # HBM slots given up; their rows are ``demoted``
    ddr_victims: torch.Tensor  # DDR slots given up; their rows leave memory
    demoted: RowBatch  # rows of ``hbm_victims`` (CPU)
    staged: RowBatch  # rows from below memory (CPU; values may still be read)
    staged_up: torch.Tensor  # indices of ``staged`` entering HBM
    into_ddr: torch.Tensor  # indices into ``demoted + staged`` entering DDR, in order
    demoted_out: torch.Tensor  # indices of ``demoted`` leaving memory
    staged_out: torch.Tensor  # indices of ``staged`` staying out of memory
    window_pushed: int = 0  # HBM's window: its oldest rows that leave it
    window_entering: torch.Tensor | None = None  # keys entering HBM's window, in order


def _empty(device: torch.device | None = None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def write_leaving(t: TableEngine, leaving: RowBatch) -> None:
    """Step 1 of a commit: write the dirty rows of ``leaving`` to the store, after the touches of
    all of them where the table's rows expire (may raise; nothing moved)."""
    expiry.write_leaving_touches(t, leaving)
    t.rows.write(leaving.select(leaving.dirty))


def forget_leaving(t: TableEngine, keys: torch.Tensor, freq: torch.Tensor) -> None:
    """Step 4 of a commit: the sketch remembers the frequencies of rows that left memory."""
    if keys.numel():
        t.sketch.raise_to(keys, freq)


def commit(t: TableEngine, plan: Plan, read: StagedRead | None = None) -> RowBatch:
    """Carry ``plan`` out (lock held); ``read``: the staged rows' values, still being read.

    With ``read``, every move is made while the read runs (the staged rows enter their slots with
    their metadata, placeholder values), and only their values are copied in once it is done: the
    work after the read, which nothing overlaps, is that copy. A failed read takes the staged rows
    out of the tiers again; the other moves stand (rows that left memory were written first).

    Returns:
        The staged rows that stayed out of memory (copies).

    Raises:
        StoreError: writing back the rows that leave memory, or ``read``, failed. A failed write
            moves nothing.
    """
    if read is not None and bool(plan.staged.dirty.any()):
        raise RuntimeError("rows still being read cannot be dirty")  # a bug in the planner's caller
    staged = plan.staged
    dv = t.ddr.read(plan.ddr_victims)
    d_out = plan.demoted.select(plan.demoted_out)
    if read is None:
        s_out = staged.select(plan.staged_out)
        write_leaving(t, RowBatch.cat([dv, d_out, s_out]))
    else:  # rows still being read are clean: they need no write
        write_leaving(t, RowBatch.cat([dv, d_out]))
    p_rows = t.ddr.read(plan.up)
    t.hbm.remove(plan.hbm_victims)
    t.ddr.remove(torch.cat([plan.up, plan.ddr_victims]))
    h_slots = t.hbm.insert(RowBatch.cat([p_rows, staged.select(plan.staged_up)]))
    d_slots = t.ddr.insert(_take(plan.demoted, staged, plan.into_ddr))
    if t.window is not None and plan.window_entering is not None:
        t.window.advance(t.hbm, plan.window_pushed, plan.window_entering)
    # the keys and counts of the rows staying out are known before their values are read
    out_keys, out_freq = staged.keys.index_select(0, plan.staged_out), staged.freq.index_select(0, plan.staged_out)
    forget_leaving(t, torch.cat([dv.keys, d_out.keys, out_keys]), torch.cat([dv.freq, d_out.freq, out_freq]))
    if read is not None:  # the only work after the read: its values, and the rows staying out
        _fill_staged(t, plan, read, h_slots[len(p_rows):], d_slots)
        s_out = staged.select(plan.staged_out)
        expiry.write_leaving_touches(t, s_out)  # looked up, staying out: touched
    st = t.stats
    st.hbm.promotions += plan.up.numel() + plan.staged_up.numel()
    st.hbm.demotions += len(plan.demoted)
    st.hbm.write_backs += int(d_out.dirty.sum())
    st.ddr.promotions += int((plan.into_ddr >= len(plan.demoted)).sum())
    st.ddr.demotions += len(dv)
    st.ddr.write_backs += int(dv.dirty.sum())
    return s_out


def _fill_staged(t: TableEngine, plan: Plan, read: StagedRead, h_slots: torch.Tensor, d_slots: torch.Tensor) -> None:
    """Wait for ``read`` and copy the staged rows' values into the slots they entered (``h_slots``:
    those of ``plan.staged_up``; ``d_slots``: of ``plan.into_ddr``); a failed read takes them out."""
    from_staged = plan.into_ddr >= len(plan.demoted)
    d_staged = d_slots.index_select(0, to_device(torch.nonzero(from_staged).flatten(), d_slots.device))
    try:
        t.complete(read)  # the staged rows' values: the read ran while the caller planned and moved
    except BaseException:
        t.hbm.remove(h_slots)
        t.ddr.remove(d_staged)
        raise
    staged = plan.staged
    t.hbm.fill(h_slots, staged.weights.index_select(0, plan.staged_up), staged.state.index_select(0, plan.staged_up))
    into = plan.into_ddr[from_staged] - len(plan.demoted)
    t.ddr.fill(d_staged, staged.weights.index_select(0, into), staged.state.index_select(0, into))


def _take(demoted: RowBatch, staged: RowBatch, index: torch.Tensor) -> RowBatch:
    """Rows of ``demoted + staged`` at ``index``, in that order, copying only the rows taken."""
    n = len(demoted)
    from_d = index < n
    return merge_in_order(demoted.select(index[from_d]), staged.select(index[~from_d] - n), from_d)


def _displace(t: TableEngine, tier: MemoryTier, contenders: torch.Tensor, forced: int,
              exclude: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
    """Rows of ``tier`` to give up: the lowest ``forced`` (departures owed, no contest), then one
    for each of ``contenders`` (scores, CPU, best first) that beats the next lowest row.

    Returns:
        (victim slots, lowest first; how many of ``forced`` were found; how many contenders won).
        Contenders descend and victims ascend, so the winners are a prefix of ``contenders``.
    """
    want = min(forced + contenders.numel(), tier.capacity)
    if want <= 0:
        return _empty(tier.device), 0, 0
    # Few candidates beat a resident row (~1.5% of HBM's at 1% HBM on Zipf 1.1), so ask first
    # for about as many victims as last time, and for all ``want`` only when each of those was
    # beaten: choosing 2x the need instead of ``want`` halved lowest()'s cost.
    guess = forced + max(_MIN_VICTIMS, 2 * t.last_swaps.get(tier.tier, want))
    k = min(want, guess) if t.policy.admission else want
    while True:
        victims, vscores = tier.lowest(k, t.scores_of(tier), t.config.eviction_sample, exclude,
                                       t.generator_for(tier))
        m = victims.numel()
        got = min(forced, m)
        rest = m - got
        if t.policy.admission and rest:
            # strict admission (a tuned setting): a contender must beat the victim without the
            # access it is making now, as if the victim had been accessed too
            margin = t.clock.increment() if t.strict else 0.0
            wins = int((contenders[:rest] > vscores[got:].cpu() + margin).sum())
        else:
            wins = min(rest, contenders.numel())
        if wins < rest or m < k or k == want:
            break
        k = want
    t.last_swaps[tier.tier] = wins
    return victims[:got + wins], got, wins


def admit(t: TableEngine, tier: MemoryTier, cand_scores: torch.Tensor, extra_free: int,
          exclude: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan which candidates enter ``tier``: (candidate indices admitted, victim slots displaced).

    Candidates fill free slots best-first, then replace the lowest-scored rows they beat.
    """
    n = cand_scores.numel()
    if n == 0 or tier.capacity == 0:
        return _empty(), _empty(tier.device)
    order = torch.argsort(cand_scores, descending=True, stable=True)
    free = min(tier.free + extra_free, n)
    victims, _, wins = _displace(t, tier, cand_scores.index_select(0, order[free:]), 0, exclude)
    return order[:free + wins], victims


@dataclass
class WindowAdmission:
    """What :func:`admit_windowed` decided: who enters, who leaves, and the window's change."""

    admitted: torch.Tensor  # candidate indices entering the tier
    victims: torch.Tensor  # slots given up: main's rows displaced, and window rows pushed out that lost
    pushed: int  # the window's oldest rows that left it
    entering: torch.Tensor  # candidate indices entering the window, in order


def admit_windowed(t: TableEngine, tier: MemoryTier, window: Window, cand_scores: torch.Tensor) -> WindowAdmission:
    """Plan admission into ``tier`` through ``window`` (see :mod:`embcache.engine.window`).

    Every candidate takes a window place, best first (as :class:`embcache.sim.LrfuSim` replays
    it); the window keeps the last ``window.rows`` that entered, and the rest are pushed out,
    oldest first (old window rows, then this batch's first candidates). Each pushed row that
    needs room (one departure per candidate beyond the free slots) contests one of the main
    region's lowest rows, best against lowest: the higher score stays, the other leaves. Pushed
    rows beyond the departures owed, and pinned ones, join the main region outright; departures
    owed beyond the pushed rows (a window still filling) are main's lowest rows, and where too
    few rows can leave, the last candidates stay out.
    """
    n = cand_scores.numel()
    if n == 0 or tier.capacity == 0:
        return WindowAdmission(_empty(), _empty(tier.device), 0, _empty())
    order = torch.argsort(cand_scores, descending=True, stable=True)
    live = window.live(tier)
    n_old = live.numel()
    need = n - min(tier.free, n)  # departures for every candidate to enter
    over = max(0, n_old + n - window.rows)
    p_old = min(over, n_old)
    p_new = over - p_old
    old_slots = live[:p_old]
    p_scores = torch.cat([t.scores_of(tier)(old_slots).cpu(), cand_scores.index_select(0, order[:p_new])])
    # pinned old rows cannot leave: they join main without a contest (the last in rank)
    pinned = torch.cat([(tier.pins_at(old_slots) > 0).cpu(), torch.zeros(p_new, dtype=torch.bool)])
    rank = torch.argsort(torch.where(pinned, torch.inf, p_scores), descending=True, stable=True)
    eligible = over - int(pinned.sum())
    contests = min(eligible, need)
    skip = int(pinned.sum()) + eligible - contests  # pushed rows joining main outright
    victims, got, wins = _displace(t, tier, p_scores.index_select(0, rank[skip:skip + contests]), need - contests,
                                   live)
    lost = rank[skip + wins:skip + contests]  # pushed rows that lost their contest (or found no victim)
    lost_old, lost_new = lost[lost < p_old], lost[lost >= p_old] - p_old
    dropped = need - contests - got  # departures owed that no row could make
    kept = torch.ones(n, dtype=torch.bool)
    kept[order[lost_new]] = False
    kept[order[n - dropped:]] = False
    entering = order[p_new:n - dropped]
    return WindowAdmission(admitted=order[kept.index_select(0, order)],
                           victims=torch.cat([victims, old_slots.index_select(0, to_device(lost_old, tier.device))]),
                           pushed=p_old, entering=entering)


def plan_access(t: TableEngine, ddr_cands: torch.Tensor, staged: RowBatch) -> Plan:
    """Plan the moves after an access: the accessed DDR rows (``ddr_cands``, unique slots) and the
    ``staged`` rows compete for HBM; the rows HBM displaced and the staged rows it did not take
    compete for DDR; what loses there leaves memory (or stays out)."""
    n_d = ddr_cands.numel()
    d_scores = t.policy.score_at(t.ddr.freq, t.ddr.last, ddr_cands, t.clock)
    s_scores = t.policy.score(staged.freq, staged.last, t.clock)
    # 1. HBM: promote the best of (DDR rows accessed, staged rows), through its window if it has one
    cand_scores = torch.cat([d_scores, s_scores])
    pushed, entering = 0, None
    if t.window is None:
        admitted_h, victims_h = admit(t, t.hbm, cand_scores, 0, None)
    else:
        w = admit_windowed(t, t.hbm, t.window, cand_scores)
        admitted_h, victims_h, pushed = w.admitted, w.victims, w.pushed
        entering = torch.cat([t.ddr.keys.index_select(0, ddr_cands), staged.keys]).index_select(0, w.entering)
    up = ddr_cands[admitted_h[admitted_h < n_d]]
    staged_up = admitted_h[admitted_h >= n_d] - n_d
    staged_left = torch.ones(len(staged), dtype=torch.bool)
    staged_left[staged_up] = False
    rest = torch.nonzero(staged_left).flatten()  # staged rows HBM did not take
    # 2. DDR: rows displaced from HBM and staged rows HBM did not take, ranked on their counts
    demoted = t.hbm.read(victims_h).to(torch.device("cpu"))
    n_hv = len(demoted)
    c_scores = t.policy.score(torch.cat([demoted.freq, staged.freq.index_select(0, rest)]),
                              torch.cat([demoted.last, staged.last.index_select(0, rest)]), t.clock)
    # rows leaving DDR for HBM make room but are not victims (slots, not a capacity-sized mask)
    admitted_d, victims_d = admit(t, t.ddr, c_scores, up.numel(), up if up.numel() else None)
    cand_in = torch.zeros(n_hv + rest.numel(), dtype=torch.bool)
    cand_in[admitted_d] = True
    hv_in, rest_in = cand_in[:n_hv], cand_in[n_hv:]
    return Plan(up=up, hbm_victims=victims_h, ddr_victims=victims_d, demoted=demoted, staged=staged,
                staged_up=staged_up,
                into_ddr=torch.cat([torch.nonzero(hv_in).flatten(), n_hv + rest[rest_in]]),
                demoted_out=torch.nonzero(~hv_in).flatten(), staged_out=rest[~rest_in], window_pushed=pushed,
                window_entering=entering)


def boosted_scores(t: TableEngine, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor,
                   wanted: Keyset | None) -> torch.Tensor:
    """Policy scores, with rows of ``wanted`` above every other row (ordered by their counts)."""
    scores = t.policy.score(freq, last, t.clock)
    if wanted is None or len(wanted) == 0 or keys.numel() == 0:
        return scores
    ckeys = keys.cpu()
    pos = torch.searchsorted(wanted.keys, ckeys).clamp_(max=len(wanted) - 1)
    member = to_device(wanted.keys[pos] == ckeys, scores.device)
    boost = to_device(_WANTED_SCORE + wanted.counts[pos].to(torch.float64) * _WANTED_STEP, scores.device)
    return torch.where(member, boost, scores)


def _boosted_scores_of(t: TableEngine, tier: MemoryTier, wanted: Keyset | None) -> ScoreOf:
    """:func:`boosted_scores` of ``tier``'s rows at ``slots`` (for :meth:`MemoryTier.lowest`)."""
    def score(slots: torch.Tensor) -> torch.Tensor:
        return boosted_scores(t, tier.keys.index_select(0, slots), tier.freq.index_select(0, slots),
                              tier.last.index_select(0, slots), wanted)
    return score


def plan_arrange(t: TableEngine, keys_h: torch.Tensor, keys_d: torch.Tensor,
                 stage: Callable[[torch.Tensor], RowBatch], wanted: Keyset | None = None) -> Plan:
    """Plan moving the rows of ``keys_h`` into HBM and of ``keys_d`` into DDR, as far as unpinned room allows.

    Args:
        keys_h, keys_d: unique CPU keys, disjoint, each hottest first. When pinned rows leave
            too little room, HBM's coldest targets go to DDR instead, and DDR's stay on disk.
        stage: the rows (clean, CPU, in order) of non-resident target keys.
        wanted: a keyset whose rows are evicted last and demoted to DDR first (begin_pass).
    """
    hbm, ddr = t.hbm, t.ddr
    sample = t.config.eviction_sample
    # 1. HBM: make room for targets not there yet, evicting unpinned non-targets (lowest first)
    hs = hbm.find(keys_h).cpu()
    up = torch.nonzero(hs < 0).flatten()
    ds_up = ddr.find(keys_h[up])
    victims_h = _empty(hbm.device)
    evict_h = up.numel() - hbm.free
    over_keys = _empty()
    over_ds = over_keys
    if evict_h > 0:
        excl = hs[hs >= 0]  # targets already in HBM stay
        victims_h, _ = hbm.lowest(evict_h, _boosted_scores_of(t, hbm, wanted), sample, excl, t.generator_for(hbm))
        keep = up.numel() - (evict_h - victims_h.numel())
        over_keys, over_ds = keys_h[up[keep:]], ds_up[keep:]
        up, ds_up = up[:keep], ds_up[:keep]
    from_d = ds_up >= 0
    d_slots_up = ds_up[from_d]
    stage_h = keys_h[up[~from_d]]
    # 2. DDR targets: HBM's overflow first (hotter), then keys_d not in HBM
    kd = keys_d[hbm.find(keys_d).cpu() < 0]
    keys_d2 = torch.cat([over_keys, kd])
    ds2 = torch.cat([over_ds, ddr.find(kd)])
    stage_d = keys_d2[ds2 < 0]
    staged = stage(torch.cat([stage_h, stage_d]))
    n_sh = stage_h.numel()
    demoted = hbm.read(victims_h).to(torch.device("cpu"))
    n_hv = len(demoted)
    # DDR's candidates, in order: demoted rows that are DDR targets, staged DDR targets (both
    # required), then the other demoted rows, best first (optional)
    hv_req = torch.isin(demoted.keys, keys_d) if n_hv else torch.zeros(0, dtype=torch.bool)
    optional = torch.nonzero(~hv_req).flatten()
    if optional.numel():
        opt_scores = boosted_scores(t, demoted.keys[optional], demoted.freq[optional], demoted.last[optional], wanted)
        optional = optional[torch.argsort(opt_scores, descending=True, stable=True)]
    n_req_hv = int(hv_req.sum())
    cands = torch.cat([torch.nonzero(hv_req).flatten(), n_hv + torch.arange(n_sh, len(staged)), optional])
    n_required = n_req_hv + len(staged) - n_sh
    room = ddr.free + d_slots_up.numel()
    victims_d = _empty()
    if n_required > room:
        excl_d = torch.cat([d_slots_up, ds2[ds2 >= 0]])  # rows moving up, and DDR targets already there
        victims_d, _ = ddr.lowest(n_required - room, _boosted_scores_of(t, ddr, wanted), sample, excl_d,
                                  t.generator_for(ddr))
        room += victims_d.numel()
    n_in = min(room, cands.numel())
    out = cands[n_in:]
    return Plan(up=d_slots_up, hbm_victims=victims_h, ddr_victims=victims_d, demoted=demoted, staged=staged,
                staged_up=torch.arange(n_sh), into_ddr=cands[:n_in], demoted_out=out[out < n_hv],
                staged_out=out[out >= n_hv] - n_hv)
