"""A fused CPU kernel for the commonest update: every row of a batch resident in one float32 tier.

:func:`embcache.optim.apply_update` is a pure function of gathered rows, which a training step
pays for with a sort (``torch.unique``), a scatter (summing duplicate gradients), two gathers
(weights and state), about ten whole-batch temporaries for the optimizer's arithmetic and two
scatters back: profiled at batch 65,536 and dim 64 (row-wise AdaGrad, one thread), 17 ms, of
which the scatter-add alone was 5 ms. :func:`fused_update` does the same work in two serial
passes over the batch with no temporaries:

1. deduplicate by slot (a batch-sized hash table, :class:`~embcache.slot_table.SlotTable`, maps a
   slot to its position among the batch's unique rows) and sum duplicate gradients in batch
   order, which is the order and the rounding of ``index_add_`` into zeros;
2. for each unique row, apply the optimizer in place on the tier's weights and state and mark
   the row dirty (a bit ORed into the tier's per-row flags).

The arithmetic mirrors :mod:`embcache.optim` operation for operation, with explicit fused
multiply-adds exactly where torch's vectorized CPU kernels use them (``add(x, alpha=a)``). SGD
therefore gives bitwise the rows of :func:`~embcache.optim.apply_update`. The others agree
within float32 rounding, not bitwise: torch's float32 ``sqrt`` on the CPU is not correctly
rounded (about one value in five differs in the last bit from IEEE ``sqrt``, measured with torch
2.13), and its ``mean`` sums in a different order than a serial loop. The tests check both.

The kernel compiles with numba's NumPy error model: a division by zero gives inf or NaN as in
torch (``eps=0`` and a zero gradient), where the Python model raised ``ZeroDivisionError`` halfway
through a batch, and its per-element check kept the division and ``sqrt`` of AdaGrad and Adam
from vectorizing (with it, those two ran 1.6x slower). Rows are indexed in two dimensions, not
through per-row views, whose reference counts cost 5-12% of an SGD or row-wise AdaGrad pass.

CPU only (numba); the CUDA path keeps the torch operations, which run as batched kernels there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .optim import OPTIMIZERS, OptimizerParams
from .slot_table import GOLDEN, SlotTable

__all__ = ["fused_available", "fused_update", "segment_sum"]

_KERNEL: dict[str, Any] = {}


def _fma_intrinsic() -> Any:
    """A numba intrinsic ``fma(a, b, c)`` = a * b + c rounded once (LLVM's ``llvm.fma.f32``)."""
    import numba
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[misc]
    def fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            f32 = ir.FloatType()
            fnty = ir.FunctionType(f32, [f32, f32, f32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f32")
            return builder.call(fn, list(args))

        f32t = numba.types.float32
        return f32t(f32t, f32t, f32t), codegen

    return fma


def _prefetch_intrinsic() -> Any:
    """A numba intrinsic ``prefetch(tab, i, k)``: LLVM's prefetch (for writing) of ``&tab[i, k]``."""
    import numba
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[misc]
    def prefetch(typingctx: Any, tab: Any, i: Any, k: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]])
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(1), i32(3), i32(1)])
            return context.get_dummy_value()

        return numba.types.void(tab, i, k), codegen

    return prefetch


# Rows are visited in batch order, i.e. at random in the tier: without prefetching, each row's
# update waits on its cache misses (230 ns per row at dim 64; 85 ns with these prefetches).
_AHEAD = 8  # rows prefetched ahead
_LINE = 16  # float32 values per 64-byte cache line


_F32 = np.float32
_EXPONENT = np.int32(0x7F800000)  # float32 exponent bits: all set in NaN and inf alone


def _sum_squares_py(x: Any, i: Any) -> Any:
    """Sum of ``x[i] * x[i]`` in float32 (compiled with reassociation, i.e. vectorized)."""
    acc = _F32(0.0)
    for j in range(x.shape[1]):
        acc += x[i, j] * x[i, j]
    return acc


def _nonfinite_py(x: Any) -> Any:
    """Whether any value of the float32 array ``x`` (C-contiguous) is NaN or inf: its exponent bits
    all set. On the bits as int32, whose max reduction vectorizes without fast-math (with it, LLVM
    folds float tests such as ``v - v != 0`` away)."""
    bits = x.reshape(x.size).view(np.int32)
    top = np.int32(0)
    for j in range(bits.shape[0]):
        top = max(top, bits[j] & _EXPONENT)
    return top == _EXPONENT


def _fma_py(a: Any, b: Any, c: Any) -> Any:
    return a * b + c


def _prefetch_py(tab: Any, i: Any, k: Any) -> None:
    pass


# Module-level kernel whose helpers are globals rebound to their numba versions by _build()
# before it compiles: numba's disk cache (cache=True) works for module functions, not closures.
_fma: Any = _fma_py
_prefetch: Any = _prefetch_py
_sum_squares: Any = _sum_squares_py
_nonfinite: Any = _nonfinite_py


