"""Big-table benchmark: a table about twice the machine's RAM, trained within a bounded memory budget.

Run from the repository root::

    .venv/bin/python bench/bench_big.py            # 160M rows, ~44.5 GB on disk; ~25-40 min on 2 cores
    .venv/bin/python bench/bench_big.py --smoke    # 2M rows, small tiers (~1 min): checks the whole path

Full mode only (``python -m bench`` runs it without ``--quick``; it has no quick mode). It needs
about 50 GB of free disk: it refuses to start when the load would leave less than
``--min-free-gib`` (8) free or push the disk's used space above ``--max-used-gib`` (72), and it
stops cleanly (and deletes its data) if either limit is crossed while it runs. The default size
(160M rows, ~44.5 GB, ~1.8x the 23.5 GiB of RAM of the machine it was written on) is what those
limits leave room for on that machine's disk, with ~4 GB for the write-backs of training.

1. **Load.** A RocksDB store (``embcache.stores.open_store``) is filled with ``--rows`` rows of
   one table (dim 64 fp32 weights + row-wise AdaGrad state: 260-byte records, ~278 bytes per row
   on disk), written straight through ``Store.put_many`` in 1M-row batches with keys in ascending
   order. Sorted keys make every flushed file disjoint from the others, so RocksDB moves them
   down the levels without rewriting them (trivial moves); the load writes each byte twice (WAL
   and table file) and the compaction after it (``Store.compact``) has nothing to rewrite.
   Measured on a 4M-row trial: ~430K rows/s, ~1.1 s of compaction. The load uses 256 MiB
   memtables (``write_buffer_bytes``) so that each batch becomes one file.
2. **Train.** An ``EmbeddingCache`` on that store with explicit budgets (full mode: HBM tier
   512 MiB, DDR tier 2 GiB, RocksDB block cache 1 GiB: it holds the index and bloom-filter
   blocks of the whole store, ~0.45 GB at 160M rows, so a miss costs one data-block read) trains
   on Zipf(1.05) keys over all rows (ranks mapped to keys by a multiplicative bijection, so hot
   keys are scattered over the key space) in batches of 8,192: ``lookup`` then
   ``apply_gradients`` (gradients 1e-3) per step. The trace is cut into ``--passes`` passes run
   with the pass protocol: ``prefetch`` of pass p+1 (its ``Keyset``) while pass p trains,
   ``begin_pass`` / ``end_pass`` around each. The first ``begin_pass`` stages pass 0 from disk
   with nothing to overlap; it is reported apart ("initial staging") and kept out of the
   training rate. One torch and numba thread (``--threads``), as in the other benchmarks: the
   second core is left to staging, write-back and RocksDB's compactions.
3. **Memory.** A thread samples the process's resident set (``VmRSS`` of ``/proc/self/status``)
   every 0.5 s from before the load to the end. The baseline is the RSS right before the cache
   opens (the trace and keysets are already built by then); the figure is the peak RSS while
   the cache is open (sampled, and ``VmHWM`` after resetting it through
   ``/proc/self/clear_refs`` where the kernel allows) minus the baseline, compared with the
   configured budget (HBM + DDR + block cache) plus 1 GiB for everything else (indexes,
   frequency sketch, memtables, staging buffers, allocator slack).

Reports load time and rate, the store's size on disk, training rows/s (a row is one key looked
up and updated), hit ratios per tier (HBM, DDR, SSD including rows created on first touch),
staging time per pass, and the peak RSS against the budget. Writes ``bench/results/big.json``,
``big.md`` and ``big.png`` (RSS over time with the budget lines; rows/s over time);
``--smoke`` writes ``big-smoke.*``. The data directory (``--path``, default a fresh directory
under ``/tmp``) is deleted at the end unless ``--keep``; ``--reuse`` trains on a store a
``--keep`` run left at ``--path`` with the same ``--rows`` instead of loading it again.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._common import machine_info, markdown_table, write_json  # noqa: E402
from embcache import CacheConfig, EmbeddingCache, Keyset, TableConfig  # noqa: E402
from embcache.optim import state_width  # noqa: E402
from embcache.stores import open_store  # noqa: E402

TABLE = "big"
DIM = 64
OPTIMIZER = "rowwise_adagrad"
BATCH = 8192
ALPHA = 1.05
GIB = 1 << 30
MIB = 1 << 20
OVERHEAD_BYTES = GIB  # allowance above the configured budget
LOAD_BATCH = 1 << 20
LOAD_WRITE_BUFFER = 256 * MIB
META = "bench_big"
SAMPLE_S = 0.5


@dataclass(frozen=True)
class Mode:
    """Sizes of one run."""

    rows: int
    hbm_bytes: int
    ddr_bytes: int
    block_cache_bytes: int
    passes: int
    pass_batches: int


FULL = Mode(rows=160_000_000, hbm_bytes=512 * MIB, ddr_bytes=2 * GIB, block_cache_bytes=GIB, passes=6,
            pass_batches=1500)
SMOKE = Mode(rows=2_000_000, hbm_bytes=16 * MIB, ddr_bytes=64 * MIB, block_cache_bytes=64 * MIB, passes=3,
             pass_batches=60)


class DiskLimitError(RuntimeError):
    """The disk crossed a limit of the run (too little free space, or too much used)."""


@dataclass
class DiskGuard:
    """Limits on the disk holding the data: free space above ``min_free``, used space below ``max_used``."""

    path: str
    min_free: int
    max_used: int

    def check(self, extra: int = 0) -> None:
        """Raise DiskLimitError if the limits are crossed now, or would be after writing ``extra`` more bytes."""
        du = shutil.disk_usage(self.path)
        if du.free - extra < self.min_free:
            raise DiskLimitError(f"disk of {self.path}: {du.free / GIB:.1f} GiB free"
                                 f"{f', {extra / GIB:.1f} GiB more needed' if extra else ''}; "
                                 f"the run keeps at least {self.min_free / GIB:.0f} GiB free")
        if du.used + extra > self.max_used:
            raise DiskLimitError(f"disk of {self.path}: {du.used / GIB:.1f} GiB used"
                                 f"{f' + {extra / GIB:.1f} GiB to write' if extra else ''}; "
                                 f"the run keeps used space below {self.max_used / GIB:.0f} GiB")


def rss_bytes() -> int:
    """The process's resident set size (``VmRSS``) in bytes."""
    return _status_kib("VmRSS:") * 1024


