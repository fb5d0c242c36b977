"""Keyset files: one pass's keysets saved as a ``.npz`` and loaded back, validated.

The file holds the keys and counts of each table (arrays ``keys_<i>`` and ``counts_<i>``, tables
in sorted order) and a JSON header (``header``: the format name :data:`KEYSET_FORMAT`, its
version :data:`KEYSET_VERSION`, the tables, optional metadata). :func:`save_keysets` writes it
atomically; :func:`load_keysets` and :func:`keyset_file_meta` read it and raise
:class:`~embcache.keyset.KeysetFileError` on a damaged or mismatched file.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, InvalidKeysError
from .keyset import Keyset, KeysetFileError, PathLike, as_keysets

__all__ = ["KEYSET_FORMAT", "KEYSET_VERSION", "keyset_file_meta", "load_keysets", "save_keysets"]

KEYSET_FORMAT = "embcache-keyset"
KEYSET_VERSION = 1


def save_keysets(path: PathLike, keysets: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None) -> None:
    """Write one pass's keysets to ``path`` (a ``.npz``), atomically.

    Args:
        path: the file to write (replaced if it exists; ``.npz`` is not appended).
        keysets: ``{table: Keyset or keys}``.
        meta: JSON-serializable metadata stored with them (e.g. the pass index, the data range).

    Raises:
        InvalidKeysError: keysets are not a mapping of valid keysets.
        ConfigError: ``meta`` is not JSON-serializable.
    """
    ks = as_keysets(keysets)
    for k in ks.values():
        k.validate()
    try:
        meta_json = json.dumps(dict(meta or {}), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"keyset metadata must be JSON-serializable: {exc}") from None
    header = {"format": KEYSET_FORMAT, "version": KEYSET_VERSION, "tables": sorted(ks), "meta": json.loads(meta_json)}
    arrays: dict[str, np.ndarray] = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
    for i, name in enumerate(sorted(ks)):
        arrays[f"keys_{i}"] = ks[name].keys.numpy()
        arrays[f"counts_{i}"] = ks[name].counts.numpy()
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _read_header(path: str, npz: Any) -> dict[str, Any]:
    if "header" not in npz.files:
        raise KeysetFileError(f"{path!r} is not an embcache keyset file (no header)")
    try:
        header = json.loads(bytes(npz["header"]).decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeysetFileError(f"{path!r}: damaged keyset header: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != KEYSET_FORMAT:
        raise KeysetFileError(f"{path!r} is not an embcache keyset file (format {header.get('format')!r})"
                              if isinstance(header, dict) else f"{path!r}: damaged keyset header")
    if header.get("version") != KEYSET_VERSION:
        raise KeysetFileError(f"{path!r} has keyset format version {header.get('version')!r}; "
                              f"this embcache reads version {KEYSET_VERSION}")
    if not isinstance(header.get("tables"), list) or not all(isinstance(t, str) for t in header["tables"]):
        raise KeysetFileError(f"{path!r}: damaged keyset header (tables)")
    return header


def _open_npz(path: PathLike) -> tuple[str, Any]:
    p = os.fspath(path)
    try:
        return p, np.load(p, allow_pickle=False)
    except FileNotFoundError:
        raise KeysetFileError(f"keyset file {p!r} does not exist") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise KeysetFileError(f"{p!r} is not a readable keyset file: {exc}") from None


def keyset_file_meta(path: PathLike) -> dict[str, Any]:
    """The metadata saved with a keyset file (see :func:`save_keysets`).

    Raises:
        KeysetFileError: the file is missing, damaged, or not a keyset file of this version.
    """
    p, npz = _open_npz(path)
    with npz:
        meta = _read_header(p, npz).get("meta", {})
    return dict(meta) if isinstance(meta, dict) else {}


def load_keysets(path: PathLike, tables: Iterable[str] | None = None) -> dict[str, Keyset]:
    """Read one pass's keysets written by :func:`save_keysets`, validating them.

    Args:
        path: the ``.npz`` file.
        tables: the tables the caller expects; the file must hold exactly these (default: any).

    Returns:
        ``{table: Keyset}``.

    Raises:
        KeysetFileError: the file is missing or damaged, of another format or version, holds
            other tables than ``tables``, or its arrays break a keyset's invariants (int64 1-D
            keys strictly ascending, counts >= 1 of the same length).
    """
    p, npz = _open_npz(path)
    out: dict[str, Keyset] = {}
    with npz:
        header = _read_header(p, npz)
        names: list[str] = header["tables"]
        if tables is not None:
            want = sorted(set(tables))
            if want != sorted(names):
                raise KeysetFileError(f"{p!r} holds keysets of tables {sorted(names)}, expected {want}")
        for i, name in enumerate(names):
            try:
                keys, counts = npz[f"keys_{i}"], npz[f"counts_{i}"]
            except KeyError:
                raise KeysetFileError(f"{p!r}: the arrays of table {name!r} are missing") from None
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
                raise KeysetFileError(f"{p!r}: the arrays of table {name!r} are damaged: {exc}") from None
            if keys.dtype != np.int64 or counts.dtype != np.int64 or keys.ndim != 1 or keys.shape != counts.shape:
                raise KeysetFileError(f"{p!r}: table {name!r} must have int64 keys and counts [n] of the same "
                                      f"length, got {keys.dtype} {keys.shape} and {counts.dtype} {counts.shape}")
            ks = Keyset(torch.from_numpy(keys), torch.from_numpy(counts))
            try:
                ks.validate()
            except InvalidKeysError as exc:
                raise KeysetFileError(f"{p!r}: table {name!r}: {exc}") from None
            out[name] = ks
    return out

