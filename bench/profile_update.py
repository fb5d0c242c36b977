"""Where an all-hot lookup + row-wise AdaGrad update spends its time (issue: the update near its bound).

Command: ``.venv/bin/python bench/profile_update.py [BATCH] [DIM]`` (default 8192 64; a minute).

All rows of a Zipf(1.05) trace in HBM (on the CPU), one torch thread. Prints rows/s of lookup +
update through the cache, of the ``index_select`` ceiling over the same rows, and of a bare
read-modify-write in plain torch (unique, index_add, the optimizer's math, index_copy), best of 3;
then a cProfile of one pass of lookup + update (the kernels and the Python around them).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.workloads import zipf_trace  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402


def main(argv: list[str]) -> int:
    """Measure and profile; see the module docstring."""
    torch.set_num_threads(1)
    batch, dim = (int(argv[0]), int(argv[1])) if len(argv) >= 2 else (8192, 64)
    ids = zipf_trace(batch * 40, 10_000_000, 1.05, seed=0)
    uniq = np.unique(ids)
    n = len(uniq)
    table = TableConfig(name="t", dim=dim, optimizer="rowwise_adagrad", lr=0.01)
    with tempfile.TemporaryDirectory() as d:
        with EmbeddingCache(CacheConfig(hbm_bytes=1 << 20, ddr_bytes=0, path=d + "/p", device="cpu"), [table]) as p:
            rb = p.row_bytes("t")
        cfg = CacheConfig(hbm_bytes=(n + 64) * rb, ddr_bytes=0, path=d + "/c", device="cpu", mrc_sample_rate=0)
        with EmbeddingCache(cfg, [table]) as cache:
            for i in range(0, n, batch):
                cache.lookup("t", torch.from_numpy(uniq[i:i + batch]))
            keys = [torch.from_numpy(ids[i:i + batch]) for i in range(0, len(ids), batch)]
            dense = [torch.from_numpy(np.searchsorted(uniq, k.numpy())) for k in keys]
            out = torch.empty(batch, dim)
            grads = torch.randn(batch, dim) * 0.1
            weights, state = torch.rand(n, dim), torch.zeros(n)

            def through_cache() -> None:
                for k in keys:
                    cache.lookup("t", k, out=out)
                    cache.apply_gradients("t", k, grads)

            def ceiling() -> None:
                for ix in dense:
                    torch.index_select(weights, 0, ix, out=out)

            def bare_rmw() -> None:
                for ix in dense:
                    torch.index_select(weights, 0, ix, out=out)
                    u, inv = torch.unique(ix, return_inverse=True)
                    g = torch.zeros(u.numel(), dim).index_add_(0, inv, grads)
                    s = state.index_select(0, u) + g.pow(2).mean(1)
                    w = weights.index_select(0, u) - 0.01 * g / (s.sqrt() + 1e-10).unsqueeze(1)
                    weights.index_copy_(0, u, w)
                    state.index_copy_(0, u, s)

            best: dict[str, float] = {}
            for fn in (through_cache, ceiling, bare_rmw):
                fn()  # warm-up (numba compiles, pages fault in)
            for _ in range(3):
                for fn in (through_cache, ceiling, bare_rmw):
                    t0 = time.perf_counter()
                    fn()
                    best[fn.__name__] = min(best.get(fn.__name__, float("inf")), time.perf_counter() - t0)
            rows = len(keys) * batch
            for name, seconds in best.items():
                print(f"{name:>14}: {rows / seconds / 1e6:6.2f} M rows/s")
            print(f"cache / ceiling: {best['ceiling'] / best['through_cache']:.2f}x")
            prof = cProfile.Profile()
            prof.enable()
            through_cache()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
