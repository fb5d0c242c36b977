"""HBM-tier lookup and update rates on CUDA: all hits, with misses, pipelined, and host syncs per call.

Run from the repository root::

    .venv/bin/python bench/bench_gpu.py                 # on CUDA: dim 64 and 128, batch 65,536, 1M resident rows
    .venv/bin/python bench/bench_gpu.py --quick         # fewer repetitions (writes gpu-quick.*)
    .venv/bin/python bench/bench_gpu.py --device cpu    # the same measurement on the CPU (a check of the code)

With ``--device auto`` (the default) on a machine without CUDA it prints that it is skipped,
writes nothing and exits 0; ``--device cuda`` there prints why it cannot run (torch built with
or without CUDA, no device visible) and exits 2. ``python -m bench --device cuda`` (or the
default ``auto`` on a CUDA machine) runs it as ``bench_gpu.py [--quick] --device cuda``.

All-hit setup, per dim: an ``EmbeddingCache`` (row-wise AdaGrad, RocksDB store in a temporary
directory) whose HBM tier has room for ``--rows`` (1M) rows plus 1%, and a 64 MiB DDR tier
(pinned when the device is CUDA). The ``--rows`` keys (sparse int64 ids) are looked up once, in
chunks of 65,536, so that every row is created and resident in HBM (checked), then batches of
``--batch`` (65,536) keys of those rows are timed, with the keys, the output buffer and the
gradients already on the device:

- ``lookup``: ``cache.lookup(table, keys, out=buf)``, keys Zipf(1.05) over the resident rows
  (hot rows scattered over the key space) and uniform over them;
- ``update``: ``cache.apply_gradients(table, keys, grads)`` on the same batches;
- the ceiling: ``torch.index_select(weights, 0, slots, out=buf)`` on a plain ``[rows, dim]``
  float32 tensor on the device, with the slots of the same batches (no key -> slot index).

Miss setup, per dim: a second cache over ``--miss-rows`` rows (default ``--rows``) whose HBM tier
holds 25% of them and whose DDR tier (pinned on CUDA) a further 25%; the rest live only in the
RocksDB store. It is filled by chunked updates of every row (a row only looked up is not written
to the store when it leaves memory, and would be made again instead of read), warmed up by one
pass over the timed batches, then ``lookup`` and ``apply_gradients`` are timed on batches of
Zipf(1.05) keys over all its rows (the same hot rows; the updates' batches drawn apart from the
lookups', which would otherwise have just brought their rows into memory). The JSON records, per
timed window, the deltas of ``cache.stats()``: lookups, HBM and DDR hits, store hits and rows
created (``hbm_hit_ratio`` = HBM hits / lookups), updates, HBM promotions and demotions, and rows
read from and written to the store (an update's rows show only there).

Timing: each call is timed alone between ``torch.cuda.synchronize()`` calls (no-ops on the CPU);
a rate is the batch over the median time of ``--reps`` calls after warm-up (min and max times in
the JSON). Pipelined (all-hit lookup and update, Zipf keys): ``--reps`` calls back to back and one
synchronize at the end; the rate is calls x batch over the total, and ``issue_s`` is the time
until the last call returned (before the final sync). An ``issue_s`` near the total means the CPU
does not run ahead of the GPU (host syncs, or the CPU side is the bottleneck).

Host syncs per call: for each contender (all-hit lookup, update and index_select on both key
traces: one call after a warm-up call of the same batch; miss lookup and update: one call of a
fresh Zipf batch, since a batch just seen finds its rows resident) one call is run inside
:func:`embcache.syncs.count_syncs` (torch's sync debug mode, the calling thread's syncs); the JSON
records the count and where each sync was made (``file:line``). On the CPU nothing is counted
(``available`` false; "—" in the table). The count is a floor: torch does not report every sync.

Reference, stated and not measured here: NVIDIA's HierarchicalKV publishes about 2 billion
``find`` per second at dim 64 on an A100 (its benchmark: 1M-key batches, a table at load factor
1.0 in HBM); its ``find`` returns value pointers, so it compares with the lookup here less the
row copy.

The CUDA device is named with its index (``cuda:0``, not ``cuda``), for the cache and for every
tensor: ``EmbeddingCache.lookup`` checks ``out.device == `` the cache's device, and
``torch.device("cuda") != torch.device("cuda:0")`` although tensors made on ``"cuda"`` live on
``cuda:0``. The JSON records whether the DDR tier's memory is pinned (``ddr_pinned``).

It prints a line as each phase of each dim starts and ends (with its seconds). A phase that
fails is recorded in the JSON (``errors``: phase -> the exception, per dim) and the rest goes
on; the exit code is then 1 (the files are still written).

Writes ``bench/results/gpu.json``, ``gpu.md`` and ``gpu.png`` (``gpu-quick.*`` with ``--quick``),
with ``summary`` rows (the cache's lookup and update, all hits and with misses, over
``index_select``) for ``python -m bench``; the JSON's ``machine`` entry names the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
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
from embcache.syncs import count_syncs  # noqa: E402
from embcache.tier import resident_row_bytes  # noqa: E402

TABLE = "t"
OPTIMIZER = "rowwise_adagrad"
ALPHA = 1.05
HKV_FINDS_PER_S = 2e9  # HierarchicalKV's published find rate at dim 64 on an A100 (not measured here)
DDR_BYTES = 64 << 20
FILL_CHUNK = 65536
MISS_HBM_SHARE = 0.25  # of the miss cache's rows, held in its HBM tier
MISS_DDR_SHARE = 0.25  # a further share held in its DDR tier (the rest only in the store)
N_BATCHES = 8  # distinct batches per key trace, cycled through
# Untimed all-hit calls before each timing: the miss-ratio sampler copies each lookup's keys to
# pinned host memory and works through them 16 batches at a time, so its pool of pinned buffers
# grows (a cudaHostAlloc of ~0.3 ms per call) for the first few dozen calls of a cache, then
# only reuses them: a training loop's steady state, which a 3-call warm-up did not reach.
WARMUP_CALLS = 48


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


def pipelined(fn: Callable[[int], object], calls: int, batch: int, sync: Callable[[], None]) -> dict[str, Any]:
    """``calls`` back-to-back calls of ``fn(i)`` with one sync at the end (after WARMUP_CALLS calls).

    ``issue_s`` is the time until the last call returned, ``total_s`` until the device finished.
    """
    for i in range(WARMUP_CALLS):
        fn(i)
    sync()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    issued = time.perf_counter() - t0
    sync()
    total = time.perf_counter() - t0
    return {"calls": calls, "keys_per_s": calls * batch / total, "issue_s": issued, "total_s": total,
            "issue_share": issued / total}


def syncs_of(call: Callable[[], object], sync: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """The host syncs of one ``call()`` on ``device``: count and where (None off CUDA, where a machine with a
    GPU would count a CPU cache's calls as making none)."""
    if device.type != "cuda":
        call()
        return {"available": False, "count": None, "where": []}
    sync()
    with count_syncs() as seen:
        call()
    sync()
    return {"available": seen.available, "count": len(seen) if seen.available else None, "where": seen.where}


def syncs_of_one_call(fn: Callable[[int], object], sync: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """The host syncs of one call ``fn(0)``, after a warm-up call of the same batch (all hits stay all hits)."""
    fn(0)
    return syncs_of(lambda: fn(0), sync, device)


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Where a window's lookups were served, and the rows it moved (``cache.stats()[table]`` before and after).

    Hits count lookups only; an update's rows show in the promotions and store reads and writes.
    """
    d = {"lookups": after["lookups"] - before["lookups"], "updates": after["updates"] - before["updates"],
         "hbm_hits": after["hbm"]["hits"] - before["hbm"]["hits"],
         "ddr_hits": after["ddr"]["hits"] - before["ddr"]["hits"],
         "store_hits": after["ssd"]["hits"] - before["ssd"]["hits"],
         "store_created": after["ssd"]["created"] - before["ssd"]["created"],
         # lookups and updates alike: rows moved between the tiers, read from and written to the store
         "hbm_promotions": after["hbm"]["promotions"] - before["hbm"]["promotions"],
         "hbm_demotions": after["hbm"]["demotions"] - before["hbm"]["demotions"],
         "store_read_rows": after["ssd"]["read_rows"] - before["ssd"]["read_rows"],
         "store_write_rows": after["ssd"]["write_rows"] - before["ssd"]["write_rows"]}
    d["hbm_hit_ratio"] = d["hbm_hits"] / d["lookups"] if d["lookups"] else None
    return d


class Phases:
    """Runs the phases of one dim: prints as each starts and ends, records failures and seconds."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.errors: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], object]) -> bool:
        """Run ``fn()`` as phase ``name``; False (and the error recorded) if it raised."""
        print(f"dim {self.dim}: {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # a one-shot run: keep every other figure
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            ok = False
        else:
            ok = True
        self.seconds[name] = time.perf_counter() - t0
        print(f"dim {self.dim}: {name} {'done' if ok else 'FAILED'} in {self.seconds[name]:.1f} s", flush=True)
        return ok


def sparse_ids(n: int, salt: int) -> torch.Tensor:
    """``n`` distinct int64 ids spread over the key space."""
    return torch.from_numpy((np.arange(n, dtype=np.int64) * np.int64(-7046029254386353131)) ^ np.int64(salt))


def zipf_positions(n: int, rows: int, rng: np.random.Generator) -> torch.Tensor:
    """``n`` Zipf(ALPHA) draws over ``rows`` positions, the hot ranks scattered over the positions."""
    position_of_rank = rng.permutation(rows)
    return torch.from_numpy(position_of_rank[zipf_ranks(n, rows, ALPHA, rng)])


def fill(cache: EmbeddingCache, ids: torch.Tensor, device: torch.device, dim: int, update: bool = False) -> None:
    """Create every row of ``ids`` by lookups of FILL_CHUNK keys; with ``update``, by updates.

    An updated row is written to the store when it leaves the memory tiers; a row only looked up
    is not (the store lacks it, and the next lookup makes it again), so the cache with misses is
    filled by updates: its rows beyond HBM and DDR are then read from the store.
    """
    grads = torch.full((FILL_CHUNK, dim), 1e-3, device=device)
    for start in range(0, ids.shape[0], FILL_CHUNK):
        keys = ids[start:start + FILL_CHUNK].to(device)
        if update:
            cache.apply_gradients(TABLE, keys, grads[:keys.shape[0]])
        else:
            cache.lookup(TABLE, keys)


def hit_phases(ph: Phases, out: dict[str, Any], rows: int, batch: int, reps: int, device: torch.device,
               work: str) -> None:
    """All-hit: fill an HBM tier with ``rows`` rows; time, pipeline and count syncs of lookup, update, index_select."""
    dim = ph.dim
    sync = make_sync(device)
    rng = np.random.default_rng(dim)
    ids = sparse_ids(rows, dim)
    zipf_pos = zipf_positions(N_BATCHES * batch, rows, rng)
    uniform_pos = torch.from_numpy(rng.integers(0, rows, N_BATCHES * batch, dtype=np.int64))
    rb = resident_row_bytes(dim, torch.float32, state_width(OPTIMIZER, dim), device)
    cfg = CacheConfig(hbm_bytes=(rows + rows // 100 + 64) * rb, ddr_bytes=DDR_BYTES, path=os.path.join(work, f"d{dim}"),
                      device=str(device))
    table = TableConfig(name=TABLE, dim=dim, optimizer=OPTIMIZER, lr=0.01, seed=dim)
    with EmbeddingCache(cfg, [table]) as cache:
        def do_fill() -> None:
            fill(cache, ids, device, dim)
            st = cache.stats()[TABLE]["hbm"]
            out["hbm_capacity_rows"] = st["capacity_rows"]
            out["ddr_pinned"] = ddr_pinned(cache)
            if st["resident_rows"] != rows:
                raise RuntimeError(f"expected all {rows} rows in the HBM tier after filling, "
                                   f"found {st['resident_rows']}")

        if not ph.run("all-hit fill", do_fill):
            return
        ids_dev = ids.to(device)
        buf = torch.empty(batch, dim, device=device)
        grads = torch.full((batch, dim), 1e-3, device=device)
        weights = torch.randn(rows, dim, device=device)
        traces: dict[str, dict[str, Any]] = {}
        out["traces"] = traces
        calls: dict[str, dict[str, Callable[[int], object]]] = {}
        for trace_name, positions in (("zipf", zipf_pos), ("uniform", uniform_pos)):
            pos = positions.to(device).view(N_BATCHES, batch)
            keys = ids_dev[pos]
            calls[trace_name] = {
                "lookup": per_batch(lambda k: cache.lookup(TABLE, k, out=buf), keys),
                "update": per_batch(lambda k: cache.apply_gradients(TABLE, k, grads), keys),
                "index_select": per_batch(lambda p: torch.index_select(weights, 0, p, out=buf), pos)}

            def timed(trace_name: str = trace_name) -> None:
                fns = calls[trace_name]
                before = cache.stats()[TABLE]
                t_lookup = timings(fns["lookup"], reps, WARMUP_CALLS, sync)
                t_update = timings(fns["update"], reps, WARMUP_CALLS, sync)
                t_select = timings(fns["index_select"], reps, WARMUP_CALLS, sync)
                delta = stats_delta(before, cache.stats()[TABLE])
                traces[trace_name] = {"lookup": rate(batch, t_lookup), "update": rate(batch, t_update),
                                      "index_select": rate(batch, t_select),
                                      "hbm_hit_ratio": delta["hbm_hit_ratio"], "tiers": delta}

            ph.run(f"all-hit timed, {trace_name} keys", timed)

        def pipe() -> None:
            out["pipelined"] = {op: pipelined(calls["zipf"][op], reps, batch, sync) for op in ("lookup", "update")}

        ph.run("all-hit pipelined", pipe)

        def syncs() -> None:
            for trace_name, fns in calls.items():
                traces.setdefault(trace_name, {})["syncs"] = {op: syncs_of_one_call(fn, sync, device)
                                                              for op, fn in fns.items()}

        ph.run("all-hit syncs per call", syncs)


def miss_phases(ph: Phases, out: dict[str, Any], miss_rows: int, batch: int, reps: int, device: torch.device,
                work: str) -> None:
    """With misses: a cache whose HBM and DDR hold a share of ``miss_rows`` rows; time lookup and update."""
    dim = ph.dim
    sync = make_sync(device)
    rng = np.random.default_rng(dim + 1)
    ids = sparse_ids(miss_rows, ~dim)
    # the same hot rows for both, but the updates' batches are drawn apart from the lookups': the
    # lookups just before them would otherwise have brought every row they touch into memory
    pos = zipf_positions(2 * N_BATCHES * batch, miss_rows, rng).view(2, N_BATCHES, batch)
    rb = resident_row_bytes(dim, torch.float32, state_width(OPTIMIZER, dim), device)
    hbm_rows, ddr_rows = int(miss_rows * MISS_HBM_SHARE), int(miss_rows * MISS_DDR_SHARE)
    cfg = CacheConfig(hbm_bytes=hbm_rows * rb, ddr_bytes=ddr_rows * rb, path=os.path.join(work, f"miss{dim}"),
                      device=str(device))
    table = TableConfig(name=TABLE, dim=dim, optimizer=OPTIMIZER, lr=0.01, seed=dim)
    miss: dict[str, Any] = {"rows": miss_rows, "hbm_share": MISS_HBM_SHARE, "ddr_share": MISS_DDR_SHARE}
    out["miss"] = miss
    with EmbeddingCache(cfg, [table]) as cache:
        def do_fill() -> None:
            fill(cache, ids, device, dim, update=True)
            st = cache.stats()[TABLE]
            miss.update(hbm_capacity_rows=st["hbm"]["capacity_rows"], ddr_capacity_rows=st["ddr"]["capacity_rows"],
                        hbm_resident_rows=st["hbm"]["resident_rows"], ddr_resident_rows=st["ddr"]["resident_rows"],
                        ddr_pinned=ddr_pinned(cache))

        if not ph.run("miss fill", do_fill):
            return
        keys = ids.to(device)[pos.to(device)]  # [2, N_BATCHES, batch]: lookups', updates'
        buf = torch.empty(batch, dim, device=device)
        grads = torch.full((batch, dim), 1e-3, device=device)
        fns: dict[str, Callable[[int], object]] = {
            "lookup": per_batch(lambda k: cache.lookup(TABLE, k, out=buf), keys[0]),
            "update": per_batch(lambda k: cache.apply_gradients(TABLE, k, grads), keys[1])}

        def timed(op: str) -> Callable[[], None]:
            def go() -> None:
                before = cache.stats()[TABLE]
                t = timings(fns[op], reps, N_BATCHES, sync)  # warm-up: one pass over the batches
                miss[op] = rate(batch, t)
                miss[op]["tiers"] = stats_delta(before, cache.stats()[TABLE])
            return go

        for op in ("lookup", "update"):
            ph.run(f"miss timed {op}", timed(op))
        if isinstance(miss.get("lookup"), dict):
            miss["hbm_hit_ratio"] = miss["lookup"]["tiers"]["hbm_hit_ratio"]

        # a batch never seen: one seen just before would find its rows resident (no misses to count)
        fresh = ids.to(device)[zipf_positions(2 * batch, miss_rows, rng).to(device)].view(2, batch)

        def syncs() -> None:
            miss["syncs"] = {"lookup": syncs_of(lambda: cache.lookup(TABLE, fresh[0], out=buf), sync, device),
                             "update": syncs_of(lambda: cache.apply_gradients(TABLE, fresh[1], grads), sync, device)}

        ph.run("miss syncs per call", syncs)


def run_dim(dim: int, rows: int, miss_rows: int, batch: int, reps: int, device: torch.device,
            work: str) -> dict[str, Any]:
    """Every phase of one dim; a failed phase is recorded in ``errors`` and the rest goes on."""
    out: dict[str, Any] = {"dim": dim, "rows": rows, "batch": batch, "hbm_capacity_rows": 0, "traces": {}}
    ph = Phases(dim)
    ph.run("all-hit", lambda: hit_phases(ph, out, rows, batch, reps, device, work))
    ph.run("misses", lambda: miss_phases(ph, out, miss_rows, batch, reps, device, work))
    out["errors"] = ph.errors
    out["phase_seconds"] = ph.seconds
    return out


def _keys(c: dict[str, Any] | None, op: str) -> float | None:
    """Median keys/s of ``c[op]``, None when that phase failed."""
    v = (c or {}).get(op)
    return v["keys_per_s"] if isinstance(v, dict) and "keys_per_s" in v else None


def _m(v: float | None) -> str:
    return "—" if v is None else f"{v / 1e6:,.1f}M"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else format_ratio(a / b)


def _syncs(s: dict[str, Any] | None, ops: tuple[str, ...]) -> str:
    """Syncs of one call per op, "a/b/c" ("—" where not counted, "—" alone when none was: off CUDA)."""
    counts = [(s or {}).get(op, {}).get("count") for op in ops]
    if all(c is None for c in counts):
        return "—"
    return "/".join("—" if c is None else str(c) for c in counts)


def render(res: dict[str, Any]) -> str:
    """Markdown tables: per-call rates per (dim, case), then the pipelined rates."""
    rows = []
    for r in res["results"]:
        for trace, c in r.get("traces", {}).items():
            look, upd, sel = _keys(c, "lookup"), _keys(c, "update"), _keys(c, "index_select")
            hit = c.get("hbm_hit_ratio")
            rows.append([r["dim"], f"all in HBM, {trace}", "—" if hit is None else f"{hit:.1%}", "—", _m(look),
                         _m(upd), _m(sel), _ratio(look, sel), _ratio(upd, sel),
                         f"{look / HKV_FINDS_PER_S:.3f}x" if r["dim"] == 64 and look else "—",
                         _syncs(c.get("syncs"), ("lookup", "update", "index_select"))])
        m = r.get("miss")
        if m:
            sel = _keys(r.get("traces", {}).get("zipf"), "index_select")
            look, upd = _keys(m, "lookup"), _keys(m, "update")
            hit = m.get("hbm_hit_ratio")
            tiers = m["lookup"]["tiers"] if isinstance(m.get("lookup"), dict) else None
            below = "—" if not tiers or not tiers["lookups"] else (
                f"{tiers['ddr_hits'] / tiers['lookups']:.1%} / "
                f"{(tiers['store_hits'] + tiers['store_created']) / tiers['lookups']:.1%}")
            rows.append([r["dim"], f"{m['hbm_share']:.0%} of {m['rows']:,} in HBM, zipf",
                         "—" if hit is None else f"{hit:.1%}", below, _m(look), _m(upd), _m(sel),
                         _ratio(look, sel), _ratio(upd, sel), "—", _syncs(m.get("syncs"), ("lookup", "update"))])
    table = markdown_table(["dim", "rows", "HBM hits", "DDR / store", "lookup keys/s", "update keys/s",
                            "index_select keys/s (all-hit zipf)", "lookup / index_select", "update / index_select",
                            "lookup / HKV 2e9 (published, not measured)",
                            "syncs/call (lookup/update[/index_select])"], rows)
    pipe_rows = []
    for r in res["results"]:
        z = r.get("traces", {}).get("zipf", {})
        for op, p in r.get("pipelined", {}).items():
            pipe_rows.append([r["dim"], op, _m(_keys(z, op)), _m(p["keys_per_s"]), p["calls"],
                              f"{p['issue_s'] * 1e3:,.1f} ms / {p['total_s'] * 1e3:,.1f} ms ({p['issue_share']:.0%})"])
    if pipe_rows:
        table += "\n\nPipelined (all in HBM, zipf keys; calls back to back, one sync at the end):\n\n" + markdown_table(
            ["dim", "op", "per call, synced", "pipelined keys/s", "calls", "CPU issue / total"], pipe_rows)
    return table


def plot(res: dict[str, Any], path: str) -> None:
    """Keys/s (log) of lookup, update and index_select per dim and case, with HierarchicalKV's stated rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: list[tuple[str, dict[str, Any]]] = []
    for r in res["results"]:
        groups += [(f"dim {r['dim']}\n{trace}", c) for trace, c in r.get("traces", {}).items()]
        if r.get("miss"):
            groups.append((f"dim {r['dim']}\nzipf, misses", r["miss"]))
    ops = (("lookup", "embcache lookup"), ("update", "embcache update (row-wise AdaGrad)"),
           ("index_select", "index_select (no index)"))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.4))
    width = 0.8 / len(ops)
    for j, (op, label) in enumerate(ops):
        xs, med, lo, hi = [], [], [], []
        for i, (_, c) in enumerate(groups):
            v = c.get(op)
            if isinstance(v, dict) and "keys_per_s" in v:
                xs.append(i + (j - (len(ops) - 1) / 2) * width)
                med.append(v["keys_per_s"])
                lo.append(v["keys_per_s"] - v["keys_per_s_min"])
                hi.append(v["keys_per_s_max"] - v["keys_per_s"])
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=label)
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


def summary(results: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    """Rows for ``python -m bench``: lookup and update over index_select (all-hit Zipf), all hits and with misses."""
    rows = []
    for r in results:
        sel = _keys(r.get("traces", {}).get("zipf"), "index_select")
        cases = (("HBM-tier", r.get("traces", {}).get("zipf")),
                 ("with misses (25% of rows in HBM)", r.get("miss")))
        for label, c in cases:
            for op in ("lookup", "update"):
                v = _keys(c, op)
                if v is not None and sel:
                    rows.append({"case": f"{label} {op}, dim {r['dim']}, Zipf keys, on {device.type}",
                                 "ratio": v / sel, "reference": f"index_select on {device.type}", "target": None})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA when present, else skip (default)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions; writes gpu-quick.*")
    ap.add_argument("--dims", default="64,128", help="comma-separated embedding dims (default 64,128)")
    ap.add_argument("--rows", type=int, default=1 << 20, help="rows resident in the HBM tier (default 1,048,576)")
    ap.add_argument("--miss-rows", type=int, default=None,
                    help="rows of the cache with misses, 25%% of them in HBM, 25%% in DDR (default --rows)")
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
    miss_rows = args.miss_rows or args.rows
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="embcache-gpu-") as work:
        for dim in (int(d) for d in args.dims.split(",")):
            r = run_dim(dim, args.rows, miss_rows, args.batch, reps, device, work)
            z, m = r.get("traces", {}).get("zipf", {}), r.get("miss") or {}
            print(f"dim {dim}: all-hit lookup {_m(_keys(z, 'lookup'))} keys/s, update {_m(_keys(z, 'update'))}, "
                  f"index_select {_m(_keys(z, 'index_select'))}; with misses lookup {_m(_keys(m, 'lookup'))}, "
                  f"update {_m(_keys(m, 'update'))} (Zipf); errors: {r['errors'] or 'none'}", flush=True)
            results.append(r)
    if device.type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(device)
    failed = {f"dim {r['dim']}: {phase}": err for r in results for phase, err in r["errors"].items()}
    res: dict[str, Any] = {
        "benchmark": "HBM-tier lookup and update rates vs index_select: all hits, with misses, pipelined, syncs",
        "command": info["command"], "device": str(device), "device_name": info.get("cuda_device") or info["cpu_model"],
        "batch": args.batch, "machine": info, "optimizer": OPTIMIZER, "alpha": ALPHA, "reps": reps,
        "miss_rows": miss_rows,
        "reference": {"name": "HierarchicalKV find, dim 64, A100 (published, not measured)",
                      "keys_per_s": HKV_FINDS_PER_S},
        "results": results,
        "summary": summary(results, device),
        "errors": failed,
        "seconds": time.perf_counter() - t0,
    }
    table = render(res)
    print(table)
    stem = os.path.join(args.out, "gpu-quick" if args.quick else "gpu")
    write_json(stem + ".json", res)
    name = info.get("cuda_device") or info["cpu_model"]
    errors = "".join(f"\n- {k}: {v}" for k, v in failed.items())
    Path(stem + ".md").write_text(
        f"# HBM-tier rates on {device.type} ({name})\n\nCommand: `{res['command']}`; batch {args.batch:,}, "
        f"{args.rows:,} rows resident in HBM (all-hit); {miss_rows:,} rows with "
        f"{MISS_HBM_SHARE:.0%} in HBM and {MISS_DDR_SHARE:.0%} in DDR (misses); median of {reps} calls. "
        f"Syncs/call: host syncs of one call counted by torch's sync debug mode (— off CUDA). Reference "
        f"(stated, not measured): HierarchicalKV ~{HKV_FINDS_PER_S:.0e} finds/s at dim 64 on an A100. Commit "
        f"{str(info['git_commit'])[:7]}{' (dirty tree)' if info['git_dirty'] else ''}, {info['started_at']}; "
        f"DDR tier pinned: {', '.join(str(r.get('ddr_pinned')) for r in results)}.\n\n{table}\n"
        + (f"\nFailed phases:{errors}\n" if failed else ""))
    plot(res, stem + ".png")
    print(f"wrote {stem}.json/.md/.png ({res['seconds']:.0f} s)"
          + (f"; FAILED phases: {list(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
