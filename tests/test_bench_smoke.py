"""Smoke tests of benchmark scripts at tiny sizes (the full runs live in bench/, see bench/__main__.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import bench_gpu


def test_bench_gpu_on_cpu_writes_positive_rates(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--dims", "8,16", "--rows", "4096", "--batch", "1024", "--reps", "3",
            "--threads", "0", "--out", str(tmp_path)]
    assert bench_gpu.main(args) == 0
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert doc["device"] == "cpu"
    assert [r["dim"] for r in doc["results"]] == [8, 16]
    for r in doc["results"]:
        assert r["rows"] == 4096 and r["hbm_capacity_rows"] >= 4096
        for trace in ("zipf", "uniform"):
            c = r["traces"][trace]
            assert c["hbm_hit_ratio"] == 1.0  # every timed key is resident in the HBM tier
            for op in ("lookup", "update", "index_select"):
                assert 0 < c[op]["keys_per_s_min"] <= c[op]["keys_per_s"] <= c[op]["keys_per_s_max"]
                assert c[op]["calls"] == 3
    assert len(doc["summary"]) == 2 and all(s["ratio"] > 0 for s in doc["summary"])
    assert doc["reference"]["keys_per_s"] == 2e9
    assert (tmp_path / "gpu.md").read_text().startswith("# HBM-tier rates on cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto runs the full benchmark where CUDA is present")
def test_bench_gpu_auto_skips_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_gpu.main(["--out", str(tmp_path)]) == 0
    assert "skipped" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
