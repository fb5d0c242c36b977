"""Row optimizers, applied to a batch of unique rows as one vectorized, pure function.

The cache keeps, next to each row's weights ``[dim]``, an optimizer-state vector of float32
``[S]`` (``S = state_width(optimizer, dim)``) that moves between tiers with the row. The caller
gathers the unique rows of a batch, upcasts their weights to float32, sums the gradients of
duplicate keys, and calls :func:`apply_update`, which returns the new weights and state.

Semantics follow torch where torch has the rule, operation for operation, so that training
through the cache reproduces ``torch.nn.Embedding(sparse=True)`` with a torch optimizer.
:func:`torch_update` is that arithmetic in torch operations (the CUDA path). On the CPU,
:func:`apply_update` and the cache's in-place update of resident rows run one fused numba kernel
(:mod:`embcache.fused`) with the same operations, so a row's value never depends on its tier;
it equals :func:`torch_update` bitwise for SGD and within float32 rounding (a few ulp) for the
others, because torch's CPU ``sqrt`` is not correctly rounded and its ``mean`` sums in another
order. "Bitwise equal" below is said of :func:`torch_update`.

* ``"sgd"``: ``w -= lr * g``, as ``torch.optim.SGD``. Bitwise equal when no key repeats inside
  a batch; torch does not coalesce a sparse gradient and adds each duplicate's ``-lr * g_i``
  one after the other, where the cache applies ``-lr * sum(g_i)`` once (last-bit differences).
* ``"adagrad"``: ``s += g*g; w -= lr * g / (sqrt(s) + eps)``; bitwise equal (checked on CPU) to
  the sparse branch of ``torch.optim.Adagrad`` with ``lr_decay=0``, which coalesces first.
* ``"rowwise_adagrad"``: FBGEMM's ``EXACT_ROWWISE_ADAGRAD``: one accumulator per row,
  ``s += mean(g*g); w -= lr * g / (sqrt(s) + eps)``.
* ``"rowwise_adagrad_momentum"``: momentum-scaled row-wise AdaGrad, after the optimizer named
  in Zhang et al., "Two-dimensional Sparse Parallelism for Large Scale Deep Learning
  Recommendation Model Training" (arXiv 2508.03854, 2025). The paper's algorithm box could not be
  read from the material available when this was written (only its abstract, and Meta's blog
  post on the same work, which says that FBGEMM's row-wise AdaGrad state is called its
  "momentum"); this is the reading documented here, not a copy of the paper's formula. Row-wise
  AdaGrad's step ``lr * g / (sqrt(s) + eps)`` is taken as the input of a heavy-ball momentum
  with coefficient ``beta1`` (TableConfig's ``beta1``, 0.9 by default), so the momentum carries
  steps already scaled by each row's own AdaGrad rate:
  ``s += mean(g*g); m = beta1 * m + lr / (sqrt(s) + eps) * g; w -= m``. With ``beta1 = 0`` it
  is ``rowwise_adagrad`` operation for operation (bitwise). Like Adam's, the momentum is lazy: a
  row's ``m`` decays only on the steps that update the row.
* ``"adam"``: lazy Adam with a per-row step count (the bias correction FBGEMM's Adam offers as
  ``use_rowwise_bias_correction``). Each updated row
  does ``t += 1; m += (1-b1)(g-m); v += (1-b2)(g*g-v);
  w -= lr * sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps)``, which is exactly
  ``torch.optim.SparseAdam``'s arithmetic, i.e. ``mhat / (sqrt(vhat) + eps / sqrt(1-b2^t))``.
  Bitwise equal (checked on CPU) to ``SparseAdam`` while every row is updated at every step;
  otherwise they differ by design: ``SparseAdam`` keeps one step count per table, so a rarely
  seen row gets the bias correction of the global step, here that of its own updates. The eps
  placement is SparseAdam's; dense ``torch.optim.Adam`` divides by ``sqrt(vhat) + eps``, which
  differs only while ``sqrt(v)`` is comparable to eps.

``weight_decay`` is an L2 term added to the gradient before the rule, as torch's dense
optimizers do (``g = g + weight_decay * w``). torch refuses weight decay with sparse gradients
(SGD, Adagrad) or has none (SparseAdam); here it is lazy: only the rows in the batch decay.

State layouts (float32, per row): sgd ``[0]``; adagrad ``[dim]`` (sum of squares);
rowwise_adagrad ``[1]``; rowwise_adagrad_momentum ``[dim + 1]`` = ``m [dim] | s [1]``;
adam ``[2*dim + 1]`` = ``m [dim] | v [dim] | step [1]``. The step count
is a float32, exact up to 2^24 updates of a row; beyond that it stops growing, which changes
nothing because both bias corrections are exactly 1.0 long before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import ConfigError

__all__ = ["OPTIMIZERS", "OptimizerParams", "apply_update", "initial_state", "state_width", "torch_update"]

OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "rowwise_adagrad", "adam", "rowwise_adagrad_momentum")


def _check_optimizer(optimizer: str) -> None:
    """Reject an optimizer name that is not one of OPTIMIZERS.

    Args:
        optimizer: the name to check (a str or an ``embcache.types.Optimizer``).

    Raises:
        ConfigError: if the name is unknown.
    """
    if optimizer not in OPTIMIZERS:
        allowed = ", ".join(repr(o) for o in OPTIMIZERS)
        raise ConfigError(f"optimizer={optimizer!r} is not allowed; choose one of {allowed}")


def state_width(optimizer: str, dim: int) -> int:
    """Number of float32 optimizer-state values stored with each row.

    Args:
        optimizer: one of OPTIMIZERS.
        dim: embedding dimension (>= 1).

    Raises:
        ConfigError: if the optimizer is unknown or dim < 1.
    """
    _check_optimizer(optimizer)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ConfigError(f"dim={dim!r} is not allowed; it must be an int >= 1")
    if optimizer == "sgd":
        return 0
    if optimizer == "adagrad":
        return dim
    if optimizer == "rowwise_adagrad":
        return 1
    if optimizer == "rowwise_adagrad_momentum":
        return dim + 1  # m, then the row's sum of mean squares
    return 2 * dim + 1  # adam: m, v, per-row step count


def initial_state(
    optimizer: str,
    dim: int,
    n: int,
    device: torch.device,
    initial_accumulator_value: float = 0.0,
) -> torch.Tensor:
    """State of n rows never updated: float32 [n, state_width(optimizer, dim)] on device.

    Args:
        optimizer: one of OPTIMIZERS.
        dim: embedding dimension (>= 1).
        n: number of rows (>= 0).
        device: where to allocate the state.
        initial_accumulator_value: starting sum of squares of "adagrad", "rowwise_adagrad" and
            "rowwise_adagrad_momentum" (torch's Adagrad argument of the same name; the momentum
            starts at 0); the other optimizers ignore it.

    Raises:
        ConfigError: if the optimizer is unknown, dim < 1, n < 0, or the accumulator value
            is negative or not finite.
    """
    width = state_width(optimizer, dim)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"n={n!r} is not allowed; it must be an int >= 0")
    value = float(initial_accumulator_value)
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"initial_accumulator_value={initial_accumulator_value!r} must be finite and >= 0")
    if optimizer in ("adagrad", "rowwise_adagrad"):
        return torch.full((n, width), value, dtype=torch.float32, device=device)
    if optimizer == "rowwise_adagrad_momentum":
        state = torch.zeros((n, width), dtype=torch.float32, device=device)
        state[:, dim:] = value
        return state
    return torch.zeros((n, width), dtype=torch.float32, device=device)


@dataclass(frozen=True)
class OptimizerParams:
    """Hyper-parameters of a row optimizer (validated when built).

    Args:
        lr: learning rate (finite, >= 0).
        eps: added to the root of the second moment. torch's defaults: Adagrad 1e-10,
            Adam/SparseAdam 1e-8 (FBGEMM's rowwise AdaGrad also uses 1e-10 in practice);
            SGD ignores it.
        beta1: Adam's first-moment decay in [0, 1) (torch's default 0.9), and the momentum of
            "rowwise_adagrad_momentum"; others ignore it.
        beta2: Adam's second-moment decay in [0, 1) (torch's default 0.999); others ignore it.
        weight_decay: L2 penalty added to the gradient, ``g + weight_decay * w`` (>= 0).

    Raises:
        ConfigError: if a value is not finite or out of its range.
    """

    lr: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            ConfigError: if a value is not finite or out of its range.
        """
        for name in ("lr", "eps", "beta1", "beta2", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name}={value!r} is not allowed; it must be a finite number")
        for name in ("lr", "eps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not allowed; it must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not allowed; it must be in [0, 1)")


