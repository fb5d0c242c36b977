"""Lazy row initializers: a row's first value is a pure function of (seed, key).

A row that was never written is created on first touch, possibly in another process, tier,
device or shard than the one that touches it next, so its value cannot come from a stateful
RNG. Each element is instead a counter-based hash of (seed, key, column) (splitmix64), computed
in wrapping int64 torch arithmetic; the floating-point part uses only float32 +, -, *, / (each one
correctly rounded torch op: no libm calls, not even torch.sqrt, which is not correctly rounded
on CPU, and no fused multiply-adds) and exact bit manipulation, so a row does not depend on the
batch it is made in, nor on the device (tests/test_init.py checks CUDA against CPU bitwise where
a GPU is present, and torch against a numpy reference).

The hash, in uint64 arithmetic (``fmix`` is splitmix64's output function, ``G`` its increment)::

    s     = fmix(seed + G)                       # seed taken modulo 2**64
    r     = fmix(fmix(key + G) ^ s)              # one per row
    h[j]  = fmix(r + (j + 1) * G)                # column j: the splitmix64 stream seeded by r

* uniform: ``u = (h >> 40) / 2**24`` in [0, 1); value ``(2u - 1) * scale`` in [-scale, scale).
* normal: Box-Muller on two independent 24-bit fields of ``h``: ``u1 = ((h >> 40) + 1) / 2**24``
  in (0, 1] (never log(0)) and ``u2 = ((h >> 16) & 0xFFFFFF) / 2**24``; value
  ``sqrt(-2 ln u1) * cos(2 pi u2) * scale``. ``ln`` and ``cos`` are fixed polynomials after
  exact range reduction, ``sqrt`` a bit-trick guess and three Newton steps (errors of a few
  float32 ulps against float64 libm); the tails reach
  ``sqrt(2 * 24 ln 2) = 5.77`` standard deviations.
* zeros: all zeros.
"""

from __future__ import annotations

import math

import torch

from .errors import ConfigError, InvalidKeysError

__all__ = ["INITIALIZERS", "init_rows"]

INITIALIZERS: tuple[str, ...] = ("uniform", "normal", "zeros")

_MASK64 = (1 << 64) - 1


def _to_i64(x: int) -> int:
    """The int64 with the same 64 bits as the unsigned value x.

    Args:
        x: an integer, taken modulo 2**64.
    """
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


# splitmix64's constants; those above 2**63 become their negative int64 twins, because torch
# int64 arithmetic wraps modulo 2**64 just like uint64
_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_GAMMA_I64 = _to_i64(_GAMMA)
_MUL1_I64 = _to_i64(_MUL1)
_MUL2_I64 = _to_i64(_MUL2)

# bound the [rows, dim] int64 temporaries: small enough to stay in cache on CPU, large enough
# that per-op Python overhead is amortized
_CPU_CHUNK_ELEMENTS = 1 << 18
_CUDA_CHUNK_ELEMENTS = 1 << 22

# float32 constants of the polynomials (Taylor / atanh series)
_SQRT_HALF_BITS = 0x3F3504F3  # float32 bits of sqrt(1/2)
_LN2 = math.log(2.0)
_RSQRT_MAGIC = 0x5F3759DF  # the bit-level first guess of 1/sqrt(y), as in Quake III
_PI_OVER_2_23 = math.pi / (1 << 23)
# ln m = 2 s (1 + z/3 + z^2/5 + z^3/7 + z^4/9), s = (m-1)/(m+1), z = s^2 <= 0.0295 for
# m in [sqrt(1/2), sqrt(2)): the first omitted term is below 2e-9 relative
_LOG_COEFFS = (1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0)
# sin x = x sum_k (-1)^k x^(2k) / (2k+1)! for k <= 6; on [-pi/2, pi/2] the first omitted term is < 7e-10
_SIN_COEFFS = tuple((-1.0) ** k / math.factorial(2 * k + 1) for k in range(6, -1, -1))


def _fmix_py(x: int) -> int:
    """splitmix64's output function on a Python int (used for the per-call seed constant).

    Args:
        x: an integer, taken modulo 2**64.
    """
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def _xorshift_(z: torch.Tensor, shift: int) -> torch.Tensor:
    """In place: z ^= z >>> shift, the logical (unsigned) right shift of int64 bits.

    Args:
        z: int64 tensor of any shape, modified in place.
        shift: 1..63.
    """
    # >> on int64 is arithmetic; masking off the sign-extended top bits makes it logical
    z.bitwise_xor_(torch.bitwise_right_shift(z, shift).bitwise_and_((1 << (64 - shift)) - 1))
    return z