def hwm_bytes() -> int:
    """The process's peak resident set size (``VmHWM``) in bytes."""
    return _status_kib("VmHWM:") * 1024


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: write 5 to clear_refs); whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return hwm_bytes() <= rss_bytes() + 64 * MIB


@dataclass
class Sampler:
    """A thread sampling RSS and disk use every ``SAMPLE_S`` s; sets ``abort`` when the disk guard trips."""

    guard: DiskGuard
    t0: float = field(default_factory=time.perf_counter)
    samples: list[tuple[float, int, int, str, float]] = field(default_factory=list)  # s, rss, disk, phase, load
    phase: str = "setup"
    abort: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="bench-big-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()
            if not self.abort.is_set():
                try:
                    self.guard.check()
                except DiskLimitError as exc:
                    self.reason = str(exc)
                    self.abort.set()

    def sample(self) -> None:
        """Record one sample now."""
        used = shutil.disk_usage(self.guard.path).used
        self.samples.append((time.perf_counter() - self.t0, rss_bytes(), used, self.phase, os.getloadavg()[0]))

    def check(self) -> None:
        """Raise DiskLimitError if the sampler saw a limit crossed."""
        if self.abort.is_set():
            raise DiskLimitError(self.reason)

    def max_rss(self, phases: tuple[str, ...]) -> int:
        """Peak sampled RSS during ``phases``."""
        return max((s[1] for s in self.samples if s[3] in phases), default=0)


def coprime_multiplier(n: int) -> int:
    """An odd multiplier near n / golden ratio, coprime with n: ``rank * m % n`` is a bijection of [0, n)."""
    m = max(int(n / 1.618033988749895) | 1, 1)
    while math.gcd(m, n) != 1:
        m += 2
    return m