def _check_batch(optimizer: str, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
    """Check shapes, dtypes and devices of one apply_update batch.

    Args:
        optimizer: one of OPTIMIZERS.
        weights: float32 [n, dim].
        state: float32 [n, state_width(optimizer, dim)].
        grads: float32 [n, dim].

    Raises:
        ConfigError: if the optimizer is unknown.
        ValueError: if a shape, dtype or device does not match.
    """
    _check_optimizer(optimizer)
    if weights.dim() != 2 or weights.shape[1] < 1:
        raise ValueError(f"weights must be [n, dim] with dim >= 1, got shape {tuple(weights.shape)}")
    n, dim = weights.shape
    width = state_width(optimizer, dim)
    for name, t, shape in (("weights", weights, (n, dim)), ("state", state, (n, width)), ("grads", grads, (n, dim))):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for {optimizer!r}, got {tuple(t.shape)}")
        if t.device != weights.device:
            raise ValueError(f"{name} is on {t.device} but weights are on {weights.device}")


def apply_update(
    optimizer: str,
    params: OptimizerParams,
    weights: torch.Tensor,
    state: torch.Tensor,
    grads: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply one optimizer step to a batch of unique rows; a pure function (inputs untouched).

    Args:
        optimizer: one of OPTIMIZERS.
        params: the hyper-parameters.
        weights: float32 [n, dim], the rows' current weights (upcast by the caller).
        state: float32 [n, state_width(optimizer, dim)], the rows' optimizer state.
        grads: float32 [n, dim], the gradient of each row, already summed over duplicate keys.

    Returns:
        (new weights float32 [n, dim], new state float32 [n, S]), freshly allocated on the
        inputs' device.

    Raises:
        ConfigError: if the optimizer is unknown.
        ValueError: if a shape, dtype or device does not match.

    On the CPU (with numba) the step runs in the fused kernel of :mod:`embcache.fused`, the same
    arithmetic as the cache's in-place update of resident rows, so that a row's new value never
    depends on the tier it was in; elsewhere it is :func:`torch_update`.
    """
    _check_batch(optimizer, weights, state, grads)
    if weights.device.type == "cpu":
        from .fused import FusedScratch, fused_available, fused_update

        if fused_available(weights):
            new_w, new_s = weights.clone(), state.clone()
            n = weights.shape[0]
            fused_update(optimizer, params, new_w, new_s, torch.zeros(n, dtype=torch.int32), 1,
                         torch.arange(n), grads, FusedScratch())
            return new_w, new_s
    return torch_update(optimizer, params, weights, state, grads)


def torch_update(
    optimizer: str,
    params: OptimizerParams,
    weights: torch.Tensor,
    state: torch.Tensor,
    grads: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_update` in torch operations, in torch's own optimizers' operation order.

    Bitwise equal to torch's sparse optimizers where the module docstring says so; the CUDA path
    of the cache. Arguments, result and errors as :func:`apply_update`.
    """
    _check_batch(optimizer, weights, state, grads)
    g = grads
    if params.weight_decay != 0.0:
        # torch's form (grad.add(param, alpha=wd)); a new tensor, so grads stay untouched
        g = grads.add(weights, alpha=params.weight_decay)
    if optimizer == "sgd":
        return _sgd(params, weights, state, g)
    if optimizer == "adagrad":
        return _adagrad(params, weights, state, g)
    if optimizer == "rowwise_adagrad":
        return _rowwise_adagrad(params, weights, state, g)
    if optimizer == "rowwise_adagrad_momentum":
        return _rowwise_adagrad_momentum(params, weights, state, g)
    return _adam(params, weights, state, g)


def _sgd(
    params: OptimizerParams, weights: torch.Tensor, state: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain SGD, as torch.optim.SGD without momentum.

    Args:
        params: the hyper-parameters.
        weights: float32 [n, dim].
        state: float32 [n, 0].
        g: float32 [n, dim], weight decay already added.
    """
    # add with alpha is the arithmetic of torch's param.add_(grad, alpha=-lr) (on CPU it rounds
    # once); w - lr * g rounds twice and differs in the last bit
    return weights.add(g, alpha=-params.lr), state.clone()


def _adagrad(
    params: OptimizerParams, weights: torch.Tensor, state: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise AdaGrad, mirroring the sparse branch of torch.optim.Adagrad (lr_decay=0).

    Args:
        params: the hyper-parameters.
        weights: float32 [n, dim].
        state: float32 [n, dim], sum of squared gradients.
        g: float32 [n, dim], weight decay already added.
    """
    # torch: state_sum.add_(sparse(g.pow(2))); std = sqrt(state_sum[rows]).add_(eps);
    # param.add_(sparse(g / std), alpha=-clr) with clr = lr / (1 + 0) = lr
    new_state = state + g.pow(2)
    std = new_state.sqrt().add_(params.eps)
    return weights.add(g / std, alpha=-params.lr), new_state


def _rowwise_adagrad(
    params: OptimizerParams, weights: torch.Tensor, state: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, fed the mean square gradient.

    Args:
        params: the hyper-parameters.
        weights: float32 [n, dim].
        state: float32 [n, 1], sum over steps of the row's mean squared gradient.
        g: float32 [n, dim], weight decay already added.
    """
    new_state = state + (g * g).mean(dim=1, keepdim=True)
    # FBGEMM's order: multiplier = lr / (sqrt(s) + eps), then w - multiplier * g. A full_like
    # numerator keeps it one division (a Python-scalar numerator becomes reciprocal() * lr).
    denom = new_state.sqrt().add_(params.eps)
    multiplier = torch.full_like(denom, params.lr).div_(denom)
    return weights - multiplier * g, new_state


def _rowwise_adagrad_momentum(
    params: OptimizerParams, weights: torch.Tensor, state: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Momentum-scaled row-wise AdaGrad (see the module docstring for the rule and its source).

    Args:
        params: the hyper-parameters (``beta1`` is the momentum).
        weights: float32 [n, dim].
        state: float32 [n, dim + 1] = m | s.
        g: float32 [n, dim], weight decay already added.
    """
    dim = weights.shape[1]
    new_s = state[:, dim:] + (g * g).mean(dim=1, keepdim=True)
    # the multiplier exactly as _rowwise_adagrad computes it, so that beta1 = 0 is that rule bitwise
    denom = new_s.sqrt().add_(params.eps)
    multiplier = torch.full_like(denom, params.lr).div_(denom)
    m = state[:, :dim] * params.beta1 + multiplier * g
    return weights - m, torch.cat([m, new_s], dim=1)


def _adam(
    params: OptimizerParams, weights: torch.Tensor, state: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lazy Adam with a per-row step, in torch.optim.SparseAdam's operation order.

    Args:
        params: the hyper-parameters.
        weights: float32 [n, dim].
        state: float32 [n, 2*dim + 1] = m | v | step.
        g: float32 [n, dim], weight decay already added.
    """
    dim = weights.shape[1]
    m_old = state[:, :dim]
    v_old = state[:, dim : 2 * dim]
    step = state[:, 2 * dim :] + 1.0  # [n, 1]

    # torch: update = (g - m).mul_(1 - b1); m.add_(update); numer = update + m_old (== new m)
    m = m_old + (g - m_old).mul_(1.0 - params.beta1)
    v = v_old + g.pow(2).sub_(v_old).mul_(1.0 - params.beta2)
    denom = v.sqrt().add_(params.eps)

    # torch computes the step size in double from Python floats and rounds it to float32 when it
    # scales the float32 update; do the same per row
    t = step.double()
    bias_correction1 = 1.0 - torch.pow(params.beta1, t)
    bias_correction2 = 1.0 - torch.pow(params.beta2, t)
    step_size = (bias_correction2.sqrt() * params.lr).div_(bias_correction1).float()

    # torch: param.add_(sparse(-step_size * numer.div_(denom)))
    new_weights = weights + (m / denom).mul_(step_size.neg_())
    return new_weights, torch.cat([m, v, step], dim=1)
