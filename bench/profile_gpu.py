"""Where an all-hit lookup's and update's host time goes, on the device the HBM tier lives on.

Run from the repository root (on a machine with a GPU; ``--device cpu`` runs the same on the CPU)::

    python3 bench/profile_gpu.py                  # dim 64, batch 65,536, 1M rows resident in HBM
    python3 bench/profile_gpu.py --device cpu --rows 65536 --batch 8192   # a check of the code

``bench_gpu`` found the cache's all-hit lookup at 0.03x of ``index_select`` on an H200, and ten
calls back to back took as long to issue as to run: the host is the limit. This splits one call
into its parts, each timed alone the same way, with the keys already on the device:

- ``lookup`` / ``update``: ``cache.lookup(table, keys, out=buf)`` / ``cache.apply_gradients``;
- ``find_touch_gather``: the HBM tier's probe, touch and row gather (the lookup's device work);
- ``index.find``: the key -> slot probe alone;
- ``mrc.observe``: the miss-ratio sampler's share of a lookup (a copy of the keys to the host);
- ``index_select``: the ceiling (a gather of the same rows by known slots).

Per part: ``issue`` is the host time of one call with the device's queue not waited on (the median
of ``--reps`` calls issued back to back), ``synced`` the time of one call between two
synchronizes. A part whose issue time is near its synced time is bound by the host. Then
``torch.profiler`` records ``--reps`` lookups and updates: the kernels each launches per call and
the torch operators that take the most host time.

Writes ``bench/results/gpu-profile.json`` and ``gpu-profile.md`` (``--out`` elsewhere).
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

from bench._common import machine_info, markdown_table, timings, write_json  # noqa: E402
from bench.bench_gpu import (  # noqa: E402
    OPTIMIZER,
    TABLE,
    WARMUP_CALLS,
    CudaUnavailable,
    fill,
    make_sync,
    resolve_device,
    sparse_ids,
    zipf_positions,
)
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.optim import state_width  # noqa: E402
from embcache.tier import resident_row_bytes  # noqa: E402


def issue_and_synced(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median host time per call of ``fn`` issued back to back, and median time of a synced call (s),
    after WARMUP_CALLS calls (the sampler's pinned buffers in steady state: see bench_gpu)."""
    for _ in range(WARMUP_CALLS):
        fn()
    sync()
    issue = timings(fn, reps, warmup=0)
    sync()
    synced = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        synced.append(time.perf_counter() - t0)
    return {"issue_s": statistics.median(issue), "synced_s": statistics.median(synced)}


