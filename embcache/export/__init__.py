"""Exports of a model's rows in an open format: full versions and deltas (see :mod:`embcache.export.format`)."""

from .format import (
    ExportFormatError,
    TablePart,
    TableRows,
    Version,
    latest_version,
    list_versions,
    load_model,
    read_table,
    read_version,
    version_chain,
    version_dir,
    write_version,
)
from .tensor import from_tensor

__all__ = [
    "ExportFormatError",
    "TablePart",
    "TableRows",
    "Version",
    "from_tensor",
    "latest_version",
    "list_versions",
    "load_model",
    "read_table",
    "read_version",
    "version_chain",
    "version_dir",
    "write_version",
]
