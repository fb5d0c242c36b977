"""Where a tiered lookup's time goes around its store read (issue: the tiered path near its bound).

Command: ``.venv/bin/python bench/profile_tiered.py [BATCH] [DIM]`` (default 8192 64; half a minute).

A Zipf(1.1) trace over 200,000 ids, HBM 1% and DDR 10% of them, row-wise AdaGrad, one torch
thread, on the CPU; 60 batches warm up, 60 are timed. Every timed lookup that reads the store on
its reader thread is split, by timing its hand-over of the read (``readers.submit``) and its wait
for it (``TableEngine.complete``), into: ``pre`` (the HBM probe, the unique of the misses, the DDR
probe: before the read starts), ``beside`` (what this thread does while the read runs: DDR hits,
planning, moves), ``wait`` (the read's remainder) and ``post`` (the read values copied in and out).
``pre + post`` is on the critical path whatever the read costs; the read is hidden when ``wait``
is near 0. ``read`` is the store read itself, timed on the reader thread: where ``beside`` is the
longer, the placement beside the read, not the read, sets the lookup's time.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.engine import table as table_mod  # noqa: E402
from embcache.optim import state_width  # noqa: E402
from embcache.tier import resident_row_bytes  # noqa: E402

IDS = 200_000


def zipf_batches(n_ids: int, batch: int, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A draw of ``batch`` keys at a time from a Zipf(1.1) trace over ``n_ids`` ids (spread over
    all 64 bits); the trace of this script, ``ab_kernels.py`` and ``price_sample.py``."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_ids + 1) ** 1.1
    p /= p.sum()
    ids = (np.arange(n_ids, dtype=np.int64) * np.int64(0x1E3779B97F4A7C15)) ^ np.int64(12345)

    def draw() -> torch.Tensor:
        return torch.from_numpy(ids[rng.choice(n_ids, batch, p=p)])
    return draw


def tiered_cache(n_ids: int, dim: int, path: str, **config: Any) -> EmbeddingCache:
    """A CPU cache of one table ``t`` (row-wise AdaGrad, lr 0.01) with HBM 1% and DDR 10% of
    ``n_ids`` rows; ``config``: more CacheConfig settings."""
    rb = resident_row_bytes(dim, torch.float32, state_width("rowwise_adagrad", dim), "cpu")
    cfg = CacheConfig(hbm_bytes=n_ids // 100 * rb, ddr_bytes=n_ids // 10 * rb, path=path, device="cpu", **config)
    return EmbeddingCache(cfg, [TableConfig(name="t", dim=dim, optimizer="rowwise_adagrad", lr=0.01)])


def main(argv: list[str]) -> int:
    """Time the phases; see the module docstring."""
    torch.set_num_threads(1)
    batch, dim = (int(argv[0]), int(argv[1])) if len(argv) >= 2 else (8192, 64)
    draw = zipf_batches(IDS, batch)
    with tempfile.TemporaryDirectory() as d, tiered_cache(IDS, dim, d) as cache:
        for _ in range(60):
            cache.lookup("t", draw())
        engine = cache._tables["t"]
        marks: dict[str, float] = {}
        submit, complete = engine.readers.submit, table_mod.TableEngine.complete

        def timed_submit(*args: Any, **kwargs: Any) -> Any:
            marks["submit"] = time.perf_counter()
            return submit(*args, **kwargs)

        def timed_complete(self: table_mod.TableEngine, read: Any) -> None:
            if read.done:
                return
            marks["wait0"] = time.perf_counter()
            complete(self, read)
            marks["wait1"] = time.perf_counter()

        reads: list[float] = []
        rows_read = engine.rows.read

        def timed_read(*args: Any, **kwargs: Any) -> Any:
            r0 = time.perf_counter()
            try:
                return rows_read(*args, **kwargs)
            finally:
                reads.append(time.perf_counter() - r0)

        engine.readers.submit = timed_submit  # type: ignore[method-assign]
        table_mod.TableEngine.complete = timed_complete  # type: ignore[method-assign]
        engine.rows.read = timed_read  # type: ignore[method-assign]
        try:
            batches = [draw() for _ in range(60)]
            phases = {"pre": 0.0, "beside": 0.0, "wait": 0.0, "post": 0.0}
            total, n = 0.0, 0
            for b in batches:
                marks.clear()
                t0 = time.perf_counter()
                cache.lookup("t", b)
                t1 = time.perf_counter()
                total += t1 - t0
                if "submit" in marks and "wait0" in marks:
                    n += 1
                    phases["pre"] += marks["submit"] - t0
                    phases["beside"] += marks["wait0"] - marks["submit"]
                    phases["wait"] += marks["wait1"] - marks["wait0"]
                    phases["post"] += t1 - marks["wait1"]
        finally:
            table_mod.TableEngine.complete = complete  # type: ignore[method-assign]
            engine.rows.read = rows_read  # type: ignore[method-assign]
    print(f"B={batch} d={dim}: {1e3 * total / len(batches):.2f} ms per lookup; of the {n} that read beside: "
          + ", ".join(f"{k} {1e3 * v / max(n, 1):.2f} ms" for k, v in phases.items())
          + f"; the store read itself {1e3 * float(np.mean(reads)) if reads else 0.0:.2f} ms (mean of {len(reads)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
