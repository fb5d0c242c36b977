"""Shared fixtures: store kinds, cache factories under tmp_path."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU (CI), Triton's interpreter runs the fused probe kernel on CPU tensors
# (tests/test_triton_probe.py); it must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.optim import state_width
from embcache.tier import resident_row_bytes

from .fakecuda import FakeCuda, fake_cuda
from .realcuda import REAL_CUDA, RealCuda

STORES = ["rocksdb", "lmdb"]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """Each store backend in turn."""
    return str(request.param)


def row_bytes(dim: int, optimizer: str = "sgd", device: str = "cpu") -> int:
    """Memory bytes one fp32 row costs in a tier on ``device`` (MemoryTier.row_bytes)."""
    return resident_row_bytes(dim, torch.float32, state_width(optimizer, dim), device)


def cuda_or_stand_in() -> contextlib.AbstractContextManager[Any]:
    """The CUDA device: the real one where torch sees one, else the stand-in of tests/fakecuda.py."""
    return contextlib.nullcontext(RealCuda()) if REAL_CUDA else fake_cuda()


@pytest.fixture
def fakecuda() -> Iterator[FakeCuda | RealCuda]:
    """The test runs on "cuda": under the CPU stand-in (tests/fakecuda.py), or on a real GPU where
    there is one, through tests/realcuda.py's RealCuda (the same interface)."""
    with cuda_or_stand_in() as fc:
        yield fc


@pytest.fixture(params=["cpu", "cuda" if REAL_CUDA else "fakecuda"])
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    """The cache's device: "cpu", then "cuda" (under the stand-in without a GPU: its GPU branches run on the CPU)."""
    if request.param == "cpu":
        yield "cpu"
    else:
        with cuda_or_stand_in():
            yield "cuda"


@pytest.fixture
def make_cache(tmp_path: Any, store: str) -> Iterator[Callable[..., EmbeddingCache]]:
    """Factory: ``make_cache(hbm_rows=, ddr_rows=, tables=, **config)`` under tmp_path; closes all at teardown.

    ``device`` defaults to "cpu"; tests taking the ``device`` fixture pass it on to run both ways.
    """
    made: list[EmbeddingCache] = []

    def factory(hbm_rows: int = 4, ddr_rows: int = 8, tables: list[TableConfig] | None = None,
                path: str | None = None, **kw: Any) -> EmbeddingCache:
        tables = tables or [TableConfig(name="t", dim=8, optimizer="adagrad", lr=0.1, seed=3)]
        n = len(tables)
        kw.setdefault("device", "cpu")
        rb = row_bytes(tables[0].dim, tables[0].optimizer)
        hot = row_bytes(tables[0].dim, tables[0].optimizer, kw["device"])  # the GPU's index takes more
        cfg = CacheConfig(hbm_bytes=hbm_rows * hot * n, ddr_bytes=ddr_rows * rb * n,
                          path=path or str(tmp_path / "store"), store=store, **kw)
        cache = EmbeddingCache(cfg, tables)
        made.append(cache)
        return cache

    yield factory
    for c in made:
        c.close()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``EMBCACHE_FAILURE_LOG`` set, append each failure's report to that file as it happens.

    A run cut at a time limit (``scripts/gpu-check.sh`` on a lent GPU) can lose pytest's summary:
    on an H100 an interrupt broke xdist's controller and two failures came back without a
    traceback. Under xdist this runs in the controller, which gets every worker's reports.
    """
    path = os.environ.get("EMBCACHE_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):  # a worker: its controller writes
        return
    with open(path, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        for name, text in report.sections:
            if name.startswith("Captured"):
                f.write(f"---- {name}\n{text[-4000:]}\n")
