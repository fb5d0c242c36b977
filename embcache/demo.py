"""A small end-to-end demo: train a two-tower click model through the cache and report hit rates.

Run: ``./dev demo`` (or ``python -m embcache.demo --help``). Two tables (users, items) with
Zipf-popular ids are trained with row-wise AdaGrad through an EmbeddingCache whose HBM and DDR
tiers hold a few percent of the rows; the rest lives in RocksDB on disk. Labels come from a
hidden model, so the loss really falls. At the end it prints per-tier hit rates.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch
from tqdm import tqdm

from . import __version__
from .cache import EmbeddingCache
from .config import CacheConfig, TableConfig


def zipf_sampler(n_ids: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Cumulative popularity of ``n_ids`` ids under Zipf(alpha), ids scattered by a permutation."""
    weights = 1.0 / np.arange(1, n_ids + 1, dtype=np.float64) ** alpha
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def draw(cdf: np.ndarray, perm: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` ids drawn from the popularity ``cdf`` (rank -> id through ``perm``)."""
    ranks = np.searchsorted(cdf, rng.random(n), side="right")
    return perm[np.minimum(ranks, len(perm) - 1)]


def main(argv: list[str] | None = None) -> None:
    """Run the demo (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="embcache-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"embcache-demo {__version__}")
    parser.add_argument("--steps", type=int, default=600, help="training batches (default 600)")
    parser.add_argument("--batch", type=int, default=4096, help="samples per batch (default 4096)")
    parser.add_argument("--users", type=int, default=1_000_000, help="user ids (default 1M)")
    parser.add_argument("--items", type=int, default=200_000, help="item ids (default 200k)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--store", choices=["rocksdb", "lmdb"], default="rocksdb")
    parser.add_argument("--path", default=None, help="store directory (default: a fresh temporary one)")
    parser.add_argument("--hbm-mb", type=float, default=2.0, help="HBM tier size in MiB (default 2)")
    parser.add_argument("--ddr-mb", type=float, default=8.0, help="DDR tier size in MiB (default 8)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    user_cdf, item_cdf = zipf_sampler(args.users, 1.05, rng), zipf_sampler(args.items, 1.1, rng)
    user_perm, item_perm = rng.permutation(args.users), rng.permutation(args.items)
    # hidden model that generates labels: a fixed random vector per id, derived from the id
    hidden_dim = 8

    def hidden(ids: np.ndarray, salt: int) -> torch.Tensor:
        g = np.random.default_rng(salt)
        proj = g.standard_normal((64, hidden_dim))
        bits = ((ids[:, None] >> np.arange(64)) & 1).astype(np.float64) * 2 - 1
        return torch.from_numpy(np.tanh(bits @ proj / 8.0)).float()

    path = args.path or tempfile.mkdtemp(prefix="embcache-demo-")
    config = CacheConfig(hbm_bytes=int(args.hbm_mb * 2**20), ddr_bytes=int(args.ddr_mb * 2**20),
                         path=path, store=args.store)
    tables = [TableConfig(name="user", dim=args.dim, optimizer="rowwise_adagrad", lr=0.1, seed=1),
              TableConfig(name="item", dim=args.dim, optimizer="rowwise_adagrad", lr=0.1, seed=2)]
    start = time.perf_counter()
    with EmbeddingCache(config, tables) as cache:
        cap = {name: cache.capacity_rows(name) for name in ("user", "item")}
        print(f"store: {args.store} at {path}; device: {cache.device}")
        for name, n in (("user", args.users), ("item", args.items)):
            print(f"  {name}: {n:,} ids, HBM holds {cap[name]['hbm']:,} rows, DDR {cap[name]['ddr']:,} rows")
        bar = tqdm(range(args.steps), desc="training", unit="batch", dynamic_ncols=True)
        ema = None
        for _ in bar:
            users = draw(user_cdf, user_perm, args.batch, rng)
            items = draw(item_cdf, item_perm, args.batch, rng)
            logit_true = (hidden(users, 1) * hidden(items, 2)).sum(1) * 2.0
            labels = torch.bernoulli(torch.sigmoid(logit_true))
            u = cache.lookup("user", users).requires_grad_()
            i = cache.lookup("item", items).requires_grad_()
            logits = (u * i).sum(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.device))
            loss.backward()
            assert u.grad is not None and i.grad is not None
            cache.apply_gradients("user", users, u.grad)
            cache.apply_gradients("item", items, i.grad)
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            s = cache.stats()["user"]
            bar.set_postfix(loss=f"{ema:.4f}", hbm=f"{s['hbm']['hits'] / max(s['lookups'], 1):.1%}",
                            ddr=f"{s['ddr']['hits'] / max(s['lookups'], 1):.1%}")
        cache.flush()
        stats = cache.stats()
    elapsed = time.perf_counter() - start
    print(f"\n{args.steps * args.batch:,} samples in {elapsed:.1f} s "
          f"({args.steps * args.batch / elapsed:,.0f} samples/s); final loss (EMA) {ema:.4f}")
    print("\n| table | lookups | HBM hit | DDR hit | SSD hit | created | SSD rows read | SSD rows written |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in stats.items():
        n = max(s["lookups"], 1)
        print(f"| {name} | {s['lookups']:,} | {s['hbm']['hits'] / n:.1%} | {s['ddr']['hits'] / n:.1%} | "
              f"{s['ssd']['hits'] / n:.1%} | {s['ssd']['created'] / n:.1%} | {s['ssd']['read_rows']:,} | "
              f"{s['ssd']['write_rows']:,} |")
    if args.path is None:
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.isdir(path):
        print(f"store kept at {path}; run again with --path to continue training")


if __name__ == "__main__":
    main()
