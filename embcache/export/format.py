"""The export format: numbered versions of a model's rows, each a directory of ``.npz`` files and a manifest.

A directory of exports holds versions ``v00000001``, ``v00000002``, ... Each version is either
*full* (every row of every table) or a *delta* (the rows changed and the keys deleted since the
version before it, its ``base_version``). Inside a version::

    manifest.json        what the version holds (written last; see below)
    t0000.npz            one file per table: arrays ``keys`` (int64 [n]), ``weights`` ([n, dim]),
    t0001.npz            ``deleted`` (int64 [m]) and, when exported with optimizer state,
    ...                  ``state`` (float32 [n, state_width])

``weights`` are in the table's storage dtype; numpy has no bfloat16, so a bfloat16 table's
weights are its raw bits as uint16 (``torch.from_numpy(w).view(torch.bfloat16)``, or
``(w.astype(np.uint32) << 16).view(np.float32)`` without torch). The manifest says which.

Why ``.npz``: numpy reads it with nothing else installed (``np.load``), it keeps 2-D arrays and
their dtypes as they are, and it costs embcache no dependency beyond numpy, which every user of
the library already has. (Parquet needs pyarrow and flattens rows to lists; safetensors needs
its package and cannot hold a model's tables as separate, independently checksummed files.)

Atomicity: a writer builds the version in a temporary directory beside it, fsyncs every file,
writes the manifest last, then renames the directory into place and fsyncs the parent. A reader
takes a version only when its manifest is present and every file's size and SHA-256 match it, so
a version copied half-way (by rsync, say) is ignored until it is complete, never read in part.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import EmbcacheError
from ..stores.base import fsync_dir

__all__ = ["FORMAT", "FORMAT_VERSION", "ExportFormatError", "TablePart", "TableRows", "Version", "check_directory",
           "fold", "latest_version", "list_versions", "load_model", "read_table", "read_version", "version_chain",
           "version_dir", "weights_array", "weights_tensor", "write_version"]

FORMAT = "embcache-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_VERSION_RE = re.compile(r"^v(\d{8})$")
_CHUNK = 1 << 20


class ExportFormatError(EmbcacheError, ValueError):
    """An export directory or version is malformed: a bad manifest, a missing or corrupt file, a broken chain."""


@dataclass
class TablePart:
    """One table's rows in a version being written."""

    config: dict[str, Any]  # the table's definition (``TableConfig.to_dict()``)
    keys: np.ndarray  # int64 [n]
    weights: np.ndarray | torch.Tensor  # [n, dim] in the table's storage dtype (a bfloat16 tensor is stored as bits)
    deleted: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # int64 [m]
    state: np.ndarray | None = None  # float32 [n, state_width], or None for weights only


@dataclass
class Version:
    """A complete version's manifest, read back."""

    path: str
    version: int
    kind: str  # "full" or "delta"
    base_version: int | None
    created_unix: float
    covers: dict[str, Any]  # what the version covers: e.g. {"steps": {table: clock}, "time": unix}
    tables: dict[str, dict[str, Any]]  # name -> {file, dim, dtype, rows, deleted, with_state, sha256, bytes, config}


@dataclass
class TableRows:
    """One table's rows as a reader sees them: a full version, or full + deltas folded."""

    config: dict[str, Any]
    keys: np.ndarray  # int64 [n], ascending
    weights: np.ndarray  # [n, dim], storage dtype (uint16 bits for bfloat16)
    state: np.ndarray | None  # float32 [n, S] when every folded version carried state
    dtype: str


def check_directory(directory: str | os.PathLike[str]) -> str:
    """``directory`` as a string, when it can hold versions (missing, or a directory).

    Raises:
        ExportFormatError: it exists and is not a directory.
    """
    path = os.fspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ExportFormatError(f"export directory {path!r} exists and is not a directory")
    return path


def version_dir(directory: str, version: int) -> str:
    """Path of version ``version`` under ``directory``."""
    return os.path.join(directory, f"v{version:08d}")


def weights_array(weights: np.ndarray | torch.Tensor) -> tuple[np.ndarray, str]:
    """``weights`` as a numpy array the format stores, and the dtype name the manifest records."""
    if isinstance(weights, torch.Tensor):
        t = weights.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        arr = t.numpy()
    else:
        arr = np.ascontiguousarray(weights)
    names = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
    if arr.dtype not in names:
        raise ExportFormatError(f"weights of dtype {arr.dtype} cannot be exported (float32, float16, bfloat16)")
    return arr, names[arr.dtype]


