"""The export format: versions written atomically, read back only when complete, deltas folded in order."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from embcache.export import (
    ExportFormatError,
    TablePart,
    latest_version,
    list_versions,
    load_model,
    read_version,
    version_dir,
    write_version,
)

CFG = {"name": "items", "dim": 4}


def _part(keys: list[int], fill: float, deleted: list[int] | None = None, state: bool = False) -> TablePart:
    k = np.array(keys, dtype=np.int64)
    w = np.tile(np.float32(fill) + k[:, None].astype(np.float32), (1, 4))
    return TablePart(CFG, k, w, np.array(deleted or [], dtype=np.int64),
                     np.ones((k.size, 2), np.float32) * fill if state else None)


def test_full_then_deltas_fold_to_the_last_writer(tmp_path: str) -> None:
    d = str(tmp_path)
    write_version(d, 1, "full", {"items": _part([5, 1, 3], 0.0)}, covers={"steps": {"items": 10}})
    write_version(d, 2, "delta", {"items": _part([3, 7], 100.0, deleted=[1])}, base_version=1)
    write_version(d, 3, "delta", {"items": _part([7], 200.0)}, base_version=2)
    assert list_versions(d) == [1, 2, 3]
    version, model = load_model(d)
    assert version == 3
    rows = model["items"]
    assert rows.keys.tolist() == [3, 5, 7]
    assert rows.weights[:, 0].tolist() == [103.0, 5.0, 207.0]
    v2, model2 = load_model(d, 2)
    assert v2 == 2 and model2["items"].keys.tolist() == [3, 5, 7]
    assert model2["items"].weights[:, 0].tolist() == [103.0, 5.0, 107.0]
    assert read_version(version_dir(d, 1)).covers == {"steps": {"items": 10}}  # type: ignore[union-attr]


def test_a_plain_numpy_reader_needs_nothing_else(tmp_path: str) -> None:
    d = str(tmp_path)
    write_version(d, 1, "full", {"items": _part([2, 4], 1.0, state=True)})
    with open(os.path.join(d, "v00000001", "manifest.json")) as f:
        manifest = json.load(f)
    entry = manifest["tables"]["items"]
    z = np.load(os.path.join(d, "v00000001", entry["file"]))
    assert z["keys"].tolist() == [2, 4] and z["weights"].shape == (2, 4) and z["state"].shape == (2, 2)
    assert entry["rows"] == 2 and entry["with_state"] and entry["dtype"] == "float32"


def test_bfloat16_weights_round_trip_as_bits(tmp_path: str) -> None:
    d = str(tmp_path)
    w = torch.randn(3, 4).to(torch.bfloat16)
    write_version(d, 1, "full", {"items": TablePart(CFG, np.arange(3), w)})
    _, model = load_model(d)
    rows = model["items"]
    assert rows.dtype == "bfloat16"
    back = torch.from_numpy(rows.weights).view(torch.bfloat16)
    assert torch.equal(back, w)
    as_f32 = (rows.weights.astype(np.uint32) << 16).view(np.float32)  # the torch-free recipe of the docs
    assert np.array_equal(as_f32, w.float().numpy())


def test_a_half_copied_version_is_ignored_until_complete(tmp_path: str) -> None:
    d = str(tmp_path)
    write_version(d, 1, "full", {"items": _part([1], 0.0)})
    write_version(d, 2, "delta", {"items": _part([1], 9.0)}, base_version=1)
    v2 = version_dir(d, 2)
    path = os.path.join(v2, "t0000.npz")
    good = open(path, "rb").read()
    open(path, "wb").write(good[: len(good) // 2])  # a copy cut short
    assert read_version(v2) is None
    assert latest_version(d).version == 1  # type: ignore[union-attr]
    with pytest.raises(ExportFormatError, match="missing or incomplete"):
        load_model(d, 2)
    open(path, "wb").write(good)
    assert latest_version(d).version == 2  # type: ignore[union-attr]
    os.remove(os.path.join(v2, "manifest.json"))  # manifest not there yet
    assert latest_version(d).version == 1  # type: ignore[union-attr]


def test_bad_writes_are_refused_and_leave_nothing(tmp_path: str) -> None:
    d = str(tmp_path)
    write_version(d, 1, "full", {"items": _part([1], 0.0)})
    with pytest.raises(ExportFormatError, match="exists already"):
        write_version(d, 1, "full", {"items": _part([1], 0.0)})
    with pytest.raises(ExportFormatError, match="base_version"):
        write_version(d, 3, "delta", {"items": _part([1], 0.0)}, base_version=1)
    bad = TablePart(CFG, np.arange(3), np.zeros((2, 4), np.float32))
    with pytest.raises(ExportFormatError, match="shape"):
        write_version(d, 2, "full", {"items": bad})
    assert list_versions(d) == [1] and sorted(os.listdir(d)) == ["v00000001"]
    with pytest.raises(ExportFormatError, match="no complete version"):
        load_model(str(tmp_path / "empty"))


def test_a_foreign_or_newer_manifest_is_an_error_not_a_wait(tmp_path: str) -> None:
    d = str(tmp_path)
    write_version(d, 1, "full", {"items": _part([1], 0.0)})
    mpath = os.path.join(version_dir(d, 1), "manifest.json")
    m = json.load(open(mpath))
    m["format_version"] = 99
    json.dump(m, open(mpath, "w"))
    with pytest.raises(ExportFormatError, match="newer"):
        read_version(version_dir(d, 1))
