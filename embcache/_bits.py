"""Bit helpers shared across the package: powers of two and the splitmix64 finalizer on torch int64.

:func:`mix64` is the one torch definition of splitmix64's finalizer (Stafford's "Mix13"): the key
index hashes keys with it, and the policy's count-min sketch hashes its seeded keys with it. It
is a bijection of the 64-bit patterns, so distinct keys never share a full hash, and patterned
keys (consecutive ids, multiples of a large power of two) spread evenly; :func:`unmix64` inverts
it, which lets tests build colliding keys on purpose. The numba kernels of the index and the
simulators compute the same finalizer on uint64 scalars from :data:`M1` and :data:`M2`.
"""

from __future__ import annotations

import torch

__all__ = ["M1", "M2", "mix64", "next_pow2", "unmix64"]

# splitmix64 finalizer multipliers (Stafford's "Mix13"); both are odd, so they have inverses mod
# 2**64, which unmix64 uses.
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB


def _i64(v: int) -> int:
    # The int64 with the same 64 bits (torch arithmetic is on signed int64).
    return v - (1 << 64) if v >= 1 << 63 else v


_M1_I64, _M2_I64 = _i64(M1), _i64(M2)
_M1_INV_I64, _M2_INV_I64 = _i64(pow(M1, -1, 1 << 64)), _i64(pow(M2, -1, 1 << 64))
# torch has no unsigned 64-bit shift: ``x >> s`` is arithmetic, so mask off the copied sign bits.
_LOW34 = (1 << 34) - 1
_LOW37 = (1 << 37) - 1
_LOW33 = (1 << 33) - 1


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def mix64(keys: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer of each key, computed in wrapping int64 arithmetic.

    Args:
        keys: int64 tensor of any shape, any device (not modified).

    Returns:
        int64, same shape and device: the 64-bit hash bit patterns (a bijection of the keys).
    """
    x = keys ^ ((keys >> 30) & _LOW34)
    x.mul_(_M1_I64)
    x ^= (x >> 27) & _LOW37
    x.mul_(_M2_I64)
    x ^= (x >> 31) & _LOW33
    return x


def _unxorshift(x: torch.Tensor, shift: int) -> torch.Tensor:
    # Inverse of x ^ (x >>> shift): each round fixes ``shift`` more of the high bits.
    low = (1 << (64 - shift)) - 1
    y = x
    for _ in range(64 // shift):
        y = x ^ ((y >> shift) & low)
    return y


def unmix64(h: torch.Tensor) -> torch.Tensor:
    """The keys whose :func:`mix64` is ``h`` (the finalizer is a bijection).

    Args:
        h: int64 tensor of hash bit patterns, any device.

    Returns:
        int64 keys with ``mix64(keys) == h``.
    """
    x = _unxorshift(h, 31) * _M2_INV_I64
    x = _unxorshift(x, 27) * _M1_INV_I64
    return _unxorshift(x, 30)
