"""Stochastic rounding of updated low-precision rows (embcache/rounding.py, TableConfig.stochastic_rounding)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.errors import ConfigError
from embcache.init import init_rows
from embcache.optim import OptimizerParams, apply_update, initial_state, torch_update
from embcache.rounding import stochastic_round, to_storage, uniforms
from embcache.rpc.codec import table_from_proto, table_to_proto

LOW = [torch.bfloat16, torch.float16]


def _ulp_above_one(dtype: torch.dtype) -> float:
    return 2.0 ** -(7 if dtype == torch.bfloat16 else 10)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased_where_round_to_nearest_is_not(dtype: torch.dtype, sign: float) -> None:
    n, frac = 40_000, 0.3
    ulp = _ulp_above_one(dtype)
    x = torch.full((n, 1), sign * (1.0 + frac * ulp))  # 0.3 of the way from 1 to the next value up
    got = to_storage(x, dtype, True, 7, torch.arange(n), 0)
    assert got.dtype == dtype
    values = got.double()
    # every result is one of the two neighbours, each as often as its distance says
    assert set(values.flatten().tolist()) == {sign * 1.0, sign * (1.0 + ulp)}
    sigma = ulp * math.sqrt(frac * (1 - frac) / n)
    bias = abs(values.mean().item() - x.double().mean().item())
    assert bias < 5 * sigma
    # round to nearest is off by 0.3 of a step, about 60 sigma
    rtn_bias = abs(x.to(dtype).double().mean().item() - x.double().mean().item())
    assert rtn_bias == pytest.approx(frac * ulp, rel=1e-3)
    assert rtn_bias > 50 * sigma


def test_unbiased_over_a_spread_of_values_and_steps() -> None:
    # values over many binades (and float16's subnormals), each rounded at 64 steps: the mean of
    # the roundings tracks the value within the statistical bound of its own gap
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(512, 4, generator=gen) * torch.logspace(-6, 2, 512).unsqueeze(1)).float()
    keys = torch.arange(512)
    for dtype in LOW:
        acc = torch.zeros_like(x, dtype=torch.float64)
        steps = 64
        for step in range(steps):
            acc += to_storage(x, dtype, True, 3, keys, step).double()
        mean = acc / steps
        near = x.to(dtype)
        other = torch.nextafter(near, torch.where(x > near.float(), torch.tensor(math.inf, dtype=dtype),
                                                  torch.tensor(-math.inf, dtype=dtype)))
        gap = (other.double() - near.double()).abs()
        assert bool(((mean - x.double()).abs() <= 5 * gap * 0.5 / math.sqrt(steps) + 1e-30).all())


def test_representable_and_nonfinite_values_are_kept() -> None:
    u = torch.rand(1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for dtype in LOW:
        x = torch.tensor([[1.0, 0.0, -2.5, float("inf"), float("-inf"), 1e6]])
        got = stochastic_round(x, dtype, u)
        assert got[0, :5].tolist() == [1.0, 0.0, -2.5, math.inf, -math.inf]
        assert got[0, 5].item() == x.to(dtype)[0, 5].item()  # beyond (or at) the range: as the cast
        assert math.isnan(stochastic_round(torch.tensor([[math.nan]]), dtype, u[:, :1]).item())


def test_draws_are_a_function_of_seed_key_step_and_column_only() -> None:
    keys = torch.tensor([5, -(2**63), 2**63 - 1, 5])
    state = torch.get_rng_state()
    a = uniforms(9, keys, 4, 3)
    assert torch.equal(torch.get_rng_state(), state)  # the user's generator is not drawn from
    assert torch.equal(a, uniforms(9, keys, 4, 3))
    assert torch.equal(a[0], a[3])  # same key, same draws, wherever it is in the batch
    assert torch.equal(a[1:3], uniforms(9, keys[1:3], 4, 3))
    for other in (uniforms(10, keys, 4, 3), uniforms(9, keys, 5, 3), uniforms(9, keys + 1, 4, 3)):
        assert not torch.equal(a, other)
    assert bool(((a >= 0) & (a < 1)).all()) and a[0, 0] != a[0, 1]


def test_config_rejects_stochastic_rounding_without_low_precision() -> None:
    with pytest.raises(ConfigError, match="stochastic_rounding"):
        TableConfig(name="t", dim=4, stochastic_rounding=True)
    with pytest.raises(ConfigError, match="stochastic_rounding"):
        TableConfig(name="t", dim=4, dtype="bfloat16", stochastic_rounding=1)  # type: ignore[arg-type]
    cfg = TableConfig(name="t", dim=4, dtype="float16", stochastic_rounding=True)
    assert table_from_proto(table_to_proto(cfg)) == cfg
    assert not table_from_proto(table_to_proto(TableConfig(name="t", dim=4))).stochastic_rounding


DIM = 8
KEYS = 24


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for _ in range(steps):
        keys = torch.randint(0, KEYS, (16,), generator=gen)
        out.append((keys, torch.randn(16, DIM, generator=gen) * 0.05))
    return out


def _reference(cfg: TableConfig, batches: list[tuple[torch.Tensor, torch.Tensor]], update: object) -> torch.Tensor:
    """Rows of keys 0..KEYS-1 after ``batches``, the whole table as plain tensors."""
    keys = torch.arange(KEYS)
    w = init_rows(cfg.initializer, float(cfg.init_scale or 0), cfg.seed, keys, DIM).to(cfg.torch_dtype)
    s = initial_state(cfg.optimizer, DIM, KEYS, torch.device("cpu"))
    params = OptimizerParams(lr=cfg.lr, eps=float(cfg.eps or 0), beta1=cfg.beta1, beta2=cfg.beta2)
    for step, (k, g) in enumerate(batches):
        uk, inv = torch.unique(k, return_inverse=True)
        gsum = torch.zeros(uk.numel(), DIM).index_add_(0, inv, g)
        nw, ns = update(cfg.optimizer, params, w[uk].float(), s[uk], gsum)  # type: ignore[operator]
        w[uk] = to_storage(nw, cfg.torch_dtype, True, cfg.seed, uk, step)
        s[uk] = ns
    return w


def _train(tmp: Path, cfg: TableConfig, hbm_rows: int, ddr_rows: int,
           batches: list[tuple[torch.Tensor, torch.Tensor]], reopen_at: int | None = None,
           restore: bool = False) -> torch.Tensor:
    """Rows of keys 0..KEYS-1 trained through a cache; at ``reopen_at`` it is closed and opened again
    (with ``restore``: checkpointed, closed and restored into another path and backend)."""
    from .conftest import row_bytes

    rb = row_bytes(DIM, cfg.optimizer)
    config = CacheConfig(hbm_bytes=hbm_rows * rb, ddr_bytes=ddr_rows * rb, path=str(tmp / "a"))
    cache = EmbeddingCache(config, [cfg])
    try:
        for i, (k, g) in enumerate(batches):
            if i == reopen_at and restore:
                cache.checkpoint(tmp / "ckpt")
                cache.close()
                other = dataclasses.replace(config, path=str(tmp / "b"), store="lmdb")
                cache = EmbeddingCache.restore(tmp / "ckpt", other)
            elif i == reopen_at:
                cache.close()
                cache = EmbeddingCache(config)
            cache.lookup(cfg.name, k)
            cache.apply_gradients(cfg.name, k, g)
        return cache.lookup(cfg.name, torch.arange(KEYS)).to("cpu", cfg.torch_dtype)
    finally:
        cache.close()


@pytest.mark.parametrize(("optimizer", "dtype"), [("rowwise_adagrad_momentum", "bfloat16"), ("sgd", "float16")])
def test_rows_round_alike_in_every_tier_and_match_the_reference(tmp_path: Path, optimizer: str, dtype: str) -> None:
    cfg = TableConfig(name="t", dim=DIM, optimizer=optimizer, lr=0.02, seed=5, dtype=dtype, stochastic_rounding=True)
    batches = _batches(12)
    # every row in HBM (the in-place update), in DDR only, and none in memory (staged from the store)
    got = [_train(tmp_path / name, cfg, h, d, batches) for name, h, d in
           (("hbm", 4 * KEYS, 0), ("ddr", 0, 4 * KEYS), ("store", 0, 0), ("mixed", 3, 5))]
    for other in got[1:]:
        assert torch.equal(got[0], other)
    # the cache's CPU update (the numba kernel) rounds as the plain-tensor reference with that
    # same kernel, and, for sgd, whose kernel is bitwise torch's, as the torch-op update (the GPU path)
    assert torch.equal(got[0], _reference(cfg, batches, apply_update))
    if optimizer == "sgd":
        assert torch.equal(got[0], _reference(cfg, batches, torch_update))
    # and the rounding is not round-to-nearest
    rtn = _train(tmp_path / "rtn", TableConfig(**{**cfg.to_dict(), "stochastic_rounding": False}), 0, 0, batches)
    assert not torch.equal(got[0], rtn)


def test_a_reopened_or_restored_cache_rounds_as_an_unbroken_run(tmp_path: Path) -> None:
    cfg = TableConfig(name="t", dim=DIM, optimizer="sgd", lr=0.02, seed=5, dtype="bfloat16", stochastic_rounding=True)
    batches = _batches(10)
    unbroken = _train(tmp_path / "a", cfg, 8, 8, batches)
    assert torch.equal(unbroken, _train(tmp_path / "b", cfg, 8, 8, batches, reopen_at=5))
    assert torch.equal(unbroken, _train(tmp_path / "c", cfg, 8, 8, batches, reopen_at=5, restore=True))


def test_bfloat16_training_tracks_float32_more_closely_with_stochastic_rounding(tmp_path: Path) -> None:
    """A small deterministic task (rows pulled towards targets by SGD at a small rate, the regime
    where round-to-nearest loses updates smaller than half a bfloat16 step): the bf16 rows with
    stochastic rounding stay near the float32 run's, those rounded to nearest stall far from it."""
    tables = [TableConfig(name=n, dim=DIM, optimizer="sgd", lr=0.01, seed=3, dtype=dt, stochastic_rounding=sr,
                          init_scale=1.0) for n, dt, sr in (("f32", "float32", False), ("rtn", "bfloat16", False),
                                                            ("sr", "bfloat16", True))]
    keys = torch.arange(128)
    target = torch.randn(128, DIM, generator=torch.Generator().manual_seed(0)) * 2
    with EmbeddingCache(CacheConfig(hbm_bytes=1 << 20, ddr_bytes=0, path=str(tmp_path)), tables) as cache:
        target = target.to(cache.device)  # the hot tier's device: CUDA where there is one
        for _ in range(200):
            for t in tables:
                cache.apply_gradients(t.name, keys, cache.lookup(t.name, keys) - target)
        w = {t.name: cache.lookup(t.name, keys) for t in tables}
    rms = {n: (w[n] - w["f32"]).pow(2).mean().sqrt().item() for n in ("rtn", "sr")}
    assert rms["sr"] < rms["rtn"] / 4, rms
