"""Torch modules whose embedding tables live in an embedding cache (embedded or remote).

``CachedEmbedding``, ``CachedEmbeddingBag`` and ``CachedEmbeddingBagCollection`` behave like
``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` / torchrec's ``EmbeddingBagCollection``, but
hold no copy of the table: every forward looks up the batch's unique keys in the cache, and
every backward hands their gradients to the cache, which applies the table's own optimizer
(the one in its :class:`~embcache.TableConfig`) in place.

Fused backward-optimizer. This is the design of FBGEMM's table-batched embeddings (TBE): the
optimizer step of the embedding rows happens *inside* ``loss.backward()``. Consequences:

* There is no ``optimizer.step()`` for the embeddings and ``zero_grad()`` does not concern them;
  the modules have no parameters (``list(m.parameters()) == []``). A torch optimizer still steps
  the dense part of the model. Their ``state_dict()`` entry holds the rows (see "Checkpoints").
* Each backward is one step. Gradient accumulation over micro-batches (several backwards before
  one ``step``) steps each time; so does a second backward through a retained graph.
* A table used by two modules (or one module called twice) in one step gets one optimizer step
  per backward node, each with its own gradient. For SGD that equals torch's single step with
  the summed gradient (up to rounding); for stateful optimizers (AdaGrad, Adam) it does not.
  :class:`CachedEmbeddingBagCollection` merges the features of a table into one lookup and one
  update, which is exactly torch's summed gradient.
* Every key a bag refers to is updated, with a zero gradient where the pooling gives it none
  (max mode, zero per-sample weights), as torch's sparse gradient lists every looked-up index;
  for SGD and AdaGrad a zero gradient changes nothing, Adam's moments decay. Keys equal to
  ``padding_idx``, and keys after the last offset with ``include_last_offset=True``, are not
  looked up at all.

Updates happen only when the module is in training mode and gradients are enabled. Under
``torch.no_grad()``/``torch.inference_mode()`` or after ``module.eval()`` the lookups still
happen (and count in the cache's statistics), the outputs do not require grad, and nothing is
applied.

Devices. Rows come back on ``cache.device``; keys are uniqued and bags pooled there. Outputs
are on the device where the model computes: the module's ``device`` argument when given, else
``cache.device`` (TorchRec's rule: a collection returns on the module's device, wherever its
input was). Inputs may be on the host or on that device: a data loader's host tensors need no
copy. A remote ``embcache.Client`` returns rows on the CPU, so a module over one that feeds a
CUDA model takes ``device="cuda"``. Gradients flow back across the copy to the cache.

Copies. ``copy.deepcopy`` of a module (or of a model holding one) shares the cache, so the copy
reads and trains the same table; ``module.to(device)`` changes nothing (there is nothing to move).
The modules cannot be pickled with the cache; save their ``state_dict()`` (see "Checkpoints").

Checkpoints. Each module's ``state_dict()`` has one entry, ``<prefix>._extra_state`` (torch's key
for non-tensor state), for its tables (a collection: all of its tables), so a training script
that does ``torch.save(model.state_dict())`` and later ``model.load_state_dict(torch.load(...))``
(``weights_only`` loading works) resumes with the same rows. The ``persist`` argument says what
the entry holds:

* ``"rows"`` (default): the stored rows themselves, whole (keys, weights with the optimizer state,
  access frequencies), exported from the cache (dirty rows are written back first). For tables
  up to ``max_state_bytes`` (default 256 MiB of records, all of the module's tables together);
  above it the entry holds no rows and ``state_dict()`` warns (``RuntimeWarning``).
* ``"checkpoint"`` with ``checkpoint_dir``: ``state_dict()`` writes a consistent cache checkpoint
  (``cache.checkpoint``, all tables) to a new ``checkpoint_dir/embcache-<time>-<id>`` and the
  entry names it by its absolute path; modules sharing a cache share one checkpoint per
  ``state_dict()`` call. Old checkpoints are not deleted. For tables of any size.
* ``"none"``: no entry (the cache persists itself with ``flush``/``checkpoint``/``restore``).

``load_state_dict`` makes the module's tables in its cache hold exactly the saved rows: it
imports them (``import_rows``) and deletes stored rows the saved cache did not have (a later
lookup creates them from the initializer, as the saved cache would). The tables must have the
saved layout (dim, optimizer, dtype, initializer, seed), else it fails; an entry missing from the
state_dict is a missing key (strict loading fails, ``strict=False`` reports it). A remote
``embcache.Client`` can neither export nor import rows: ``persist="rows"`` warns on save and load
that the rows are not in the state_dict, ``persist="checkpoint"`` makes the servers checkpoint
(``Client.checkpoint``; the entry lists their directories) and warns that resuming means
restarting the servers from those directories; ``persist="none"`` silences this.

TorchRec. :class:`CachedEmbeddingBagCollection` stands in for torchrec's ``EmbeddingBagCollection``
(torchrec is optional; nothing here imports it unless a KeyedJaggedTensor comes in):

* Input: a ``KeyedJaggedTensor``, duck-typed (``keys()``, ``values()``, ``lengths()`` or
  ``offsets()``, optionally ``weights_or_none()`` as per-sample weights and ``stride_per_key()``
  for variable batch sizes per feature), or the mapping ``{feature: input}`` as before. Features
  of the KJT that the collection does not have are ignored (torchrec's rule).
* Output follows the input: a mapping gives ``{feature: tensor}`` (as always); a KJT gives a
  torchrec ``KeyedTensor`` (keys in the collection's feature order) when torchrec is installed,
  else that same dict.
* Configuration: :meth:`CachedEmbeddingBagCollection.from_torchrec` takes torchrec's
  ``EmbeddingBagConfig``s (``name`` is the cache table, ``embedding_dim`` must be its dim,
  ``feature_names`` and per-table ``pooling`` SUM or MEAN are kept, ``num_embeddings`` is ignored:
  keys are any int64) and :meth:`~CachedEmbeddingBagCollection.embedding_bag_configs` gives them
  back, which torchrec's DLRM reads; :func:`tables_from_torchrec` makes the cache's TableConfigs.

torch.compile. The modules' ``forward`` is wrapped in ``torch.compiler.disable`` (when the first
module is built: that imports ``torch._dynamo``, which ``import embcache`` avoids): Dynamo does not
trace into it (it would reach the store's numpy code and the data-dependent ``torch.unique``)
and makes a graph break there instead, so a model holding the modules compiles with any backend
(inductor by default) and its dense layers are compiled, while the cache calls run eagerly.
Their autograd node is an ordinary one in the middle of the compiled graphs, so
``loss.backward()`` still hands the gradients to the cache. Training is the same as in eager
mode (tests/test_nn_compile.py). The lookup is not a ``torch.library`` custom op on purpose: its
output size depends on the batch's unique keys and its backward has a side effect (the optimizer
step in the cache) that an op returning nothing would have to keep from being pruned; the graph
break costs one Python call per module and forward, next to a cache round trip.

Errors (raised before anything is looked up, so a bad batch changes nothing):

* ``TypeError``: input, offsets or per_sample_weights is not a tensor (or None where allowed).
* :class:`~embcache.errors.InvalidKeysError` (a ``ValueError``): bad dtype or shape of input,
  offsets or per_sample_weights; offsets not starting at 0, decreasing or past the input's
  length; offsets given with a 2-D input or missing with a 1-D one; a collection batch whose
  features are not the configured ones. torch raises ``ValueError`` for the shape errors its
  Python layer checks and ``RuntimeError`` for the rest; here it is one type throughout.
* ``NotImplementedError``: per_sample_weights with mode "mean" or "max", with torch's own message,
  so code written for ``torch.nn.EmbeddingBag`` catches the same type.
* At construction: :class:`~embcache.errors.UnknownTableError` (a ``KeyError``) for a table
  the cache does not have, :class:`~embcache.errors.ConfigError` (a ``ValueError``) for a bad
  mode, padding_idx or feature mapping, ``TypeError`` for an object that is not a cache.
* Errors of the cache itself (e.g. ``NonFiniteGradientError`` from a NaN loss) surface from
  ``forward`` or ``loss.backward()`` unchanged; the cache applies nothing then.

Differences from torch, on purpose: keys are any int64 (there is no ``num_embeddings`` and no
index-out-of-range error); ``padding_idx`` is a key value (a negative one is a key, not an
index counted from the end); a 2-D input with zero columns gives empty bags (zeros) where torch
fails; per_sample_weights of any floating dtype are cast to float32 (torch wants the weight's
dtype); with ``include_last_offset=True``, keys after the last offset belong to no bag in every
mode (torch's "sum" ignores them, but its "mean" counts them and its "max" pools them into the
last bag); ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are not offered.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import CacheConfig, TableConfig
from .errors import ConfigError, InvalidKeysError, UnknownTableError
from .fused import segment_sum

__all__ = [
    "MODES",
    "PERSIST",
    "CacheLike",
    "CachedEmbedding",
    "CachedEmbeddingBag",
    "CachedEmbeddingBagCollection",
    "FeatureInput",
    "tables_from_torchrec",
]

#: Pooling modes of the bag modules (torch's).
MODES: tuple[str, ...] = ("sum", "mean", "max")

#: What a module's ``state_dict()`` holds of its tables (the ``persist`` argument): see "Checkpoints".
PERSIST: tuple[str, ...] = ("rows", "checkpoint", "none")

#: The state_dict key (after the module's prefix) of a module's tables: torch's name for non-tensor state.
STATE_KEY = "_extra_state"
_STATE_FORMAT = 1
_IMPORT_ROWS = 1 << 16
#: Default ``max_state_bytes``: above it, persist="rows" leaves the rows out of the state_dict (and warns).
DEFAULT_MAX_STATE_BYTES = 256 << 20  # rows per import_rows/delete_rows call on load

_INDEX_DTYPES = (torch.int32, torch.int64)
_CACHE_METHODS = ("lookup", "apply_gradients", "lookup_many", "apply_gradients_many", "tables", "device")

#: One feature of a collection batch: a 2-D input (fixed-size bags), ``(input, offsets)`` or
#: ``(input, offsets, per_sample_weights)``.
FeatureInput = (
    torch.Tensor
    | tuple[torch.Tensor, torch.Tensor | None]
    | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
)


class CacheLike(Protocol):
    """What the modules need of a cache: :class:`~embcache.EmbeddingCache` or ``embcache.Client``."""

    @property
    def device(self) -> torch.device:
        """Device the looked-up rows are returned on."""
        ...

    def tables(self) -> Mapping[str, TableConfig]:
        """The cache's tables by name."""
        ...

    def lookup(self, table: str, keys: torch.Tensor, /) -> torch.Tensor:
        """Rows of ``keys`` (int64 [n]): float32 [n, dim] on ``device``."""
        ...

    def apply_gradients(self, table: str, keys: torch.Tensor, grads: torch.Tensor, /) -> None:
        """Apply the table's optimizer to the rows of ``keys`` with ``grads`` float32 [n, dim]."""
        ...

    def lookup_many(self, keys: Mapping[str, torch.Tensor], /) -> Mapping[str, torch.Tensor]:
        """Rows of several tables in one call: ``{table: keys [n]} -> {table: float32 [n, dim]}``."""
        ...

    def apply_gradients_many(self, updates: Mapping[str, tuple[torch.Tensor, torch.Tensor]], /) -> None:
        """Apply gradients to several tables in one call: ``{table: (keys [n], grads [n, dim])}``."""
        ...