def profiled(fn: Callable[[], object], reps: int, sync: Callable[[], None], device: torch.device,
             top: int) -> dict[str, Any]:
    """``reps`` calls of ``fn`` under torch.profiler: kernels per call and the top operators by host time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(WARMUP_CALLS):
        fn()
    sync()
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn()
        sync()
    events = prof.events()
    kernels = sum(1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    ops = []
    averages = prof.key_averages()
    for a in averages:
        ops.append({"name": a.key, "calls": a.count / reps, "self_cpu_us": a.self_cpu_time_total / reps,
                    "cpu_us": a.cpu_time_total / reps,
                    "device_us": getattr(a, "self_device_time_total", getattr(a, "self_cuda_time_total", 0.0)) / reps})
    ops.sort(key=lambda o: -o["self_cpu_us"])
    return {"kernels_per_call": kernels / reps, "ops": ops[:top],
            "torch_ops_per_call": sum(o["calls"] for o in ops if o["name"].startswith("aten::")),
            "op_host_us_per_call": sum(a.self_cpu_time_total for a in averages) / reps}


def main(argv: list[str] | None = None) -> int:
    """Run the profile (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA when present, else the CPU")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1 << 20, help="rows resident in the HBM tier (default 1,048,576)")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15, help="operators listed per call (by host time)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    try:
        device = resolve_device(args.device) or torch.device("cpu")
    except CudaUnavailable as exc:
        print(f"profile_gpu: cannot run: {exc}", file=sys.stderr)
        return 2
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    sync = make_sync(device)
    dim, batch = args.dim, args.batch
    rng = np.random.default_rng(dim)
    ids = sparse_ids(args.rows, dim)
    rb = resident_row_bytes(dim, torch.float32, state_width(OPTIMIZER, dim), device)
    res: dict[str, Any] = {"benchmark": "host time of an all-hit lookup and update, by part",
                           "command": info["command"], "device": str(device), "machine": info, "dim": dim,
                           "batch": batch, "rows": args.rows, "reps": args.reps}
    with tempfile.TemporaryDirectory(prefix="embcache-gpuprof-") as work:
        cfg = CacheConfig(hbm_bytes=(args.rows + args.rows // 100 + 64) * rb, ddr_bytes=64 << 20,
                          path=os.path.join(work, "c"), device=str(device))
        with EmbeddingCache(cfg, [TableConfig(name=TABLE, dim=dim, optimizer=OPTIMIZER, lr=0.01, seed=dim)]) as cache:
            print("filling ...", flush=True)
            fill(cache, ids, device, dim)
            pos = zipf_positions(batch, args.rows, rng).to(device)
            keys = ids.to(device)[pos]
            buf = torch.empty(batch, dim, device=device)
            grads = torch.full((batch, dim), 1e-3, device=device)
            weights = torch.randn(args.rows, dim, device=device)
            t = cache._tables[TABLE]  # the parts below are the engine's own steps
            now = t.clock.now
            parts: dict[str, Callable[[], object]] = {
                "lookup": lambda: cache.lookup(TABLE, keys, out=buf),
                "update": lambda: cache.apply_gradients(TABLE, keys, grads),
                "find_touch_gather": lambda: t.hbm.find_touch_gather(keys, 0.0, now, buf),
                "index.find": lambda: t.hbm.index.find(keys),
                "index_select": lambda: torch.index_select(weights, 0, pos, out=buf)}
            mrc = t.mrc
            if mrc is not None:
                parts["mrc.observe"] = lambda: mrc.observe(keys)
            timing = {}
            for name, fn in parts.items():
                print(f"timing {name} ...", flush=True)
                timing[name] = issue_and_synced(fn, args.reps, sync)
            res["parts"] = timing
            res["profile"] = {}
            for name in ("lookup", "update"):
                print(f"profiling {name} ...", flush=True)
                res["profile"][name] = profiled(parts[name], args.reps, sync, device, args.top)
    rows = [[name, f"{v['issue_s'] * 1e3:.3f}", f"{v['synced_s'] * 1e3:.3f}", f"{batch / v['synced_s'] / 1e6:,.1f}M"]
            for name, v in res["parts"].items()]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else info["cpu_model"]
    text = [f"# Host time of an all-hit lookup and update on {device} ({name})",
            "", f"Command: `{res['command']}`; dim {dim}, batch {batch:,}, {args.rows:,} rows resident in HBM; "
            f"medians of {args.reps} calls. Commit {str(info['git_commit'])[:7]}"
            f"{' (dirty tree)' if info['git_dirty'] else ''}.", "",
            markdown_table(["part", "issue ms (host)", "synced ms", "keys/s synced"], rows)]
    for name, p in res["profile"].items():
        text += ["", f"## {name}: {p['kernels_per_call']:.0f} kernels and {p['torch_ops_per_call']:.0f} aten calls "
                 f"per call, {p['op_host_us_per_call']:.0f} us of host time in operators; operators by host time", "",
                 markdown_table(["operator", "calls", "self host us", "host us (with children)", "device us"],
                                [[o["name"], f"{o['calls']:.1f}", f"{o['self_cpu_us']:.1f}", f"{o['cpu_us']:.1f}",
                                  f"{o['device_us']:.1f}"] for o in p["ops"]])]
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "gpu-profile.json"), res)
    Path(os.path.join(args.out, "gpu-profile.md")).write_text("\n".join(text) + "\n")
    print("\n".join(text), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