def keys_of(ranks: np.ndarray, n: int, mult: int) -> np.ndarray:
    """Keys in [0, n) of Zipf ranks: a bijection that scatters hot ranks over the key space."""
    if n * mult >= 2**63:
        raise ValueError(f"{n} rows are too many for the int64 key bijection")
    return (ranks.astype(np.int64) * np.int64(mult)) % np.int64(n)


def zipf_ranks(count: int, n: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` Zipf(alpha) ranks in [0, n) (alpha > 1): numpy's unbounded Zipf draws, rejecting ranks >= n.

    Rejection gives exactly the Zipf law truncated to n ranks, without the n-entry cumulative
    table that inverse-CDF sampling needs (1.3 GB at 160M rows). Draws in chunks, not per key.
    """
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        need = count - filled
        draw = rng.zipf(alpha, int(need * 1.6) + 1024)
        draw = draw[draw <= n][:need] - 1
        out[filled:filled + draw.size] = draw
        filled += draw.size
    return out


def dir_bytes(path: str) -> int:
    """Allocated bytes of the files under ``path`` (one stat per file)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def table_config() -> TableConfig:
    """The benchmark's table."""
    return TableConfig(name=TABLE, dim=DIM, optimizer=OPTIMIZER, lr=0.01, seed=1)


def record_bytes() -> int:
    """Bytes of one stored record (weights + optimizer state)."""
    return DIM * 4 + 4 * state_width(OPTIMIZER, DIM)


def fill_store(path: str, n_rows: int, guard: DiskGuard, sampler: Sampler, progress: bool) -> dict[str, Any]:
    """Write ``n_rows`` rows (keys 0..n-1, ascending) into a RocksDB store at ``path/store``; timings."""
    width = record_bytes()
    rng = np.random.default_rng(1)
    # A pool of random records (weights ~U(-1/16, 1/16), AdaGrad sums in [0, 1)) read at a shifting
    # offset: every batch holds different bytes, which LZ4 cannot compress (as trained weights).
    pool_rows = 1_000_003
    w = (rng.random((pool_rows, DIM), dtype=np.float32) - 0.5) / 8
    s = rng.random((pool_rows, width // 4 - DIM), dtype=np.float32)
    pool = np.ascontiguousarray(np.concatenate([w.view(np.uint8), s.view(np.uint8)], axis=1))
    del w, s
    t0 = time.perf_counter()
    store = open_store("rocksdb", os.path.join(path, "store"), write_buffer_bytes=LOAD_WRITE_BUFFER)
    try:
        store.open_table(TABLE, width)
        store.put_meta("tables", json.dumps([table_config().to_dict()]).encode())
        with tqdm(total=n_rows, desc=f"loading {n_rows:,} rows", unit="rows", unit_scale=True,
                  disable=not progress, mininterval=2.0) as bar:
            for start in range(0, n_rows, LOAD_BATCH):
                sampler.check()
                guard.check()
                n = min(LOAD_BATCH, n_rows - start)
                records = pool[(start + np.arange(n)) % pool_rows]
                store.put_many(TABLE, np.arange(start, start + n, dtype=np.int64), records)
                bar.update(n)
        store.flush()
        t1 = time.perf_counter()
        sampler.phase = "compact"
        store.compact()
        t2 = time.perf_counter()
        info = {"rows": n_rows, "write_seconds": t1 - t0, "compact_seconds": t2 - t1, "load_seconds": t2 - t0,
                "rows_per_s": n_rows / (t2 - t0)}
        store.put_meta(META, json.dumps(info).encode())
    finally:
        store.close()
    return info


@dataclass
class Trace:
    """The training keys, cut into passes of batches, with each pass's keyset."""

    keys: np.ndarray  # int64 [passes * pass_batches * BATCH]
    passes: int
    pass_batches: int
    keysets: list[Keyset]

    def batches(self, p: int) -> Iterator[torch.Tensor]:
        """The batches of pass ``p`` (views into the trace)."""
        per = self.pass_batches * BATCH
        chunk = torch.from_numpy(self.keys[p * per:(p + 1) * per])
        yield from chunk.split(BATCH)


def make_trace(n_rows: int, passes: int, pass_batches: int, seed: int = 7) -> Trace:
    """Zipf(ALPHA) keys over all ``n_rows`` rows for ``passes`` passes, and each pass's keyset."""
    rng = np.random.default_rng(seed)
    per = pass_batches * BATCH
    keys = keys_of(zipf_ranks(passes * per, n_rows, ALPHA, rng), n_rows, coprime_multiplier(n_rows))
    keysets = [Keyset.from_keys(torch.from_numpy(keys[p * per:(p + 1) * per])) for p in range(passes)]
    return Trace(keys, passes, pass_batches, keysets)


def _tier_hits(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    looked = max(after["lookups"] - before["lookups"], 1)
    out = {t: (after[t]["hits"] - before[t]["hits"]) / looked for t in ("hbm", "ddr")}
    out["ssd"] = (after["ssd"]["hits"] - before["ssd"]["hits"]) / looked
    out["created"] = (after["ssd"]["created"] - before["ssd"]["created"]) / looked
    return out


def train(path: str, mode: Mode, trace: Trace, sampler: Sampler, progress: bool) -> dict[str, Any]:
    """Open the cache on the loaded store and train ``trace`` pass by pass; figures and memory."""
    cfg = CacheConfig(hbm_bytes=mode.hbm_bytes, ddr_bytes=mode.ddr_bytes, path=path, store="rocksdb", device="cpu",
                      store_options={"block_cache_bytes": mode.block_cache_bytes})
    grads = torch.full((BATCH, DIM), 1e-3)
    out = torch.empty(BATCH, DIM)
    gc.collect()
    baseline = rss_bytes()
    hwm_reset = reset_peak_rss()
    sampler.phase = "open"
    t_open = time.perf_counter()
    cache = EmbeddingCache(cfg, [table_config()])
    after_open = rss_bytes()
    passes: list[dict[str, Any]] = []
    batch_ends: list[float] = []  # seconds since the sampler's start, one per batch
    try:
        open_s = time.perf_counter() - t_open
        caps = cache.stats()[TABLE]
        sampler.phase = "stage"
        t_stage = time.perf_counter()
        pending = cache.prefetch({TABLE: trace.keysets[0]})
        write_back: Any = None
        train_start = 0.0
        first = cache.stats()[TABLE]
        bar = tqdm(total=trace.passes * trace.pass_batches, desc="training", unit="batch", disable=not progress,
                   mininterval=2.0)
        with bar:
            for p in range(trace.passes):
                t_begin = time.perf_counter()
                report = cache.begin_pass({TABLE: trace.keysets[p]})
                staged = pending.result()[TABLE]
                begin_s = time.perf_counter() - t_begin
                if p == 0:
                    initial_stage_s = time.perf_counter() - t_stage
                    train_start = time.perf_counter()
                    first = cache.stats()[TABLE]
                sampler.phase = "train"
                if p + 1 < trace.passes:
                    pending = cache.prefetch({TABLE: trace.keysets[p + 1]})
                before = cache.stats()[TABLE]
                t_pass = time.perf_counter()
                for b in trace.batches(p):
                    cache.lookup(TABLE, b, out=out)
                    cache.apply_gradients(TABLE, b, grads)
                    batch_ends.append(time.perf_counter() - sampler.t0)
                    bar.update(1)
                    if sampler.abort.is_set():
                        break
                pass_s = time.perf_counter() - t_pass
                after = cache.stats()[TABLE]
                if write_back is not None:
                    write_back.result()
                write_back = cache.end_pass()
                rows = after["lookups"] - before["lookups"]
                passes.append({"pass": p, "keyset_rows": report[TABLE]["keyset_rows"],
                               "pinned_rows": report[TABLE]["pinned_rows"], "staged_rows": staged["staged_rows"],
                               "staging_seconds": staged["seconds"], "begin_pass_seconds": begin_s,
                               "train_seconds": pass_s, "rows": rows, "rows_per_s": rows / pass_s,
                               "hit_ratio": _tier_hits(before, after)})
                bar.set_postfix(rows_per_s=f"{rows / pass_s / 1e3:.0f}K", hbm=f"{passes[-1]['hit_ratio']['hbm']:.0%}")
                if sampler.abort.is_set():  # a disk limit: stop training, report what was done
                    break
        if write_back is not None:
            write_back.result()
        train_s = time.perf_counter() - train_start
        last = cache.stats()[TABLE]
        sampler.phase = "close"
        t_close = time.perf_counter()
    finally:
        cache.close()
    close_s = time.perf_counter() - t_close
    peak_sampled = sampler.max_rss(("open", "stage", "train", "close"))
    peak_hwm = hwm_bytes() if hwm_reset else None
    sampler.phase = "done"
    peak = max(peak_sampled, peak_hwm or 0)
    budget = mode.hbm_bytes + mode.ddr_bytes + mode.block_cache_bytes
    trained = last["lookups"] - first["lookups"]
    return {
        "aborted": sampler.reason if sampler.abort.is_set() else None,
        "open_seconds": open_s, "initial_stage_seconds": initial_stage_s, "train_seconds": train_s,
        "close_seconds": close_s, "trained_rows": trained, "rows_per_s": trained / train_s,
        "rows_per_s_with_initial_stage": trained / (train_s + initial_stage_s),
        "hit_ratio": _tier_hits(first, last), "passes": passes,
        "tiers": {t: {"capacity_rows": caps[t]["capacity_rows"], "capacity_bytes": caps[t]["capacity_bytes"]}
                  for t in ("hbm", "ddr")},
        "ssd": {k: last["ssd"][k] for k in ("reads", "read_rows", "read_bytes", "writes", "write_rows",
                                            "write_bytes", "seconds")},
        "memory": {"baseline_rss_bytes": baseline, "after_open_rss_bytes": after_open,
                   "tier_capacity_bytes": sum(caps[t]["capacity_bytes"] for t in ("hbm", "ddr")),
                   "peak_rss_sampled_bytes": peak_sampled,
                   "peak_rss_hwm_bytes": peak_hwm, "peak_rss_bytes": peak, "peak_over_baseline_bytes": peak - baseline,
                   "budget_bytes": budget, "allowance_bytes": budget + OVERHEAD_BYTES,
                   "within_budget": peak - baseline <= budget + OVERHEAD_BYTES,
                   "over_budget_bytes": peak - baseline - budget},
        "batch_end_seconds": batch_ends,
    }


def render(res: dict[str, Any]) -> str:
    """Markdown: the headline figures, then one row per pass."""
    t, ld, m, mode = res["train"], res["load"], res["train"]["memory"], res["mode"]
    h = t["hit_ratio"]
    head = markdown_table(["figure", "value"], [
        ["rows (dim 64 fp32 + row-wise AdaGrad)", f"{ld['rows']:,}"],
        ["store on disk after load / after training", f"{res['store_bytes_after_load'] / 1e9:.1f} GB / "
         f"{res['store_bytes_after_train'] / 1e9:.1f} GB ({res['store_bytes_after_load'] / ld['rows']:.0f} B/row)"],
        ["store / machine RAM", f"{res['store_bytes_after_load'] / res['machine']['mem_total_bytes']:.2f}x"],
        ["load (write + compact)", f"{ld['load_seconds']:.0f} s ({ld['write_seconds']:.0f} + "
         f"{ld['compact_seconds']:.0f}); {ld['rows_per_s'] / 1e3:.0f}K rows/s"
         + (" (reused)" if res["reused"] else "")],
        ["tiers: HBM / DDR / block cache", f"{mode['hbm_bytes'] / MIB:.0f} MiB ({t['tiers']['hbm']['capacity_rows']:,} "
         f"rows) / {mode['ddr_bytes'] / MIB:.0f} MiB ({t['tiers']['ddr']['capacity_rows']:,} rows) / "
         f"{mode['block_cache_bytes'] / MIB:.0f} MiB"],
        ["trained rows (lookup + update)", f"{t['trained_rows']:,} in {len(t['passes'])} passes of "
         f"{mode['pass_batches']:,} batches of {BATCH:,}"],
        ["training rate", f"{t['rows_per_s'] / 1e3:.0f}K rows/s ({t['rows_per_s_with_initial_stage'] / 1e3:.0f}K "
         f"with the initial staging of {t['initial_stage_seconds']:.0f} s)"],
        ["hits HBM / DDR / SSD (+created)", f"{h['hbm']:.1%} / {h['ddr']:.1%} / {h['ssd']:.2%} (+{h['created']:.2%})"],
        ["peak RSS - baseline", f"{m['peak_over_baseline_bytes'] / GIB:.2f} GiB (baseline "
         f"{m['baseline_rss_bytes'] / GIB:.2f} GiB)"],
        ["RSS - baseline right after the cache opened",
         f"{(m['after_open_rss_bytes'] - m['baseline_rss_bytes']) / GIB:.2f} GiB (tiers' capacity "
         f"{m['tier_capacity_bytes'] / GIB:.2f} GiB, preallocated; the rest: key indexes, "
         "free-slot stacks, frequency sketch)"],
        ["budget (HBM + DDR + block cache) + 1 GiB", f"{m['budget_bytes'] / GIB:.2f} + 1 = "
         f"{m['allowance_bytes'] / GIB:.2f} GiB: **{'within' if m['within_budget'] else 'OVER'}**"],
        ["1-min load average (start / mean while training / end)",
         " / ".join(f"{x:.2f}" for x in (res["machine"]["loadavg_at_start"][0],
                                         res["loadavg_1min_mean_training"] or float("nan"), res["loadavg_at_end"][0]))],
    ])
    rows = [[p["pass"], f"{p['keyset_rows']:,}", f"{p['pinned_rows']:,}", f"{p['staged_rows']:,}",
             f"{p['staging_seconds']:.1f}", f"{p['begin_pass_seconds']:.1f}", f"{p['train_seconds']:.1f}",
             f"{p['rows_per_s'] / 1e3:.0f}K", f"{p['hit_ratio']['hbm']:.1%}", f"{p['hit_ratio']['ddr']:.1%}",
             f"{p['hit_ratio']['ssd'] + p['hit_ratio']['created']:.2%}"] for p in t["passes"]]
    per_pass = markdown_table(["pass", "keyset rows", "pinned", "staged", "staging s", "begin_pass s", "train s",
                               "rows/s", "HBM", "DDR", "SSD"], rows)
    return f"{head}\n\n{per_pass}"


def plot(res: dict[str, Any], path: str) -> None:
    """RSS over time with the budget lines (top) and training rows/s over time (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = res["train"]["memory"]
    samples = res["samples"]
    ts = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples]) / GIB
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    ax1.plot(ts, rss, lw=1, label="RSS")
    base = m["baseline_rss_bytes"] / GIB
    ax1.axhline(base, color="gray", ls=":", lw=1, label=f"baseline before the cache opened ({base:.1f} GiB)")
    ax1.axhline(base + m["budget_bytes"] / GIB, color="tab:orange", ls="--", lw=1,
                label=f"+ budget HBM + DDR + block cache ({m['budget_bytes'] / GIB:.1f} GiB)")
    ax1.axhline(base + m["allowance_bytes"] / GIB, color="tab:red", lw=1, label="+ budget + 1 GiB")
    spans: dict[str, list[float]] = {}
    for t, _r, _u, ph, _l in samples:
        spans.setdefault(ph, [t, t])[1] = t
    colors = {"load": "tab:blue", "compact": "tab:purple", "stage": "tab:olive", "train": "tab:green"}
    for ph, (a, b) in spans.items():
        if ph in colors:
            ax1.axvspan(a, b, color=colors[ph], alpha=0.08, label=ph)
    ax1.set_ylabel("resident memory (GiB)")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=7, loc="upper left")
    ax1.grid(True, alpha=0.3)
    ends = np.array(res["train"]["batch_end_seconds"])
    if ends.size > 1:
        window = max(2.0, (ends[-1] - ends[0]) / 200)
        edges = np.arange(ends[0], ends[-1] + window, window)
        counts, _ = np.histogram(ends, bins=edges)
        ax2.plot(edges[:-1] + window / 2, counts * BATCH / window / 1e3, lw=1)
    ax2.axhline(res["train"]["rows_per_s"] / 1e3, color="gray", ls="--", lw=1,
                label=f"mean {res['train']['rows_per_s'] / 1e3:.0f}K rows/s")
    ax2.set_ylabel("training rows/s (thousands)")
    ax2.set_xlabel("seconds since start")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=7)
    ax2.grid(True, alpha=0.3)
    gb = res["store_bytes_after_load"] / 1e9
    ax1.set_title(f"{res['load']['rows'] / 1e6:.0f}M rows, {gb:.1f} GB on disk "
                  f"({res['store_bytes_after_load'] / res['machine']['mem_total_bytes']:.2f}x RAM), Zipf {ALPHA}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _prepare_path(arg: str | None, reuse: bool) -> tuple[str, bool]:
    """The data directory and whether this run created it (refuses a non-empty one unless reusing)."""
    if arg is None:
        if reuse:
            raise SystemExit("--reuse needs --path (the directory a --keep run left)")
        return tempfile.mkdtemp(prefix="embcache-big-"), True
    p = os.path.abspath(arg)
    if reuse:
        if not os.path.isdir(os.path.join(p, "store")):
            raise SystemExit(f"--reuse: no store under {p}")
        return p, False
    if os.path.exists(p) and (not os.path.isdir(p) or os.listdir(p)):
        raise SystemExit(f"--path {p} exists and is not empty; give a new directory (or --reuse a kept one)")
    os.makedirs(p, exist_ok=True)
    return p, True


def _reused_load(path: str, rows: int) -> dict[str, Any]:
    """The load figures a --keep run stored, checking the row count."""
    store = open_store("rocksdb", os.path.join(path, "store"))
    try:
        raw = store.get_meta(META)
    finally:
        store.close()
    info = json.loads(raw) if raw else None
    if not info or info.get("rows") != rows:
        raise SystemExit(f"--reuse: the store under {path} was not loaded by this benchmark with {rows:,} rows")
    return dict(info)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="2M rows, small tiers: a quick check (writes big-smoke.*)")
    ap.add_argument("--rows", type=float, default=None, help=f"rows in the table (default {FULL.rows:,}; smoke "
                    f"{SMOKE.rows:,})")
    ap.add_argument("--hbm-mib", type=int, default=None, help="HBM tier (default 512; smoke 16)")
    ap.add_argument("--ddr-mib", type=int, default=None, help="DDR tier (default 2048; smoke 64)")
    ap.add_argument("--block-cache-mib", type=int, default=None, help="RocksDB block cache (default 1024; smoke 64)")
    ap.add_argument("--passes", type=int, default=None, help="passes (default 6; smoke 3)")
    ap.add_argument("--pass-batches", type=int, default=None, help="batches of 8,192 per pass (default 1500; "
                    "smoke 60)")
    ap.add_argument("--threads", type=int, default=1, help="torch and numba threads (default 1; 0 = all cores)")
    ap.add_argument("--path", default=None, help="data directory: new or empty (default: a fresh one under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the data directory at the end")
    ap.add_argument("--reuse", action="store_true", help="train on the store a --keep run left at --path")
    ap.add_argument("--min-free-gib", type=float, default=8.0, help="stop if the disk has less free (default 8)")
    ap.add_argument("--max-used-gib", type=float, default=72.0, help="stop if the disk has more used (default 72)")
    ap.add_argument("--out", default=str(_ROOT / "bench" / "results"), help="results directory")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    base = SMOKE if args.smoke else FULL
    mode = Mode(rows=int(args.rows) if args.rows else base.rows,
                hbm_bytes=args.hbm_mib * MIB if args.hbm_mib is not None else base.hbm_bytes,
                ddr_bytes=args.ddr_mib * MIB if args.ddr_mib is not None else base.ddr_bytes,
                block_cache_bytes=(args.block_cache_mib * MIB if args.block_cache_mib is not None
                                   else base.block_cache_bytes),
                passes=args.passes or base.passes, pass_batches=args.pass_batches or base.pass_batches)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
        with contextlib.suppress(Exception):  # numba may lack a threading layer
            import numba

            numba.set_num_threads(min(args.threads, int(getattr(numba.config, "NUMBA_NUM_THREADS", args.threads))))
    progress = not args.no_progress
    t0 = time.perf_counter()
    info = machine_info(script=__file__, argv=sys.argv[1:] if argv is None else argv)
    path, created = _prepare_path(args.path, args.reuse)
    guard = DiskGuard(path, int(args.min_free_gib * GIB), int(args.max_used_gib * GIB))
    disk_before = shutil.disk_usage(path)
    print(f"data under {path}; disk: {disk_before.used / 1e9:.1f} GB used, {disk_before.free / 1e9:.1f} GB free; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    res: dict[str, Any] = {"benchmark": "big table (about 2x RAM) trained within the memory budget",
                           "command": info["command"],
                           "machine": info, "mode": vars(mode), "dim": DIM, "optimizer": OPTIMIZER, "batch": BATCH,
                           "alpha": ALPHA, "record_bytes": record_bytes(), "overhead_allowance_bytes": OVERHEAD_BYTES,
                           "reused": bool(args.reuse), "disk_before": disk_before._asdict(),
                           "torch_threads": torch.get_num_threads()}
    try:
        with Sampler(guard) as sampler:
            if args.reuse:
                load = _reused_load(path, mode.rows)
            else:
                guard.check(extra=int(mode.rows * 290))  # ~278 B/row measured, + WAL and compaction slack
                sampler.phase = "load"
                load = fill_store(path, mode.rows, guard, sampler, progress)
            res["load"] = load
            res["store_bytes_after_load"] = dir_bytes(os.path.join(path, "store"))
            print(f"loaded {mode.rows:,} rows: {res['store_bytes_after_load'] / 1e9:.2f} GB on disk in "
                  f"{load['load_seconds']:.0f} s", flush=True)
            sampler.phase = "trace"
            trace = make_trace(mode.rows, mode.passes, mode.pass_batches)
            res["train"] = train(path, mode, trace, sampler, progress)
            del trace
            res["store_bytes_after_train"] = dir_bytes(os.path.join(path, "store"))
            res["disk_peak_used_bytes"] = max(s[2] for s in sampler.samples)
        res["samples"] = sampler.samples
    except DiskLimitError as exc:
        print(f"stopped: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if created and not args.keep:
            shutil.rmtree(path, ignore_errors=True)
            print(f"deleted {path}", flush=True)
        elif args.keep:
            print(f"kept {path}", flush=True)
    res["loadavg_at_end"] = list(os.getloadavg())
    train_load = [s[4] for s in res["samples"] if s[3] == "train"]
    res["loadavg_1min_mean_training"] = float(np.mean(train_load)) if train_load else None
    res["seconds"] = time.perf_counter() - t0
    m = res["train"]["memory"]
    res["summary"] = [{"case": f"peak RSS over budget + 1 GiB, {mode.rows / 1e6:.0f}M rows "
                               f"({res['store_bytes_after_load'] / 1e9:.0f} GB on disk)",
                       "ratio": m["peak_over_baseline_bytes"] / m["allowance_bytes"], "target": 1.0,
                       "lower_is_better": True, "met": bool(m["within_budget"]),
                       "reference": f"HBM + DDR + block cache + 1 GiB = {m['allowance_bytes'] / GIB:.2f} GiB"}]
    table = render(res)
    if res["train"]["aborted"]:
        table = f"**Stopped early**: {res['train']['aborted']}\n\n{table}"
    print(table)
    stem = os.path.join(args.out, "big-smoke" if args.smoke else "big")
    doc = {k: v for k, v in res.items() if k != "samples"}
    doc["samples"] = [{"s": round(s[0], 2), "rss_bytes": s[1], "disk_used_bytes": s[2], "phase": s[3],
                       "loadavg_1min": s[4]} for s in res["samples"]]
    write_json(stem + ".json", doc)
    Path(stem + ".md").write_text(f"# Big table: {mode.rows:,} rows, about "
                                  f"{res['store_bytes_after_load'] / info['mem_total_bytes']:.1f}x RAM\n\n"
                                  f"Command: `{res['command']}`; {info['cpu_count']} CPUs, commit "
                                  f"`{(info['git_commit'] or 'unknown')[:12]}`"
                                  f"{' (dirty tree)' if info['git_dirty'] else ''}, {info['started_at']}."
                                  f"\n\n{table}\n")
    plot(res, stem + ".png")
    print(f"wrote {stem}.json/.md/.png ({res['seconds']:.0f} s)")
    return 2 if res["train"]["aborted"] else 0


if __name__ == "__main__":
    sys.exit(main())
