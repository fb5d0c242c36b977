"""Host syncs of each public call of a cache on CUDA, counted on a real GPU (torch's sync debug mode).

Run from the repository root on a machine with CUDA::

    .venv/bin/python bench/syncs_per_call.py            # writes bench/results/syncs.json and syncs.md

The calls are those of the sync budget that ``tests/test_gpu_path.py`` asserts (under the CPU
stand-in in CI, on the device where there is one): :func:`public_calls` builds them for both.
Each call is counted once, right after the same call ran once uncounted (so lazy set-up is not counted),
with where each sync came from. Without CUDA it prints that it is skipped and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._common import machine_info, markdown_table, write_json  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.optim import state_width  # noqa: E402
from embcache.syncs import count_syncs  # noqa: E402
from embcache.tier import resident_row_bytes  # noqa: E402

# Host syncs per call on "cuda" as counted under the stand-in (tests/fakecuda.py): the budget.
BUDGETS = {
    "lookup, all hit": 1,  # the hit count that tells the host nothing missed
    "lookup_many, all hit": 2,  # one per table
    "apply_gradients, all hit": 2,  # unique; then the finite and the all-resident checks, read back together
    # hit count, staging copy, victims (sample, scores to the host), staging copy, index insert (2); a first
    # call makes 6, a later one 7, here and on the H200 alike
    "lookup, misses": 7,
    "apply_gradients, misses": 7,
    "begin_pass": 11,  # once per pass
}


def budget_cache(path: str, store: str = "rocksdb") -> EmbeddingCache:
    """Two AdaGrad tables of dim 8 on "cuda", 64 rows of HBM and 128 of DDR each."""
    rb = resident_row_bytes(8, torch.float32, state_width("adagrad", 8), "cuda")
    tables = [TableConfig(name=n, dim=8, optimizer="adagrad", lr=0.1, seed=3) for n in ("t", "u")]
    return EmbeddingCache(CacheConfig(hbm_bytes=64 * rb * 2, ddr_bytes=128 * rb * 2, path=path, store=store,
                                      device="cuda"), tables)


def public_calls(cache: EmbeddingCache) -> dict[str, Callable[[], object]]:
    """The budgeted calls (names as in ``BUDGETS``), with keys 0..39 of both tables made resident first."""
    hot = torch.arange(40)
    hot_d, grads_d = hot.cuda(), torch.ones(80, 8, device="cuda")
    cache.lookup_many({"t": hot, "u": hot})
    fresh = iter(range(10))  # each call with misses takes keys no earlier call touched

    def base() -> int:
        return 10_000 * (1 + next(fresh))

    return {
        "lookup, all hit": lambda: cache.lookup("t", hot),
        "lookup_many, all hit": lambda: cache.lookup_many({"t": hot, "u": hot_d}),
        "apply_gradients, all hit": lambda: cache.apply_gradients("t", hot, torch.ones(40, 8)),
        "lookup, misses": lambda: cache.lookup("t", torch.arange(20, 220) + base()),
        "apply_gradients, misses": lambda: cache.apply_gradients("t", torch.arange(500, 580) + base(), grads_d),
        "begin_pass": lambda: cache.begin_pass({"t": torch.arange(1000, 1100) + base()}),  # end_pass: after_call
    }


def after_call(cache: EmbeddingCache, name: str) -> None:
    """What must follow a call before the next (``begin_pass`` needs its ``end_pass``)."""
    if name == "begin_pass":
        cache.end_pass().result()


def main(argv: list[str] | None = None) -> int:
    """Count and report (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("syncs_per_call: skipped: no CUDA device (tests/test_gpu_path.py counts these under the stand-in)")
        return 0
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="embcache-syncs-") as work:
        with budget_cache(os.path.join(work, "c")) as cache:
            calls = public_calls(cache)
            for name, call in calls.items():
                call()  # warm-up, just before (an all-hit call's rows are resident again): lazy set-up is not counted
                after_call(cache, name)
                torch.cuda.synchronize()
                with count_syncs() as syncs:
                    call()
                after_call(cache, name)
                torch.cuda.synchronize()
                rows.append({"call": name, "syncs": len(syncs), "budget": BUDGETS[name], "where": syncs.where})
                print(f"{name}: {len(syncs)} host syncs (stand-in budget {BUDGETS[name]})", flush=True)
    res = {"benchmark": "host syncs per public call on CUDA", "command": info["command"], "machine": info,
           "device_name": torch.cuda.get_device_name(0), "results": rows}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "syncs.json"), res)
    table = markdown_table(["call", "host syncs (real GPU)", "budget (stand-in)", "where"],
                           [[r["call"], r["syncs"], r["budget"], "<br>".join(r["where"])] for r in rows])
    Path(args.out, "syncs.md").write_text(f"# Host syncs per call on {res['device_name']}\n\n{table}\n")
    print(table)
    return 0 if all(r["syncs"] <= r["budget"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
