"""Lazy initializers of embcache.init: a pure function of (seed, key), checked against numpy."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import embcache.init as init_mod
from embcache.errors import ConfigError, InvalidKeysError
from embcache.init import INITIALIZERS, init_rows

from .fakecuda import fake_cuda

U64 = np.uint64
GAMMA = U64(0x9E3779B97F4A7C15)
MUL1 = U64(0xBF58476D1CE4E5B9)
MUL2 = U64(0x94D049BB133111EB)
F32 = np.float32

EXTREME_KEYS = [-(2**63), 2**63 - 1, 0, -1, 1, 2**53, 2**53 + 1, -(2**53) - 1, 2**62, -(2**62)]


# ---- pure-numpy uint64 reference ------------------------------------------------------------


def np_fmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function on uint64 arrays (multiplication wraps modulo 2**64).

    Args:
        z: uint64 array of any shape.
    """
    z = (z ^ (z >> U64(30))) * MUL1
    z = (z ^ (z >> U64(27))) * MUL2
    return z ^ (z >> U64(31))


def np_hash(seed: int, keys: np.ndarray, dim: int) -> np.ndarray:
    """Element hashes fmix(fmix(fmix(key + G) ^ fmix(seed + G)) + (j + 1) G), uint64 [n, dim].

    Args:
        seed: any int.
        keys: int64 [n].
        dim: number of columns.
    """
    with np.errstate(over="ignore"):
        s = np_fmix(np.array([(seed + int(GAMMA)) % 2**64], dtype=U64))[0]
        r = np_fmix(np_fmix(keys.astype(np.int64).view(U64) + GAMMA) ^ s)
        cols = np.arange(1, dim + 1, dtype=U64) * GAMMA
        return np_fmix(r[:, None] + cols[None, :])


def np_uniform(seed: int, keys: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """The uniform initializer in numpy float32, operation for operation.

    Args:
        seed: any int.
        keys: int64 [n].
        dim: number of columns.
        scale: half-width.
    """
    top = (np_hash(seed, keys, dim) >> U64(40)).astype(F32)
    return ((top * F32(2.0**-23)) - F32(1.0)) * F32(scale)


def np_normal(seed: int, keys: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """The normal initializer in numpy float32, operation for operation (bit tricks included).

    Args:
        seed: any int.
        keys: int64 [n].
        dim: number of columns.
        scale: standard deviation.
    """
    h = np_hash(seed, keys, dim)
    top = (h >> U64(40)) & U64(0xFFFFFF)
    mid = (h >> U64(16)) & U64(0xFFFFFF)
    u1 = (top + U64(1)).astype(F32) * F32(2.0**-24)
    ix = u1.view(np.int32) - np.int32(0x3F3504F3)
    k = (ix >> 23).astype(F32)
    m = ((ix & np.int32(0x7FFFFF)) + np.int32(0x3F3504F3)).view(F32)
    s = (m - F32(1.0)) / (m + F32(1.0))
    z = s * s
    p = np.full_like(z, F32(1.0 / 9.0))
    for c in (1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0):
        p = p * z + F32(c)
    log_u1 = p * s * F32(2.0) + k * F32(math.log(2.0))
    y = log_u1 * F32(-2.0)
    r = np.maximum(y, F32(1e-30))
    half = r * F32(0.5)
    r = (np.int32(0x5F3759DF) - (r.view(np.int32) >> 1)).view(F32)
    for _ in range(3):
        r = r * (F32(1.5) - (r * r) * half)
    radius = y * r
    x = (np.abs(mid.astype(F32) - F32(2**23)) - F32(2**22)) * F32(math.pi / 2**23)
    x2 = x * x
    q = np.full_like(x2, F32(1.0 / math.factorial(13)))
    for j in range(5, -1, -1):
        q = q * x2 + F32((-1.0) ** j / math.factorial(2 * j + 1))
    return radius * (q * x) * F32(scale)


def np_box_muller64(seed: int, keys: np.ndarray, dim: int) -> np.ndarray:
    """Textbook float64 Box-Muller on the same two 24-bit fields (libm log and cos).

    Args:
        seed: any int.
        keys: int64 [n].
        dim: number of columns.
    """
    h = np_hash(seed, keys, dim)
    u1 = (((h >> U64(40)) & U64(0xFFFFFF)).astype(np.float64) + 1.0) / 2**24
    u2 = ((h >> U64(16)) & U64(0xFFFFFF)).astype(np.float64) / 2**24
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64)


# ---- tests -------------------------------------------------------------------------------------


def test_numpy_reference_is_splitmix64() -> None:
    # Vigna's splitmix64.c from state 1234567: the reference hash is the real thing
    state = np.array([1234567], dtype=U64)
    got = []
    with np.errstate(over="ignore"):
        for _ in range(3):
            state = state + GAMMA
            got.append(int(np_fmix(state.copy())[0]))
    assert got == [6457827717110365317, 3203168211198807973, 9817491932198370423]


def test_torch_hash_matches_numpy_bitwise() -> None:
    keys = torch.cat([_keys(1000), torch.tensor(EXTREME_KEYS)])
    for seed in (0, 1, -1, 2**63 - 1, -(2**63), 2**70 + 5):
        bases = init_mod._row_bases(seed, keys)
        offsets = torch.arange(1, 9, dtype=torch.int64).mul_(init_mod._GAMMA_I64)
        got = init_mod._hash_block(bases, offsets, last=True).numpy().view(U64)
        np.testing.assert_array_equal(got, np_hash(seed, keys.numpy(), 8))


@pytest.mark.parametrize("scale", [1.0, 0.05, 1.0 / math.sqrt(7)])
def test_uniform_matches_numpy_bitwise(scale: float) -> None:
    # 10k rows of dim 64 span several chunks of the CPU implementation
    keys = torch.cat([_keys(10_000, 1), torch.tensor(EXTREME_KEYS)])
    got = init_rows("uniform", scale, 42, keys, 64)
    np.testing.assert_array_equal(got.numpy(), np_uniform(42, keys.numpy(), 64, scale))


def test_normal_matches_numpy_bitwise_and_textbook_box_muller() -> None:
    keys = torch.cat([_keys(5_000, 2), torch.tensor(EXTREME_KEYS)])
    got = init_rows("normal", 0.3, 9, keys, 64)
    np.testing.assert_array_equal(got.numpy(), np_normal(9, keys.numpy(), 64, 0.3))
    # the polynomials are accurate: within a few float32 ulps of libm's float64 Box-Muller
    want = np_box_muller64(9, keys.numpy(), 64) * 0.3
    np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=0, atol=3e-6)


