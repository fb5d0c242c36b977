"""Train a compact DLRM on a synthetic Criteo-like data set, with its 26 embedding tables in embcache.

Run from the repository root::

    python -m examples.dlrm                       # defaults: about 7 min on 2 CPU cores (404 s measured), end to end
    python -m examples.dlrm --mode torch          # the same model with every table in memory
    python -m examples.dlrm --export-dir exports --export-every 4   # a delta of the tables every 4 passes
    python -m examples.dlrm --help

What it does:

1. **Data.** Generates (``examples/synthetic.py``) ``--passes`` training passes of
   ``--samples-per-pass`` samples and one held-out pass (the next "day", for AUC): 13 dense
   features, 26 sparse int64 ids with Zipf popularity drifting from pass to pass, labels from a
   hidden model with a ~25% click rate. Written to disk, read back memory-mapped in batches.
2. **Keysets.** The unique ids of each pass and table with their counts
   (:func:`embcache.keyset.keysets_from_file`), saved next to the data (:func:`save_keysets`).
   They size the cache: each table's ``memory_share`` is the rows two consecutive passes need,
   and by default HBM+DDR hold the largest such pair with 10% to spare (``--hbm-mb``/``--ddr-mb``
   override), while the rows touched over the whole run are several times more.
3. **Model.** DLRM: bottom MLP over the dense features to ``--dim``, one embedding bag per
   categorical feature (``CachedEmbeddingBagCollection``: one cache round trip per step), pairwise
   dot interaction, top MLP to a logit, BCE loss. Dense part: Adam. Embeddings: row-wise AdaGrad
   (``--emb-optimizer``: also ``adagrad`` and the momentum-scaled ``rowwise_adagrad_momentum``),
   applied by the cache inside ``loss.backward()``; rows stored in ``--emb-dtype`` (float32,
   float16, bfloat16), with ``--stochastic-rounding`` rounded stochastically after each update.
4. **Passes** (HugeCTR's Embedding Training Cache protocol, with the next pass staged in the
   background): ``prefetch(keysets[p + 1])`` while pass ``p`` trains, ``begin_pass`` (hottest rows
   in HBM, pinned), ``end_pass`` (dirty rows written back in the background).

Modes (``--mode``):

* ``cache``: the protocol above.
* ``cache-noprefetch``: ``begin_pass``/``end_pass`` without ``prefetch``: each pass's rows are
  staged synchronously when it begins.
* ``cache-nopass``: no pass protocol at all; rows move on demand (lookups miss to disk).
* ``torch``: every table in memory as ``torch.nn.EmbeddingBag(sparse=True)`` (all
  ``n_f`` rows; ids mapped to row indices by inverting the data set's id hash, the usual
  "categorify" step) with a sparse optimizer: ``torch.optim.Adagrad`` for ``adagrad``, and for
  ``rowwise_adagrad`` and ``rowwise_adagrad_momentum`` (which torch lacks) a vectorized step on
  the coalesced sparse gradient with embcache's own update rule. Rows the data touches start
  from the cache's initializer, so ``torch`` and the cache modes train the same model and their
  losses agree to float rounding.

A progress bar shows the loss, samples/s and the current pass's per-tier hit rates; the end
prints a table per pass (hit rates, throughput, staging) and the held-out AUC. ``--json``
writes the same summary as JSON (used by ``bench/bench_dlrm.py``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.init import init_rows
from embcache.keyset import Keyset, KeysetFileError, keyset_file_meta, keysets_from_file, load_keysets, save_keysets
from embcache.nn import CachedEmbeddingBagCollection
from embcache.optim import OptimizerParams, apply_update, initial_state, state_width
from embcache.tier import resident_row_bytes

from .synthetic import N_DENSE, N_SPARSE, Batch, SyntheticConfig, SyntheticDataset, generate_dataset

__all__ = ["DLRM", "MODES", "TABLES", "Trainer", "auc", "build_parser", "main", "run"]

MODES = ("cache", "cache-noprefetch", "cache-nopass", "torch")
EMB_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "rowwise_adagrad_momentum")
TABLES = [f"C{i + 1}" for i in range(N_SPARSE)]
_TIERS = ("hbm", "ddr", "ssd", "created")


# ------------------------------------------------------------------------------------- model
def _mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """The dense part of DLRM: bottom MLP, pairwise dot interaction with the embeddings, top MLP.

    Args:
        dim: embedding dimension (the bottom MLP's output size too).
        bottom: hidden sizes of the bottom MLP (13 -> ... -> dim).
        top: hidden sizes of the top MLP (dim + 27*26/2 -> ... -> 1).
        features: number of embedding bags (26).
    """

    li: torch.Tensor
    lj: torch.Tensor

    def __init__(self, dim: int, bottom: Sequence[int] = (64,), top: Sequence[int] = (128, 64),
                 features: int = N_SPARSE) -> None:
        super().__init__()
        self.bottom = _mlp([N_DENSE, *bottom, dim], last_relu=True)
        n = features + 1
        li, lj = torch.triu_indices(n, n, offset=1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top = _mlp([dim + li.numel(), *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Logits [B] of dense float32 [B, 13] and pooled embeddings [B, 26, dim]."""
        z = self.bottom(dense)
        t = torch.cat([z.unsqueeze(1), emb], dim=1)
        inter = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([z, inter], dim=1)).squeeze(1)


