"""Typed errors raised by embcache.

Every error says what was wrong and what is allowed. Each subclasses the builtin that fits
(ValueError for bad input, KeyError for unknown names, RuntimeError for state and I/O problems)
as well as :class:`EmbcacheError`, so callers can catch either. An operation that raises one of
these has changed nothing.
"""

from __future__ import annotations

__all__ = [
    "BatchTooLargeError",
    "CacheClosedError",
    "CheckpointExistsError",
    "ConfigError",
    "EmbcacheError",
    "InvalidGradientError",
    "InvalidKeysError",
    "InvalidRowsError",
    "MigratingError",
    "NonFiniteGradientError",
    "PassStateError",
    "ReadOnlyError",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
    "TableConflictError",
    "UnknownTableError",
    "WrongShardError",
]


class EmbcacheError(Exception):
    """Base class of every error embcache raises on purpose."""


class ConfigError(EmbcacheError, ValueError):
    """A TableConfig or CacheConfig field has a value that is not allowed."""


class UnknownTableError(EmbcacheError, KeyError):
    """The named table does not exist in this cache."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class TableConflictError(EmbcacheError, ValueError):
    """A table was declared with a definition that conflicts with the stored one."""


class InvalidKeysError(EmbcacheError, ValueError):
    """Keys are not a 1-D integer tensor (or array)."""


class InvalidRowsError(EmbcacheError, ValueError):
    """Rows passed to assign have the wrong shape, dtype or values."""


class InvalidGradientError(EmbcacheError, ValueError):
    """Gradients have the wrong shape, dtype or device."""


class NonFiniteGradientError(InvalidGradientError):
    """Gradients contain NaN or infinity (rejected unless the table allows them)."""


class BatchTooLargeError(EmbcacheError, ValueError):
    """A batch holds more keys than CacheConfig.max_batch_keys allows."""


class CacheClosedError(EmbcacheError, RuntimeError):
    """The cache was closed; no further operations are possible."""


class PassStateError(EmbcacheError, RuntimeError):
    """begin_pass while a pass is active, or end_pass without one."""


class CheckpointExistsError(EmbcacheError, FileExistsError):
    """The checkpoint directory exists and is not empty."""


class StoreError(EmbcacheError, RuntimeError):
    """The cold-tier key-value store failed."""


class StoreLockedError(StoreError):
    """The store path is held by another process (or another open cache)."""


class StoreFullError(StoreError):
    """The store could not write because its disk (or LMDB map) is full."""


class WrongShardError(EmbcacheError, RuntimeError):
    """A parameter server was asked for keys by a client using another version of the fleet's shard map.

    Nothing was applied. The server's map travels with the refusal; ``embcache.Client`` adopts it
    and routes the keys again, so a user sees this only from a misconfigured client or fleet.
    """


class MigratingError(EmbcacheError, RuntimeError):
    """A write touched rows that a reshard is moving to another shard; nothing was applied.

    ``embcache.Client`` resends it until the migration commits (or the call's deadline).
    """


class ReadOnlyError(EmbcacheError, RuntimeError):
    """A write reached a server in serving mode (``embcache-server --serve``); nothing was applied.

    A serving server serves an exported model read-only: its rows change only when it applies
    the export's next version. The message names the version it serves.
    """