if TYPE_CHECKING:
    from .cache import EmbeddingCache

    def _embedded_cache_is_cache_like(cache: EmbeddingCache) -> CacheLike:  # checked by mypy only
        return cache


# ---------------------------------------------------------------------- construction helpers
def _check_cache(cache: Any) -> None:
    """Reject an object lacking the cache methods (duck-typed, so proxies and clients pass)."""
    missing = [m for m in _CACHE_METHODS if not hasattr(cache, m)]
    if missing:
        raise TypeError(f"cache must be an EmbeddingCache or embcache.Client; {type(cache).__name__} lacks {missing}")


def _table_config(cache: CacheLike, table: str) -> TableConfig:
    """The config of ``table``; UnknownTableError if the cache does not serve it."""
    tables = cache.tables()
    if not isinstance(table, str) or table not in tables:
        raise UnknownTableError(f"unknown table {table!r}; tables: {sorted(tables)}")
    return tables[table]


def _check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} is not allowed; choose one of {', '.join(repr(m) for m in MODES)}")
    return str(mode)


def _check_padding_idx(padding_idx: Any) -> int | None:
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or not -(2**63) <= padding_idx < 2**63:
        raise ConfigError(f"padding_idx={padding_idx!r}: must be None or an int64 key")
    return padding_idx


