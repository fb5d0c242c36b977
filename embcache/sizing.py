"""Capacity sizing from a key trace: miss-ratio curves and the tier sizes a target hit ratio needs.

``embcache sizing TRACE...`` replays a trace of keys (``.npy`` arrays of int keys in access
order, or keyset files: ``.npz`` with ``keys`` and optional ``counts``, whose accesses are
replayed in a seeded random order) through exact simulators (:mod:`embcache.sim`) of LRU,
LFU, embcache's own policy (``lrfu``, with admission) and Belady's optimum (OPT, the bound no
policy beats), at capacities from 0.1% to 100% of the distinct keys. It prints the curves,
plots them (PNG), and finds by bisection the smallest capacity that reaches each target hit
ratio, in rows and in bytes for the table's dim, dtype and optimizer (a resident row carries
its weights, its optimizer state, 24 bytes of bookkeeping and 8 bytes of key index on the CPU).
It also gives the store's (SSD tier's) payload: every distinct key of the trace ends up there
once trained, as a record of its weights and optimizer state plus its 8-byte key.

LRU and OPT are stack algorithms: their hit ratio never falls as the capacity grows, so the
bisection finds the smallest capacity exactly. LFU and lrfu are not (a larger cache can admit
a row that later displaces a better one): their curves can dip. The bisection is therefore
bracketed by the measured grid: it runs between the largest grid capacity below the target and
the next one, so the answer reaches the target and so does every grid capacity above it; only
a dip inside that one grid interval could go unseen.

The HBM tier is sized for ``--hbm-hit`` (share of lookups served from HBM); HBM and DDR
together for ``--memory-hit`` (share served from memory, i.e. not from the SSD): DDR gets the
difference. Sizes assume one table; several tables need the sum of their own sizes.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from . import sim
from .config import TableConfig
from .engine.rows import record_bytes
from .optim import state_width
from .tier import resident_row_bytes

__all__ = ["POLICIES", "SizingReport", "load_trace", "main", "needed_capacity", "size_trace", "store_record_bytes"]

#: name -> ``(trace, capacity) -> hits``, in plotting order
POLICIES: dict[str, Callable[[np.ndarray, int], int]] = {
    "LRU": sim.lru_hits,
    "LFU": sim.lfu_hits,
    "embcache (lrfu)": sim.lrfu_hits,
    "OPT": sim.opt_hits,
}


def load_trace(paths: Sequence[str], seed: int = 0) -> np.ndarray:
    """Keys (int64, access order) from ``.npy`` traces and ``.npz`` keyset files, concatenated.

    A keyset (``keys`` [n], optional ``counts`` [n]) becomes ``counts[i]`` accesses of
    ``keys[i]`` in a random order (seeded), so passes keep their order but not their inside.

    Raises:
        ValueError: a file is neither, or holds no integer keys.
    """
    parts = []
    rng = np.random.default_rng(seed)
    for path in paths:
        if path.endswith(".npy"):
            arr = np.load(path, allow_pickle=False)
        elif path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                if "keys" not in z:
                    raise ValueError(f"{path}: a keyset file needs a 'keys' array (has {sorted(z.files)})")
                keys = z["keys"]
                counts = z["counts"] if "counts" in z else np.ones(keys.shape, dtype=np.int64)
            arr = rng.permutation(np.repeat(keys, counts.astype(np.int64)))
        else:
            raise ValueError(f"{path}: expected a .npy trace or a .npz keyset")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
        parts.append(arr.astype(np.int64, copy=False))
    if not parts:
        raise ValueError("no trace given")
    return np.concatenate(parts)


def needed_capacity(hits_at: Callable[[int], int], n_accesses: int, n_keys: int, target: float,
                    grid: Sequence[int] = ()) -> int | None:
    """Smallest capacity (rows) whose hit ratio reaches ``target``, by bisection; None if even all keys miss it.

    Without ``grid`` the bisection runs over ``[0, n_keys]`` and assumes the hit ratio never falls
    as the capacity grows (true of LRU and OPT). With the capacities already measured in
    ``grid``, it runs only between the largest of them that misses the target and the next
    capacity (of the grid, or ``n_keys``): the result reaches the target, and so does every grid
    capacity above it, whether or not the curve dips elsewhere (LFU, lrfu).
    """
    if n_accesses == 0 or hits_at(n_keys) < target * n_accesses:
        return None
    lo, hi = 0, n_keys  # invariant: hits_at(lo) misses the target (0 rows hit nothing), hits_at(hi) reaches it
    points = sorted({c for c in grid if 0 < c < n_keys})
    below = [i for i, c in enumerate(points) if hits_at(c) < target * n_accesses]
    if below:
        lo = points[below[-1]]
        hi = points[below[-1] + 1] if below[-1] + 1 < len(points) else n_keys
    elif points:
        hi = points[0]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hits_at(mid) >= target * n_accesses:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class SizingReport:
    """Curves and tier sizes of one trace."""

    accesses: int
    distinct_keys: int
    row_bytes: int
    capacities: list[int]
    curves: dict[str, list[float]]
    needed: dict[str, dict[str, int | None]]  # policy -> {"hbm": rows, "memory": rows}
    targets: dict[str, float]
    record_bytes: int | None = None  # bytes of one row in the store (weights + optimizer state), if known

    @property
    def store_bytes(self) -> int | None:
        """Payload of the store (SSD tier) once every distinct key is trained: keys x (record + 8-byte key)."""
        return None if self.record_bytes is None else self.distinct_keys * (self.record_bytes + 8)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (with ``store_bytes``)."""
        return {**vars(self), "store_bytes": self.store_bytes}