@pytest.mark.parametrize("initializer", INITIALIZERS)
def test_same_key_same_row_in_any_batch(initializer: str) -> None:
    keys = _keys(300, 3)
    full = init_rows(initializer, 0.1, 5, keys, 16)
    assert torch.equal(full, init_rows(initializer, 0.1, 5, keys, 16))  # across calls
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(0))
    assert torch.equal(init_rows(initializer, 0.1, 5, keys[perm], 16), full[perm])  # batch order
    assert torch.equal(init_rows(initializer, 0.1, 5, keys[7:8], 16), full[7:8])  # alone
    dup = keys[[4, 4, 9, 4]]
    assert torch.equal(init_rows(initializer, 0.1, 5, dup, 16), full[[4, 4, 9, 4]])  # duplicates
    # column j does not depend on dim: a wider table extends the narrower one's rows
    assert torch.equal(init_rows(initializer, 0.1, 5, keys, 40)[:, :16], full)


def test_same_rows_in_a_subprocess() -> None:
    keys = torch.tensor([*EXTREME_KEYS, 12345, 678])
    script = (
        "import sys, torch\n"
        "from embcache.init import init_rows\n"
        f"keys = torch.tensor({[int(k) for k in keys]})\n"
        "for name in ('uniform', 'normal'):\n"
        "    sys.stdout.write(init_rows(name, 0.25, 77, keys, 12).numpy().tobytes().hex() + '\\n')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True,
                          timeout=120)
    lines = proc.stdout.split()
    assert lines[0] == init_rows("uniform", 0.25, 77, keys, 12).numpy().tobytes().hex()
    assert lines[1] == init_rows("normal", 0.25, 77, keys, 12).numpy().tobytes().hex()


@pytest.mark.parametrize("initializer", ["uniform", "normal"])
def test_different_seeds_and_keys_differ(initializer: str) -> None:
    keys = torch.arange(-5_000, 5_000)
    a = init_rows(initializer, 1.0, 0, keys, 8)
    b = init_rows(initializer, 1.0, 1, keys, 8)
    assert not torch.any(torch.all(a == b, dim=1))  # no row is the same under another seed
    assert torch.unique(a, dim=0).shape[0] == keys.numel()  # nor are two keys' rows alike
    assert torch.all(a.std(dim=1) > 0)  # nor are a row's columns
    # seeds are taken modulo 2**64
    assert torch.equal(init_rows(initializer, 1.0, -1, keys, 8), init_rows(initializer, 1.0, 2**64 - 1, keys, 8))