def _fmix_(z: torch.Tensor, last: bool = True) -> torch.Tensor:
    """In place: splitmix64's output function on int64 bits.

    Args:
        z: int64 tensor of any shape, modified in place.
        last: apply the final xorshift; it leaves bits 33..63 unchanged, so a caller that reads
            only those may skip it and still get exactly fmix's bits there.
    """
    _xorshift_(z, 30).mul_(_MUL1_I64)
    _xorshift_(z, 27).mul_(_MUL2_I64)
    if last:
        _xorshift_(z, 31)
    return z


def _row_bases(seed: int, keys: torch.Tensor) -> torch.Tensor:
    """The per-row state r = fmix(fmix(key + G) ^ fmix(seed + G)) of each key.

    Args:
        seed: any int (taken modulo 2**64).
        keys: int64 [n].
    """
    seed_mix = _to_i64(_fmix_py(seed + _GAMMA))
    r = _fmix_(keys + _GAMMA_I64)
    return _fmix_(r.bitwise_xor_(seed_mix))


def _hash_block(bases: torch.Tensor, column_offsets: torch.Tensor, last: bool) -> torch.Tensor:
    """Element hashes h[i, j] = fmix(bases[i] + column_offsets[j]).

    Args:
        bases: int64 [rows].
        column_offsets: int64 [dim], (j + 1) * G.
        last: apply fmix's final xorshift (see _fmix_).
    """
    return _fmix_(bases[:, None] + column_offsets[None, :], last=last)


def _uniform_block(h: torch.Tensor) -> torch.Tensor:
    """Values in [-1, 1) from the top 24 bits of each hash; float32, exact.

    Args:
        h: int64 [rows, dim] hashes (bits 33..63 of fmix suffice).
    """
    top = torch.bitwise_right_shift(h, 40).bitwise_and_(0xFFFFFF).to(torch.float32)
    # k / 2**23 - 1 for k < 2**24 is exactly representable: no rounding anywhere
    return top.mul_(2.0**-23).sub_(1.0)


def _log_unit(u: torch.Tensor) -> torch.Tensor:
    """Natural log of positive, normal float32 values, with integer bit tricks and basic arithmetic only.

    Args:
        u: float32 [...], positive and normal (here in [2**-24, 1]).
    """
    # musl's logf reduction, exact: u = m * 2**k with m in [sqrt(1/2), sqrt(2)), read off the bits
    # (a bit offset instead of frexp + where, which are several times slower on CPU)
    ix = u.view(torch.int32) - _SQRT_HALF_BITS
    k = torch.bitwise_right_shift(ix, 23).to(torch.float32)
    m = ix.bitwise_and_(0x7FFFFF).add_(_SQRT_HALF_BITS).view(torch.float32)
    s = (m - 1.0).div_(m + 1.0)  # m - 1 is exact (Sterbenz)
    z = s * s
    p = torch.full_like(z, _LOG_COEFFS[0])
    for c in _LOG_COEFFS[1:]:
        p.mul_(z).add_(c)
    return p.mul_(s).mul_(2.0).add_(k.mul_(_LN2))


def _sqrt(y: torch.Tensor) -> torch.Tensor:
    """Square root of finite float32 values >= 0, with integer bit tricks and basic arithmetic only.

    Args:
        y: float32 [...], finite, >= 0 (zeros give zeros); consumed (modified in place).
    """
    # torch.sqrt is not correctly rounded on CPU (torch 2.13 differs from IEEE in ~15% of float32
    # results), so CPU and CUDA could disagree; instead: the classic bit-trick guess of 1/sqrt(y)
    # (relative error < 3.5%), three Newton steps (< 1e-10 before float32 rounding), then y * (1/sqrt(y))
    r = y.clamp(min=1e-30)  # keeps the guess finite at y = 0, where y * r below is still 0
    half = r * 0.5
    r = torch.bitwise_right_shift(r.view(torch.int32), 1).neg_().add_(_RSQRT_MAGIC).view(torch.float32)
    for _ in range(3):
        r = r.mul_(1.5 - (r * r).mul_(half))
    return y.mul_(r)