class _TimedCache:
    """The cache as the embedding modules see it, timing their calls (to show what the cache costs per step)."""

    def __init__(self, cache: EmbeddingCache) -> None:
        self.cache = cache
        self.seconds = 0.0

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def tables(self) -> dict[str, TableConfig]:
        return self.cache.tables()

    def lookup(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self.cache.lookup(table, keys)
        finally:
            self.seconds += time.perf_counter() - t0

    def apply_gradients(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            self.cache.apply_gradients(table, keys, grads)
        finally:
            self.seconds += time.perf_counter() - t0

    def lookup_many(self, keys: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return self.cache.lookup_many(keys)
        finally:
            self.seconds += time.perf_counter() - t0

    def apply_gradients_many(self, updates: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        try:
            self.cache.apply_gradients_many(updates)
        finally:
            self.seconds += time.perf_counter() - t0


class CacheEmbeddings(nn.Module):
    """The 26 embedding bags served by an embedding cache (one round trip per step)."""

    def __init__(self, cache: EmbeddingCache, device: torch.device) -> None:
        super().__init__()
        self.timed = _TimedCache(cache)
        # outputs on the model's device (the ids stay on the host: the cache copies them once)
        self.ebc = CachedEmbeddingBagCollection(self.timed, TABLES, mode="sum", device=device)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        """Pooled rows [B, 26, dim] on the model's device of sparse ids [B, 26] (one id per bag, any device)."""
        cols = sparse.t().contiguous().unsqueeze(2)  # [26, B, 1]: each a 2-D input of one-id bags
        out = self.ebc({name: cols[i] for i, name in enumerate(TABLES)})
        return torch.stack([out[name] for name in TABLES], dim=1)

    def step(self) -> None:
        """Nothing: the cache applied the optimizer inside backward."""

    def clear_grads(self) -> None:
        """Nothing to clear."""


class _RowOptimizer:
    """A row-wise rule torch lacks (row-wise AdaGrad, with or without momentum) for sparse
    gradients: embcache's rule on the coalesced rows."""

    def __init__(self, optimizer: str, weights: Sequence[torch.Tensor], cfg: TableConfig) -> None:
        self.optimizer = optimizer
        self.weights = list(weights)
        self.state = [initial_state(optimizer, w.shape[1], w.shape[0], w.device) for w in self.weights]
        self.params = OptimizerParams(lr=cfg.lr, eps=float(cfg.eps or 0.0), beta1=cfg.beta1, beta2=cfg.beta2)

    @torch.no_grad()
    def step(self) -> None:
        for w, s in zip(self.weights, self.state, strict=True):
            if w.grad is None:
                continue
            g = w.grad.coalesce()  # sums duplicate rows, as the cache does
            idx = g.indices()[0]
            new_w, new_s = apply_update(self.optimizer, self.params, w.index_select(0, idx),
                                        s.index_select(0, idx), g.values())
            w.index_copy_(0, idx, new_w)
            s.index_copy_(0, idx, new_s)

    def zero_grad(self) -> None:
        for w in self.weights:
            w.grad = None


class TorchEmbeddings(nn.Module):
    """All 26 tables in memory as ``torch.nn.EmbeddingBag(sparse=True)`` with a sparse optimizer.

    Args:
        data: the data set's config (cardinalities and the id hash to invert).
        tables: the cache's table configs (dim, optimizer, lr, eps, seed, init scale).
        touched: ``{table: Keyset}`` of every id the run uses; their rows start from the cache's
            initializer (the rest from ``torch.rand`` with the same distribution; never used).
        device: where the tables live.
    """

    def __init__(self, data: SyntheticConfig, tables: Sequence[TableConfig], touched: dict[str, Keyset],
                 device: torch.device) -> None:
        super().__init__()
        self.data = data
        self.device = device
        bags: list[nn.EmbeddingBag] = []
        cfg = tables[0]
        for f, t in enumerate(tables):
            n = data.cardinalities[f]
            bag = nn.EmbeddingBag(n, t.dim, mode="sum", sparse=True, device=device)
            with torch.no_grad():
                scale = float(t.init_scale or 0.0)
                bag.weight.uniform_(-scale, scale)
                ids = touched[t.name].keys
                if ids.numel():
                    rows = torch.from_numpy(data.item_of(f, ids.numpy())).to(device)
                    bag.weight[rows] = init_rows(str(t.initializer), scale, t.seed, ids.to(device), t.dim)
            bags.append(bag)
        self.bags = nn.ModuleList(bags)
        weights = [b.weight for b in bags]
        eps = float(cfg.eps or 0.0)
        self.optimizer: Any
        if cfg.optimizer == "adagrad":
            self.optimizer = torch.optim.Adagrad(weights, lr=cfg.lr, eps=eps)
        elif cfg.optimizer in ("rowwise_adagrad", "rowwise_adagrad_momentum"):
            self.optimizer = _RowOptimizer(cfg.optimizer, weights, cfg)
        else:
            raise ValueError(f"torch mode supports {', '.join(EMB_OPTIMIZERS)}, not {cfg.optimizer!r}")

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        """Pooled rows [B, 26, dim] of sparse ids [B, 26]."""
        items = torch.from_numpy(self.data.items_of(sparse.cpu().numpy()).T.copy()).to(self.device)
        return torch.stack([bag(items[f].unsqueeze(1)) for f, bag in enumerate(self.bags)], dim=1)

    def step(self) -> None:
        """The sparse optimizer step."""
        self.optimizer.step()

    def clear_grads(self) -> None:
        """Clear the sparse gradients."""
        self.optimizer.zero_grad()


# ------------------------------------------------------------------------------------- metrics
def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by the rank-sum (Mann-Whitney) formula, ties given their mean rank.

    Args:
        scores: float [n] (any monotone score, e.g. logits).
        labels: [n] of 0/1.

    Returns:
        AUC in [0, 1]; NaN when one class is absent.
    """
    s = scores.detach().double().cpu().reshape(-1)
    y = labels.detach().cpu().reshape(-1) > 0.5
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(s)
    sorted_s = s[order]
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last member
    mean_rank = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(s)
    ranks[order] = mean_rank[inverse]
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _tier_counts(stats: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Lookups and key occurrences served per tier, summed over tables."""
    out = dict.fromkeys(("lookups", *_TIERS), 0)
    for s in stats.values():
        out["lookups"] += s["lookups"]
        out["hbm"] += s["hbm"]["hits"]
        out["ddr"] += s["ddr"]["hits"]
        out["ssd"] += s["ssd"]["hits"]
        out["created"] += s["ssd"]["created"]
    return out


def _rates(now: dict[str, int], before: dict[str, int]) -> dict[str, float]:
    n = now["lookups"] - before["lookups"]
    return {t: (now[t] - before[t]) / n if n else 0.0 for t in _TIERS}


# ------------------------------------------------------------------------------------- run
@dataclass
class _Pass:
    index: int
    samples: int = 0
    seconds: float = 0.0
    begin_seconds: float = 0.0
    loss_sum: float = 0.0
    batches: int = 0
    keyset_rows: int = 0
    staged_rows: int = 0
    cache_seconds: float = 0.0
    counts: dict[str, int] | None = None
    rates: dict[str, float] | None = None

    def row(self) -> dict[str, Any]:
        return {"pass": self.index, "samples": self.samples, "seconds": self.seconds,
                "samples_per_s": self.samples / self.seconds if self.seconds else 0.0,
                "begin_pass_seconds": self.begin_seconds, "loss": self.loss_sum / max(self.batches, 1),
                "keyset_rows": self.keyset_rows, "prefetch_staged_rows": self.staged_rows,
                "batches": self.batches, "cache_call_seconds": self.cache_seconds,
                "lookups": (self.counts or {}).get("lookups", 0), "tier_counts": dict(self.counts or {}),
                "hit_rates": self.rates or {}}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m examples.dlrm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="cache", help="how the tables are served (default cache)")
    p.add_argument("--passes", type=_positive, default=32, help="training passes (default 32); one more is held out")
    p.add_argument("--samples-per-pass", type=_positive, default=50_000, help="samples per pass (default 50,000)")
    p.add_argument("--eval-samples", type=_positive, default=None, help="held-out samples (default: samples per pass)")
    p.add_argument("--batch", type=_positive, default=2048, help="samples per batch (default 2048)")
    p.add_argument("--dim", type=_positive, default=16, help="embedding dimension (default 16)")
    p.add_argument("--scale", type=float, default=0.3,
                   help="table cardinalities = Criteo Kaggle's x scale (default 0.3: up to 3M ids per table; "
                        "4: up to 41M, Terabyte-like)")
    p.add_argument("--drift", type=float, default=0.02, help="new hot ids per pass, x sqrt(cardinality)")
    p.add_argument("--hbm-mb", type=float, default=None,
                   help="HBM tier in MiB (default: what the largest pass needs, +10%%; see _memory_plan)")
    p.add_argument("--ddr-mb", type=float, default=None,
                   help="DDR tier in MiB (default: room to stage the next pass's new rows, +10%%)")
    p.add_argument("--store", choices=["rocksdb", "lmdb"], default="rocksdb", help="cold tier (default rocksdb)")
    p.add_argument("--path", default=None,
                   help="working directory; its cache/ is made afresh (default: a temporary one, removed at exit)")
    p.add_argument("--data", default=None,
                   help="data set directory, reused when it holds the same data set (default: under --path)")
    p.add_argument("--threads", type=int, default=0, help="torch (and numba) threads; 0 = number of cores")
    p.add_argument("--seed", type=int, default=0, help="seed of the data set and of the dense model")
    p.add_argument("--emb-optimizer", choices=EMB_OPTIMIZERS, default="rowwise_adagrad",
                   help="embedding optimizer (default rowwise_adagrad; rowwise_adagrad_momentum: momentum-scaled, "
                        "its momentum --emb-momentum)")
    p.add_argument("--emb-momentum", type=float, default=0.9,
                   help="momentum of rowwise_adagrad_momentum (TableConfig.beta1, default 0.9)")
    p.add_argument("--emb-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="storage dtype of the embedding rows (cache modes; default float32)")
    p.add_argument("--stochastic-rounding", action="store_true",
                   help="round updated float16/bfloat16 rows stochastically (cache modes; needs --emb-dtype)")
    p.add_argument("--emb-lr", type=float, default=0.05, help="embedding learning rate (default 0.05)")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate of the dense part (default 0.002)")
    p.add_argument("--bottom-mlp", default="512,256,64",
                   help="hidden sizes of the bottom MLP (default 512,256,64: DLRM's Criteo Kaggle configuration)")
    p.add_argument("--top-mlp", default="512,256", help="hidden sizes of the top MLP (default 512,256)")
    p.add_argument("--admit-after", type=int, default=0,
                   help="admission of new ids (cache modes): an id gets a trained row once looked up this many "
                        "times (default 0: at once)")
    p.add_argument("--export-dir", default=None,
                   help="export the tables here (embcache's open format: a full version, then deltas)")
    p.add_argument("--export-every", type=_positive, default=1,
                   help="with --export-dir: export after every N training passes (default 1)")
    p.add_argument("--ttl-steps", type=int, default=0,
                   help="expiry (cache modes): a row not looked up or updated for this many steps of its table's "
                        "clock (one step per id looked up in the table; a batch moves it --batch steps) is deleted "
                        "from memory and the store; a sweep runs after each pass (default 0: rows never expire)")
    p.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _set_threads(n: int) -> int:
    n = n if n > 0 else (os.cpu_count() or 1)
    torch.set_num_threads(n)
    with contextlib.suppress(Exception):  # numba may be built without threading layers, or capped lower
        import numba

        numba.set_num_threads(min(n, int(getattr(numba.config, "NUMBA_NUM_THREADS", n))))
    return n


def _dataset(args: argparse.Namespace, root: str) -> SyntheticDataset:
    """Open the data set at ``root`` if it is the one asked for, else generate it there."""
    cfg = SyntheticConfig(seed=args.seed, scale=args.scale, drift=args.drift)
    counts = [args.samples_per_pass] * args.passes + [args.eval_samples or args.samples_per_pass]
    if os.path.exists(os.path.join(root, "meta.json")):
        with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
            ds = SyntheticDataset(root)
            if ds.config == cfg and ds.samples == counts:
                return ds
        shutil.rmtree(root, ignore_errors=True)
    return generate_dataset(root, cfg, counts, progress=not args.no_progress)


def _keysets(ds: SyntheticDataset, progress: bool) -> list[dict[str, Keyset]]:
    """Keysets of every pass, computed once and saved next to the data (reloaded when valid)."""
    out = []
    for p in range(ds.passes):
        path = os.path.join(ds.root, f"pass_{p:03d}", "keysets.npz")
        if os.path.exists(path):
            try:
                if keyset_file_meta(path) == {"pass": p, "samples": ds.samples[p]}:
                    out.append(load_keysets(path, TABLES))
                    continue
            except KeysetFileError:
                pass  # damaged or stale: compute again
        ks = keysets_from_file(ds.path(p, "sparse"), TABLES, progress=progress, desc=f"keysets {p}")
        save_keysets(path, ks, meta={"pass": p, "samples": ds.samples[p]})
        out.append(ks)
    return out


def _union(keysets: Sequence[dict[str, Keyset]]) -> dict[str, Keyset]:
    out = dict(keysets[0])
    for ks in keysets[1:]:
        out = {t: out[t].merge(ks[t]) for t in TABLES}
    return out


def _memory_plan(keysets: Sequence[dict[str, Keyset]], row_bytes: int) -> tuple[int, int, dict[str, float]]:
    """Default HBM and DDR bytes and each table's ``memory_share``, from the passes' keysets.

    As in HugeCTR's Embedding Training Cache, HBM holds the current pass and host memory the
    next one while it is staged. A table's share is the rows of its largest pass (+2 for
    rounding); HBM holds 110% of the shares, so every pass fits in HBM; DDR adds what the
    table needing the most extra room for its next pass's new rows asks for (+10%).
    """
    pairs = [{t: len(a[t].merge(b[t])) for t in TABLES} for a, b in itertools.pairwise(keysets)]
    single = {t: max(len(k[t]) for k in keysets) for t in TABLES}
    need = {t: max((p[t] for p in pairs), default=single[t]) for t in TABLES}
    shares = {t: float(single[t] + 2) for t in TABLES}
    total = sum(shares.values())
    ddr_frac = max(0.1, max(1.1 * need[t] / shares[t] for t in TABLES) - 1.1)
    return int(1.1 * total * row_bytes), int(ddr_frac * total * row_bytes), shares


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Generate the data, train, evaluate; returns the summary (also printed by :func:`main`).

    Raises:
        ValueError: an option is out of range.
    """
    with Trainer(args) as trainer:
        for p in range(trainer.train_passes):
            trainer.train_pass(p)
        return trainer.finish()


class Trainer:
    """One run of the example, steppable pass by pass (``bench/bench_dlrm.py`` interleaves several).

    ``Trainer(args)`` generates (or reuses) the data, computes the keysets, builds the model and
    the cache; ``train_pass(p)`` trains pass ``p`` (passes in order); ``drain()`` waits for the
    cache's background work (prefetch, write-back); ``finish()`` evaluates on the held-out pass
    and returns the summary. Use as a context manager: the cache is closed and a temporary
    working directory removed at exit.

    Args:
        args: options from :func:`build_parser`.

    Raises:
        ValueError: an option is out of range.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        if min(args.passes, args.samples_per_pass, args.batch, args.dim, args.eval_samples or 1) < 1:
            raise ValueError("--passes, --samples-per-pass, --eval-samples, --batch and --dim must be >= 1")
        if args.export_dir and args.mode == "torch":
            raise ValueError("--export-dir exports the cache's tables: it needs a cache mode, not --mode torch")
        self.args = args
        self.threads = _set_threads(args.threads)
        self.progress = not args.no_progress
        self._temp = args.path is None
        self.path = tempfile.mkdtemp(prefix="embcache-dlrm-") if self._temp else args.path
        os.makedirs(self.path, exist_ok=True)
        atexit.register(self.close)  # also on Ctrl-C
        self.cache: EmbeddingCache | None = None
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        args = self.args
        t_start = self.t_start = time.perf_counter()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.ds = _dataset(args, args.data or os.path.join(self.path, "data"))
        t_data = time.perf_counter()
        self.keysets = _keysets(self.ds, self.progress)
        t_keysets = time.perf_counter()
        self.touched = _union(self.keysets)
        if args.admit_after and args.mode == "torch":
            raise SystemExit("--admit-after needs a cache mode (the torch mode keeps every row)")
        if args.ttl_steps and args.mode == "torch":
            raise SystemExit("--ttl-steps needs a cache mode (the torch mode keeps every row)")
        if args.ttl_steps < 0:
            raise SystemExit("--ttl-steps must be >= 0")
        if args.mode == "torch" and (args.emb_dtype != "float32" or args.stochastic_rounding):
            raise SystemExit("--emb-dtype and --stochastic-rounding need a cache mode (the torch mode is float32)")
        if args.stochastic_rounding and args.emb_dtype == "float32":
            raise SystemExit("--stochastic-rounding needs --emb-dtype float16 or bfloat16")
        tables = [TableConfig(name=t, dim=args.dim, optimizer=args.emb_optimizer, lr=args.emb_lr, seed=i + 1,
                              beta1=args.emb_momentum, admit_after=args.admit_after, ttl_steps=args.ttl_steps,
                              dtype=args.emb_dtype, stochastic_rounding=args.stochastic_rounding)
                  for i, t in enumerate(TABLES)]
        # the HBM tier's rows, on the device the cache puts it on (a GPU's cost more than the host's)
        self.row_bytes = resident_row_bytes(args.dim, tables[0].torch_dtype, state_width(args.emb_optimizer, args.dim),
                                            self.device)
        hbm_bytes, ddr_bytes, shares = _memory_plan(self.keysets, self.row_bytes)
        self.hbm_bytes = int(args.hbm_mb * 2**20) if args.hbm_mb is not None else hbm_bytes
        self.ddr_bytes = int(args.ddr_mb * 2**20) if args.ddr_mb is not None else ddr_bytes
        tables = [TableConfig(**{**t.to_dict(), "memory_share": shares[t.name]}) for t in tables]

        torch.manual_seed(args.seed)
        self.model = DLRM(args.dim, _sizes(args.bottom_mlp), _sizes(args.top_mlp)).to(self.device)
        self.dense_opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.emb: CacheEmbeddings | TorchEmbeddings
        if args.mode == "torch":
            self.emb = TorchEmbeddings(self.ds.config, tables, self.touched, self.device)
        else:
            cache_path = os.path.join(self.path, "cache")
            shutil.rmtree(cache_path, ignore_errors=True)  # train from scratch: the dense model starts fresh too
            self.cache = EmbeddingCache(CacheConfig(hbm_bytes=self.hbm_bytes, ddr_bytes=self.ddr_bytes,
                                                    path=cache_path, store=args.store, device=str(self.device)),
                                        tables)
            self.emb = CacheEmbeddings(self.cache, self.device)
        self.passes_on = args.mode in ("cache", "cache-noprefetch")
        self.prefetch_on = args.mode == "cache"
        self.train_passes = self.ds.passes - 1
        self.rows: list[_Pass] = []
        self.exports: list[dict[str, Any]] = []  # --export-dir: one entry per version written
        self._write_backs: list[Any] = []
        self._prefetches: list[Any] = []
        self._bar = tqdm(total=sum(math.ceil(self.ds.samples[p] / args.batch) for p in range(self.train_passes)),
                         desc="train", unit="batch", disable=not self.progress, dynamic_ncols=True)
        self.seconds = {"data": t_data - t_start, "keysets": t_keysets - t_data,
                        "setup": time.perf_counter() - t_keysets, "train": 0.0}

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the cache and remove a temporary working directory (idempotent)."""
        if self.cache is not None:
            cache, self.cache = self.cache, None
            cache.close()
        if self._temp:
            shutil.rmtree(self.path, ignore_errors=True)
        atexit.unregister(self.close)

    def _counts(self) -> dict[str, int]:
        if self.cache is None:
            return dict.fromkeys(("lookups", *_TIERS), 0)
        return _tier_counts(self.cache.stats())

    def _cache_seconds(self) -> float:
        return self.emb.timed.seconds if isinstance(self.emb, CacheEmbeddings) else 0.0

    def _export(self, cache: EmbeddingCache, p: int) -> None:
        """Export the rows changed since the last export (the first: every row) as the next version."""
        r = cache.export_delta(self.args.export_dir)
        self.exports.append({"pass": p + 1, "version": r.version, "kind": r.kind, "rows": r.rows,
                             "deleted": r.deleted, "seconds": r.seconds})
        self.seconds["export"] = self.seconds.get("export", 0.0) + r.seconds

    def train_pass(self, p: int) -> dict[str, Any]:
        """Train pass ``p`` (the next one): begin_pass, prefetch of p + 1, its batches, end_pass; its row."""
        if p != len(self.rows) or p >= self.train_passes:
            raise ValueError(f"passes run in order: expected pass {len(self.rows)}, got {p}")
        cache, device = self.cache, self.device
        row = _Pass(p, keyset_rows=sum(len(k) for k in self.keysets[p].values()))
        t0 = time.perf_counter()
        before, staged_before, cache_s0 = self._counts(), _staged(cache), self._cache_seconds()
        if self.prefetch_on and cache is not None and p == 0:
            self._prefetches.append(cache.prefetch(self.keysets[0]))
        if self.passes_on and cache is not None:
            cache.begin_pass(self.keysets[p])
            if self.prefetch_on:  # the next pass (the last training pass prefetches the held-out pass)
                self._prefetches = [cache.prefetch(self.keysets[p + 1])]
        row.begin_seconds = time.perf_counter() - t0
        self.model.train()
        self.emb.train()
        loss_acc = torch.zeros((), device=device)
        last_refresh = time.perf_counter()
        for i, batch in enumerate(_batches(self.ds, p, self.args.batch, device)):
            logits = self.model(batch.dense, self.emb(batch.sparse))
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            self.dense_opt.zero_grad(set_to_none=True)
            self.emb.clear_grads()
            loss.backward()  # the cache applies the embeddings' optimizer here
            self.dense_opt.step()
            self.emb.step()
            loss_acc += loss.detach()
            row.samples += batch.labels.numel()
            row.batches += 1
            self._bar.update(1)
            now = time.perf_counter()
            if self.progress and (now - last_refresh > 0.5 or i == 0):
                last_refresh = now
                post = {"pass": f"{p + 1}/{self.train_passes}", "loss": f"{float(loss_acc) / row.batches:.4f}",
                        "samples/s": f"{row.samples / (now - t0):,.0f}"}
                if cache is not None:
                    r = _rates(self._counts(), before)
                    post.update({t: f"{r[t]:.0%}" for t in _TIERS})
                self._bar.set_postfix(post, refresh=False)
        row.loss_sum = float(loss_acc)
        if self.passes_on and cache is not None:
            self._write_backs.append(cache.end_pass())
        if self.args.ttl_steps and cache is not None:
            cache.expire_now()  # rows not touched for --ttl-steps go (unpinned: the pass has ended)
        row.seconds = time.perf_counter() - t0
        if self.args.export_dir and cache is not None and (p + 1) % self.args.export_every == 0:
            self._export(cache, p)
        after = self._counts()
        row.counts = {k: v - before[k] for k, v in after.items()}
        row.rates = _rates(after, before) if cache is not None else {}
        row.staged_rows = _staged(cache) - staged_before
        row.cache_seconds = self._cache_seconds() - cache_s0
        self.seconds["train"] += row.seconds
        self.rows.append(row)
        if p == self.train_passes - 1:
            self._bar.close()
        return row.row()

    def drain(self) -> float:
        """Wait for this run's background work (write-backs, prefetch); the seconds waited."""
        t0 = time.perf_counter()
        for f in [*self._write_backs, *self._prefetches]:
            with contextlib.suppress(CancelledError):
                f.result()
        self._write_backs = [f for f in self._write_backs if not f.done()]
        return time.perf_counter() - t0

    def finish(self) -> dict[str, Any]:
        """Evaluate on the held-out pass (AUC, log loss) and return the summary; closes the cache."""
        if len(self.rows) != self.train_passes:
            raise ValueError(f"train all {self.train_passes} passes first ({len(self.rows)} done)")
        t_wb = time.perf_counter()
        for f in self._write_backs:
            f.result()
        self.seconds["train"] += time.perf_counter() - t_wb
        cache, ds = self.cache, self.ds
        eval_pass = ds.passes - 1
        t_eval = time.perf_counter()
        ev = _Pass(eval_pass, keyset_rows=sum(len(k) for k in self.keysets[eval_pass].values()))
        before = self._counts()
        if self.passes_on and cache is not None:
            cache.begin_pass(self.keysets[eval_pass])
        self.model.eval()
        self.emb.eval()
        scores, labels = [], []
        with torch.no_grad():
            for batch in tqdm(_batches(ds, eval_pass, self.args.batch, self.device), desc="eval", unit="batch",
                              total=math.ceil(ds.samples[eval_pass] / self.args.batch), disable=not self.progress,
                              dynamic_ncols=True):
                scores.append(self.model(batch.dense, self.emb(batch.sparse)).float().cpu())
                labels.append(batch.labels.cpu())
                ev.samples += batch.labels.numel()
        if self.passes_on and cache is not None:
            cache.end_pass().result()
        ev.seconds = time.perf_counter() - t_eval
        after = self._counts()
        ev.counts = {k: v - before[k] for k, v in after.items()}
        ev.rates = _rates(after, before) if cache is not None else {}
        s, y = torch.cat(scores), torch.cat(labels)
        capacity_rows = 0
        if cache is not None:
            capacity_rows = sum(sum(cache.capacity_rows(t).values()) for t in TABLES)
            cache.flush()
        rows = self.rows
        steady = [r.samples / r.seconds for r in rows[1:] if r.seconds > 0] or [rows[0].samples / rows[0].seconds]
        train_samples = sum(r.samples for r in rows)
        touched_rows = sum(len(k) for k in self.touched.values())
        area = auc(s, y)
        final_stats = cache.stats() if cache is not None else {}
        summary = {
            "mode": self.args.mode, "threads": self.threads, "device": str(self.device), "torch": torch.__version__,
            "options": {k: v for k, v in vars(self.args).items() if k != "json"},
            "passes": [r.row() for r in rows],
            "eval": {**ev.row(), "auc": area, "logloss": float(F.binary_cross_entropy_with_logits(s, y)),
                     "positive_rate": float(y.mean())},
            "auc": area,
            "train_samples": train_samples,
            "samples_per_s": train_samples / self.seconds["train"],
            "samples_per_s_median_pass": float(np.median(steady)),
            "first_pass_loss": rows[0].loss_sum / max(rows[0].batches, 1),
            "last_pass_loss": rows[-1].loss_sum / max(rows[-1].batches, 1),
            "tier_hit_rates": _rates(after, dict.fromkeys(("lookups", *_TIERS), 0)) if cache is not None else {},
            "cardinalities": list(ds.config.cardinalities), "table_rows": sum(ds.config.cardinalities),
            "touched_rows": touched_rows, "row_bytes": self.row_bytes,
            "hbm_bytes": self.hbm_bytes, "ddr_bytes": self.ddr_bytes, "memory_rows": capacity_rows,
            "touched_over_memory": touched_rows / capacity_rows if capacity_rows else None,
            "admission": ({k: sum(s["admission"][k] for s in final_stats.values())
                           for k in ("unadmitted_lookups", "dropped_updates", "admitted_rows")}
                          if final_stats else {}),
            "exports": self.exports,
            "expiry": ({k: sum(s["expiry"][k] for s in final_stats.values())
                        for k in ("expired_hbm", "expired_ddr", "expired_store", "sweeps")}
                       if final_stats else {}),
            "seconds": {**self.seconds, "eval": time.perf_counter() - t_eval,
                        "total": time.perf_counter() - self.t_start},
        }
        self.close()
        return summary


def _batches(ds: SyntheticDataset, p: int, batch: int, device: torch.device) -> Iterator[Batch]:
    for b in ds.batches(p, batch):
        yield Batch(b.dense.to(device, non_blocking=True), b.sparse, b.labels.to(device, non_blocking=True))


def _staged(cache: EmbeddingCache | None) -> int:
    if cache is None:
        return 0
    return sum(int(s["prefetch"]["staged_rows"]) for s in cache.stats().values())


def _print_summary(s: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    cache = s["mode"] != "torch"

    def pct(x: float) -> str:
        return f"{x:.1%}"

    print(f"\nDLRM, mode {s['mode']}: {s['train_samples']:,} training samples in {s['seconds']['train']:.1f} s "
          f"({s['samples_per_s']:,.0f} samples/s overall, {s['samples_per_s_median_pass']:,.0f} median pass "
          f"after the first); {s['threads']} threads on {s['device']}", file=out)
    if cache:
        print(f"tables: {s['table_rows']:,} rows, {s['touched_rows']:,} touched by the run = "
              f"{s['touched_over_memory']:.1f}x the {s['memory_rows']:,} rows HBM+DDR hold "
              f"(HBM {s['hbm_bytes'] / 2**20:.1f} MiB, DDR {s['ddr_bytes'] / 2**20:.1f} MiB, "
              f"{s['row_bytes']} B/row)", file=out)
    print("", file=out)
    head = ["pass", "samples", "s", "samples/s", "loss", "keyset rows"]
    if cache:
        head += ["HBM hit", "DDR hit", "SSD hit", "created", "staged ahead", "begin_pass s"]
    print("| " + " | ".join(head) + " |", file=out)
    print("|" + "---|" * len(head), file=out)
    for r in [*s["passes"], {**s["eval"], "pass": "held-out"}]:
        cells = [str(r["pass"]), f"{r['samples']:,}", f"{r['seconds']:.1f}", f"{r['samples_per_s']:,.0f}",
                 f"{r['loss']:.4f}" if r["pass"] != "held-out" else f"{s['eval']['logloss']:.4f}",
                 f"{r['keyset_rows']:,}"]
        if cache:
            h = r["hit_rates"]
            cells += [pct(h.get("hbm", 0)), pct(h.get("ddr", 0)), pct(h.get("ssd", 0)), pct(h.get("created", 0)),
                      f"{r['prefetch_staged_rows']:,}", f"{r['begin_pass_seconds']:.2f}"]
        print("| " + " | ".join(cells) + " |", file=out)
    print(f"\nheld-out AUC {s['auc']:.4f}, log loss {s['eval']['logloss']:.4f} "
          f"(click rate {s['eval']['positive_rate']:.1%}); loss {s['first_pass_loss']:.4f} (first pass) -> "
          f"{s['last_pass_loss']:.4f} (last pass)", file=out)
    for e in s.get("exports", []):
        print(f"export after pass {e['pass']}: version {e['version']} ({e['kind']}), {e['rows']:,} rows, "
              f"{e['deleted']:,} deleted, {e['seconds']:.2f} s", file=out)
    sec = s["seconds"]
    print(f"time: data {sec['data']:.1f} s, keysets {sec['keysets']:.1f} s, setup {sec['setup']:.1f} s, "
          f"train {sec['train']:.1f} s, eval {sec['eval']:.1f} s, total {sec['total']:.1f} s", file=out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run, print the summary table (and write ``--json``); returns the summary."""
    args = build_parser().parse_args(argv)
    summary = run(args)
    _print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
