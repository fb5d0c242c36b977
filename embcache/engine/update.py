"""Updates: the optimizer applied where each row lives, and assignment of rows.

One rule for every tier: rows of DDR and from the store are updated where HBM's are (on a GPU,
with its torch ops, not the CPU kernel, which rounds differently), so a row's next value never
depends on its tier. Gradients of duplicate keys are summed first, in batch order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..fused import fused_available, fused_update
from ..optim import apply_update, initial_state
from ..rounding import to_storage
from ..tier import DIRTY, to_device
from ..validate import all_finite, nonfinite_gradients
from .expiry import touch_resident

if TYPE_CHECKING:
    from .table import TableEngine

__all__ = ["apply_gradients", "assign", "segment_sum"]


def apply_gradients(t: TableEngine, keys: torch.Tensor, grads: torch.Tensor, given: object = None,
                    check_finite: bool = False) -> None:
    """Apply ``t``'s optimizer to the rows of ``keys`` (checked, on the cache's device; lock held).

    Args:
        given: the caller's own keys object: where the table's last lookup was given the same
            tensor, unchanged, and found every key in HBM, its slots are reused (no probe; see
            :class:`~embcache.engine.found.FoundSlots`).
        check_finite: refuse NaN or inf gradients (NonFiniteGradientError) before anything
            changes: on the CPU's fused path inside the kernel's first pass, which reads every
            gradient anyway; on a GPU read back with the check of which rows are in HBM (one
            host sync for both); elsewhere with :func:`~embcache.validate.all_finite` first.
    """
    hbm = t.hbm
    found = t.found.recall(given, hbm)
    cuda = t.device.type == "cuda"
    if hbm.capacity and fused_available(hbm.weights):
        # CPU: probe every key (no sort); when all are in HBM (a pass's steady state), one
        # fused kernel dedups, sums and updates in place (embcache/fused.py)
        slots = hbm.find(keys) if found is None else found
        if found is not None or bool((slots >= 0).all()):
            if fused_update(t.cfg.optimizer, t.params, hbm.weights, hbm.state, hbm.flags, DIRTY, slots,
                            grads.to(torch.float32), hbm.fused_scratch(), check_finite=check_finite) < 0:
                raise nonfinite_gradients(t.cfg.name)
            touch_resident(t, hbm, slots)
            t.stats.updates += keys.numel()
            t.update_steps += 1
            return
    if check_finite and not cuda and not all_finite(grads):
        raise nonfinite_gradients(t.cfg.name)
    if t.device.type == "cpu":
        ukeys, inverse = torch.unique(keys, return_inverse=True)
        gsum = torch.zeros(ukeys.numel(), t.cfg.dim, dtype=torch.float32, device=t.device)
        gsum.index_add_(0, inverse, grads)
    else:  # no atomics: the same sums on every run (see segment_sum)
        ukeys, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        gsum = segment_sum(grads, inverse, counts)
    if found is None:
        hslots = hbm.find(ukeys)
    else:  # each unique key's slot from any of its positions (all hold the same slot)
        hslots = torch.empty_like(ukeys).scatter_(0, inverse, found)
    all_in_hbm = (hslots >= 0).all()
    if check_finite and cuda:
        finite = torch.isfinite(grads.sum())
        ok, hit = torch.stack([finite, all_in_hbm]).tolist()  # one host sync for both
        if not ok:
            raise nonfinite_gradients(t.cfg.name)
    else:
        hit = bool(all_in_hbm)
    cfg, step = t.cfg, t.update_steps

    def stored(new_w: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
        # the one cast of updated weights to the storage dtype (stochastic or to nearest)
        return to_storage(new_w, cfg.torch_dtype, cfg.stochastic_rounding, cfg.seed, row_keys, step)

    if hbm.capacity and hit:
        # every row in HBM: update in place, nothing to stage or place
        w = hbm.weights.index_select(0, hslots).to(torch.float32)
        new_w, new_s = apply_update(cfg.optimizer, t.params, w, hbm.state.index_select(0, hslots), gsum)
        hbm.weights.index_copy_(0, hslots, stored(new_w, ukeys))
        hbm.state.index_copy_(0, hslots, new_s)
        hbm.set_dirty(hslots, True)
        touch_resident(t, hbm, hslots)
    else:
        def update(weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
            dev = gsum.device
            index = to_device(index, dev)
            new_w, new_s = apply_update(cfg.optimizer, t.params, to_device(weights.to(torch.float32), dev),
                                        to_device(state, dev), gsum[index])
            return stored(new_w, ukeys[index]), new_s

        t.modify(ukeys, update, hslots=hslots)
    t.update_steps += 1
    t.stats.updates += keys.numel()


def assign(t: TableEngine, keys: torch.Tensor, rows: torch.Tensor) -> None:
    """Overwrite the rows of ``keys`` (checked, non-empty) and reset their optimizer state; the last
    duplicate wins (lock held)."""
    ukeys, inverse = torch.unique(keys, return_inverse=True)
    position = torch.arange(keys.numel(), device=keys.device)
    last = torch.zeros(ukeys.numel(), dtype=torch.int64, device=keys.device)
    last.scatter_reduce_(0, inverse, position, reduce="amax", include_self=False)
    new_rows = rows[last]

    def overwrite(weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        init = initial_state(t.cfg.optimizer, t.cfg.dim, index.numel(), state.device, t.cfg.initial_accumulator_value)
        return new_rows[to_device(index, new_rows.device)].to(weights.device), init

    t.modify(ukeys, overwrite, read_store=False)
    t.stats.assigns += keys.numel()


def segment_sum(values: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sums of the rows of ``values`` [n, d] by group: ``inverse`` [n] the group of each row
    (0..u-1), ``counts`` [u] the rows in each (all >= 1). Each group's rows are added one after
    the other in their order in the batch, from 0 (``0 + v0 + v1 + ...``): the bits of
    ``index_add_`` into zeros on the CPU, and the same bits on every run on a GPU, where
    ``index_add_`` adds with atomics in whatever order threads meet (float addition is not
    associative). A stable sort groups the rows; torch's segment reduction sums each group in
    one thread per column, in order. ``unsafe`` skips its check of the lengths (a host sync)."""
    order = torch.argsort(inverse, stable=True)
    return torch.segment_reduce(values.index_select(0, order), "sum", lengths=counts, unsafe=True)
