"""The fused CPU update kernel against torch's arithmetic (torch_update) and apply_update."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from embcache.fused import FusedScratch, fused_available, fused_update, segment_sum
from embcache.optim import OPTIMIZERS, OptimizerParams, apply_update, state_width, torch_update
from embcache.tier import DIRTY

pytestmark = pytest.mark.skipif(not fused_available(torch.zeros(1, 1)), reason="needs numba")


def reference(optimizer: str, params: OptimizerParams, weights: torch.Tensor, state: torch.Tensor,
              slots: torch.Tensor, grads: torch.Tensor, update: Callable[..., tuple[torch.Tensor, torch.Tensor]],
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique slots, their new weights, their new state) by unique, index_add_ and ``update``."""
    uniq, inverse = torch.unique(slots, return_inverse=True)
    gsum = torch.zeros(uniq.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    w, s = update(optimizer, params, weights[uniq], state[uniq], gsum)
    return uniq, w, s


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("dim", [1, 7, 64])
def test_fused_update_equals_apply_update(optimizer: str, weight_decay: float, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    capacity, n = 50, 300
    weights = torch.randn(capacity, dim, generator=gen)
    state = torch.rand(capacity, state_width(optimizer, dim), generator=gen)
    if optimizer == "adam":
        state[:, 2 * dim:] = torch.randint(0, 5, (capacity, 1), generator=gen).float()  # step counts
    # a tier's flags: occupied, dirty, pins above (tier.py); the kernel sets the dirty bit, keeps the rest
    flags = torch.randint(0, 1 << 20, (capacity,), dtype=torch.int32, generator=gen) & ~DIRTY
    flags_before = flags.clone()
    params = OptimizerParams(lr=0.05, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=weight_decay)
    slots = torch.randint(0, capacity - 10, (n,), generator=gen)  # duplicates; the last 10 rows untouched
    grads = torch.randn(n, dim, generator=gen)
    grads_before, untouched = grads.clone(), (weights[-10:].clone(), state[-10:].clone())
    uniq, want_w, want_s = reference(optimizer, params, weights, state, slots, grads, torch_update)
    _, gathered_w, gathered_s = reference(optimizer, params, weights, state, slots, grads, apply_update)
    scratch = FusedScratch()

    assert fused_update(optimizer, params, weights, state, flags, DIRTY, slots, grads, scratch) == uniq.numel()

    if optimizer == "sgd":  # the same operations, the same roundings (fused multiply-add where torch has one)
        assert torch.equal(weights[uniq], want_w) and torch.equal(state[uniq], want_s)
    else:  # torch's CPU sqrt and mean round differently from IEEE sqrt and a serial sum
        torch.testing.assert_close(weights[uniq], want_w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state[uniq], want_s, rtol=1e-6, atol=1e-6)
    # in place or on gathered rows, the CPU arithmetic is one kernel: a row's tier never shows
    assert torch.equal(weights[uniq], gathered_w) and torch.equal(state[uniq], gathered_s)
    assert torch.equal(weights[-10:], untouched[0]) and torch.equal(state[-10:], untouched[1])
    assert torch.equal(flags, flags_before.index_copy(0, uniq, flags_before[uniq] | DIRTY))
    assert torch.equal(grads, grads_before)
    # the scratch (a hash table of the batch's slots) serves the next call: a smaller batch of
    # other rows, every slot twice, dedups and sums right after a bigger one filled the table
    again = torch.arange(capacity - 10, capacity).repeat(2)
    g2 = torch.randn(20, dim, generator=gen)
    uniq2, want_w2, want_s2 = reference(optimizer, params, weights, state, again, g2, apply_update)
    assert fused_update(optimizer, params, weights, state, flags, DIRTY, again, g2, scratch) == 10
    torch.testing.assert_close(weights[uniq2], want_w2, rtol=0, atol=0)
    torch.testing.assert_close(state[uniq2], want_s2, rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "adam", "rowwise_adagrad_momentum"])
def test_fused_update_divides_like_torch_when_eps_is_zero(optimizer: str) -> None:
    # eps=0 is a legal setting; a zero gradient on fresh state then divides 0 by 0. torch gives
    # NaN (so does the torch path on a GPU). The kernel once raised ZeroDivisionError (numba's
    # Python error model) halfway through the batch, after earlier rows had been written: a
    # refusal that had changed rows. It now does IEEE arithmetic, as torch does, for every row.
    dim, capacity = 16, 8
    weights = torch.randn(capacity, dim, generator=torch.Generator().manual_seed(3))
    state = torch.zeros(capacity, state_width(optimizer, dim))
    flags = torch.zeros(capacity, dtype=torch.int32)
    params = OptimizerParams(lr=0.1, eps=0.0, beta1=0.9, beta2=0.999)
    slots = torch.tensor([0, 1, 2, 3])
    grads = torch.ones(4, dim)
    grads[1] = 0.0  # row 1: 0 / 0 after row 0 was written
    grads[3, : dim // 2] = 0.0  # row 3: some elements 0 / 0 (per-element optimizers)
    uniq, want_w, want_s = reference(optimizer, params, weights, state, slots, grads, torch_update)

    assert fused_update(optimizer, params, weights, state, flags, DIRTY, slots, grads, FusedScratch()) == 4

    assert weights[1].isnan().all()  # what torch gives, not an exception
    torch.testing.assert_close(weights[uniq], want_w, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(state[uniq], want_s, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_fused_update_refuses_rows_it_cannot_update() -> None:
    assert not fused_available(torch.zeros(2, 2, dtype=torch.float16))
    params = OptimizerParams(lr=0.1, eps=1e-8, beta1=0.9, beta2=0.999)
    with pytest.raises(RuntimeError, match="float32"):
        fused_update("sgd", params, torch.zeros(2, 2, dtype=torch.float16), torch.zeros(2, 0),
                     torch.zeros(2, dtype=torch.int32), DIRTY, torch.tensor([0]), torch.ones(1, 2), FusedScratch())
    with pytest.raises(RuntimeError, match="int32 flags"):
        fused_update("sgd", params, torch.zeros(2, 2), torch.zeros(2, 0),
                     torch.zeros(2, dtype=torch.bool), DIRTY, torch.tensor([0]), torch.ones(1, 2), FusedScratch())


def test_segment_sum_is_index_add_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(500, 16, generator=gen) * torch.logspace(-6, 6, 500).unsqueeze(1)  # rounding shows
    index = torch.randint(0, 40, (500,), generator=gen)
    assert torch.equal(segment_sum(grads, index, 45), torch.zeros(45, 16).index_add_(0, index, grads))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "big"])
def test_fused_update_refuses_nonfinite_gradients_before_any_change(optimizer: str, bad: float | str) -> None:
    # check_finite: any NaN or inf, wherever it is, returns -1 with weights, state and flags as
    # they were; finite values of any size (3e38, whose sum overflows) are updated as without it.
    gen = torch.Generator().manual_seed(1)
    dim, capacity, n = 33, 40, 200  # 200 x 33 values: not a multiple of a vector's width
    weights, state = torch.randn(capacity, dim, generator=gen), torch.rand(capacity, state_width(optimizer, dim))
    flags = torch.zeros(capacity, dtype=torch.int32)
    params = OptimizerParams(lr=0.05, eps=1e-8, beta1=0.9, beta2=0.999)
    slots, grads = torch.randint(0, capacity, (n,), generator=gen), torch.randn(n, dim, generator=gen)
    before = (weights.clone(), state.clone(), flags.clone())
    for at in ((0, 0), (n // 2, 7), (n - 1, dim - 1)):
        g = grads.clone()
        g[at] = 3e38 if bad == "big" else float(bad)
        got = fused_update(optimizer, params, weights, state, flags, DIRTY, slots, g, FusedScratch(), check_finite=True)
        if bad == "big":
            assert got == torch.unique(slots).numel()
            return
        assert got == -1
        assert torch.equal(weights, before[0]) and torch.equal(state, before[1]) and torch.equal(flags, before[2])
