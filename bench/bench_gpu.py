"""HBM-tier lookup and update rates on CUDA (hot tier on the GPU, DDR tier in pinned host memory).

Run from the repository root::

    .venv/bin/python bench/bench_gpu.py                 # on CUDA: dim 64 and 128, batch 65,536, 1M resident rows
    .venv/bin/python bench/bench_gpu.py --quick         # fewer repetitions (writes gpu-quick.*)
    .venv/bin/python bench/bench_gpu.py --device cpu    # the same measurement on the CPU (a check of the code)

With ``--device auto`` (the default) on a machine without CUDA it prints that it is skipped,
writes nothing and exits 0; ``--device cuda`` there prints why it cannot run (torch built with
or without CUDA, no device visible) and exits 2. ``python -m bench --device cuda`` (or the
default ``auto`` on a CUDA machine) runs it as ``bench_gpu.py [--quick] --device cuda``.

Setup, per dim: an ``EmbeddingCache`` (row-wise AdaGrad, RocksDB store in a temporary
directory) whose HBM tier has room for ``--rows`` (1M) rows plus 1%, and a 64 MiB DDR tier
(pinned when the device is CUDA). The ``--rows`` keys (sparse int64 ids) are looked up once so
that every row is created and resident in HBM (checked), then batches of ``--batch`` (65,536)
keys of those rows are timed, with the keys, the output buffer and the gradients already on the
device:

- ``lookup``: ``cache.lookup(table, keys, out=buf)``, keys Zipf(1.05) over the resident rows
  (hot rows scattered over the key space) and uniform over them;
- ``update``: ``cache.apply_gradients(table, keys, grads)`` on the same batches;
- the ceiling: ``torch.index_select(weights, 0, slots, out=buf)`` on a plain ``[rows, dim]``
  float32 tensor on the device, with the slots of the same batches (no key -> slot index).

Each call is timed alone between ``torch.cuda.synchronize()`` calls (no-ops on the CPU); a
rate is the batch over the median time of ``--reps`` calls after warm-up (min and max times in
the JSON). Reference, stated and not measured here: NVIDIA's HierarchicalKV publishes about
2 billion ``find`` per second at dim 64 on an A100 (its benchmark: 1M-key batches, a table at
load factor 1.0 in HBM); its ``find`` returns value pointers, so it compares with the lookup
here less the row copy.

The CUDA device is named with its index (``cuda:0``, not ``cuda``), for the cache and for every
tensor: ``EmbeddingCache.lookup`` checks ``out.device == `` the cache's device, and
``torch.device("cuda") != torch.device("cuda:0")`` although tensors made on ``"cuda"`` live on
``cuda:0``. The JSON records whether the DDR tier's memory is pinned (``ddr_pinned``).

Writes ``bench/results/gpu.json``, ``gpu.md`` and ``gpu.png`` (``gpu-quick.*`` with ``--quick``),
with ``summary`` rows (the cache's HBM lookup and update over ``index_select``) for
``python -m bench``; the JSON's ``machine`` entry names the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
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

from bench._common import format_ratio, machine_info, markdown_table, write_json  # noqa: E402
from bench.bench_index import timings  # noqa: E402
from bench.workloads import zipf_ranks  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.optim import state_width  # noqa: E402
from embcache.tier import resident_row_bytes  # noqa: E402

TABLE = "t"
OPTIMIZER = "rowwise_adagrad"
ALPHA = 1.05
HKV_FINDS_PER_S = 2e9  # HierarchicalKV's published find rate at dim 64 on an A100 (not measured here)
DDR_BYTES = 64 << 20
FILL_CHUNK = 65536


class CudaUnavailable(RuntimeError):
    """``--device cuda`` on a machine where torch sees no CUDA device (the message says why)."""


def cuda_missing_reason() -> str:
    """Why torch cannot use CUDA here, in words."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}, or no driver)")


def resolve_device(name: str) -> torch.device | None:
    """The device to measure on, CUDA with its index; None when ``auto`` finds no CUDA (skipped).

    Raises:
        CudaUnavailable: ``name`` is "cuda" and torch sees no CUDA device.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else ""
        if not name:
            return None
    if name == "cuda":
        if not torch.cuda.is_available():
            raise CudaUnavailable(f"--device cuda, but {cuda_missing_reason()}")
        return torch.device("cuda", torch.cuda.current_device())  # "cuda:0": see the module docstring
    return torch.device(name)


def ddr_pinned(cache: EmbeddingCache) -> bool | None:
    """Whether the table's DDR tier lives in pinned host memory (None if that cannot be seen)."""
    try:
        return bool(cache._tables[TABLE].ddr.weights.is_pinned())  # type: ignore[attr-defined]
    except (AttributeError, KeyError, RuntimeError):
        return None


