"""The package's version: one number, in pyproject.toml, read from the installed metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version

__all__ = ["version"]


def version() -> str:
    """The installed distribution's version (``0+unknown`` when run from a source tree that was never installed)."""
    try:
        return _metadata_version("embcache")
    except PackageNotFoundError:
        return "0+unknown"
