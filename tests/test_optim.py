"""Row optimizers of embcache.optim against torch's sparse optimizers and plain references."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from embcache.errors import ConfigError
from embcache.optim import OPTIMIZERS, OptimizerParams, initial_state, state_width
from embcache.optim import (
    torch_update as apply_update,  # the torch-operation reference; the fused CPU path: test_fused.py
)

N_ROWS = 50
DIM = 8
N_STEPS = 6

# rows >= TOUCHED are never updated; batches of BATCH draws from [0, TOUCHED) repeat rows
# across steps and hold duplicates inside a step
TOUCHED = 40
BATCH = 30


def _batches(seed: int, every_row: bool = False, unique: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (indices, upstream gradient) pairs, one per step.

    Args:
        seed: generator seed.
        every_row: include every row of the table in every step.
        unique: no index twice inside a step.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(N_STEPS):
        if unique:
            idx = torch.randperm(TOUCHED, generator=gen)[:BATCH]
        else:
            idx = torch.randint(0, TOUCHED, (BATCH,), generator=gen)
            idx = torch.cat([idx, idx[:3]])  # duplicates inside the step, for sure
        if every_row:
            idx = torch.cat([torch.arange(N_ROWS), idx])
        upstream = torch.randn(idx.numel(), DIM, generator=gen)
        out.append((idx, upstream))
    return out


def _run_both(
    optimizer: str,
    params: OptimizerParams,
    make_torch_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    initial_accumulator_value: float = 0.0,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Train a sparse nn.Embedding with a torch optimizer and a table with apply_update.

    Args:
        optimizer: one of OPTIMIZERS.
        params: our hyper-parameters.
        make_torch_opt: builds the torch optimizer over the embedding's parameters.
        batches: (indices [B], upstream gradient [B, DIM]) per step.
        initial_accumulator_value: starting accumulator of both.

    Returns:
        per step: (torch's weights [N_ROWS, DIM], ours [N_ROWS, DIM], our state [N_ROWS, S]).
    """
    torch.manual_seed(0)
    emb = torch.nn.Embedding(N_ROWS, DIM, sparse=True)
    opt = make_torch_opt(list(emb.parameters()))
    table = emb.weight.detach().clone()
    state = initial_state(optimizer, DIM, N_ROWS, torch.device("cpu"), initial_accumulator_value)
    history = []
    for idx, upstream in batches:
        opt.zero_grad()
        (emb(idx) * upstream).sum().backward()
        grad = emb.weight.grad
        assert grad is not None and grad.is_sparse
        # the cache sums duplicate keys before apply_update, as coalesce does
        grad = grad.coalesce()
        rows = grad.indices()[0]
        opt.step()
        new_w, new_s = apply_update(optimizer, params, table[rows], state[rows], grad.values())
        table[rows] = new_w
        state[rows] = new_s
        history.append((emb.weight.detach().clone(), table.clone(), state.clone()))
    return history


