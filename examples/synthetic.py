"""A synthetic Criteo-like click data set: deterministic, Zipf-popular sparse ids, drifting passes.

Each sample has 13 dense float features, 26 categorical features (one id per feature) and a 0/1
label, like the Criteo click logs DLRM is trained on. The data set is split into passes (think
days); pass ``p`` is a pure function of ``(config, p)``.

* **Ids.** Feature ``f`` has ``n_f`` items (Criteo Kaggle's cardinalities times ``scale``: from
  a handful up to 10M at ``scale=1``; ``scale=4`` gives four tables of 22M-41M items, the size of
  Criteo Terabyte's largest, and nothing is materialized per item, so any scale costs the same
  per sample). An item index ``i`` in ``[0, n_f)`` is written as the
  sparse int64 id ``fmix64(i ^ salt_f)`` (murmur3's 64-bit finalizer, a bijection), so ids are
  scattered over the whole int64 range like hashed Criteo values; :meth:`SyntheticConfig.item_of`
  inverts it (the dense index a plain ``torch.nn.EmbeddingBag`` needs).
* **Popularity.** Ranks follow a Zipf law with exponent ``alpha_f`` in ``alpha_range`` (a
  continuous power law on ``[1, n_f + 1)`` inverted in closed form, so no per-feature CDF table
  is needed). **Drift:** in pass ``p`` the item of rank ``r`` is ``(r - p * k_f) mod n_f`` with
  ``k_f = floor(drift * sqrt(n_f))``: every pass ``k_f`` items from the cold end of the index
  range become the hottest and every other item slides ``k_f`` ranks colder.
* **Labels** come from a hidden model: ``logit = bias + cat_signal * sum_f s_f w_f(id_f) +
  dense_signal * sum_j v_j z_j`` where ``w_f`` is a hash-derived weight per id (uniform with
  unit variance), ``s_f`` a per-feature importance, ``z_j`` the standard-normal latent behind
  dense feature ``j``, and ``bias`` is solved so that the mean click probability is
  ``base_rate`` (Criteo's is about 25%). ``label ~ Bernoulli(sigmoid(logit))``.
* **Dense features** are ``log1p`` of counts ``floor(exp(mu_j + sigma_j z_j))``, as DLRM's
  Criteo preprocessing takes ``log(x + 1)`` of the integer features.

On disk: ``root/meta.json`` and per pass ``root/pass_NNN/{dense,sparse,label}.npy`` (float32
``[N, 13]``, int64 ``[N, 26]``, float32 ``[N]``), read back memory-mapped in batches. Samples
are generated in fixed blocks of 65,536, each from its own seeded generator, so the bytes do
not depend on how the work is chunked. About 1M samples per few seconds, vectorized numpy.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

__all__ = [
    "CRITEO_CARDINALITIES",
    "N_DENSE",
    "N_SPARSE",
    "Batch",
    "SyntheticConfig",
    "SyntheticDataset",
    "generate_dataset",
]

N_DENSE = 13
N_SPARSE = 26
#: Criteo Kaggle (Display Advertising Challenge) cardinalities of C1..C26.
CRITEO_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
    10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
_BLOCK = 1 << 16  # samples per seeded generator block: the bytes do not depend on write chunks
_FORMAT = "embcache-synthetic-criteo"
_VERSION = 1
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_C1_INV = np.uint64(pow(0xFF51AFD7ED558CCD, -1, 1 << 64))
_C2_INV = np.uint64(pow(0xC4CEB9FE1A85EC53, -1, 1 << 64))
_S33 = np.uint64(33)


def _fmix64(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer (a bijection of uint64), in place on a uint64 array."""
    x ^= x >> _S33
    x *= _C1
    x ^= x >> _S33
    x *= _C2
    x ^= x >> _S33
    return x