def store_record_bytes(dim: int, dtype: torch.dtype, state_width: int) -> int:
    """Bytes of one row's record in the store (defined once: :func:`embcache.engine.rows.record_bytes`)."""
    return record_bytes(dim, dtype, state_width)


def size_trace(trace: np.ndarray, row_bytes: int, hbm_hit: float, memory_hit: float, points: int = 16,
               policies: Sequence[str] = tuple(POLICIES), progress: bool = True,
               record_bytes: int | None = None) -> SizingReport:
    """Miss-ratio curves of ``policies`` on ``trace`` and the capacities the two targets need.

    ``record_bytes`` (a row's bytes in the store, :func:`store_record_bytes`) adds the store's size.

    Raises:
        ValueError: an unknown policy, or targets outside (0, 1].
    """
    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {list(POLICIES)}")
    for target in (hbm_hit, memory_hit):
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target hit ratios must be in (0, 1], got {target}")
    n = int(trace.size)
    distinct = int(np.unique(trace).size)
    caps = sorted({max(1, round(distinct * f)) for f in np.geomspace(0.001, 1.0, points)})
    curves: dict[str, list[float]] = {}
    needed: dict[str, dict[str, int | None]] = {}
    work = len(policies) * (len(caps) + 2)
    with tqdm(total=work, desc="replaying", unit="run", disable=not progress) as bar:
        for name in policies:
            fn = POLICIES[name]
            memo: dict[int, int] = {}

            def hits_at(c: int, fn: Callable[[np.ndarray, int], int] = fn, memo: dict[int, int] = memo) -> int:
                if c not in memo:
                    memo[c] = fn(trace, c)
                return memo[c]

            curve = []
            for c in caps:
                curve.append(hits_at(c) / n if n else 0.0)
                bar.update(1)
            curves[name] = curve
            needed[name] = {}
            for tier, target in (("hbm", hbm_hit), ("memory", memory_hit)):
                needed[name][tier] = needed_capacity(hits_at, n, distinct, target, grid=caps)
                bar.update(1)
    return SizingReport(n, distinct, row_bytes, caps, curves, needed, {"hbm": hbm_hit, "memory": memory_hit},
                        record_bytes)


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return f"{b:.1f} TiB"


