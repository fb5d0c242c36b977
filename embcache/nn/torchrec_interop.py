"""TorchRec's types for :class:`~embcache.nn.CachedEmbeddingBagCollection`, duck-typed (torchrec is optional).

In: a ``KeyedJaggedTensor`` split into each feature's bags (:func:`kjt_features`). Out: a
torchrec ``KeyedTensor`` when torchrec is installed (:func:`keyed_output`). Configuration:
``EmbeddingBagConfig``s to the collection's features and pooling modes
(:func:`features_from_torchrec`) and back (:func:`bag_configs`), and to the cache's
TableConfigs (:func:`tables_from_torchrec`). Nothing here imports torchrec unless a
KeyedJaggedTensor comes in. See "TorchRec" in :mod:`embcache.nn`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import TableConfig
from ..errors import ConfigError, InvalidKeysError
from .bags import check_index_tensor
from .lookup import CacheLike, table_config

__all__ = [
    "EmbeddingBagConfigLike",
    "bag_configs",
    "features_from_torchrec",
    "is_kjt",
    "keyed_output",
    "kjt_features",
    "tables_from_torchrec",
]


class EmbeddingBagConfigLike(Protocol):
    """The fields of torchrec's ``EmbeddingBagConfig`` that embcache and torchrec's models read."""

    @property
    def name(self) -> str:
        """The table's name (the cache's table)."""
        ...

    @property
    def embedding_dim(self) -> int:
        """The table's dimension."""
        ...

    @property
    def feature_names(self) -> Sequence[str]:
        """The features that read the table."""
        ...

    @property
    def pooling(self) -> object:
        """torchrec's ``PoolingType`` (SUM or MEAN), or its name."""
        ...


# ---------------------------------------------------------------------- configuration
def features_from_torchrec(cache: CacheLike,
                           tables: Sequence[EmbeddingBagConfigLike]) -> tuple[dict[str, str], dict[str, str]]:
    """``({feature: table}, {feature: mode})`` of torchrec ``EmbeddingBagConfig``s over ``cache``'s tables.

    Raises:
        UnknownTableError: a table is not in the cache.
        ConfigError: a dimension differs from the cache's table, a feature is repeated, or a
            pooling is not SUM or MEAN.
    """
    features: dict[str, str] = {}
    modes: dict[str, str] = {}
    for cfg in tables:
        name, dim = cfg.name, cfg.embedding_dim
        pooling = str(getattr(cfg.pooling, "value", cfg.pooling)).lower()
        if pooling not in ("sum", "mean"):
            raise ConfigError(f"table {name!r}: pooling {cfg.pooling!r} is not offered; use SUM or MEAN")
        table_dim = table_config(cache, name).dim
        if table_dim != dim:
            raise ConfigError(f"table {name!r}: embedding_dim={dim} but the cache's table has dim={table_dim}")
        for f in cfg.feature_names:
            if f in features:
                raise ConfigError(f"feature {f!r} appears in tables {features[f]!r} and {name!r}")
            features[f], modes[f] = name, pooling
    return features, modes


@dataclass
class _TableView:
    """The fields of torchrec's EmbeddingBagConfig that its models read."""

    name: str
    embedding_dim: int
    feature_names: list[str]
    pooling: str
    num_embeddings: int = 0


def bag_configs(features: Mapping[str, str], modes: Mapping[str, str],
                table_dims: Mapping[str, int]) -> list[EmbeddingBagConfigLike]:
    """One EmbeddingBagConfig-like view per table: its features, pooling (its first feature's, upper case), dim."""
    return [_TableView(t, d, [f for f, ft in features.items() if ft == t],
                       modes[next(f for f, ft in features.items() if ft == t)].upper())
            for t, d in table_dims.items()]