def make_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def per_batch(fn: Callable[[torch.Tensor], object], batches: torch.Tensor) -> Callable[[int], object]:
    """``i -> fn(batches[i])``, cycling through the rows of ``batches`` ([n, batch])."""
    return lambda i: fn(batches[i % batches.shape[0]])


def rate(batch: int, seconds: list[float]) -> dict[str, Any]:
    """Keys/s over the median call (and the fastest and slowest)."""
    return {"keys_per_s": batch / statistics.median(seconds), "keys_per_s_max": batch / min(seconds),
            "keys_per_s_min": batch / max(seconds), "calls": len(seconds), "median_s": statistics.median(seconds)}


def run_dim(dim: int, rows: int, batch: int, reps: int, n_batches: int, device: torch.device,
            work: str) -> dict[str, Any]:
    """Fill an HBM tier with ``rows`` rows of ``dim`` and time lookup, update and index_select on it."""
    sync = make_sync(device)
    rng = np.random.default_rng(dim)
    # Sparse ids, and batches as positions into them: Zipf (rank r -> a random position) or uniform.
    ids = torch.from_numpy((np.arange(rows, dtype=np.int64) * np.int64(-7046029254386353131)) ^ np.int64(dim))
    position_of_rank = rng.permutation(rows)
    zipf_pos = torch.from_numpy(position_of_rank[zipf_ranks(n_batches * batch, rows, ALPHA, rng)])
    uniform_pos = torch.from_numpy(rng.integers(0, rows, n_batches * batch, dtype=np.int64))
    rb = resident_row_bytes(dim, torch.float32, state_width(OPTIMIZER, dim))
    cfg = CacheConfig(hbm_bytes=(rows + rows // 100 + 64) * rb, ddr_bytes=DDR_BYTES, path=os.path.join(work, f"d{dim}"),
                      device=str(device))
    table = TableConfig(name=TABLE, dim=dim, optimizer=OPTIMIZER, lr=0.01, seed=dim)
    out: dict[str, Any] = {"dim": dim, "rows": rows, "batch": batch, "hbm_capacity_rows": 0}
    with EmbeddingCache(cfg, [table]) as cache:
        for start in range(0, rows, FILL_CHUNK):
            cache.lookup(TABLE, ids[start:start + FILL_CHUNK].to(device))
        st = cache.stats()[TABLE]["hbm"]
        out["hbm_capacity_rows"] = st["capacity_rows"]
        out["ddr_pinned"] = ddr_pinned(cache)
        if st["resident_rows"] != rows:
            raise RuntimeError(f"expected all {rows} rows in the HBM tier after filling, found {st['resident_rows']}")
        ids_dev = ids.to(device)
        buf = torch.empty(batch, dim, device=device)
        grads = torch.full((batch, dim), 1e-3, device=device)
        weights = torch.randn(rows, dim, device=device)
        contenders: dict[str, dict[str, Any]] = {}
        for trace_name, positions in (("zipf", zipf_pos), ("uniform", uniform_pos)):
            pos = positions.to(device).view(n_batches, batch)
            keys = ids_dev[pos]
            before = cache.stats()[TABLE]
            t_lookup = timings(per_batch(lambda k: cache.lookup(TABLE, k, out=buf), keys), reps, 3, sync)
            t_update = timings(per_batch(lambda k: cache.apply_gradients(TABLE, k, grads), keys), reps, 3, sync)
            t_select = timings(per_batch(lambda p: torch.index_select(weights, 0, p, out=buf), pos), reps, 3, sync)
            after = cache.stats()[TABLE]
            looked = after["lookups"] - before["lookups"]
            contenders[trace_name] = {
                "lookup": rate(batch, t_lookup), "update": rate(batch, t_update),
                "index_select": rate(batch, t_select),
                "hbm_hit_ratio": (after["hbm"]["hits"] - before["hbm"]["hits"]) / max(looked, 1),
            }
        out["traces"] = contenders
    return out


def render(res: dict[str, Any]) -> str:
    """Markdown table: one row per (dim, trace)."""
    rows = []
    for r in res["results"]:
        for trace, c in r["traces"].items():
            look, upd, sel = c["lookup"]["keys_per_s"], c["update"]["keys_per_s"], c["index_select"]["keys_per_s"]
            rows.append([r["dim"], trace, f"{c['hbm_hit_ratio']:.1%}", f"{look / 1e6:,.1f}M", f"{upd / 1e6:,.1f}M",
                         f"{sel / 1e6:,.1f}M", format_ratio(look / sel), format_ratio(upd / sel),
                         f"{look / HKV_FINDS_PER_S:.3f}x" if r["dim"] == 64 else "—"])
    return markdown_table(["dim", "keys", "HBM hits", "lookup keys/s", "update keys/s", "index_select keys/s",
                           "lookup / index_select", "update / index_select",
                           "lookup / HKV 2e9 (published, not measured)"], rows)


def plot(res: dict[str, Any], path: str) -> None:
    """Keys/s (log) of lookup, update and index_select per dim and key trace, with HierarchicalKV's stated rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(f"dim {r['dim']}\n{trace}", c) for r in res["results"] for trace, c in r["traces"].items()]
    ops = (("lookup", "embcache lookup"), ("update", "embcache update (row-wise AdaGrad)"),
           ("index_select", "index_select (no index)"))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.4))
    width = 0.8 / len(ops)
    for j, (op, label) in enumerate(ops):
        xs = [i + (j - (len(ops) - 1) / 2) * width for i in range(len(groups))]
        med = [c[op]["keys_per_s"] for _, c in groups]
        err = [[m - c[op]["keys_per_s_min"] for m, (_, c) in zip(med, groups, strict=True)],
               [c[op]["keys_per_s_max"] - m for m, (_, c) in zip(med, groups, strict=True)]]
        ax.bar(xs, med, width, yerr=err, capsize=2, label=label)
    ax.axhline(HKV_FINDS_PER_S, color="k", ls="--", lw=1,
               label="HierarchicalKV find, dim 64, A100 (published, not measured)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=8)
    ax.set_ylabel("keys/s (median call; whiskers: fastest/slowest)")
    ax.set_title(f"HBM-tier rates on {res['device']} ({res['device_name']}), batch {res['batch']:,}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA when present, else skip (default)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions; writes gpu-quick.*")
    ap.add_argument("--dims", default="64,128", help="comma-separated embedding dims (default 64,128)")
    ap.add_argument("--rows", type=int, default=1 << 20, help="rows resident in the HBM tier (default 1,048,576)")
    ap.add_argument("--batch", type=int, default=65536, help="keys per batch (default 65,536)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per contender (default 50; quick 10)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1; 0 = all cores)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    args = ap.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except CudaUnavailable as exc:
        print(f"bench_gpu: cannot run: {exc}. Use --device auto to skip without CUDA, or --device cpu to run the "
              "same measurement on the CPU.", file=sys.stderr, flush=True)
        return 2
    if device is None:
        print(f"bench_gpu: skipped: no CUDA device ({cuda_missing_reason()}; pass --device cpu to run the same "
              "measurement on the CPU)")
        return 0
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    reps = args.reps or (10 if args.quick else 50)
    n_batches = 8
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="embcache-gpu-") as work:
        for dim in (int(d) for d in args.dims.split(",")):
            r = run_dim(dim, args.rows, args.batch, reps, n_batches, device, work)
            z = r["traces"]["zipf"]
            print(f"dim {dim}: lookup {z['lookup']['keys_per_s'] / 1e6:.1f}M keys/s, update "
                  f"{z['update']['keys_per_s'] / 1e6:.1f}M keys/s, index_select "
                  f"{z['index_select']['keys_per_s'] / 1e6:.1f}M keys/s (Zipf)", flush=True)
            results.append(r)
    if device.type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(device)
    res: dict[str, Any] = {
        "benchmark": "HBM-tier lookup and update rates vs index_select",
        "command": info["command"], "device": str(device), "device_name": info.get("cuda_device") or info["cpu_model"],
        "batch": args.batch, "machine": info, "optimizer": OPTIMIZER, "alpha": ALPHA, "reps": reps,
        "reference": {"name": "HierarchicalKV find, dim 64, A100 (published, not measured)",
                      "keys_per_s": HKV_FINDS_PER_S},
        "results": results,
        "summary": [{"case": f"HBM-tier {op}, dim {r['dim']}, Zipf keys, on {device.type}",
                     "ratio": r["traces"]["zipf"][op]["keys_per_s"] / r["traces"]["zipf"]["index_select"]["keys_per_s"],
                     "reference": f"index_select on {device.type}", "target": None}
                    for r in results for op in ("lookup", "update")],
        "seconds": time.perf_counter() - t0,
    }
    table = render(res)
    print(table)
    stem = os.path.join(args.out, "gpu-quick" if args.quick else "gpu")
    write_json(stem + ".json", res)
    name = info.get("cuda_device") or info["cpu_model"]
    Path(stem + ".md").write_text(
        f"# HBM-tier rates on {device.type} ({name})\n\nCommand: `{res['command']}`; batch {args.batch:,}, "
        f"{args.rows:,} rows resident in HBM, median of {reps} calls. Reference (stated, not measured): "
        f"HierarchicalKV ~{HKV_FINDS_PER_S:.0e} finds/s at dim 64 on an A100. Commit "
        f"{str(info['git_commit'])[:7]}{' (dirty tree)' if info['git_dirty'] else ''}, {info['started_at']}; "
        f"DDR tier pinned: {', '.join(str(r.get('ddr_pinned')) for r in results)}.\n\n{table}\n")
    plot(res, stem + ".png")
    print(f"wrote {stem}.json/.md/.png ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
