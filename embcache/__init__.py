"""embcache: a hierarchical (HBM / DDR / SSD) embedding cache for training recommendation models.

>>> from embcache import EmbeddingCache, CacheConfig, TableConfig
>>> cache = EmbeddingCache(CacheConfig(path="./data"), tables=[TableConfig(name="user", dim=64)])
"""

from . import nn
from ._version import version as _version
from .cache import EmbeddingCache
from .client import Client
from .config import CacheConfig, TableConfig
from .errors import (
    BatchTooLargeError,
    CacheClosedError,
    CheckpointExistsError,
    ConfigError,
    EmbcacheError,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    NonFiniteGradientError,
    PassStateError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    TableConflictError,
    UnknownTableError,
)
from .keyset import Keyset
from .prefetch import LookAhead, PrefetchFuture
from .rpc.errors import DataLossError, ShardRestartedError
from .types import Initializer, Optimizer, PolicyName, StoreKind, Tier

__version__ = _version()

__all__ = [
    "BatchTooLargeError",
    "CacheClosedError",
    "CacheConfig",
    "CheckpointExistsError",
    "Client",
    "ConfigError",
    "DataLossError",
    "EmbcacheError",
    "EmbeddingCache",
    "Initializer",
    "InvalidGradientError",
    "InvalidKeysError",
    "InvalidRowsError",
    "Keyset",
    "LookAhead",
    "NonFiniteGradientError",
    "Optimizer",
    "PassStateError",
    "PolicyName",
    "PrefetchFuture",
    "ShardRestartedError",
    "StoreError",
    "StoreFullError",
    "StoreKind",
    "StoreLockedError",
    "TableConfig",
    "TableConflictError",
    "Tier",
    "UnknownTableError",
    "nn",
]