def weights_tensor(weights: np.ndarray, dtype: str) -> torch.Tensor:
    """The stored ``weights`` as a torch tensor of the table's dtype (bfloat16 from its bits)."""
    t = torch.from_numpy(np.ascontiguousarray(weights))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_synced(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())


def write_version(directory: str, version: int, kind: str, tables: Mapping[str, TablePart], *,
                  base_version: int | None = None, covers: Mapping[str, Any] | None = None) -> Version:
    """Write version ``version`` under ``directory`` atomically (see the module's docstring).

    Args:
        directory: the export directory (created if missing).
        version: the version's number (>= 1); it must not exist yet.
        kind: "full" or "delta".
        tables: each table's rows.
        base_version: for a delta, the version it follows (must be ``version - 1``).
        covers: what the version covers (training steps, time), recorded as given.

    Returns:
        The written version's manifest.

    Raises:
        ExportFormatError: bad arguments or the version exists already.
        OSError: the write failed (nothing is left under the version's name).
    """
    if kind not in ("full", "delta"):
        raise ExportFormatError(f"kind={kind!r}: must be 'full' or 'delta'")
    if not isinstance(version, int) or version < 1:
        raise ExportFormatError(f"version={version!r}: must be an int >= 1")
    if kind == "delta" and base_version != version - 1:
        raise ExportFormatError(f"a delta's base_version must be version - 1 ({version - 1}), not {base_version}")
    os.makedirs(directory, exist_ok=True)
    final = version_dir(directory, version)
    if os.path.exists(final):
        raise ExportFormatError(f"version {version} exists already in {directory}")
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        entries: dict[str, dict[str, Any]] = {}
        for i, (name, part) in enumerate(sorted(tables.items())):
            entries[name] = _write_table(tmp, f"t{i:04d}.npz", part)
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "version": version, "kind": kind,
            "base_version": base_version if kind == "delta" else None, "created_unix": time.time(),
            "covers": dict(covers or {}), "tables": entries,
        }
        mpath = os.path.join(tmp, MANIFEST)
        with open(mpath, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _version_from(final, manifest)


def _write_table(tmp: str, file: str, part: TablePart) -> dict[str, Any]:
    keys = np.ascontiguousarray(part.keys, dtype=np.int64).reshape(-1)
    weights, dtype = weights_array(part.weights)
    deleted = np.ascontiguousarray(part.deleted, dtype=np.int64).reshape(-1)
    if weights.ndim != 2 or weights.shape[0] != keys.shape[0]:
        raise ExportFormatError(f"weights of shape {tuple(weights.shape)} for {keys.shape[0]} keys")
    arrays = {"keys": keys, "weights": weights, "deleted": deleted}
    if part.state is not None:
        state = np.ascontiguousarray(part.state, dtype=np.float32)
        if state.ndim != 2 or state.shape[0] != keys.shape[0]:
            raise ExportFormatError(f"state of shape {tuple(state.shape)} for {keys.shape[0]} keys")
        arrays["state"] = state
    path = os.path.join(tmp, file)
    _write_synced(path, arrays)
    return {"file": file, "dim": int(weights.shape[1]), "dtype": dtype, "rows": int(keys.shape[0]),
            "deleted": int(deleted.shape[0]), "with_state": part.state is not None,
            "state_width": int(arrays["state"].shape[1]) if part.state is not None else 0,
            "bytes": os.path.getsize(path), "sha256": _sha256(path), "config": dict(part.config)}


def _version_from(path: str, m: Mapping[str, Any]) -> Version:
    return Version(path=path, version=int(m["version"]), kind=str(m["kind"]),
                   base_version=None if m.get("base_version") is None else int(m["base_version"]),
                   created_unix=float(m["created_unix"]), covers=dict(m.get("covers") or {}),
                   tables={str(k): dict(v) for k, v in dict(m["tables"]).items()})


def read_version(path: str, *, verify: bool = True) -> Version | None:
    """The manifest of the version at ``path``, or None while it is incomplete.

    Incomplete means: no manifest yet, a manifest that does not parse, or (with ``verify``) a
    table file missing or whose size or SHA-256 differ from the manifest's. A manifest of
    another format or of a newer format version raises instead: waiting would not help.

    Raises:
        ExportFormatError: the manifest is complete but not one this code reads.
    """
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ExportFormatError(f"{mpath}: not an {FORMAT} manifest")
    if int(m.get("format_version", 0)) > FORMAT_VERSION:
        raise ExportFormatError(f"{mpath}: format version {m.get('format_version')} is newer than this "
                                f"code reads ({FORMAT_VERSION}); upgrade embcache")
    try:
        version = _version_from(path, m)
    except (KeyError, TypeError, ValueError):
        return None
    if verify:
        for entry in version.tables.values():
            fpath = os.path.join(path, str(entry["file"]))
            try:
                if os.path.getsize(fpath) != int(entry["bytes"]) or _sha256(fpath) != entry["sha256"]:
                    return None
            except OSError:
                return None
    return version


def list_versions(directory: str) -> list[int]:
    """The version numbers present under ``directory`` (complete or not), ascending."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _VERSION_RE.match(n)))


def latest_version(directory: str) -> Version | None:
    """The newest complete version under ``directory`` (None if none is complete).

    Versions are taken in order; an incomplete one hides those after it (a delta cannot be
    applied without the one before it)."""
    latest: Version | None = None
    for n in list_versions(directory):
        v = read_version(version_dir(directory, n))
        if v is None:
            break
        latest = v
    return latest


def read_table(version: Version, table: str, *, with_state: bool = False) -> dict[str, np.ndarray]:
    """One table's arrays of a version: ``keys``, ``weights``, ``deleted`` (and ``state`` if asked and present).

    Raises:
        ExportFormatError: the version has no such table, or its file does not hold the arrays.
    """
    entry = version.tables.get(table)
    if entry is None:
        raise ExportFormatError(f"version {version.version} has no table {table!r} (has {sorted(version.tables)})")
    with np.load(os.path.join(version.path, str(entry["file"])), allow_pickle=False) as z:
        wanted = ["keys", "weights", "deleted"] + (["state"] if with_state and "state" in z.files else [])
        try:
            return {k: z[k] for k in wanted}
        except KeyError as exc:
            raise ExportFormatError(f"{entry['file']} of version {version.version}: {exc}") from None


def fold(base: TableRows | None, config: dict[str, Any], dtype: str, part: Mapping[str, np.ndarray],
         full: bool) -> TableRows:
    """``base`` with one version's ``part`` applied: a full part replaces it, a delta overwrites
    its keys and drops its deleted keys (vectorized; keys come out ascending)."""
    keys, weights = part["keys"], part["weights"]
    state = part.get("state")
    if full or base is None:
        order = np.argsort(keys, kind="stable")
        return TableRows(config, keys[order], weights[order], None if state is None else state[order], dtype)
    keep = ~np.isin(base.keys, np.concatenate([keys, part["deleted"]]))
    all_keys = np.concatenate([base.keys[keep], keys])
    all_w = np.concatenate([base.weights[keep], weights])
    all_s = None
    if base.state is not None and state is not None:
        all_s = np.concatenate([base.state[keep], state])
    order = np.argsort(all_keys, kind="stable")
    return TableRows(config, all_keys[order], all_w[order], None if all_s is None else all_s[order], dtype)


def version_chain(directory: str, version: int | None = None) -> list[Version]:
    """The versions to apply, in order, to hold ``version`` (default: the newest complete one):
    its newest full version at or before it, then each delta after that.

    Raises:
        ExportFormatError: no complete version, the version asked for is incomplete, or the chain
            from the full version to it is broken.
    """
    target = latest_version(directory) if version is None else read_version(version_dir(directory, version))
    if target is None:
        raise ExportFormatError(f"{directory}: no complete version" if version is None
                                else f"{directory}: version {version} is missing or incomplete")
    chain = [target]
    while chain[-1].kind == "delta":
        base = chain[-1].base_version
        prev = read_version(version_dir(directory, int(base or 0))) if base else None
        if prev is None:
            raise ExportFormatError(f"{directory}: delta {chain[-1].version} follows version {base}, "
                                    "which is missing or incomplete")
        chain.append(prev)
    chain.reverse()
    return chain


def load_model(directory: str, version: int | None = None, *, tables: Sequence[str] | None = None,
               with_state: bool = False) -> tuple[int, dict[str, TableRows]]:
    """Every table's rows as of ``version`` (default: the newest complete one): its newest full
    version at or before it, with the deltas after that folded in.

    Returns:
        ``(version, {table: rows})``.

    Raises:
        ExportFormatError: no complete version, the version asked for is incomplete, or the chain
            from the full version to it is broken.
    """
    chain = version_chain(directory, version)
    target = chain[-1]
    out: dict[str, TableRows] = {}
    for v in chain:
        for name, entry in v.tables.items():
            if tables is not None and name not in tables:
                continue
            part = read_table(v, name, with_state=with_state)
            out[name] = fold(out.get(name), dict(entry["config"]), str(entry["dtype"]), part, v.kind == "full")
    return target.version, out