def _fmix64_inverse(x: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_fmix64` (``x ^= x >> 33`` is its own inverse), in place."""
    x ^= x >> _S33
    x *= _C2_INV
    x ^= x >> _S33
    x *= _C1_INV
    x ^= x >> _S33
    return x


def _salts(seed: int, stream: int) -> np.ndarray:
    """One uint64 salt per sparse feature, derived from the seed."""
    return np.random.default_rng([seed, stream, 0x5A17]).integers(0, 2**63, N_SPARSE, dtype=np.int64).astype(np.uint64)


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the synthetic data set (every field feeds the bytes; same config, same data).

    Args:
        seed: the data set's seed.
        scale: cardinalities are Criteo Kaggle's times ``scale`` (default 0.1: up to ~1M items);
            small features keep at least ``min(Criteo's, 10)`` items.
        max_cardinality: cap on any feature's items (None: no cap).
        alpha_range: Zipf exponents of the features, spread evenly over this range in a seeded order.
        drift: new hot items per pass, as a multiple of ``sqrt(n_f)`` (0 = stationary).
        base_rate: mean click probability (Criteo's is about 0.25).
        cat_signal: weight of the categorical part of the hidden logit.
        dense_signal: weight of the dense part of the hidden logit.
    """

    seed: int = 0
    scale: float = 0.1
    max_cardinality: int | None = None
    alpha_range: tuple[float, float] = (1.05, 1.2)
    drift: float = 0.02
    base_rate: float = 0.25
    cat_signal: float = 1.6
    dense_signal: float = 0.8
    cardinalities: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.scale > 0 or not math.isfinite(self.scale):
            raise ValueError(f"scale={self.scale!r}: must be a finite number > 0")
        lo, hi = self.alpha_range
        if not 1.0 < lo <= hi:
            raise ValueError(f"alpha_range={self.alpha_range!r}: need 1 < low <= high")
        if not 0.0 < self.base_rate < 1.0:
            raise ValueError(f"base_rate={self.base_rate!r}: must be in (0, 1)")
        if self.drift < 0:
            raise ValueError(f"drift={self.drift!r}: must be >= 0")
        cards = [max(min(c, 10), round(c * self.scale)) for c in CRITEO_CARDINALITIES]
        if self.max_cardinality is not None:
            cards = [min(c, max(int(self.max_cardinality), 1)) for c in cards]
        object.__setattr__(self, "cardinalities", tuple(int(c) for c in cards))

    # -------------------------------------------------------------- derived constants
    @property
    def alphas(self) -> np.ndarray:
        """Zipf exponent per feature (float64 [26])."""
        lo, hi = self.alpha_range
        order = np.random.default_rng([self.seed, 1]).permutation(N_SPARSE)
        return lo + (hi - lo) * order / max(N_SPARSE - 1, 1)

    @property
    def drift_steps(self) -> np.ndarray:
        """Ranks every item slides per pass, per feature (int64 [26])."""
        n = np.asarray(self.cardinalities, dtype=np.float64)
        return np.floor(self.drift * np.sqrt(n)).astype(np.int64)

    @property
    def importance(self) -> np.ndarray:
        """Weight ``s_f`` of each feature in the hidden logit (float64 [26], squares sum to 1)."""
        s = np.random.default_rng([self.seed, 2]).uniform(0.2, 1.0, N_SPARSE)
        return s / np.sqrt((s * s).sum())

    @property
    def dense_params(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mu, sigma, v): log-count location and spread, and hidden weight of each dense feature."""
        g = np.random.default_rng([self.seed, 3])
        mu, sigma = g.uniform(0.0, 4.0, N_DENSE), g.uniform(0.5, 1.5, N_DENSE)
        v = g.standard_normal(N_DENSE)
        return mu, sigma, v / np.sqrt((v * v).sum())

    def ids_of(self, feature: int, items: np.ndarray) -> np.ndarray:
        """Sparse int64 ids of item indices (``[0, n_f)``) of one feature (a bijection)."""
        x = np.asarray(items, dtype=np.int64).astype(np.uint64) ^ _salts(self.seed, 0)[feature]
        return _fmix64(x).view(np.int64)

    def item_of(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """Item indices (int64) of sparse ids of one feature: the inverse of :meth:`ids_of`."""
        x = _fmix64_inverse(np.array(ids, dtype=np.int64).view(np.uint64))
        return (x ^ _salts(self.seed, 0)[feature]).view(np.int64)

    def items_of(self, ids: np.ndarray) -> np.ndarray:
        """Item indices (int64 [n, 26]) of a batch of sparse ids ``[n, 26]``: :meth:`item_of` per column."""
        x = _fmix64_inverse(np.array(ids, dtype=np.int64).view(np.uint64))
        return (x ^ _salts(self.seed, 0)).view(np.int64)

    def weights_of(self, ids: np.ndarray) -> np.ndarray:
        """Hidden per-id weights ``w_f`` (float64, uniform, unit variance) of ids ``[n, 26]``."""
        x = np.array(ids, dtype=np.int64).view(np.uint64) ^ _salts(self.seed, 1)
        u = (_fmix64(x) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        return (2.0 * u - 1.0) * math.sqrt(3.0)

    # -------------------------------------------------------------- sampling
    def _ranks(self, u: np.ndarray) -> np.ndarray:
        """Zipf ranks (int64 [n, 26]) from uniforms in [0, 1): inverse CDF of x^-a on [1, n + 1)."""
        n = np.asarray(self.cardinalities, dtype=np.float64)
        one_a = 1.0 - self.alphas
        tail = 1.0 - (n + 1.0) ** one_a  # mass of [1, n + 1) up to normalization
        x = np.exp(np.log1p(-u * tail) / one_a)
        return np.minimum(x.astype(np.int64) - 1, np.asarray(self.cardinalities) - 1)

    def _latent(self, pass_index: int, block: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids [n, 26], dense latents z [n, 13], label uniforms [n]) of one block of one pass."""
        g = np.random.default_rng([self.seed, 100 + pass_index, block])
        ranks = self._ranks(g.random((n, N_SPARSE)))
        cards = np.asarray(self.cardinalities, dtype=np.int64)
        items = np.mod(ranks - pass_index * self.drift_steps, cards)
        ids = _fmix64(items.astype(np.uint64) ^ _salts(self.seed, 0)).view(np.int64)
        return ids, g.standard_normal((n, N_DENSE)), g.random(n)

    def _raw_logits(self, ids: np.ndarray, z: np.ndarray) -> np.ndarray:
        _, _, v = self.dense_params
        return self.cat_signal * (self.weights_of(ids) @ self.importance) + self.dense_signal * (z @ v)

    @property
    def bias(self) -> float:
        """The logit offset giving a mean click probability of ``base_rate`` (solved on a pilot block)."""
        ids, z, _ = self._latent(0, 0, _BLOCK)
        raw = self._raw_logits(ids, z)
        lo, hi = -20.0, 20.0
        for _ in range(60):  # bisection: the mean probability rises with the bias
            mid = 0.5 * (lo + hi)
            if (1.0 / (1.0 + np.exp(-(raw + mid)))).mean() < self.base_rate:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def block(self, pass_index: int, block: int, n: int, bias: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dense float32 [n, 13], sparse int64 [n, 26], label float32 [n]) of one block of a pass."""
        ids, z, u = self._latent(pass_index, block, n)
        mu, sigma, _ = self.dense_params
        dense = np.log1p(np.floor(np.exp(mu + sigma * z))).astype(np.float32)
        p = 1.0 / (1.0 + np.exp(-(self._raw_logits(ids, z) + bias)))
        return dense, ids, (u < p).astype(np.float32)

    def to_json(self) -> dict[str, object]:
        """The fields, for meta.json."""
        d = asdict(self)
        d["alpha_range"] = list(self.alpha_range)
        d["cardinalities"] = list(self.cardinalities)
        return d


class Batch(NamedTuple):
    """One batch: dense float32 [B, 13], sparse int64 ids [B, 26], labels float32 [B]."""

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor


class SyntheticDataset:
    """A generated data set on disk (see :func:`generate_dataset`), read memory-mapped.

    Args:
        root: the directory :func:`generate_dataset` wrote.

    Raises:
        FileNotFoundError: ``root`` has no meta.json.
        ValueError: meta.json is not of this format and version.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)
        with open(os.path.join(self.root, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            raise ValueError(f"{self.root!r} is not a synthetic data set of version {_VERSION}")
        cfg = dict(meta["config"])
        cfg.pop("cardinalities", None)
        cfg["alpha_range"] = tuple(cfg["alpha_range"])
        self.config = SyntheticConfig(**cfg)
        self.samples: list[int] = [int(n) for n in meta["samples"]]

    @property
    def passes(self) -> int:
        """Number of passes on disk."""
        return len(self.samples)

    def path(self, pass_index: int, what: str) -> str:
        """Path of ``dense``, ``sparse`` or ``label`` .npy of a pass."""
        return os.path.join(self.root, f"pass_{pass_index:03d}", f"{what}.npy")

    def arrays(self, pass_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dense, sparse, label) of a pass, memory-mapped read-only."""
        return tuple(np.load(self.path(pass_index, w), mmap_mode="r")  # type: ignore[return-value]
                     for w in ("dense", "sparse", "label"))

    def batches(self, pass_index: int, batch_size: int, start: int = 0, stop: int | None = None,
                drop_last: bool = False) -> Iterator[Batch]:
        """Batches of a pass in order, copied out of the memory maps as tensors.

        Args:
            pass_index: the pass.
            batch_size: samples per batch.
            start, stop: the sample range (default the whole pass).
            drop_last: skip a last batch smaller than ``batch_size``.
        """
        dense, sparse, label = self.arrays(pass_index)
        stop = len(label) if stop is None else min(stop, len(label))
        for lo in range(start, stop, batch_size):
            hi = min(lo + batch_size, stop)
            if drop_last and hi - lo < batch_size:
                return
            yield Batch(torch.from_numpy(np.array(dense[lo:hi])), torch.from_numpy(np.array(sparse[lo:hi])),
                        torch.from_numpy(np.array(label[lo:hi])))


def generate_dataset(root: str | os.PathLike[str], config: SyntheticConfig, samples: int | Sequence[int],
                     passes: int | None = None, progress: bool = True) -> SyntheticDataset:
    """Write a synthetic data set to ``root`` (created; files there are replaced) and open it.

    Args:
        root: the directory.
        config: the data set's shape and seed.
        samples: samples of each pass (an int with ``passes``, or one count per pass).
        passes: number of passes when ``samples`` is an int.
        progress: show a tqdm progress bar.

    Raises:
        ValueError: counts are missing or negative.
    """
    if isinstance(samples, int):
        if passes is None:
            raise ValueError("passes is needed when samples is one count")
        counts = [samples] * passes
    else:
        counts = [int(n) for n in samples]
    if any(n < 0 for n in counts):
        raise ValueError(f"sample counts must be >= 0, got {counts}")
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    bias = config.bias
    with tqdm(total=sum(counts), desc="data", unit="sample", unit_scale=True, disable=not progress,
              dynamic_ncols=True) as bar:
        for p, n in enumerate(counts):
            d = os.path.join(root, f"pass_{p:03d}")
            os.makedirs(d, exist_ok=True)
            dense = np.lib.format.open_memmap(os.path.join(d, "dense.npy"), "w+", np.float32, (n, N_DENSE))
            sparse = np.lib.format.open_memmap(os.path.join(d, "sparse.npy"), "w+", np.int64, (n, N_SPARSE))
            label = np.lib.format.open_memmap(os.path.join(d, "label.npy"), "w+", np.float32, (n,))
            for b, lo in enumerate(range(0, n, _BLOCK)):
                hi = min(lo + _BLOCK, n)
                dense[lo:hi], sparse[lo:hi], label[lo:hi] = config.block(p, b, hi - lo, bias)
                bar.update(hi - lo)
            for a in (dense, sparse, label):
                a.flush()
            del dense, sparse, label
    meta = {"format": _FORMAT, "version": _VERSION, "config": config.to_json(), "samples": counts, "bias": bias}
    with open(os.path.join(root, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return SyntheticDataset(root)