def _kernel_py(opt: int, weights: Any, state: Any, flags: Any, dirty: Any, slots: Any, grads: Any,  # pragma: no cover
               table: Any, shift: Any, uslots: Any, gsum: Any, lr: float, eps: float, beta1: float,
               beta2: float, wd: float, check: bool) -> int:
    """The fused update (see the module docstring); returns the number of unique rows, or -1
    (nothing changed) when ``check`` and a gradient is NaN or inf."""
    n, d = grads.shape
    lr32, eps32, wd32 = _F32(lr), _F32(eps), _F32(wd)
    neg_lr32 = _F32(-lr)
    one_b1, one_b2, beta1_32 = _F32(1.0 - beta1), _F32(1.0 - beta2), _F32(beta1)
    mask = table.shape[0] - 1
    for h in range(mask + 1):
        table[h] = -1
    if check and _nonfinite(grads):
        return -1  # refused before anything changes
    u = 0
    for i in range(n):  # 1. unique rows and summed gradients, in batch order
        s = slots[i]
        h = np.int64((np.uint64(s) * GOLDEN) >> shift)
        e = table[h]
        while e >= 0 and (e >> 32) != s:
            h = (h + 1) & mask
            e = table[h]
        if e < 0:
            p = u
            table[h] = (s << 32) | p
            uslots[p] = s
            u += 1
            for j in range(d):
                gsum[p, j] = _F32(0.0) + grads[i, j]
        else:
            p = e & 0xFFFFFFFF
            for j in range(d):
                gsum[p, j] += grads[i, j]
    width = state.shape[1]
    for p in range(u):  # 2. the optimizer, in place
        if p + _AHEAD < u:
            q = uslots[p + _AHEAD]
            for k in range(0, d, _LINE):
                _prefetch(weights, q, k)
            for k in range(0, width, _LINE):
                _prefetch(state, q, k)
            _prefetch(flags, q, 0)
        s = uslots[p]
        flags[s, 0] |= dirty
        if wd32 != _F32(0.0):
            for j in range(d):  # torch: grads.add(weights, alpha=wd)
                gsum[p, j] = _fma(weights[s, j], wd32, gsum[p, j])
        if opt == 0:  # sgd: weights.add(g, alpha=-lr)
            for j in range(d):
                weights[s, j] = _fma(gsum[p, j], neg_lr32, weights[s, j])
        elif opt == 1:  # adagrad
            for j in range(d):
                acc = state[s, j] + gsum[p, j] * gsum[p, j]
                state[s, j] = acc
                std = _F32(np.sqrt(acc)) + eps32
                weights[s, j] = _fma(gsum[p, j] / std, neg_lr32, weights[s, j])
        elif opt == 2:  # rowwise_adagrad
            acc = state[s, 0] + _sum_squares(gsum, p) / _F32(d)
            state[s, 0] = acc
            multiplier = lr32 / (_F32(np.sqrt(acc)) + eps32)
            for j in range(d):
                weights[s, j] = weights[s, j] - multiplier * gsum[p, j]
        elif opt == 3:  # adam: state = m | v | step
            step = state[s, 2 * d] + _F32(1.0)
            state[s, 2 * d] = step
            t = np.float64(step)
            bias1 = 1.0 - beta1 ** t
            bias2 = 1.0 - beta2 ** t
            neg_step_size = -_F32((np.sqrt(bias2) * lr) / bias1)
            for j in range(d):
                m = state[s, j] + (gsum[p, j] - state[s, j]) * one_b1
                v = state[s, d + j] + (gsum[p, j] * gsum[p, j] - state[s, d + j]) * one_b2
                state[s, j] = m
                state[s, d + j] = v
                weights[s, j] = weights[s, j] + (m / (_F32(np.sqrt(v)) + eps32)) * neg_step_size
        else:  # rowwise_adagrad_momentum: state = m | s
            acc = state[s, d] + _sum_squares(gsum, p) / _F32(d)
            state[s, d] = acc
            multiplier = lr32 / (_F32(np.sqrt(acc)) + eps32)
            for j in range(d):
                m = state[s, j] * beta1_32 + multiplier * gsum[p, j]
                state[s, j] = m
                weights[s, j] = weights[s, j] - m
    return u


def _segment_sum_py(grads: Any, index: Any, out: Any) -> None:  # pragma: no cover - compiled
    """``out[index[i]] += grads[i]`` in order: the arithmetic of ``index_add_`` into zeros."""
    for i in range(index.shape[0]):
        r = index[i]
        for j in range(grads.shape[1]):
            out[r, j] += grads[i, j]


def _build() -> Any:
    global _fma, _prefetch, _sum_squares, _nonfinite
    import numba

    _fma, _prefetch = _fma_intrinsic(), _prefetch_intrinsic()
    # the sum of squares may be reassociated (vectorized); torch's mean reduces in its own order too
    # A call, not inline="always": numba inlines in its own IR, where the caller's strict flags
    # then apply, and the sum ran serially (8,192 rows of 64: 0.26 ms inlined, 0.035 ms called).
    _sum_squares = numba.njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})(_sum_squares_py)
    _nonfinite = numba.njit(nogil=True, cache=True)(_nonfinite_py)
    _KERNEL["segment_sum"] = numba.njit(nogil=True, cache=True)(_segment_sum_py)
    return numba.njit(nogil=True, cache=True, error_model="numpy")(_kernel_py)


