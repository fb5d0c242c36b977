"""Admission of new keys (``TableConfig.admit_after``): a key gets a trained, stored row only once
it has been looked up that many times.

The table counts the lookups of keys the store lacks in a count-min sketch of raw counts
(``TableEngine.admission``; a collision admits a key early, never late). A key is admitted when
its count reaches ``admit_after``, or when the store holds its row (trained before admission was
on, imported, or written by ``assign``). A lookup of a key not admitted returns the
``unadmitted`` row and places nothing; an update drops its gradient; a pass or prefetch does not
stage it. Every function expects the table's lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..tier import RowBatch

if TYPE_CHECKING:
    from .table import TableEngine

__all__ = ["admissible", "admitted", "stage_admitting"]


def stage_admitting(t: TableEngine, keys: torch.Tensor, counts: torch.Tensor, inc: float,
                    now: int) -> tuple[RowBatch, torch.Tensor]:
    """Stage (unique, CPU, non-empty) ``keys`` looked up ``counts`` times under admission.

    Keys the store lacks count towards admission; those whose count reaches ``admit_after``
    are admitted now (staged like any row), the others get the ``unadmitted`` rows and stay
    out of memory and the store. A table whose lookups create no rows (``t.stored_only``,
    ``CacheConfig.lookups_create_rows=False``) admits no key this way: only stored rows are
    staged. Returns the staged rows and the rows to return for ``keys``.
    """
    read = t.rows.read(keys)
    keep = read.fmask.clone()
    if t.admission is not None:
        _mark_stored(t, keys[read.fmask])
    new = torch.nonzero(~read.fmask).flatten()
    if new.numel() and t.admission is not None and not t.stored_only:
        seen = t.admission.add_and_estimate(keys[new], counts[new].to(torch.float64))
        reached = seen >= t.cfg.admit_after
        keep[new] = reached
        t.stats.admitted_rows += int(reached.sum())
    out = ~keep
    n_out = int(out.sum())
    t.count_stage(counts, read, not_made=n_out)
    t.stats.unadmitted_lookups += int(counts[out].sum())
    values = read.weights
    if n_out and t.cfg.unadmitted == "zeros":
        values = values.clone()
        values[out] = 0
    staged = t.stage_meta(keys[keep], counts[keep], inc, now, read.weights[keep], read.state[keep])
    return staged, values


def admissible(t: TableEngine, keys: torch.Tensor) -> torch.Tensor:
    """The CPU ``keys`` (in order) that may be placed: resident or admitted."""
    ok = t.resident(keys)
    rest = torch.nonzero(~ok).flatten()
    if rest.numel():
        ok[rest] = admitted(t, keys[rest])
    return keys[ok]


def admitted(t: TableEngine, keys: torch.Tensor) -> torch.Tensor:
    """Bool [n]: which of the non-resident CPU ``keys`` are admitted (stored, or counted enough)."""
    assert t.admission is not None
    ok = t.admission.estimate(keys) >= t.cfg.admit_after
    maybe = torch.nonzero(~ok).flatten()
    if maybe.numel():  # rows stored before admission was on, imported or assigned are admitted
        stored = t.rows.read_counted(keys[maybe]).fmask
        ok[maybe] = stored
        _mark_stored(t, keys[maybe][stored])
    return ok


def _mark_stored(t: TableEngine, keys: torch.Tensor) -> None:
    """Count stored ``keys`` as admitted, so that :func:`admitted` answers for them without reading
    the store again (the update after a lookup would otherwise read each such row twice)."""
    assert t.admission is not None
    if keys.numel():
        t.admission.raise_to(keys, torch.full((keys.numel(),), float(t.cfg.admit_after)))
