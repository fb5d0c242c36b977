"""embcache: a hierarchical (HBM / DDR / SSD) embedding cache for training recommendation models.

>>> from embcache import EmbeddingCache, CacheConfig, TableConfig
>>> cache = EmbeddingCache(CacheConfig(path="./data"), tables=[TableConfig(name="user", dim=64)])

The embedded cache needs only the core install; :class:`Client` and the fleet's errors
(``DataLossError``, ``ShardRestartedError``) need gRPC, ``pip install 'embcache[server]'``, and are
imported on first use, so ``import embcache`` works without it.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import nn
from ._extras import missing_extra
from ._version import version as _version
from .cache import EmbeddingCache
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
from .types import Initializer, Optimizer, PolicyName, StoreKind, Tier

if TYPE_CHECKING:
    from .client import Client
    from .rpc.errors import DataLossError, ShardRestartedError

__version__ = _version()

# The names that need the server extra (gRPC): imported by __getattr__ on first use.
_SERVER_NAMES = {"Client": ".client", "DataLossError": ".rpc.errors", "ShardRestartedError": ".rpc.errors"}


def __getattr__(name: str) -> Any:
    module = _SERVER_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module, __name__), name)
    except ImportError as exc:
        err = missing_extra(exc, f"embcache.{name}")
        if err is exc:
            raise
        raise err from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_SERVER_NAMES])


__all__ = [
    "BatchTooLargeError",
    "CacheClosedError",
    "CacheConfig",
    "CheckpointExistsError",
    "ConfigError",
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
# `from embcache import *` takes the server's names only where the server extra is installed.
if importlib.util.find_spec("grpc") is not None:
    __all__ += ["Client", "DataLossError", "ShardRestartedError"]
