"""The torch modules of :mod:`embcache.nn`: CachedEmbedding, CachedEmbeddingBag, CachedEmbeddingBagCollection.

Each forward checks its batch and uniques its keys (:mod:`.bags`), looks their rows up as one
autograd node whose backward updates the cache (:mod:`.lookup`) and pools them (:mod:`.bags`).
Their tables' state_dict entry comes from :class:`~.state.TableStateModule`; TorchRec input,
output and configuration from :mod:`.torchrec_interop`. Here too: the modules' devices, copies
(``copy.deepcopy`` shares the cache) and ``torch.compile`` (their forwards are kept out of Dynamo
when the first module is built). The behaviour is described in :mod:`embcache.nn`'s docstring.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError, InvalidKeysError
from .bags import (
    FeatureInput,
    canonical_bags,
    check_index_tensor,
    check_mode,
    check_padding_idx,
    pool,
    unique_and_inverse,
    unpack_feature,
    with_padding_row,
)
from .lookup import CacheLike, Fetch, cached_rows, check_cache, table_config
from .state import DEFAULT_MAX_STATE_BYTES, TableStateModule
from .torchrec_interop import (
    EmbeddingBagConfigLike,
    bag_configs,
    features_from_torchrec,
    is_kjt,
    keyed_output,
    kjt_features,
)

__all__ = ["CachedEmbedding", "CachedEmbeddingBag", "CachedEmbeddingBagCollection"]


class _CacheModule(TableStateModule):
    """Base of the modules: holds the cache, which copies of the module share."""

    cache: CacheLike
    out_device: torch.device | None  # the ``device`` argument (None: the cache's device)

    def __init__(self, cache: CacheLike) -> None:
        super().__init__()
        _keep_out_of_compile()
        check_cache(cache)
        self.cache = cache

    def _init_device(self, device: torch.device | str | None) -> None:
        try:
            self.out_device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device={device!r} is not a torch device") from exc

    @property
    def output_device(self) -> torch.device:
        """Where outputs go: the ``device`` argument, else the cache's device."""
        return self.out_device if self.out_device is not None else self.cache.device

    def _rows(self, keys: dict[str, torch.Tensor], dims: Mapping[str, int], many: bool) -> list[torch.Tensor]:
        """Rows of each table's unique ``keys``, which backward updates when training with gradients on."""
        return cached_rows(Fetch(self.cache, keys, dims, many), self.training and torch.is_grad_enabled())

    def _device_repr(self) -> str:
        return f", device={str(self.out_device)!r}" if self.out_device is not None else ""

    def __deepcopy__(self, memo: dict[int, Any]) -> _CacheModule:
        # The table lives in the cache, and a cache (locks, an open store) cannot be copied:
        # copy.deepcopy(model) (EMA, SWA) gives a module over the same cache, like a shared table.
        memo[id(self.cache)] = self.cache
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