def test_state_width_and_initial_state() -> None:
    assert state_width("sgd", 8) == 0
    assert state_width("adagrad", 8) == 8
    assert state_width("rowwise_adagrad", 8) == 1
    assert state_width("adam", 8) == 17
    assert state_width("rowwise_adagrad_momentum", 8) == 9
    for name in OPTIMIZERS:
        s = initial_state(name, 8, 5, torch.device("cpu"), 0.25)
        assert s.shape == (5, state_width(name, 8))
        assert s.dtype == torch.float32
        if name == "rowwise_adagrad_momentum":  # momentum 0, then the accumulator
            assert torch.all(s[:, :8] == 0.0) and torch.all(s[:, 8] == 0.25)
            continue
        expected = 0.25 if name in ("adagrad", "rowwise_adagrad") else 0.0
        assert torch.all(s == expected)
    assert initial_state("adam", 4, 0, torch.device("cpu")).shape == (0, 9)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ConfigError):
        state_width("momentum", 8)
    with pytest.raises(ConfigError):
        state_width("sgd", 0)
    with pytest.raises(ConfigError):
        initial_state("adagrad", 8, -1, torch.device("cpu"))
    with pytest.raises(ConfigError):
        initial_state("adagrad", 8, 1, torch.device("cpu"), -1.0)
    with pytest.raises(ConfigError):
        OptimizerParams(lr=0.1, eps=1e-8, beta1=1.0, beta2=0.999)
    with pytest.raises(ConfigError):
        OptimizerParams(lr=math.nan, eps=1e-8, beta1=0.9, beta2=0.999)
    with pytest.raises(ConfigError):
        OptimizerParams(lr=0.1, eps=-1.0, beta1=0.9, beta2=0.999)
    p = OptimizerParams(lr=0.1, eps=1e-8, beta1=0.9, beta2=0.999)
    w = torch.zeros(3, 4)
    with pytest.raises(ConfigError):
        apply_update("momentum", p, w, torch.zeros(3, 0), w)
    with pytest.raises(ValueError):
        apply_update("adagrad", p, w, torch.zeros(3, 3), w)  # state too narrow
    with pytest.raises(ValueError):
        apply_update("sgd", p, w, torch.zeros(3, 0), torch.zeros(2, 4))  # grads of other rows
    with pytest.raises(ValueError):
        apply_update("sgd", p, w.half(), torch.zeros(3, 0), w)  # caller must upcast


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_inputs_not_mutated_and_empty_batch(optimizer: str) -> None:
    p = OptimizerParams(lr=0.1, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(6, 4, generator=gen)
    s = initial_state(optimizer, 4, 6, torch.device("cpu"), 0.1)
    g = torch.randn(6, 4, generator=gen)
    w0, s0, g0 = w.clone(), s.clone(), g.clone()
    new_w, new_s = apply_update(optimizer, p, w, s, g)
    assert torch.equal(w, w0) and torch.equal(s, s0) and torch.equal(g, g0)
    assert new_w.shape == w.shape and new_s.shape == s.shape
    assert new_w.dtype == torch.float32 and new_s.dtype == torch.float32
    assert new_w.data_ptr() != w.data_ptr()
    assert not torch.equal(new_w, w)
    e_w, e_s = apply_update(optimizer, p, w[:0], s[:0], g[:0])
    assert e_w.shape == (0, 4) and e_s.shape == (0, s.shape[1])


def test_sgd_matches_torch() -> None:
    p = OptimizerParams(lr=0.0731, eps=0.0, beta1=0.9, beta2=0.999)

    def make(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.0731)

    for want, got, _ in _run_both("sgd", p, make, _batches(1, unique=True)):
        assert torch.equal(want, got)
    # torch.optim.SGD does not coalesce a sparse gradient: it adds each duplicate's -lr * g to the
    # row one after the other, while the cache applies -lr * (g1 + g2) once; only rounding differs
    for want, got, _ in _run_both("sgd", p, make, _batches(1)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_adagrad_matches_torch_bitwise() -> None:
    p = OptimizerParams(lr=0.05, eps=1e-10, beta1=0.9, beta2=0.999)
    history = _run_both(
        "adagrad",
        p,
        lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-10, initial_accumulator_value=0.1),
        _batches(2),
        initial_accumulator_value=0.1,
    )
    for want, got, _ in history:
        # the brief allows 1e-6 relative; the operation order is torch's, so it is bitwise on CPU
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
        assert torch.equal(want, got)
    # rows never touched keep their initial value
    first_w = history[0][0]
    assert torch.equal(history[-1][1][TOUCHED:], first_w[TOUCHED:])


def _dense_rowwise_adagrad(
    w: torch.Tensor, s: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float, eps: float
) -> list[torch.Tensor]:
    """Straightforward float64 rowwise AdaGrad over the whole table (rows without gradient skip).

    Args:
        w: float32 [N, D] initial weights.
        s: float32 [N, 1] initial accumulators.
        batches: (indices [B], upstream gradient [B, D]) per step.
        lr: learning rate.
        eps: epsilon.
    """
    w, s = w.double().clone(), s.double().clone()
    out = []
    for idx, upstream in batches:
        g = torch.zeros_like(w).index_add_(0, idx, upstream.double())
        touched = torch.zeros(w.shape[0], dtype=torch.bool)
        touched[idx] = True
        for r in range(w.shape[0]):
            if touched[r]:
                s[r] += (g[r] * g[r]).mean()
                w[r] -= lr * g[r] / (s[r].sqrt() + eps)
        out.append(w.clone())
    return out


def test_rowwise_adagrad_matches_reference() -> None:
    lr, eps = 0.05, 1e-10
    p = OptimizerParams(lr=lr, eps=eps, beta1=0.9, beta2=0.999)
    batches = _batches(3)
    history = _run_both("rowwise_adagrad", p, lambda ps: torch.optim.SGD(ps, lr=0.0), batches, 0.1)
    torch.manual_seed(0)
    w0 = torch.nn.Embedding(N_ROWS, DIM).weight.detach()
    ref = _dense_rowwise_adagrad(w0, torch.full((N_ROWS, 1), 0.1), batches, lr, eps)
    for (_, got, _), want in zip(history, ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(history[-1][1][TOUCHED:], w0[TOUCHED:])


def _dense_rowwise_adagrad_momentum(
    w: torch.Tensor, s: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float, eps: float,
    beta: float, wd: float = 0.0,
) -> list[torch.Tensor]:
    """Momentum-scaled row-wise AdaGrad written out on plain float64 tensors, row by row, over the
    whole table: ``s += mean(g^2); m = beta * m + lr * g / (sqrt(s) + eps); w -= m``, for the rows
    a step touches (the momentum of the others waits, as the cache's does).

    Args:
        w: float32 [N, D] initial weights.
        s: float32 [N, 1] initial accumulators.
        batches: (indices [B], upstream gradient [B, D]) per step.
        lr, eps, beta, wd: hyper-parameters (wd: L2 added to the gradient).
    """
    w, s = w.double().clone(), s.double().clone()
    m = torch.zeros_like(w)
    out = []
    for idx, upstream in batches:
        g = torch.zeros_like(w).index_add_(0, idx, upstream.double())
        for r in torch.unique(idx).tolist():
            gr = g[r] + wd * w[r]
            s[r] += (gr * gr).mean()
            m[r] = beta * m[r] + lr * gr / (s[r].sqrt() + eps)
            w[r] -= m[r]
        out.append(w.clone())
    return out


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_rowwise_adagrad_momentum_matches_reference(wd: float) -> None:
    lr, eps, beta = 0.05, 1e-10, 0.9
    p = OptimizerParams(lr=lr, eps=eps, beta1=beta, beta2=0.999, weight_decay=wd)
    batches = _batches(5)
    history = _run_both("rowwise_adagrad_momentum", p, lambda ps: torch.optim.SGD(ps, lr=0.0), batches, 0.1)
    torch.manual_seed(0)
    w0 = torch.nn.Embedding(N_ROWS, DIM).weight.detach()
    ref = _dense_rowwise_adagrad_momentum(w0, torch.full((N_ROWS, 1), 0.1), batches, lr, eps, beta, wd)
    for (_, got, _), want in zip(history, ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(history[-1][1][TOUCHED:], w0[TOUCHED:])
    # the momentum matters: the same steps without it land elsewhere
    plain = _dense_rowwise_adagrad_momentum(w0, torch.full((N_ROWS, 1), 0.1), batches, lr, eps, 0.0, wd)
    assert (plain[-1] - ref[-1]).abs().max() > 1e-3


def test_rowwise_adagrad_momentum_without_momentum_is_rowwise_adagrad_bitwise() -> None:
    p = OptimizerParams(lr=0.05, eps=1e-10, beta1=0.0, beta2=0.999)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.0)  # noqa: E731
    a = _run_both("rowwise_adagrad_momentum", p, sgd, _batches(6), 0.1)
    b = _run_both("rowwise_adagrad", p, sgd, _batches(6), 0.1)
    for (_, wa, sa), (_, wb, sb) in zip(a, b, strict=True):
        assert torch.equal(wa, wb)
        assert torch.equal(sa[:, DIM:], sb)


def _per_row_adam(
    w: torch.Tensor,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    wd: float = 0.0,
) -> tuple[list[torch.Tensor], list[int]]:
    """Straightforward float64 lazy Adam with a per-row step count, SparseAdam's eps placement.

    Args:
        w: float32 [N, D] initial weights.
        batches: (indices [B], upstream gradient [B, D]) per step.
        lr, b1, b2, eps, wd: hyper-parameters.

    Returns:
        the weights after each step, and the final step count of each row.
    """
    w = w.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    steps = [0] * w.shape[0]
    out = []
    for idx, upstream in batches:
        g = torch.zeros_like(w).index_add_(0, idx, upstream.double())
        for r in sorted(set(idx.tolist())):
            gr = g[r] + wd * w[r]
            steps[r] += 1
            t = steps[r]
            m[r] = b1 * m[r] + (1 - b1) * gr
            v[r] = b2 * v[r] + (1 - b2) * gr * gr
            w[r] -= lr * math.sqrt(1 - b2**t) / (1 - b1**t) * m[r] / (v[r].sqrt() + eps)
        out.append(w.clone())
    return out, steps


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_adam_matches_per_row_reference(wd: float) -> None:
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    p = OptimizerParams(lr=lr, eps=eps, beta1=b1, beta2=b2, weight_decay=wd)
    batches = _batches(4)
    history = _run_both("adam", p, lambda ps: torch.optim.SGD(ps, lr=0.0), batches)
    torch.manual_seed(0)
    w0 = torch.nn.Embedding(N_ROWS, DIM).weight.detach()
    ref, steps = _per_row_adam(w0, batches, lr, b1, b2, eps, wd)
    for (_, got, _), want in zip(history, ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    final_state = history[-1][2]
    assert final_state[:, 2 * DIM].tolist() == [float(t) for t in steps]
    assert min(steps[:TOUCHED]) < N_STEPS  # some rows skipped steps: the lazy case is exercised
    assert torch.equal(history[-1][1][TOUCHED:], w0[TOUCHED:])


def test_adam_matches_sparse_adam_when_every_row_updates() -> None:
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    p = OptimizerParams(lr=lr, eps=eps, beta1=b1, beta2=b2)
    history = _run_both(
        "adam", p, lambda ps: torch.optim.SparseAdam(ps, lr=lr, betas=(b1, b2), eps=eps), _batches(5, every_row=True)
    )
    for want, got, _ in history:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert torch.equal(want, got)  # same operation order as SparseAdam: bitwise on CPU


def test_weight_decay_matches_dense_torch_when_every_row_updates() -> None:
    # torch refuses weight decay with sparse gradients, so compare with dense parameters
    # whose every row gets a gradient every step
    gen = torch.Generator().manual_seed(6)
    w0 = torch.randn(N_ROWS, DIM, generator=gen)
    grads = [torch.randn(N_ROWS, DIM, generator=gen) for _ in range(N_STEPS)]
    cases: list[tuple[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], float]] = [
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.1), 0.0),
        ("adagrad", lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=0.1, eps=1e-10), 1e-6),
    ]
    for name, make, rtol in cases:
        param = torch.nn.Parameter(w0.clone())
        opt = make([param])
        p = OptimizerParams(lr=0.05, eps=1e-10, beta1=0.9, beta2=0.999, weight_decay=0.1)
        w, s = w0.clone(), initial_state(name, DIM, N_ROWS, torch.device("cpu"))
        for g in grads:
            param.grad = g.clone()
            opt.step()
            w, s = apply_update(name, p, w, s, g)
            torch.testing.assert_close(w, param.detach(), rtol=rtol, atol=rtol * 1e-2)
        if name == "sgd":
            assert torch.equal(w, param.detach())