def test_extreme_keys() -> None:
    keys = torch.tensor(EXTREME_KEYS)
    for name in ("uniform", "normal"):
        rows = init_rows(name, 0.5, 3, keys, 32)
        assert rows.shape == (len(EXTREME_KEYS), 32)
        assert torch.isfinite(rows).all()
        assert torch.unique(rows, dim=0).shape[0] == len(EXTREME_KEYS)
    # int32 keys give the rows of the same int64 keys
    small = torch.tensor([-3, 0, 7, 2**31 - 1], dtype=torch.int32)
    assert torch.equal(init_rows("uniform", 0.5, 3, small, 8), init_rows("uniform", 0.5, 3, small.long(), 8))


def test_uniform_statistics() -> None:
    scale = 0.2
    x = init_rows("uniform", scale, 11, torch.arange(1_000), 100).double().flatten()  # 100k values
    assert x.min() >= -scale and x.max() < scale
    assert x.min() < -0.99 * scale and x.max() > 0.99 * scale
    n = x.numel()
    sd = scale / math.sqrt(3)
    assert abs(x.mean().item()) < 5 * sd / math.sqrt(n)
    assert abs(x.var().item() / sd**2 - 1) < 0.02
    hist = torch.histc(x, bins=10, min=-scale, max=scale)
    assert torch.all((hist - n / 10).abs() < 5 * math.sqrt(n / 10))


def test_normal_statistics() -> None:
    scale = 0.5
    x = init_rows("normal", scale, 12, torch.arange(1_000), 100).double().flatten() / scale
    n = x.numel()
    assert abs(x.mean().item()) < 5 / math.sqrt(n)
    assert abs(x.std().item() - 1) < 0.01
    assert abs(((x - x.mean()) ** 4).mean().item() - 3) < 0.1  # kurtosis of a normal
    within_1 = (x.abs() < 1).double().mean().item()
    within_2 = (x.abs() < 2).double().mean().item()
    assert abs(within_1 - 0.682689) < 0.006 and abs(within_2 - 0.954500) < 0.003
    assert x.abs().max() < 5.8  # 24-bit u1 bounds the radius at sqrt(48 ln 2) = 5.77


def test_zeros_and_dtypes() -> None:
    keys = _keys(50, 4)
    z = init_rows("zeros", 0.3, 1, keys, 8, torch.bfloat16)
    assert z.dtype == torch.bfloat16 and z.shape == (50, 8) and not z.any()
    for name in ("uniform", "normal"):
        full = init_rows(name, 0.3, 1, keys, 8)
        for dtype in (torch.float16, torch.bfloat16, torch.float64):
            rows = init_rows(name, 0.3, 1, keys, 8, dtype)
            assert rows.dtype == dtype
            assert torch.equal(rows, full.to(dtype))  # made in float32, rounded once
    assert init_rows("uniform", 0.3, 1, keys[:0], 8).shape == (0, 8)
    assert not init_rows("uniform", 0.0, 1, keys, 8).any()


def test_bad_arguments_raise() -> None:
    keys = torch.arange(4)
    with pytest.raises(ConfigError):
        init_rows("xavier", 0.1, 0, keys, 8)
    with pytest.raises(ConfigError):
        init_rows("uniform", -0.1, 0, keys, 8)
    with pytest.raises(ConfigError):
        init_rows("uniform", math.inf, 0, keys, 8)
    with pytest.raises(ConfigError):
        init_rows("uniform", 0.1, 0, keys, 0)
    with pytest.raises(ConfigError):
        init_rows("uniform", 0.1, 0, keys, 8, torch.int64)
    with pytest.raises(InvalidKeysError):
        init_rows("uniform", 0.1, 0, keys.double(), 8)
    with pytest.raises(InvalidKeysError):
        init_rows("uniform", 0.1, 0, keys.reshape(2, 2), 8)


def test_cuda_matches_cpu_bitwise() -> None:
    # Without a GPU the CUDA branch (its chunking, no device mixing) runs under the stand-in
    # (tests/fakecuda.py); only a real GPU shows its kernels' bits.
    keys = torch.cat([_keys(20_000, 5), torch.tensor(EXTREME_KEYS)])
    for name in INITIALIZERS:
        for dtype in (torch.float32, torch.bfloat16):
            cpu = init_rows(name, 0.07, 123, keys, 64, dtype)
            with contextlib.nullcontext() if torch.cuda.is_available() else fake_cuda():
                gpu = init_rows(name, 0.07, 123, keys.cuda(), 64, dtype)
                assert gpu.device.type == "cuda"
                assert torch.equal(gpu.cpu(), cpu), name