class CachedEmbedding(_CacheModule):
    """Like ``torch.nn.Embedding``, with the table in an embedding cache (see :mod:`embcache.nn`).

    ``forward(input)`` takes an int64/int32 tensor of keys of any shape and returns float32
    ``input.shape + (dim,)`` on :attr:`output_device` (``device``, else the cache's device).

    Args:
        cache: an :class:`~embcache.EmbeddingCache` or ``embcache.Client`` (anything :class:`CacheLike`).
        table: the table's name.
        padding_idx: a key whose output is a zero row and which is never looked up or updated;
            None (default) for none.
        device: where outputs go (the model's device); None (default): the cache's device.
        persist: what ``state_dict()`` holds of the table(s): "rows" (default), "checkpoint" or "none"
            (see "Checkpoints" in :mod:`embcache.nn`).
        checkpoint_dir: where persist="checkpoint" writes cache checkpoints.
        max_state_bytes: most record bytes persist="rows" puts in the state_dict (default 256 MiB).

    Raises:
        UnknownTableError: the cache has no table ``table``.
        ConfigError: ``padding_idx`` is not None or an int64; ``device`` is not a device; bad
            ``persist``/``checkpoint_dir``/``max_state_bytes``.
        TypeError: ``cache`` lacks the cache methods.
    """

    def __init__(self, cache: CacheLike, table: str, padding_idx: int | None = None,
                 device: torch.device | str | None = None, *,
                 persist: str = "rows", checkpoint_dir: str | os.PathLike[str] | None = None,
                 max_state_bytes: int = DEFAULT_MAX_STATE_BYTES) -> None:
        super().__init__(cache)
        self.table = table
        self.embedding_dim = table_config(cache, table).dim
        self.padding_idx = check_padding_idx(padding_idx)
        self._init_device(device)
        self._init_persist(persist, checkpoint_dir, max_state_bytes)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Rows of ``input``'s keys: float32 ``input.shape + (dim,)`` on :attr:`output_device`.

        Args:
            input: int64 or int32 keys, any shape (any int64 value is a key).

        Raises:
            TypeError: ``input`` is not a tensor.
            InvalidKeysError: ``input`` is not int64 or int32.
            The errors of the cache's ``lookup`` (nothing changed).
        """
        input = check_index_tensor("input", input, "")
        keys = input.reshape(-1).to(self.cache.device, torch.int64)
        ukeys, inverse = unique_and_inverse(keys, self.padding_idx)
        (rows,) = self._rows({self.table: ukeys}, {self.table: self.embedding_dim}, many=False)
        weight, pad = with_padding_row(rows, self.padding_idx)
        out = F.embedding(inverse, weight, padding_idx=pad)
        return out.reshape(*input.shape, self.embedding_dim).to(self.output_device)

    def _state_tables(self) -> list[str]:
        return [self.table]

    def extra_repr(self) -> str:
        """The table, its dimension and the padding key."""
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"table={self.table!r}, embedding_dim={self.embedding_dim}{pad}{self._device_repr()}"


class CachedEmbeddingBag(_CacheModule):
    """Like ``torch.nn.EmbeddingBag``, with the table in an embedding cache (see :mod:`embcache.nn`).

    ``forward(input, offsets=None, per_sample_weights=None)`` accepts what torch's does (1-D
    input with offsets, 2-D input of fixed-size bags, ``include_last_offset``, per-sample weights
    in mode "sum", empty bags giving zeros) and returns float32 [B, dim] on :attr:`output_device`,
    equal to torch's output for a table holding the cache's rows. The batch's keys are uniqued
    once, looked up with one ``cache.lookup``, pooled by ``torch.nn.functional.embedding_bag``
    and, in backward, updated with one ``cache.apply_gradients``.

    Args:
        cache: an :class:`~embcache.EmbeddingCache` or ``embcache.Client`` (anything :class:`CacheLike`).
        table: the table's name.
        mode: "sum", "mean" (default, as torch) or "max".
        include_last_offset: ``offsets`` has B + 1 entries, the last one the end of the last bag
            (torch's meaning); keys after it are ignored. Default False.
        padding_idx: a key excluded from every bag (and from "mean"'s count), never looked up or
            updated; None (default) for none. Unlike torch, a negative value is a key too.
        device: where outputs go (the model's device); None (default): the cache's device.
        persist: what ``state_dict()`` holds of the table(s): "rows" (default), "checkpoint" or "none"
            (see "Checkpoints" in :mod:`embcache.nn`).
        checkpoint_dir: where persist="checkpoint" writes cache checkpoints.
        max_state_bytes: most record bytes persist="rows" puts in the state_dict (default 256 MiB).

    Raises:
        UnknownTableError: the cache has no table ``table``.
        ConfigError: ``mode``, ``padding_idx`` or ``device`` is not allowed.
        TypeError: ``cache`` lacks the cache methods.
    """

    def __init__(self, cache: CacheLike, table: str, mode: str = "mean", include_last_offset: bool = False,
                 padding_idx: int | None = None, device: torch.device | str | None = None, *,
                 persist: str = "rows", checkpoint_dir: str | os.PathLike[str] | None = None,
                 max_state_bytes: int = DEFAULT_MAX_STATE_BYTES) -> None:
        super().__init__(cache)
        self.table = table
        self.embedding_dim = table_config(cache, table).dim
        self.mode = check_mode(mode)
        self.include_last_offset = bool(include_last_offset)
        self.padding_idx = check_padding_idx(padding_idx)
        self._init_device(device)
        self._init_persist(persist, checkpoint_dir, max_state_bytes)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled rows of each bag: float32 [B, dim] on :attr:`output_device`.

        Args:
            input: int64/int32 keys: [n] with ``offsets``, or [B, L] (B bags of L keys) without.
            offsets: int64/int32 [B] start of each bag in ``input`` ([B + 1] with
                ``include_last_offset``); must start at 0, not decrease and not pass n.
            per_sample_weights: floating, the shape of ``input``: each key's weight in its bag's
                sum (mode "sum" only); differentiable.

        Raises:
            TypeError, InvalidKeysError, NotImplementedError: see "Errors" in :mod:`embcache.nn`.
            The errors of the cache's ``lookup`` (nothing changed).
        """
        bags = canonical_bags(input, offsets, per_sample_weights, self.include_last_offset, self.mode,
                               self.cache.device, self.output_device)
        ukeys, inverse = unique_and_inverse(bags.keys, self.padding_idx)
        (rows,) = self._rows({self.table: ukeys}, {self.table: self.embedding_dim}, many=False)
        return pool(bags, inverse, rows, self.mode, self.padding_idx)

    def _state_tables(self) -> list[str]:
        return [self.table]

    def extra_repr(self) -> str:
        """The table, its dimension and the pooling options."""
        s = f"table={self.table!r}, embedding_dim={self.embedding_dim}, mode={self.mode!r}"
        if self.include_last_offset:
            s += ", include_last_offset=True"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + self._device_repr()


class CachedEmbeddingBagCollection(_CacheModule):
    """Pooled embeddings of several features, one cache round trip per forward and per backward.

    ``forward({feature: input})`` takes, per feature, a 2-D tensor of fixed-size bags,
    ``(input, offsets)`` or ``(input, offsets, per_sample_weights)`` (as
    :meth:`CachedEmbeddingBag.forward`), and returns ``{feature: float32 [B_f, dim]}`` in the
    order of ``features``, on :attr:`output_device` (``device``, else the cache's device). The
    keys of all features on one table are merged and uniqued once; all tables are looked up
    with one ``cache.lookup_many`` and, in backward, updated with one
    ``cache.apply_gradients_many``. Features sharing a table thus get one optimizer step with
    their summed gradient, as torch gives one ``nn.EmbeddingBag`` used for several inputs.

    Args:
        cache: an :class:`~embcache.EmbeddingCache` or ``embcache.Client`` (anything :class:`CacheLike`).
        features: feature name -> table name (several features may share a table), or a
            sequence of names that are both feature and table.
        mode: "sum" (default, as torchrec), "mean" or "max", for every feature.
        include_last_offset: every feature's offsets end with the end of its last bag. Default False.
        device: where outputs go (the model's device); None (default): the cache's device.
        persist: what ``state_dict()`` holds of the table(s): "rows" (default), "checkpoint" or "none"
            (see "Checkpoints" in :mod:`embcache.nn`).
        checkpoint_dir: where persist="checkpoint" writes cache checkpoints.
        max_state_bytes: most record bytes persist="rows" puts in the state_dict (default 256 MiB).

    Raises:
        UnknownTableError: a table is not in the cache.
        ConfigError: ``features`` is empty, repeats a name or is not a mapping of str to str;
            ``mode`` or ``device`` is not allowed.
        TypeError: ``cache`` lacks the cache methods.
    """

    def __init__(self, cache: CacheLike, features: Mapping[str, str] | Sequence[str],
                 mode: str | Mapping[str, str] = "sum", include_last_offset: bool = False,
                 device: torch.device | str | None = None, *,
                 persist: str = "rows", checkpoint_dir: str | os.PathLike[str] | None = None,
                 max_state_bytes: int = DEFAULT_MAX_STATE_BYTES) -> None:
        super().__init__(cache)
        if isinstance(features, Mapping):
            mapping = dict(features)
        elif isinstance(features, Sequence) and not isinstance(features, str):
            mapping = {f: f for f in features}
            if len(mapping) != len(features):
                raise ConfigError(f"features must be unique, got {list(features)}")
        else:
            raise ConfigError(f"features must be a mapping feature -> table or a sequence of names, "
                              f"got {type(features).__name__}")
        if not mapping:
            raise ConfigError("features must name at least one feature")
        bad = [(f, t) for f, t in mapping.items() if not isinstance(f, str) or not isinstance(t, str)]
        if bad:
            raise ConfigError(f"feature and table names must be strings, got {bad[:4]}")
        self.features: dict[str, str] = mapping
        if isinstance(mode, Mapping):
            if set(mode) != set(mapping):
                raise ConfigError(f"mode per feature must name exactly the features {sorted(mapping)}, "
                                  f"got {sorted(mode, key=repr)}")
            self.modes: dict[str, str] = {f: check_mode(mode[f]) for f in mapping}
        else:
            self.modes = dict.fromkeys(mapping, check_mode(mode))
        #: the pooling mode of every feature, or None when they differ (see ``modes``)
        self.mode: str | None = next(iter(self.modes.values())) if len(set(self.modes.values())) == 1 else None
        self.include_last_offset = bool(include_last_offset)
        self._init_device(device)
        self._init_persist(persist, checkpoint_dir, max_state_bytes)
        self.table_dims = {t: table_config(cache, t).dim for t in dict.fromkeys(mapping.values())}
        self.embedding_dims = {f: self.table_dims[t] for f, t in mapping.items()}
        self._torchrec_configs: list[EmbeddingBagConfigLike] | None = None

    @classmethod
    def from_torchrec(cls, cache: CacheLike, tables: Sequence[EmbeddingBagConfigLike],
                      device: torch.device | str | None = None, **options: Any) -> CachedEmbeddingBagCollection:
        """A collection configured like ``torchrec.EmbeddingBagCollection(tables=tables)``.

        Each ``EmbeddingBagConfig`` (anything with ``name``, ``embedding_dim``, ``feature_names``
        and ``pooling``) names a cache table (``name``, whose ``dim`` must equal
        ``embedding_dim``); its features read that table with its pooling (``PoolingType.SUM``
        or ``MEAN``). ``num_embeddings`` is ignored: keys are any int64, as everywhere in the
        cache (a key >= num_embeddings is a row like any other, where torchrec would fail).
        Outputs come in torchrec's order: the tables' feature names, table by table. ``options``
        go to the constructor (``persist``, ``checkpoint_dir``, ``max_state_bytes``).
        :func:`tables_from_torchrec` makes matching :class:`~embcache.TableConfig`s.

        Raises:
            UnknownTableError: a table is not in the cache.
            ConfigError: a dimension differs from the cache's table, a feature is repeated, or
                a pooling is not SUM or MEAN (``PoolingType.NONE``, unpooled, is not offered).
        """
        features, modes = features_from_torchrec(cache, tables)
        ebc = cls(cache, features, mode=modes, device=device, **options)
        ebc._torchrec_configs = list(tables)
        return ebc

    def embedding_bag_configs(self) -> list[EmbeddingBagConfigLike]:
        """The configs of torchrec's ``EmbeddingBagCollection.embedding_bag_configs()`` (DLRM reads them).

        Those passed to :meth:`from_torchrec`; else one per table with ``name``, ``embedding_dim``,
        ``feature_names``, ``pooling`` (upper case, the table's first feature's) and ``num_embeddings=0``.
        """
        if self._torchrec_configs is not None:
            return list(self._torchrec_configs)
        return bag_configs(self.features, self.modes, self.table_dims)

    def forward(self, batch: Mapping[str, FeatureInput] | Any) -> Any:
        """Pooled rows of each feature's bags, on :attr:`output_device`.

        Args:
            batch: either a mapping of every configured feature (and no other) to a 2-D input,
                ``(input, offsets)`` or ``(input, offsets, per_sample_weights)``; or a torchrec
                ``KeyedJaggedTensor`` (or any object with its ``keys()``, ``values()``,
                ``lengths()`` or ``offsets()`` and optionally ``weights_or_none()`` and
                ``stride_per_key()``) holding every configured feature (others are ignored, as
                torchrec's collection does), whose weights are the per-sample weights.

        Returns:
            For a mapping, ``{feature: float32 [B_f, dim]}`` in the order of ``features``. For a
            KeyedJaggedTensor, a torchrec ``KeyedTensor`` (keys: the features in that order,
            values float32 [B, sum of dims]) when torchrec is installed, else that same dict.

        Raises:
            TypeError, InvalidKeysError, NotImplementedError: see "Errors" in :mod:`embcache.nn`; messages
                name the feature.
            The errors of the cache's ``lookup_many`` (nothing changed).
        """
        device = self.cache.device
        keyed = is_kjt(batch)
        if keyed:
            parts = kjt_features(batch, list(self.features))
            bags = {f: canonical_bags(*parts[f], True, self.modes[f], device, self.output_device,
                                       prefix=f"feature {f!r}: ")
                    for f in self.features}
        else:
            if not isinstance(batch, Mapping):
                raise TypeError(f"batch must be a mapping feature -> input or a KeyedJaggedTensor, "
                                f"got {type(batch).__name__}")
            if set(batch) != set(self.features):
                missing = sorted(set(self.features) - set(batch))
                unknown = sorted(set(batch) - set(self.features), key=repr)
                raise InvalidKeysError(f"batch features must be exactly {sorted(self.features)}; "
                                       f"missing {missing}, unknown {unknown}")
            bags = {f: canonical_bags(*unpack_feature(f, batch[f]), self.include_last_offset, self.modes[f], device,
                                       self.output_device, prefix=f"feature {f!r}: ")
                    for f in self.features}
        ukeys: dict[str, torch.Tensor] = {}
        inverses: dict[str, torch.Tensor] = {}
        for table in self.table_dims:
            feats = [f for f, t in self.features.items() if t == table]
            keys = [bags[f].keys for f in feats]
            ukeys[table], inverse = torch.unique(torch.cat(keys) if len(keys) > 1 else keys[0], return_inverse=True)
            inverses.update(zip(feats, inverse.split([k.numel() for k in keys]), strict=True))
        rows = dict(zip(ukeys, self._rows(ukeys, self.table_dims, many=True), strict=True))
        out = {f: pool(bags[f], inverses[f], rows[t], self.modes[f]) for f, t in self.features.items()}
        return keyed_output(out, self.embedding_dims) if keyed else out

    def _state_tables(self) -> list[str]:
        return list(self.table_dims)

    def extra_repr(self) -> str:
        """The features, their tables and the pooling mode(s)."""
        mode = f"mode={self.mode!r}" if self.mode is not None else f"modes={self.modes!r}"
        return f"features={self.features!r}, {mode}{self._device_repr()}"


_compile_lock = threading.Lock()
_compile_disabled = False


def _keep_out_of_compile() -> None:
    """Wrap the modules' forwards in ``torch.compiler.disable`` (see "torch.compile" in :mod:`embcache.nn`).

    Done when the first module is built, not at import: ``torch.compiler.disable`` imports
    ``torch._dynamo`` (seconds), which ``import embcache`` (the server, the CLI) does not need.
    """
    global _compile_disabled
    with _compile_lock:
        if _compile_disabled:
            return
        for cls in (CachedEmbedding, CachedEmbeddingBag, CachedEmbeddingBagCollection):
            setattr(cls, "forward", torch.compiler.disable(cls.__dict__["forward"]))  # noqa: B010
        _compile_disabled = True

