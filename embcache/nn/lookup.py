"""How the modules of :mod:`embcache.nn` reach their cache: :class:`CacheLike` and the autograd node.

:class:`CacheLike` is what the modules need of a cache (an :class:`~embcache.EmbeddingCache` or
an ``embcache.Client``). One forward's unique keys per table are a :class:`Fetch`, looked up by
:func:`cached_rows` as one autograd node whose backward hands the rows' gradients to the cache,
which applies the table's optimizer (the fused backward-optimizer of :mod:`embcache.nn`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..config import TableConfig
from ..errors import UnknownTableError

__all__ = ["CacheLike", "Fetch", "cached_rows", "check_cache", "table_config"]

_CACHE_METHODS = ("lookup", "apply_gradients", "lookup_many", "apply_gradients_many", "tables", "device")


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
    from ..cache import EmbeddingCache

    def _embedded_cache_is_cache_like(cache: EmbeddingCache) -> CacheLike:  # checked by mypy only
        return cache


def check_cache(cache: Any) -> None:
    """Reject an object lacking the cache methods (duck-typed, so proxies and clients pass)."""
    missing = [m for m in _CACHE_METHODS if not hasattr(cache, m)]
    if missing:
        raise TypeError(f"cache must be an EmbeddingCache or embcache.Client; {type(cache).__name__} lacks {missing}")


def table_config(cache: CacheLike, table: str) -> TableConfig:
    """The config of ``table``; UnknownTableError if the cache does not serve it."""
    tables = cache.tables()
    if not isinstance(table, str) or table not in tables:
        raise UnknownTableError(f"unknown table {table!r}; tables: {sorted(tables)}")
    return tables[table]


class Fetch:
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
    def forward(ctx: Any, anchor: torch.Tensor, fetch: Fetch) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        # anchor: an empty tensor requiring grad, only so that autograd records this node
        ctx.fetch = fetch
        ctx.set_materialize_grads(False)  # unused tables get None, not zeros to apply
        return tuple(fetch.lookup())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None]:  # type: ignore[override]
        ctx.fetch.apply(grads)
        return None, None


def cached_rows(fetch: Fetch, record: bool) -> list[torch.Tensor]:
    """Look the rows up; with ``record``, as an autograd node whose backward updates the cache."""
    if not record:
        with torch.no_grad():
            return fetch.lookup()
    # a fresh, unregistered anchor: the modules hold no parameter at all
    anchor = torch.empty(0, requires_grad=True)
    return list(_CachedRows.apply(anchor, fetch))