def tables_from_torchrec(tables: Sequence[EmbeddingBagConfigLike], **options: Any) -> list[TableConfig]:
    """:class:`~embcache.TableConfig`s for torchrec ``EmbeddingBagConfig``s (name and dim; ``options`` the rest).

    E.g. ``tables_from_torchrec(configs, optimizer="adagrad", lr=0.01)``; the cache built on them
    serves :meth:`CachedEmbeddingBagCollection.from_torchrec` over the same configs.
    """
    return [TableConfig(name=cfg.name, dim=cfg.embedding_dim, **options) for cfg in tables]


# ---------------------------------------------------------------------- KeyedJaggedTensor in, KeyedTensor out
def is_kjt(batch: object) -> bool:
    """Whether ``batch`` looks like a torchrec KeyedJaggedTensor (duck-typed: torchrec is optional)."""
    if isinstance(batch, Mapping):
        return False
    has = [callable(getattr(batch, m, None)) for m in ("keys", "values", "lengths", "offsets")]
    return has[0] and has[1] and (has[2] or has[3])


def kjt_features(kjt: Any, wanted: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per wanted feature of a KeyedJaggedTensor: (values, offsets [B + 1] including the end, weights).

    ``kjt`` has ``keys()``, ``values()``, ``lengths()`` or ``offsets()``, and optionally
    ``weights_or_none()`` and ``stride_per_key()`` (see :func:`is_kjt`).
    """
    keys = list(kjt.keys())
    missing = [f for f in wanted if f not in keys]
    if missing:
        raise InvalidKeysError(f"the KeyedJaggedTensor lacks features {missing}; it has {keys}")
    values = check_index_tensor("values()", kjt.values(), "KeyedJaggedTensor ")
    weights = kjt.weights_or_none() if callable(getattr(kjt, "weights_or_none", None)) else None
    if callable(getattr(kjt, "lengths", None)):
        lengths = kjt.lengths()
    else:
        offsets = kjt.offsets()
        lengths = offsets[1:] - offsets[:-1]
    lengths = check_index_tensor("lengths()", lengths, "KeyedJaggedTensor ").to(torch.int64)
    if callable(getattr(kjt, "stride_per_key", None)):
        strides = [int(s) for s in kjt.stride_per_key()]
    else:
        if keys and lengths.numel() % len(keys):
            raise InvalidKeysError(f"KeyedJaggedTensor: {lengths.numel()} lengths do not split over {len(keys)} keys")
        strides = [lengths.numel() // len(keys)] * len(keys) if keys else []
    if sum(strides) != lengths.numel() or (lengths.numel() and bool((lengths < 0).any())):
        raise InvalidKeysError(f"KeyedJaggedTensor: lengths (shape {tuple(lengths.shape)}) do not match strides "
                               f"{strides} or are negative")
    per_key = lengths.split(strides)
    counts = torch.stack([p.sum() for p in per_key]).tolist() if per_key else []
    if sum(counts) != values.numel():
        raise InvalidKeysError(f"KeyedJaggedTensor: lengths sum to {sum(counts)} but there are {values.numel()} values")
    vals = values.split(counts)
    wts = weights.split(counts) if weights is not None else [None] * len(keys)
    out = {}
    for i, k in enumerate(keys):
        if k in wanted:
            off = torch.cat([per_key[i].new_zeros(1), per_key[i].cumsum(0)])
            out[k] = (vals[i], off, wts[i])
    return out


@functools.lru_cache(maxsize=1)
def _keyed_tensor_class() -> Any:
    """torchrec's KeyedTensor, or None when torchrec is not installed."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except ImportError:
        return None
    return KeyedTensor


def keyed_output(out: dict[str, torch.Tensor], dims: Mapping[str, int]) -> Any:
    """``out`` ({feature: [B, dim]}) as a torchrec ``KeyedTensor`` (keys in its order); without torchrec, ``out``."""
    keyed_tensor = _keyed_tensor_class()
    if keyed_tensor is None:
        return out
    return keyed_tensor(keys=list(out), length_per_key=[dims[f] for f in out],
                        values=torch.cat(list(out.values()), dim=1), key_dim=1)