# ---------------------------------------------------------------------- batch helpers
def _check_index_tensor(what: str, value: Any, prefix: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{prefix}{what} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in _INDEX_DTYPES:
        raise InvalidKeysError(f"{prefix}{what} must be an int64 or int32 tensor, got dtype {value.dtype}")
    return value


@dataclass
class _Bags:
    """One batch of bags in canonical form, on the cache's device."""

    keys: torch.Tensor  # int64 [n]: the keys of all bags (keys in no bag dropped)
    offsets: torch.Tensor  # int64 [B + 1]: bag b is keys[offsets[b]:offsets[b + 1]]; offsets[B] == n
    weights: torch.Tensor | None  # float32 [n] per-sample weights
    out_device: torch.device  # where the output goes (the module's device, see the module docstring)
    single: bool = False  # every bag holds exactly one key (a [B, 1] input)


def _canonical_bags(input: Any, offsets: Any, per_sample_weights: Any, include_last_offset: bool, mode: str,
                    device: torch.device, out_device: torch.device, prefix: str = "") -> _Bags:
    """Validate a bag batch as torch.nn.EmbeddingBag would and bring it to canonical form.

    Args:
        input: int64/int32 [n] keys with ``offsets``, or [B, L] fixed-size bags without.
        offsets: int64/int32 [B] starts of the bags ([B + 1] with ``include_last_offset``), or None.
        per_sample_weights: floating, the shape of ``input``, or None (mode "sum" only).
        include_last_offset: ``offsets`` ends with the end of the last bag (torch's meaning).
        mode: one of MODES.
        device: the cache's device.
        out_device: where the pooled output goes.
        prefix: put before error messages (a feature's name).

    Raises:
        TypeError, InvalidKeysError, NotImplementedError: see the module docstring.
    """
    input = _check_index_tensor("input", input, prefix)
    psw = per_sample_weights
    if psw is not None:
        if not isinstance(psw, torch.Tensor):
            raise TypeError(f"{prefix}per_sample_weights must be a torch.Tensor or None, got {type(psw).__name__}")
        if mode != "sum":
            raise NotImplementedError(
                f"{prefix}embedding_bag: per_sample_weights was not None. per_sample_weights is only supported "
                f"for mode='sum' (got mode='{mode}'). Please open a feature request on GitHub.")
        if not psw.dtype.is_floating_point:
            raise InvalidKeysError(f"{prefix}per_sample_weights must be floating point, got dtype {psw.dtype}")
        if psw.shape != input.shape:
            raise InvalidKeysError(f"{prefix}embedding_bag: If per_sample_weights ({psw.shape}) is not None, "
                                   f"then it must have the same shape as the input ({input.shape})")
    if input.dim() == 2:
        if offsets is not None:
            raise InvalidKeysError(f"{prefix}if input is 2D, then offsets has to be None, as input is treated as a "
                                   f"mini-batch of fixed length sequences; got offsets of type {type(offsets)}")
        n_bags, length = input.shape
        keys = input.reshape(-1).to(device, torch.int64)
        canon = torch.arange(n_bags + 1, dtype=torch.int64, device=device) * length
        weights = psw.reshape(-1) if psw is not None else None
    elif input.dim() == 1:
        if offsets is None:
            raise InvalidKeysError(f"{prefix}offsets has to be a 1D Tensor but got None")
        offsets = _check_index_tensor("offsets", offsets, prefix)
        if offsets.dim() != 1:
            raise InvalidKeysError(f"{prefix}offsets has to be a 1D Tensor, got shape {tuple(offsets.shape)}")
        n = input.numel()
        if include_last_offset and offsets.numel() == 0:
            raise InvalidKeysError(f"{prefix}include_last_offset: number of offset should be at least 1")
        end = n
        if offsets.numel():
            off = offsets.to(torch.int64)
            # one device sync for all three checks
            first, ascending, last = torch.stack([off[0], (off[1:] >= off[:-1]).all().to(torch.int64),
                                                  off[-1]]).tolist()
            if first != 0:
                raise InvalidKeysError(f"{prefix}offsets[0] has to be 0, i.e., the first sequence in the mini-batch "
                                       f"has to start from position 0. However, got {first}")
            if not ascending:
                raise InvalidKeysError(f"{prefix}offsets must be non-decreasing, got {offsets.tolist()[:32]}")
            if last > n:
                raise InvalidKeysError(f"{prefix}offsets[-1] can not be greater than input's length {n} "
                                       f"but got offsets[-1] of {last}")
            if include_last_offset:
                end = last  # keys after the last offset belong to no bag
            off = off.to(device)
            canon = off if include_last_offset else torch.cat([off, off.new_tensor([n])])
        else:
            end = 0  # no bags: no key is used
            canon = torch.zeros(1, dtype=torch.int64, device=device)
        keys = input[:end].to(device, torch.int64)
        weights = psw[:end] if psw is not None else None
    else:
        raise InvalidKeysError(f"{prefix}input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}")
    if weights is not None:
        weights = weights.to(device, torch.float32)
    return _Bags(keys, canon, weights, out_device, single=input.dim() == 2 and input.shape[1] == 1)


def _unique(keys: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique keys to look up (int64 [u]) and each key's row among them (int64 [n]).

    Keys equal to ``padding_idx`` are left out and point at row u, a zero row the caller appends.
    """
    if padding_idx is None:
        ukeys, inverse = torch.unique(keys, return_inverse=True)
        return ukeys, inverse
    real = keys != padding_idx
    ukeys, inv = torch.unique(keys[real], return_inverse=True)
    inverse = torch.full_like(keys, ukeys.numel())
    inverse[real] = inv
    return ukeys, inverse


def _with_padding_row(rows: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, int | None]:
    """Rows with a zero row appended for the padding key, and that row's index (None without padding)."""
    if padding_idx is None:
        return rows, None
    return torch.cat([rows, rows.new_zeros(1, rows.shape[1])]), rows.shape[0]


def _pool(bags: _Bags, inverse: torch.Tensor, rows: torch.Tensor, mode: str,
          padding_idx: int | None = None) -> torch.Tensor:
    """Pool the looked-up rows into bags with torch's own embedding_bag; on ``bags.out_device``.

    Bags of one key each (one categorical value per feature, as in DLRM) pool to the key's row
    (times its weight) in every mode: a gather, whose backward is one ``index_add_``, where
    ``embedding_bag``'s backward sorts the keys first.
    """
    weight, pad = _with_padding_row(rows, padding_idx)
    if bags.single:
        out = _Gather.apply(weight, inverse)
        if bags.weights is not None:
            out = out * bags.weights.unsqueeze(1)
        return out.to(bags.out_device)
    out = F.embedding_bag(inverse, weight, bags.offsets, mode=mode, per_sample_weights=bags.weights,
                          include_last_offset=True, padding_idx=pad)
    return out.to(bags.out_device)


class _Gather(torch.autograd.Function):
    """``rows[index]`` whose backward sums the gradients of repeated indices (index_add_'s bits, faster)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.n_rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return segment_sum(grad, index, ctx.n_rows), None


# ---------------------------------------------------------------------- the autograd bridge
class _Fetch:
    """The unique keys of one forward per table: looked up in forward, updated in backward.

    Args:
        cache: the cache.
        keys: unique int64 keys per table, on the cache's device.
        dims: embedding dimension per table (for tables with no keys).
        many: use lookup_many/apply_gradients_many (one round trip for all tables).
    """

    def __init__(self, cache: CacheLike, keys: dict[str, torch.Tensor], dims: Mapping[str, int], many: bool) -> None:
        self.cache = cache
        self.keys = keys
        self.names = list(keys)
        self.dims = dims
        self.many = many

    def lookup(self) -> list[torch.Tensor]:
        """Rows (float32 [u, dim], cache device) per table, in ``names`` order."""
        device = self.cache.device
        wanted = {n: k for n, k in self.keys.items() if k.numel()}
        if not wanted:
            rows: Mapping[str, torch.Tensor] = {}
        elif self.many:
            rows = self.cache.lookup_many(wanted)
        else:
            (name, keys), = wanted.items()
            rows = {name: self.cache.lookup(name, keys)}
        empty = {n: torch.zeros(0, self.dims[n], device=device) for n in self.names if n not in wanted}
        # .to is a no-op for a cache keeping its contract; it guards pooling against a stray device
        return [rows[n].to(device) if n in rows else empty[n] for n in self.names]

    def apply(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Hand the gradients of the looked-up rows to the cache (tables without a gradient skipped)."""
        updates = {n: (self.keys[n], g) for n, g in zip(self.names, grads, strict=True)
                   if g is not None and self.keys[n].numel()}
        if not updates:
            return
        if self.many:
            self.cache.apply_gradients_many(updates)
        else:
            (name, (keys, g)), = updates.items()
            self.cache.apply_gradients(name, keys, g)


class _CachedRows(torch.autograd.Function):
    """Rows looked up in the cache as a differentiable tensor; backward applies the optimizer."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, fetch: _Fetch) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        # anchor: an empty tensor requiring grad, only so that autograd records this node
        ctx.fetch = fetch
        ctx.set_materialize_grads(False)  # unused tables get None, not zeros to apply
        return tuple(fetch.lookup())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None]:  # type: ignore[override]
        ctx.fetch.apply(grads)
        return None, None


def _rows(fetch: _Fetch, record: bool) -> list[torch.Tensor]:
    """Look the rows up; with ``record``, as an autograd node whose backward updates the cache."""
    if not record:
        with torch.no_grad():
            return fetch.lookup()
    # a fresh, unregistered anchor: the modules hold no parameter at all
    anchor = torch.empty(0, requires_grad=True)
    return list(_CachedRows.apply(anchor, fetch))


# ---------------------------------------------------------------------- modules
class _CacheModule(nn.Module):
    """Base of the modules: holds the cache, which copies of the module share."""

    cache: CacheLike
    out_device: torch.device | None  # the ``device`` argument (None: the cache's device)

    def __init__(self) -> None:
        super().__init__()
        _keep_out_of_compile()

    def _init_device(self, device: torch.device | str | None) -> None:
        try:
            self.out_device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device={device!r} is not a torch device") from exc

    @property
    def output_device(self) -> torch.device:
        """Where outputs go: the ``device`` argument, else the cache's device."""
        return self.out_device if self.out_device is not None else self.cache.device

    def _device_repr(self) -> str:
        return f", device={str(self.out_device)!r}" if self.out_device is not None else ""

    # ------------------------------------------------------------------ state_dict
    persist: str
    checkpoint_dir: str | None
    max_state_bytes: int

    def _init_persist(self, persist: str, checkpoint_dir: str | os.PathLike[str] | None, max_state_bytes: int) -> None:
        if persist not in PERSIST:
            raise ConfigError(f"persist={persist!r} is not allowed; choose one of {', '.join(map(repr, PERSIST))}")
        if (persist == "checkpoint") != (checkpoint_dir is not None):
            raise ConfigError("checkpoint_dir is required with persist='checkpoint' and only allowed with it")
        if isinstance(max_state_bytes, bool) or not isinstance(max_state_bytes, int) or max_state_bytes < 0:
            raise ConfigError(f"max_state_bytes={max_state_bytes!r}: must be an int >= 0")
        self.persist = persist
        self.checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir)) if checkpoint_dir is not None else None
        self.max_state_bytes = max_state_bytes

    def _state_tables(self) -> list[str]:
        """The tables whose rows this module's state holds."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.persist != "none":
            destination[prefix + STATE_KEY] = self._cache_state(destination)

    def _cache_state(self, destination: Any) -> dict[str, Any]:
        """The state_dict entry of this module's tables (see "Checkpoints" in the module docstring)."""
        tables = self._state_tables()
        configs = self.cache.tables()
        state: dict[str, Any] = {"format": _STATE_FORMAT, "persist": self.persist,
                                 "configs": {t: configs[t].to_dict() for t in tables}}
        exportable = callable(getattr(self.cache, "export_rows", None))
        if self.persist == "checkpoint":
            directory, written = _checkpoint_once(destination, self.cache, self.checkpoint_dir)
            state["directory"] = directory
            if not exportable:  # a remote Client: the servers wrote one directory per shard
                state["persist"] = "remote"
                state["directories"] = list(written or [])
                warnings.warn(f"{type(self).__name__}: the cache is remote; the servers checkpointed the tables "
                              f"{tables} to {state['directories']}, which load_state_dict cannot restore: "
                              f"restart the servers from those directories", RuntimeWarning, stacklevel=4)
            return state
        if not exportable:
            warnings.warn(f"{type(self).__name__}: the cache ({type(self.cache).__name__}) cannot export rows, so "
                          f"this state_dict does NOT hold the tables {tables}; checkpoint the servers "
                          f"(Client.checkpoint) or build the module with persist='none' to silence this",
                          RuntimeWarning, stacklevel=4)
            state["persist"] = "omitted"
            return state
        rows: dict[str, dict[str, torch.Tensor]] = {}
        total = 0
        for t in tables:
            keys, records, freq = [], [], []
            for k, r, f in self.cache.export_rows(t, _select_all):  # type: ignore[attr-defined]
                total += r.nbytes
                if total > self.max_state_bytes:
                    warnings.warn(f"{type(self).__name__}: the rows of {tables} exceed max_state_bytes="
                                  f"{self.max_state_bytes}, so this state_dict does NOT hold them; build the module "
                                  f"with persist='checkpoint', checkpoint_dir=... (a cache checkpoint named in the "
                                  f"state_dict) or a larger max_state_bytes", RuntimeWarning, stacklevel=4)
                    state["persist"] = "omitted"
                    return state
                keys.append(torch.from_numpy(np.array(k, dtype=np.int64)))
                records.append(torch.from_numpy(np.array(r, dtype=np.uint8)))
                freq.append(torch.from_numpy(np.array(f, dtype=np.float32)))
            rows[t] = {"keys": torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64),
                       "records": torch.cat(records) if records else torch.zeros(0, 0, dtype=torch.uint8),
                       "freq": torch.cat(freq) if freq else torch.zeros(0)}
        state["rows"] = rows
        return state

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + STATE_KEY
        if key in unexpected_keys:  # torch expects it only of modules with set_extra_state
            unexpected_keys.remove(key)
        if self.persist == "none":
            return  # the cache persists itself: rows in the state_dict are ignored
        if key not in state_dict:  # torch always passes strict=True here; load_state_dict(strict=False) returns it
            missing_keys.append(key)
            return
        self._restore(state_dict[key], error_msgs)

    def _restore(self, state: Any, error_msgs: list[str]) -> None:
        """Make the cache's tables hold the rows of a state saved by :meth:`_cache_state`."""
        name = type(self).__name__
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            error_msgs.append(f"{name}: {STATE_KEY} is not an embcache module state (format {_STATE_FORMAT})")
            return
        saved = state.get("configs", {})
        tables = self._state_tables()
        configs = self.cache.tables()
        for t in tables:
            if t not in saved:
                error_msgs.append(f"{name}: the state holds no table {t!r} (it has {sorted(saved)})")
                continue
            conflicts = TableConfig.from_dict(saved[t]).layout_conflicts(configs[t])
            if conflicts:
                error_msgs.append(f"{name}: table {t!r} was saved with other {', '.join(conflicts)}")
        if error_msgs:
            return
        persist = state["persist"]
        if persist in ("omitted", "remote"):
            where = f" (the servers' checkpoints: {state.get('directories')})" if persist == "remote" else ""
            warnings.warn(f"{name}: this state_dict does not hold the rows of {tables}{where}; the cache keeps "
                          f"its own", RuntimeWarning, stacklevel=4)
            return
        if not callable(getattr(self.cache, "import_rows", None)):
            warnings.warn(f"{name}: the cache ({type(self.cache).__name__}) cannot import rows; the rows of "
                          f"{tables} in this state_dict are NOT loaded", RuntimeWarning, stacklevel=4)
            return
        if persist == "rows":
            for t in tables:
                entry = state["rows"][t]
                _replace_rows(self.cache, t, [(entry["keys"].numpy(), entry["records"].numpy(),
                                                entry["freq"].numpy())])
            return
        # persist == "checkpoint": open the checkpoint as a small CPU cache and copy the tables' rows over
        from .cache import EmbeddingCache
        directory = state["directory"]
        with tempfile.TemporaryDirectory(prefix="embcache-load-") as tmp:
            manifest_store = _checkpoint_store(directory)
            config = CacheConfig(hbm_bytes=1 << 20, ddr_bytes=1 << 20, path=tmp, store=manifest_store, device="cpu")
            with EmbeddingCache.restore(directory, config) as source:
                for t in tables:
                    _replace_rows(self.cache, t, source.export_rows(t, _select_all))

    def __deepcopy__(self, memo: dict[int, Any]) -> _CacheModule:
        # The table lives in the cache, and a cache (locks, an open store) cannot be copied:
        # copy.deepcopy(model) (EMA, SWA) gives a module over the same cache, like a shared table.
        memo[id(self.cache)] = self.cache
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


