"""What the eviction sample's size costs in hit ratio, and what it saves in placement time.

Command: ``.venv/bin/python bench/price_sample.py [--sim] [--cache] [--samples 16,8,4,2]``
(both parts by default; ``--sim`` about two minutes, ``--cache`` about one).

``--sim``: the exact simulator of the cache's policy (:class:`embcache.sim.LrfuSim`, whose victim is
the lowest-scored of ``sample`` random residents) replays every workload of
``bench/workloads.py`` (1M keys, 2M accesses, seed 0, as ``bench_policy.py``) at 0.25%, 1% and 4%
capacity with samples of 64 (the simulator's default), 16 and 4: the hit ratio each size gives
up against 64. (The cache draws ``eviction_sample`` slots per victim wanted and takes the lowest
``k`` of them all: about the same choice per victim.)

``--cache``: one cache per sample size (``CacheConfig.eviction_sample``), HBM 1% / DDR 10% of
766,000 ids (``bench_cache.py``'s tiered cases), Zipf(1.1), B=8,192, d=64, row-wise AdaGrad, no
policy tuning; all serve the same batches, in alternating order, each lookup timed in thread CPU
time: the median lookup and the memory hit ratios of each size. The store starts empty (rows are
created, not read), so the times are placement's, not RocksDB's.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.profile_tiered import tiered_cache, zipf_batches  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402
from embcache.sim import LrfuSim  # noqa: E402


def price_in_sim(n_keys: int, n_accesses: int, samples: tuple[int, ...] = (64, 16, 4)) -> None:
    """Print each workload's hit ratios per capacity and sample size (see the module docstring)."""
    for w in WORKLOADS:
        trace = np.ascontiguousarray(w.make(n_accesses, n_keys, 0), dtype=np.int64)
        cells = []
        for share in (0.0025, 0.01, 0.04):
            hits = [LrfuSim(int(share * n_keys), sample=s).access(trace) / trace.size for s in samples]
            diffs = ", ".join(f"{s}: {100 * (h - hits[0]):+.2f}" for s, h in zip(samples[1:], hits[1:], strict=True))
            cells.append(f"{share:.2%} {' '.join(f'{h:.4f}' for h in hits)} ({diffs} pts)")
        print(f"{w.name:15s} " + " | ".join(cells), flush=True)


def price_in_cache(samples: tuple[int, ...], ids_n: int = 766_000, batch: int = 8192, lookups: int = 300) -> None:
    """Print each sample size's median lookup and hit ratios (see the module docstring)."""
    torch.set_num_threads(1)
    draw = zipf_batches(ids_n, batch)
    times: dict[int, list[float]] = {s: [] for s in samples}
    with contextlib.ExitStack() as stack:
        caches = {}
        for s in samples:
            d = stack.enter_context(tempfile.TemporaryDirectory())
            caches[s] = stack.enter_context(tiered_cache(ids_n, 64, d, eviction_sample=s, tune_policy=False))
        for _ in range(150):  # warm-up: the tiers fill
            keys = draw()
            for c in caches.values():
                c.lookup("t", keys)
        before = {s: c.stats()["t"] for s, c in caches.items()}
        for i in range(lookups):
            keys = draw()
            for s in (samples if i % 2 == 0 else samples[::-1]):
                t0 = time.thread_time()
                caches[s].lookup("t", keys)
                times[s].append(time.thread_time() - t0)
        after = {s: c.stats()["t"] for s, c in caches.items()}
    for s in samples:
        n = after[s]["lookups"] - before[s]["lookups"]
        hbm = (after[s]["hbm"]["hits"] - before[s]["hbm"]["hits"]) / n
        ddr = (after[s]["ddr"]["hits"] - before[s]["ddr"]["hits"]) / n
        print(f"eviction_sample {s:3d}: median lookup {1e3 * float(np.median(times[s])):.2f} ms; "
              f"hit ratio HBM {hbm:.4f}, DDR {ddr:.4f}, memory {hbm + ddr:.4f}")


def main(argv: list[str]) -> int:
    """Run the parts asked for; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", action="store_true")
    ap.add_argument("--cache", action="store_true")
    ap.add_argument("--samples", default="16,8,4,2", help="the cache part's sample sizes")
    ap.add_argument("--keys", type=int, default=1_000_000, help="the simulator part's keys (accesses: twice)")
    args = ap.parse_args(argv)
    both = not (args.sim or args.cache)
    if args.sim or both:
        price_in_sim(args.keys, 2 * args.keys)
    if args.cache or both:
        price_in_cache(tuple(int(s) for s in args.samples.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
