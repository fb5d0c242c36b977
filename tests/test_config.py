"""Every field of CacheConfig and TableConfig refuses a bad value with a ConfigError that names it.

A configuration comes from code, from a server's TOML or from the environment; a wrong type must
not pass as something else (a flag given as the string "false" would read as True) nor fail later
with a TypeError from deep inside the cache.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from embcache import CacheConfig, TableConfig
from embcache.errors import ConfigError

_BAD_CACHE: list[tuple[str, Any]] = [
    ("hbm_bytes", -1), ("hbm_bytes", 1.5), ("hbm_bytes", True), ("ddr_bytes", "1GiB"),
    ("store", "redis"), ("device", "tpu"), ("device", "not a device"), ("policy", "fifo"),
    ("halflife", 0), ("halflife", -1.0), ("halflife", math.inf), ("halflife", "long"), ("halflife", True),
    ("idle_halving", 0), ("idle_halving", math.nan), ("idle_halving", "off"),
    ("sketch_width", 8), ("sketch_width", 24), ("sketch_width", 16.0), ("sketch_width", "wide"),
    ("eviction_sample", 0), ("eviction_sample", 2.5), ("eviction_sample", True), ("eviction_sample", "16"),
    ("mrc_sample_rate", -0.1), ("mrc_sample_rate", 1.1), ("mrc_sample_rate", "0.1"),
    ("expiry_interval", 0), ("expiry_interval", math.inf), ("expiry_interval", True), ("expiry_interval", "60"),
    ("max_batch_keys", 0), ("max_batch_keys", 2.5), ("max_batch_keys", "1000"),
    ("admission", "false"), ("reject_nonfinite", 0), ("validate_memory", "no"), ("tune_policy", 1),
    ("lookups_create_rows", None), ("store_options", 5), ("store_options", [("block_cache_bytes", 1)]),
    ("path", ""), ("path", 5),
]


@pytest.mark.parametrize(("field", "value"), _BAD_CACHE, ids=[f"{f}={v!r}" for f, v in _BAD_CACHE])
def test_cache_config_refuses_a_bad_value_by_name(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"CacheConfig.{field}"):
        CacheConfig(**({"validate_memory": False} | {field: value}))


_BAD_TABLE: list[tuple[str, Any]] = [
    ("name", ""), ("name", 5), ("name", "x" * 129), ("dim", 0), ("dim", True), ("dim", 2.0), ("dim", 70_000),
    ("optimizer", "lamb"), ("initializer", "xavier"), ("dtype", "int8"),
    ("lr", 0), ("lr", -0.1), ("lr", math.nan), ("lr", "0.1"), ("eps", -1.0), ("eps", math.inf),
    ("beta1", 1.0), ("beta2", -0.1), ("weight_decay", -1.0), ("initial_accumulator_value", -1.0),
    ("memory_share", 0), ("init_scale", -1.0), ("init_scale", math.nan), ("seed", 2**63), ("seed", True),
    ("admit_after", -1), ("admit_after", True), ("unadmitted", "random"),
    ("ttl_steps", -1), ("ttl_steps", 1.5), ("ttl_seconds", -1), ("ttl_seconds", math.inf), ("ttl_seconds", True),
    ("stochastic_rounding", 1),
]


@pytest.mark.parametrize(("field", "value"), _BAD_TABLE, ids=[f"{f}={v!r}" for f, v in _BAD_TABLE])
def test_table_config_refuses_a_bad_value_by_name(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        TableConfig(**{"name": "t", "dim": 8, field: value})


def test_stochastic_rounding_needs_a_narrow_dtype() -> None:
    with pytest.raises(ConfigError, match="stochastic_rounding"):
        TableConfig(name="t", dim=8, stochastic_rounding=True)
    assert TableConfig(name="t", dim=8, dtype="bfloat16", stochastic_rounding=True).stochastic_rounding


def test_numpy_numbers_are_numbers() -> None:
    """Sizes computed with numpy (a common case: rows x row bytes) are accepted as they are."""
    cfg = CacheConfig(hbm_bytes=np.int64(1 << 20), ddr_bytes=np.int64(0), eviction_sample=np.int32(8),
                      max_batch_keys=np.int64(4096), halflife=np.float64(1e6), mrc_sample_rate=np.float32(0.5),
                      validate_memory=False)
    assert cfg.hbm_bytes == 1 << 20 and cfg.eviction_sample == 8 and cfg.max_batch_keys == 4096


def test_table_config_round_trips_and_refuses_unknown_fields() -> None:
    t = TableConfig(name="t", dim=16, optimizer="adam", dtype="float16", admit_after=3, ttl_steps=100)
    assert TableConfig.from_dict(t.to_dict()) == t
    with pytest.raises(ConfigError, match="unknown TableConfig fields"):
        TableConfig.from_dict({**t.to_dict(), "dims": 16})