class CachedEmbedding(_CacheModule):
    """Like ``torch.nn.Embedding``, with the table in an embedding cache (see the module docstring).

    ``forward(input)`` takes an int64/int32 tensor of keys of any shape and returns float32
    ``input.shape + (dim,)`` on :attr:`output_device` (``device``, else the cache's device).

    Args:
        cache: an :class:`~embcache.EmbeddingCache` or ``embcache.Client`` (anything :class:`CacheLike`).
        table: the table's name.
        padding_idx: a key whose output is a zero row and which is never looked up or updated;
            None (default) for none.
        device: where outputs go (the model's device); None (default): the cache's device.
        persist: what ``state_dict()`` holds of the table(s): "rows" (default), "checkpoint" or "none"
            (see "Checkpoints" in the module docstring).
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
        super().__init__()
        _check_cache(cache)
        self.cache = cache
        self.table = table
        self.embedding_dim = _table_config(cache, table).dim
        self.padding_idx = _check_padding_idx(padding_idx)
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
        input = _check_index_tensor("input", input, "")
        keys = input.reshape(-1).to(self.cache.device, torch.int64)
        ukeys, inverse = _unique(keys, self.padding_idx)
        fetch = _Fetch(self.cache, {self.table: ukeys}, {self.table: self.embedding_dim}, many=False)
        (rows,) = _rows(fetch, self.training and torch.is_grad_enabled())
        weight, pad = _with_padding_row(rows, self.padding_idx)
        out = F.embedding(inverse, weight, padding_idx=pad)
        return out.reshape(*input.shape, self.embedding_dim).to(self.output_device)

    def _state_tables(self) -> list[str]:
        return [self.table]

    def extra_repr(self) -> str:
        """The table, its dimension and the padding key."""
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"table={self.table!r}, embedding_dim={self.embedding_dim}{pad}{self._device_repr()}"


class CachedEmbeddingBag(_CacheModule):
    """Like ``torch.nn.EmbeddingBag``, with the table in an embedding cache (see the module docstring).

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
            (see "Checkpoints" in the module docstring).
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
        super().__init__()
        _check_cache(cache)
        self.cache = cache
        self.table = table
        self.embedding_dim = _table_config(cache, table).dim
        self.mode = _check_mode(mode)
        self.include_last_offset = bool(include_last_offset)
        self.padding_idx = _check_padding_idx(padding_idx)
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
            TypeError, InvalidKeysError, NotImplementedError: see the module docstring.
            The errors of the cache's ``lookup`` (nothing changed).
        """
        bags = _canonical_bags(input, offsets, per_sample_weights, self.include_last_offset, self.mode,
                               self.cache.device, self.output_device)
        ukeys, inverse = _unique(bags.keys, self.padding_idx)
        fetch = _Fetch(self.cache, {self.table: ukeys}, {self.table: self.embedding_dim}, many=False)
        (rows,) = _rows(fetch, self.training and torch.is_grad_enabled())
        return _pool(bags, inverse, rows, self.mode, self.padding_idx)

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
            (see "Checkpoints" in the module docstring).
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
        super().__init__()
        _check_cache(cache)
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
        self.cache = cache
        self.features: dict[str, str] = mapping
        if isinstance(mode, Mapping):
            if set(mode) != set(mapping):
                raise ConfigError(f"mode per feature must name exactly the features {sorted(mapping)}, "
                                  f"got {sorted(mode, key=repr)}")
            self.modes: dict[str, str] = {f: _check_mode(mode[f]) for f in mapping}
        else:
            self.modes = dict.fromkeys(mapping, _check_mode(mode))
        #: the pooling mode of every feature, or None when they differ (see ``modes``)
        self.mode: str | None = next(iter(self.modes.values())) if len(set(self.modes.values())) == 1 else None
        self.include_last_offset = bool(include_last_offset)
        self._init_device(device)
        self._init_persist(persist, checkpoint_dir, max_state_bytes)
        self.table_dims = {t: _table_config(cache, t).dim for t in dict.fromkeys(mapping.values())}
        self.embedding_dims = {f: self.table_dims[t] for f, t in mapping.items()}
        self._torchrec_configs: list[Any] | None = None

    @classmethod
    def from_torchrec(cls, cache: CacheLike, tables: Sequence[Any], device: torch.device | str | None = None,
                      **options: Any) -> CachedEmbeddingBagCollection:
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
        features: dict[str, str] = {}
        modes: dict[str, str] = {}
        for cfg in tables:
            name, dim = cfg.name, cfg.embedding_dim
            pooling = str(getattr(cfg.pooling, "value", cfg.pooling)).lower()
            if pooling not in ("sum", "mean"):
                raise ConfigError(f"table {name!r}: pooling {cfg.pooling!r} is not offered; use SUM or MEAN")
            table_dim = _table_config(cache, name).dim
            if table_dim != dim:
                raise ConfigError(f"table {name!r}: embedding_dim={dim} but the cache's table has dim={table_dim}")
            for f in cfg.feature_names:
                if f in features:
                    raise ConfigError(f"feature {f!r} appears in tables {features[f]!r} and {name!r}")
                features[f], modes[f] = name, pooling
        ebc = cls(cache, features, mode=modes, device=device, **options)
        ebc._torchrec_configs = list(tables)
        return ebc

    def embedding_bag_configs(self) -> list[Any]:
        """The configs of torchrec's ``EmbeddingBagCollection.embedding_bag_configs()`` (DLRM reads them).

        Those passed to :meth:`from_torchrec`; else one per table with ``name``, ``embedding_dim``,
        ``feature_names``, ``pooling`` (upper case, the table's first feature's) and ``num_embeddings=0``.
        """
        if self._torchrec_configs is not None:
            return list(self._torchrec_configs)
        return [_TableView(t, d, [f for f, ft in self.features.items() if ft == t],
                           self.modes[next(f for f, ft in self.features.items() if ft == t)].upper())
                for t, d in self.table_dims.items()]

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
            TypeError, InvalidKeysError, NotImplementedError: see the module docstring; messages
                name the feature.
            The errors of the cache's ``lookup_many`` (nothing changed).
        """
        device = self.cache.device
        keyed = _is_kjt(batch)
        if keyed:
            parts = _kjt_features(batch, list(self.features))
            bags = {f: _canonical_bags(*parts[f], True, self.modes[f], device, self.output_device,
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
            bags = {f: _canonical_bags(*_unpack(f, batch[f]), self.include_last_offset, self.modes[f], device,
                                       self.output_device, prefix=f"feature {f!r}: ")
                    for f in self.features}
        ukeys: dict[str, torch.Tensor] = {}
        inverses: dict[str, torch.Tensor] = {}
        for table in self.table_dims:
            feats = [f for f, t in self.features.items() if t == table]
            keys = [bags[f].keys for f in feats]
            ukeys[table], inverse = torch.unique(torch.cat(keys) if len(keys) > 1 else keys[0], return_inverse=True)
            inverses.update(zip(feats, inverse.split([k.numel() for k in keys]), strict=True))
        fetch = _Fetch(self.cache, ukeys, self.table_dims, many=True)
        rows = dict(zip(fetch.names, _rows(fetch, self.training and torch.is_grad_enabled()), strict=True))
        out = {f: _pool(bags[f], inverses[f], rows[t], self.modes[f]) for f, t in self.features.items()}
        keyed_tensor = _keyed_tensor_class() if keyed else None
        if keyed_tensor is None:
            return out
        return keyed_tensor(keys=list(out), length_per_key=[self.embedding_dims[f] for f in out],
                            values=torch.cat(list(out.values()), dim=1), key_dim=1)

    def _state_tables(self) -> list[str]:
        return list(self.table_dims)

    def extra_repr(self) -> str:
        """The features, their tables and the pooling mode(s)."""
        mode = f"mode={self.mode!r}" if self.mode is not None else f"modes={self.modes!r}"
        return f"features={self.features!r}, {mode}{self._device_repr()}"


_compile_lock = threading.Lock()
_compile_disabled = False


def _keep_out_of_compile() -> None:
    """Wrap the modules' forwards in ``torch.compiler.disable`` (see "torch.compile" in the module docstring).

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


def _unpack(feature: str, value: Any) -> tuple[Any, Any, Any]:
    """(input, offsets, per_sample_weights) of one feature's batch entry."""
    if isinstance(value, torch.Tensor):
        return value, None, None
    if isinstance(value, (tuple, list)) and len(value) in (2, 3):
        return value[0], value[1], value[2] if len(value) == 3 else None
    raise TypeError(f"feature {feature!r}: expected a 2-D tensor, (input, offsets) or "
                    f"(input, offsets, per_sample_weights), got {type(value).__name__}")


# ---------------------------------------------------------------------- torchrec interop
def _is_kjt(batch: Any) -> bool:
    """Whether ``batch`` looks like a torchrec KeyedJaggedTensor (duck-typed: torchrec is optional)."""
    if isinstance(batch, Mapping):
        return False
    has = [callable(getattr(batch, m, None)) for m in ("keys", "values", "lengths", "offsets")]
    return has[0] and has[1] and (has[2] or has[3])


def _kjt_features(kjt: Any, wanted: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per wanted feature of a KeyedJaggedTensor: (values, offsets [B + 1] including the end, weights)."""
    keys = list(kjt.keys())
    missing = [f for f in wanted if f not in keys]
    if missing:
        raise InvalidKeysError(f"the KeyedJaggedTensor lacks features {missing}; it has {keys}")
    values = _check_index_tensor("values()", kjt.values(), "KeyedJaggedTensor ")
    weights = kjt.weights_or_none() if callable(getattr(kjt, "weights_or_none", None)) else None
    if callable(getattr(kjt, "lengths", None)):
        lengths = kjt.lengths()
    else:
        offsets = kjt.offsets()
        lengths = offsets[1:] - offsets[:-1]
    lengths = _check_index_tensor("lengths()", lengths, "KeyedJaggedTensor ").to(torch.int64)
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


@dataclass
class _TableView:
    """The fields of torchrec's EmbeddingBagConfig that its models read."""

    name: str
    embedding_dim: int
    feature_names: list[str]
    pooling: str
    num_embeddings: int = 0


@functools.lru_cache(maxsize=1)
def _keyed_tensor_class() -> Any:
    """torchrec's KeyedTensor, or None when torchrec is not installed."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except ImportError:
        return None
    return KeyedTensor


def tables_from_torchrec(tables: Sequence[Any], **options: Any) -> list[TableConfig]:
    """:class:`~embcache.TableConfig`s for torchrec ``EmbeddingBagConfig``s (name and dim; ``options`` the rest).

    E.g. ``tables_from_torchrec(configs, optimizer="adagrad", lr=0.01)``; the cache built on them
    serves :meth:`CachedEmbeddingBagCollection.from_torchrec` over the same configs.
    """
    return [TableConfig(name=cfg.name, dim=cfg.embedding_dim, **options) for cfg in tables]


# ---------------------------------------------------------------------- checkpoints
#: (id(state_dict being built), id(cache)) -> (weak reference to it, the checkpoint written for it)
_CHECKPOINTS: dict[tuple[int, int], tuple[weakref.ref[Any], tuple[str, Any]]] = {}


def _checkpoint_once(destination: Any, cache: Any, root: str | None) -> tuple[str, Any]:
    """Checkpoint ``cache`` under ``root`` once per ``state_dict()`` call: modules sharing a cache share it.

    Returns the directory and what ``cache.checkpoint`` returned (a Client: the servers' directories).
    """
    assert root is not None
    key = (id(destination), id(cache))
    hit = _CHECKPOINTS.get(key)
    if hit is not None and hit[0]() is destination:
        return hit[1]
    directory = os.path.join(root, f"embcache-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    result = (directory, cache.checkpoint(directory))
    try:
        ref = weakref.ref(destination, lambda _: _CHECKPOINTS.pop(key, None))
    except TypeError:  # a destination that takes no weak reference: each module writes its own
        return result
    _CHECKPOINTS[key] = (ref, result)
    return result


def _select_all(keys: np.ndarray) -> np.ndarray:
    return np.ones(keys.shape[0], dtype=bool)


def _checkpoint_store(directory: str) -> str:
    """The store backend a cache checkpoint was written with (its manifest's)."""
    import json

    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            return str(json.load(f)["store"])
    except FileNotFoundError:
        raise ConfigError(f"{directory!r} holds no embcache checkpoint (manifest.json missing); was it moved? "
                          f"The state_dict names it by its absolute path") from None


def _replace_rows(cache: Any, table: str, batches: Any) -> None:
    """Make ``table`` hold exactly the rows of ``batches`` ((keys, records, freq) ...) among its stored rows.

    Stored rows the batches do not have are deleted (a later lookup creates them from the
    initializer again, as the saved cache would), then the batches' rows are imported.
    """
    keys_seen: list[np.ndarray] = []
    for keys, records, freq in batches:
        keys = np.asarray(keys, dtype=np.int64)
        for i in range(0, keys.shape[0], _IMPORT_ROWS):
            cache.import_rows(table, torch.from_numpy(np.ascontiguousarray(keys[i:i + _IMPORT_ROWS])),
                              records[i:i + _IMPORT_ROWS], freq[i:i + _IMPORT_ROWS])
        keys_seen.append(keys)
    saved = np.concatenate(keys_seen) if keys_seen else np.zeros(0, dtype=np.int64)
    stale = [k for k, _, _ in cache.export_rows(table, lambda ks: ~np.isin(ks, saved))]
    for k in stale:
        for i in range(0, k.shape[0], _IMPORT_ROWS):
            cache.delete_rows(table, torch.from_numpy(np.ascontiguousarray(k[i:i + _IMPORT_ROWS])))