def report_markdown(r: SizingReport) -> str:
    """The curves and the sizing as Markdown tables."""
    names = list(r.curves)
    lines = [f"Trace: {r.accesses:,} accesses, {r.distinct_keys:,} distinct keys; {r.row_bytes} bytes per "
             "resident row.", "", "| capacity (rows) | bytes | " + " | ".join(names) + " |",
             "| ---: | ---: | " + " | ".join("---:" for _ in names) + " |"]
    for i, c in enumerate(r.capacities):
        lines.append(f"| {c:,} | {_fmt_bytes(c * r.row_bytes)} | "
                     + " | ".join(f"{r.curves[n][i]:.3f}" for n in names) + " |")
    ceiling = 1.0 - r.distinct_keys / r.accesses if r.accesses else 0.0
    lines += ["", f"Capacity for HBM hit ratio {r.targets['hbm']:.0%} and memory (HBM+DDR) hit ratio "
              f"{r.targets['memory']:.0%} (no capacity beats {ceiling:.3f}: every key misses once on its first "
              "access):", "",
              "| policy | HBM rows | HBM bytes | DDR rows | DDR bytes |", "| --- | ---: | ---: | ---: | ---: |"]
    for name in names:
        h, m = r.needed[name]["hbm"], r.needed[name]["memory"]
        d = None if h is None or m is None else max(m - h, 0)
        cells = [f"{x:,}" if x is not None else "unreachable" for x in (h, d)]
        byts = [_fmt_bytes(x * r.row_bytes) if x is not None else "-" for x in (h, d)]
        lines.append(f"| {name} | {cells[0]} | {byts[0]} | {cells[1]} | {byts[1]} |")
    if r.store_bytes is not None:
        lines += ["", f"Store (SSD tier): all {r.distinct_keys:,} distinct keys, once trained, at {r.record_bytes} "
                  f"bytes of weights and optimizer state + an 8-byte key each: {_fmt_bytes(r.store_bytes)} "
                  "before the store's own overhead (RocksDB: compression, compaction headroom; size the volume "
                  "well above it)."]
    return "\n".join(lines)


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a clear error (matplotlib comes with the sizing extra)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("embcache sizing plots its curves with matplotlib, which is not installed: "
                          "pip install 'embcache[sizing]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(r: SizingReport, path: str) -> None:
    """Hit ratio against capacity (rows, log scale; bytes on top), one line per policy, targets dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, curve in r.curves.items():
        ax.plot(r.capacities, curve, marker="o", ms=3, label=name, ls="--" if name == "OPT" else "-")
    for tier, target in r.targets.items():
        ax.axhline(target, color="grey", lw=0.8, ls=":")
        ax.text(r.capacities[0], target, f" {tier} target", va="bottom", fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (rows)")
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    mib = r.row_bytes / 2**20

    def to_mib(x: Any) -> Any:
        return np.asarray(x, dtype=np.float64) * mib

    def to_rows(y: Any) -> Any:
        return np.asarray(y, dtype=np.float64) / mib

    top = ax.secondary_xaxis("top", functions=(to_mib, to_rows))
    top.set_xlabel("capacity (MiB)")
    ax.set_title(f"miss-ratio curves: {r.accesses:,} accesses, {r.distinct_keys:,} keys")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``sizing`` subcommand's options."""
    p.add_argument("trace", nargs="+", help=".npy key traces (access order) and/or .npz keysets (keys, counts)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--dtype", default="float32", help="storage dtype: float32, float16, bfloat16")
    p.add_argument("--optimizer", default="rowwise_adagrad",
                   help="sgd, adagrad, rowwise_adagrad, adam, rowwise_adagrad_momentum")
    p.add_argument("--device", default="cuda",
                   help="device of the HBM tier, whose row cost is counted (default cuda: a GPU's key index costs "
                        "16 bytes a row more than the host's)")
    p.add_argument("--hbm-hit", type=float, default=0.8, help="target HBM hit ratio (default 0.8)")
    p.add_argument("--memory-hit", type=float, default=0.95, help="target HBM+DDR hit ratio (default 0.95)")
    p.add_argument("--points", type=int, default=16, help="capacities on the curve (default 16)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of: " + ", ".join(POLICIES))
    p.add_argument("--out", default="sizing.png", help="plot file (default sizing.png)")
    p.add_argument("--json", default=None, help="also write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    """Run the ``sizing`` subcommand."""
    try:
        _pyplot()  # fail before the replay, not after it, if the plot cannot be drawn
    except ImportError as exc:
        raise SystemExit(str(exc)) from exc
    cfg = TableConfig(name="sizing", dim=args.dim, optimizer=args.optimizer, dtype=args.dtype)
    width = state_width(cfg.optimizer, cfg.dim)
    rb = resident_row_bytes(cfg.dim, cfg.torch_dtype, width, args.device)
    trace = load_trace(args.trace)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    report = size_trace(trace, rb, args.hbm_hit, args.memory_hit, args.points, policies,
                        record_bytes=store_record_bytes(cfg.dim, cfg.torch_dtype, width))
    print(report_markdown(report))
    plot(report, args.out)
    print(f"\nplot: {os.path.abspath(args.out)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
        print(f"json: {os.path.abspath(args.json)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``embcache sizing`` as a standalone entry point."""
    parser = argparse.ArgumentParser(prog="embcache sizing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