def _kernel() -> Any:
    """The compiled kernel, or None without numba."""
    if "kernel" not in _KERNEL:
        try:
            _KERNEL["kernel"] = _build()
        except ImportError:
            _KERNEL["kernel"] = None
    return _KERNEL["kernel"]


def fused_available(weights: torch.Tensor) -> bool:
    """Whether :func:`fused_update` can update rows stored like ``weights`` (CPU float32, numba)."""
    return weights.device.type == "cpu" and weights.dtype == torch.float32 and _kernel() is not None


class FusedScratch:
    """Per-tier scratch of :func:`fused_update`, all sized by the batch and reused across calls:
    the slot table that deduplicates, the unique slots and their summed gradients."""

    def __init__(self, table: SlotTable | None = None) -> None:
        self.table = table or SlotTable()  # a tier lends the one its eviction sample uses too
        self.uslots = np.empty(0, dtype=np.int64)
        self.gsum = np.empty((0, 0), dtype=np.float32)

    def buffers(self, n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """``uslots`` int64 [>= n] and ``gsum`` float32 [>= n, dim] (reused across calls)."""
        if self.uslots.shape[0] < n:
            self.uslots = np.empty(n, dtype=np.int64)
        if self.gsum.shape[0] < n or self.gsum.shape[1] != dim:
            self.gsum = np.empty((n, dim), dtype=np.float32)
        return self.uslots, self.gsum


def fused_update(optimizer: str, params: OptimizerParams, weights: torch.Tensor, state: torch.Tensor,
                 flags: torch.Tensor, dirty: int, slots: torch.Tensor, grads: torch.Tensor,
                 scratch: FusedScratch, check_finite: bool = False) -> int:
    """Apply one optimizer step in place to the rows at ``slots``; returns the number of unique rows,
    or -1 when ``check_finite`` and a gradient is NaN or inf (then nothing changed: the kernel's
    first pass, which reads every gradient, checks them before its second writes any row).

    Args:
        optimizer: one of OPTIMIZERS.
        params: the hyper-parameters.
        weights: the tier's float32 [capacity, dim] rows (CPU, contiguous), changed in place.
        state: the tier's float32 [capacity, S] optimizer state, changed in place.
        flags: the tier's int32 [capacity] per-row flags; ``dirty`` is ORed into those of updated rows.
        slots: int64 [n] slot of each key of the batch (duplicates allowed, all valid).
        grads: float32 [n, dim] gradient of each key (CPU).
        dirty: the bit that marks a row dirty in ``flags``.
        scratch: the tier's :class:`FusedScratch`.
        check_finite: refuse NaN and inf gradients (return -1, nothing changed).

    Raises:
        RuntimeError: if the kernel is not available (check :func:`fused_available` first).
    """
    kernel = _kernel()
    if kernel is None or not fused_available(weights):
        raise RuntimeError("the fused update kernel needs numba and CPU float32 rows")
    n, dim = grads.shape
    uslots, gsum = scratch.buffers(n, dim)
    if flags.dtype != torch.int32:
        raise RuntimeError(f"the fused update kernel needs int32 flags, got {flags.dtype}")
    table, shift = scratch.table.arrays(n)
    flags2 = flags.numpy().reshape(-1, 1)  # 2-D for the prefetch intrinsic
    return int(kernel(OPTIMIZERS.index(optimizer), weights.numpy(), state.numpy(), flags2, np.int32(dirty),
                      slots.contiguous().numpy(), grads.contiguous().numpy(), table, shift, uslots, gsum,
                      params.lr, params.eps, params.beta1, params.beta2, params.weight_decay,
                      bool(check_finite)))


def segment_sum(grads: torch.Tensor, index: torch.Tensor, n_out: int) -> torch.Tensor:
    """``zeros(n_out, dim).index_add_(0, index, grads)``, the same bits, without torch's slow CPU scatter.

    torch's CPU ``index_add_`` took ~190 us for 2,048 x 16 floats (a scatter per element); a
    serial numba loop takes a few. Elsewhere (CUDA, no numba) it is ``index_add_``.

    Args:
        grads: float32 [n, dim].
        index: int64 [n], each in [0, n_out).
        n_out: rows of the result.
    """
    out = torch.zeros(n_out, grads.shape[1], dtype=grads.dtype, device=grads.device)
    if grads.device.type == "cpu" and grads.dtype == torch.float32 and _kernel() is not None:
        _KERNEL["segment_sum"](grads.contiguous().numpy(), index.contiguous().numpy(), out.numpy())
        return out
    return out.index_add_(0, index, grads)
