"""Shared vocabulary: string enums for tiers, optimizers, initializers and stores."""

from __future__ import annotations

from enum import Enum, unique

from .errors import ConfigError

__all__ = ["Initializer", "Optimizer", "PolicyName", "StorageDtype", "StoreKind", "Tier", "memory_tier"]


@unique
class Tier(str, Enum):
    """Where a row lives: GPU memory, host memory or the on-disk store."""

    HBM = "hbm"
    DDR = "ddr"
    SSD = "ssd"


def memory_tier(tier: str) -> Tier:
    """``tier`` named as a memory tier, HBM or DDR (the tiers that hold rows by slot).

    Raises:
        ConfigError: any other value ("ssd" included).
    """
    if tier not in (Tier.HBM, Tier.DDR):
        raise ConfigError(f"tier must be 'hbm' or 'ddr', got {tier!r}")
    return Tier(tier)


@unique
class Optimizer(str, Enum):
    """Row optimizers applied in place by the cache."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"
    ROWWISE_ADAGRAD_MOMENTUM = "rowwise_adagrad_momentum"


@unique
class Initializer(str, Enum):
    """Lazy initializers: pure functions of (seed, key)."""

    UNIFORM = "uniform"
    NORMAL = "normal"
    ZEROS = "zeros"


@unique
class StoreKind(str, Enum):
    """Backends of the cold (SSD) tier."""

    ROCKSDB = "rocksdb"
    LMDB = "lmdb"


@unique
class PolicyName(str, Enum):
    """Named eviction policies (a callable may be given instead)."""

    LRFU = "lrfu"
    LFU = "lfu"
    LRU = "lru"


@unique
class StorageDtype(str, Enum):
    """Dtype the weights are stored in (optimizer state is always float32)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