def _cos_turn(b: torch.Tensor) -> torch.Tensor:
    """cos(2 pi b / 2**24) for integers b in [0, 2**24), with basic arithmetic only.

    Args:
        b: int64 [...] in [0, 2**24).
    """
    # exact folding (integers below 2**24 are exact in float32): with d = |b - 2**23| - 2**22,
    # cos(2 pi b / 2**24) = -cos(pi |b - 2**23| / 2**23) = sin(pi d / 2**23), angle in [-pi/2, pi/2]
    x = b.to(torch.float32).sub_(float(1 << 23)).abs_().sub_(float(1 << 22)).mul_(_PI_OVER_2_23)
    x2 = x * x
    p = torch.full_like(x2, _SIN_COEFFS[0])
    for c in _SIN_COEFFS[1:]:
        p.mul_(x2).add_(c)
    return p.mul_(x)


def _normal_block(h: torch.Tensor) -> torch.Tensor:
    """Standard normal float32 values by Box-Muller on two 24-bit fields of each hash.

    Args:
        h: int64 [rows, dim] full fmix hashes.
    """
    top = torch.bitwise_right_shift(h, 40).bitwise_and_(0xFFFFFF)
    mid = torch.bitwise_right_shift(h, 16).bitwise_and_(0xFFFFFF)
    u1 = top.add_(1).to(torch.float32).mul_(2.0**-24)  # (0, 1]: log never sees 0
    radius = _sqrt(_log_unit(u1).mul_(-2.0))  # ln u1 <= 0, so the argument is >= 0
    return radius.mul_(_cos_turn(mid))


def init_rows(
    initializer: str,
    scale: float,
    seed: int,
    keys: torch.Tensor,
    dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """First values of the rows of keys: [n, dim] of dtype on keys.device, a pure function of (seed, key).

    Args:
        initializer: "uniform" (U(-scale, scale)), "normal" (N(0, scale), scale is the std)
            or "zeros".
        scale: finite, >= 0 (rounded to float32 before it scales the values).
        seed: any int (taken modulo 2**64).
        keys: integer [n] on any device; any int64 value, negative or above 2**53, is fine.
        dim: embedding dimension (>= 1).
        dtype: floating dtype of the result; values are made in float32 and rounded to it.

    Raises:
        ConfigError: if the initializer is unknown, scale is negative or not finite, dim < 1,
            or dtype is not floating.
        InvalidKeysError: if keys is not a 1-D integer tensor.
    """
    if initializer not in INITIALIZERS:
        allowed = ", ".join(repr(i) for i in INITIALIZERS)
        raise ConfigError(f"initializer={initializer!r} is not allowed; choose one of {allowed}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ConfigError(f"scale={scale!r} is not allowed; it must be a finite number >= 0")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ConfigError(f"dim={dim!r} is not allowed; it must be an int >= 1")
    if not dtype.is_floating_point:
        raise ConfigError(f"dtype={dtype} is not allowed; it must be a floating dtype")
    if not isinstance(keys, torch.Tensor) or keys.dim() != 1 or keys.dtype.is_floating_point or keys.is_complex() \
            or keys.dtype == torch.bool:
        raise InvalidKeysError("keys must be a 1-D integer tensor")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} is not allowed; it must be an int")

    device = keys.device
    n = keys.numel()
    out = torch.empty((n, dim), dtype=dtype, device=device)
    if initializer == "zeros" or n == 0:
        return out.zero_()

    bases = _row_bases(seed, keys.to(torch.int64))
    offsets = torch.arange(1, dim + 1, dtype=torch.int64, device=device).mul_(_GAMMA_I64)
    budget = _CUDA_CHUNK_ELEMENTS if device.type == "cuda" else _CPU_CHUNK_ELEMENTS
    rows_per_chunk = max(1, budget // dim)
    for start in range(0, n, rows_per_chunk):
        stop = min(n, start + rows_per_chunk)
        if initializer == "uniform":
            values = _uniform_block(_hash_block(bases[start:stop], offsets, last=False))
        else:
            values = _normal_block(_hash_block(bases[start:stop], offsets, last=True))
        # a separate multiply (not fused into an earlier op) keeps CPU and CUDA bitwise equal
        out[start:stop] = values.mul_(scale)
    return out
