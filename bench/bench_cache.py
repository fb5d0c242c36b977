"""Main benchmark of embcache: lookup, and lookup + row-wise AdaGrad update, against the ceiling and peers.

Run from the repository root::

    .venv/bin/python bench/bench_cache.py            # full: ~8 min on 2 cores
    .venv/bin/python bench/bench_cache.py --quick    # batch 8,192, dim 64, short traces: < 3 min

The FBGEMM peer runs in its own virtual environment (fbgemm-gpu-cpu pins one torch minor
version; 1.8.x goes with torch 2.13), found at ``--fbgemm-python`` (default
``$EMBCACHE_FBGEMM_PYTHON``, else ``/tmp/fbgemm-venv/bin/python``). Set it up once with::

    python3 -m venv /tmp/fbgemm-venv
    /tmp/fbgemm-venv/bin/pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0   # torch's CPU build

Without it the FBGEMM figures are reported as unavailable, with the reason, and the rest runs.

Workload: keys drawn Zipf(alpha=1.1) over 10M ids (``bench/workloads.py``'s inverse-CDF ranks),
each rank mapped to a sparse int64 id by a bijection of the 64-bit patterns (rank times an odd
constant, xor a seed), so the ids are scattered over the whole int64 range. Seeded. Batches of
8,192 and 65,536 keys, dim 64 and 128, table ``rowwise_adagrad`` (lr 0.01), CPU device.

Cases, each measured side by side in this one run:

1. **All-hot lookup.** The HBM tier is sized to hold every distinct key of the trace (the table
   is those keys only, ~590K rows in the full run, not all 10M ids: 10M x dim 128 is 5 GB; the
   key space stays the 10M sparse ids). Warm-up looks up every distinct key once, so all are
   resident; the timed lookups are checked to be 100% HBM hits. Timed: ``lookup(keys,
   out=buffer)`` over the whole trace. Ceiling: ``torch.index_select(weights, 0, idx,
   out=buffer)`` on a ``[n_rows, dim]`` float32 tensor with ``idx`` the same keys mapped to
   dense row ids. The two alternate within each repeat. Target: >= 0.8x the ceiling. The
   cache keeps a CPU tier's rows on transparent huge pages (``embcache/hostmem.py``), the
   ceiling's tensor is ordinary torch memory; ``index_select`` over a huge-page copy of it is
   timed alongside and listed as a second reference (no target), so that the table shows which
   part of the ratio is the memory's.
2. **All-hot lookup + update.** ``lookup`` then ``apply_gradients`` (a fixed random gradient)
   per batch, rows/s of the pair. Peer: FBGEMM's CPU TBE (``SplitTableBatchedEmbeddingBagsCodegen``,
   ``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``, ``EXACT_ROWWISE_ADAGRAD``, one key per
   bag) forward + backward over the same dense ids, table of the same rows; pooling ``SUM`` and
   ``NONE`` are both timed and the faster is the reference. FBGEMM runs in a subprocess in its
   venv (``bench/fbgemm_tbe.py --serve``) that times one repeat per request, so its repeats
   alternate with the cache's. No target against FBGEMM (5x was shown out of reach on this CPU);
   the target is against the memory bound instead: a step moves at least four row-sized streams
   (the lookup's read and output, the update's gradient read and row write) where the
   ``index_select`` ceiling of case 1 moves two, so the pair's rows/s >= 0.5x the ceiling's.
   A second reference measures that bound on this machine instead of assuming it: per batch,
   the same ``index_select``, then a bare read-modify-write of the same rows (each gradient row
   read once, ``row -= lr * gradient`` on its row in batch order, prefetched ahead as the cache's
   kernel is: no deduplication, no optimizer state, no flags), alternating with the cache's
   repeats. No target: it says how far the pair is from the memory traffic any step must make.
3. **Tiered lookup.** The store is prefilled with every distinct id of a longer trace (written
   with ``assign`` through a cache with no memory tiers, then closed, so nothing is in memory);
   HBM holds 1% and DDR 10% of those ids (of the trace's distinct ids, i.e. of the table
   as stored), the rest stays in RocksDB. The first half of the trace warms up (discarded);
   the second half is timed in segments (the repeats). Peers, each over its own copy of the
   same store and the same batches with the same warm-up, all open at once and run segment by
   segment in turn: RocksDB direct (``store.get_many``
   of the batch: unique keys, one multi-get, gather; then the float32 weights copied into an
   output buffer) and a Python ``OrderedDict`` LRU of HBM+DDR rows in front of the same store
   (per-key dict work in Python, one batched ``get_many`` for the misses of a batch). Per-tier
   hit rates are reported. No target against RocksDB direct (20x was shown out of reach); the
   target is against the **bound of free memory tiers**: RocksDB direct's rows/s times the store
   reads the cache saves (RocksDB direct's store rows read per key over the cache's), the rate
   the cache would reach if everything but its store reads cost nothing; target >= 0.85 of it.
   The prefetching contenders (``LookAhead``, passes) are also compared with the plain tiered
   lookup of the same case: target >= 1.0x (prefetching must not cost more than it saves in a
   loop with no compute to hide it behind). The store's files were just
   written, so they sit in the OS page cache: RocksDB reads are warm-cache reads, which
   favours the RocksDB peer. LMDB direct (``get_many`` on an LMDB store holding the same rows,
   written with the same seed) is timed the same way. Two more embcache contenders: with
   ``LookAhead`` (the next 2 batches staged in the background), and with the pass protocol
   (each segment split greedily into passes whose keysets fit in half of HBM + DDR, as the
   README advises so that two consecutive keysets fit together; the next pass's keyset is
   prefetched while the current one runs, across segment ends too: the next segment's first
   pass is prefetched during this segment's last pass and waited for inside this segment's
   timing, so that every staging is timed and none runs while another contender is timed).
   **Redis** (a peer of the lookup): every stored row's float32 weights as
   bytes, one value per 8-byte key, in a private ``redis-server`` on 127.0.0.1 started by the
   benchmark (no persistence; redis-py with hiredis), one ``MGET`` of the batch's unique keys per
   batch, gathered into the output; skipped, with the reason in the results, when
   ``redis-server`` (Debian: ``apt-get install -y redis-server``) or redis-py is missing.
4. **Tiered lookup + update.** The same tiers, trace and segments; per batch ``lookup`` then
   ``apply_gradients`` (row-wise AdaGrad, a fixed random gradient), on its own cache over its own
   copy of the store. Peer: RocksDB read-modify-write direct (``get_many`` of the batch's unique
   keys, the rows gathered into the output, the gradients of duplicate keys summed and row-wise
   AdaGrad applied to the records in numpy, ``put_many`` of them). Both apply the same gradients
   to the same rows in the same order; afterwards some rows of the two are checked to agree.
5. **Throughput vs tier sizes** (batch and dim of the first tiered case): HBM at 0.5%, 1%, 2% and
   4% of the stored rows with DDR 10x HBM (quick: 1% and 4%); at each size a fresh cache warms up
   on the same first half and times the same segments, alternating with RocksDB direct. Tiered
   lookup rows/s and per-tier hit rates, plotted in ``cache-tiers.png``.

Threads: every contender runs with the same thread count, 1 by default (``--threads``; torch's
and numba's pools, and the FBGEMM subprocess). On a 2-core machine shared with other work,
torch's 2-thread OpenMP regions stall whenever the other core is busy (``index_select`` of 8,192
rows went from ~20M to ~1M rows/s with one core taken), which made 2-thread figures swing by
10x from run to run; ``--threads 0`` keeps the libraries' defaults for a quiet machine.

Every rate is the median over repeats (after discarded warm-up) of rows / wall-clock seconds;
min and max are in the JSON too. Prints a Markdown table; writes ``bench/results/cache.json``
(with ``bench._common.machine_info``'s header: machine, versions, git commit and dirty flag,
command, start time), ``cache.md``, ``cache.png`` and ``cache-tiers.png`` (``cache-quick.*`` and
``cache-quick-tiers.png`` with ``--quick``; ``--out DIR`` puts them in DIR). ``--profile`` adds a
cProfile of the cache's tiered lookup (top functions) to the JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import itertools
import math
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


def _threads_arg(argv: Sequence[str]) -> int:
    """The value of ``--threads`` in ``argv`` (default 1), read before numba and embcache are imported."""
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 1


if __name__ == "__main__" and _threads_arg(sys.argv) > 0:
    # numba sizes its pool, and embcache's index its helper threads, from this variable
    os.environ["NUMBA_NUM_THREADS"] = str(_threads_arg(sys.argv))

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    RedisServer,
    RedisUnavailable,
    format_ratio,
    interleaved_timings,
    machine_info,
    markdown_table,
    rate_summary,
    write_json,
)
from workloads import zipf_ranks  # noqa: E402

from embcache import CacheConfig, EmbeddingCache, LookAhead, TableConfig  # noqa: E402
from embcache.hostmem import host_zeros  # noqa: E402
from embcache.keyset import Keyset  # noqa: E402
from embcache.prefetch import PrefetchFuture  # noqa: E402
from embcache.stores import Store, open_store  # noqa: E402

TABLE = "emb"
KEY_SPACE = 10_000_000
ALPHA = 1.1
LR = 0.01
EPS = 1e-10  # embcache's default eps for rowwise_adagrad; FBGEMM is given the same
STORE_SUBDIR = "store"  # where EmbeddingCache keeps its store under config.path
# lookup: of the index_select ceiling; lookup_update: of the same ceiling (the memory bound of a step);
# tiered: of the bound of free memory tiers; prefetch: of the plain tiered lookup
TARGETS = {"lookup": 0.8, "lookup_update": 0.5, "tiered": 0.85, "prefetch": 1.0}
# tier-size sweep: HBM as a share of the stored rows, DDR = DDR_PER_HBM x HBM
SWEEP_HBM_FRACTIONS = (0.005, 0.01, 0.02, 0.04)
QUICK_SWEEP_HBM_FRACTIONS = (0.01, 0.04)
DDR_PER_HBM = 10
REDIS_LOAD_CHUNK = 1 << 15
DEFAULT_FBGEMM_PYTHON = "/tmp/fbgemm-venv/bin/python"
_ID_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication is a bijection mod 2**64


# ---------------------------------------------------------------------------------- workload
def set_threads(n: int) -> None:
    """Use ``n`` threads in torch and numba (0: leave their defaults).

    Run as a script, ``NUMBA_NUM_THREADS`` was already set from ``--threads`` before the imports,
    which also sizes the helper threads of embcache's index (``embcache/index/numba_index.py``).
    """
    if n <= 0:
        return
    torch.set_num_threads(n)
    try:
        import numba

        numba.set_num_threads(min(n, int(numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
    except ImportError:
        pass


def source_digest() -> str:
    """SHA-256 over embcache/**/*.py (paths and contents): identifies the code measured."""
    root = os.path.join(os.path.dirname(HERE), "embcache")
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def numba_threads() -> int | None:
    """Threads numba's parallel loops use now (None without numba)."""
    try:
        import numba
    except ImportError:
        return None
    return int(numba.get_num_threads())


def sparse_ids(ranks: np.ndarray, seed: int) -> np.ndarray:
    """Map Zipf ranks to sparse int64 ids, bijectively (odd multiplier, xor), scattered over int64."""
    salt = np.uint64((seed * 0x2545F4914F6CDD1D + 0x632BE59BD9B4E019) % (1 << 64))
    with np.errstate(over="ignore"):
        x = (ranks.astype(np.uint64) * _ID_MULT) ^ salt
    return x.view(np.int64)


def zipf_ids(n_accesses: int, seed: int) -> np.ndarray:
    """A seeded trace of ``n_accesses`` sparse ids, Zipf(ALPHA) over KEY_SPACE ids."""
    ranks = zipf_ranks(n_accesses, KEY_SPACE, ALPHA, np.random.default_rng(seed))
    return sparse_ids(ranks, seed)


def split_batches(ids: np.ndarray, batch: int) -> list[np.ndarray]:
    """Consecutive batches of ``batch`` ids (the tail that does not fill a batch is dropped)."""
    n = len(ids) // batch
    return [np.ascontiguousarray(ids[i * batch:(i + 1) * batch]) for i in range(n)]


def warm_and_segments(ids: np.ndarray, batch: int, segments: int,
                      ) -> tuple[list[np.ndarray], list[np.ndarray], list[list[np.ndarray]]]:
    """``(all batches, warm-up half, timed half cut into at most ``segments`` equal segments)``."""
    batches = split_batches(ids, batch)
    n_warm = len(batches) // 2
    warm, timed = batches[:n_warm], batches[n_warm:]
    n_seg = min(segments, len(timed))
    per = len(timed) // n_seg
    return batches, warm, [timed[i * per:(i + 1) * per] for i in range(n_seg)]


def table_config(dim: int) -> TableConfig:
    """The benchmark's table: row-wise AdaGrad, dim ``dim``."""
    return TableConfig(name=TABLE, dim=dim, optimizer="rowwise_adagrad", lr=LR, eps=EPS, seed=1)


def row_bytes_of(dim: int, work_dir: str) -> int:
    """Memory bytes per resident row, asked of a throwaway cache (the capacity unit)."""
    path = os.path.join(work_dir, f"rowbytes-{dim}")
    with EmbeddingCache(CacheConfig(hbm_bytes=0, ddr_bytes=0, path=path, device="cpu"), [table_config(dim)]) as c:
        rb = c.row_bytes(TABLE)
    shutil.rmtree(path, ignore_errors=True)
    return rb


def stats_of(cache: EmbeddingCache) -> dict[str, Any]:
    """The table's counters, flattened to what the benchmark checks."""
    s = cache.stats()[TABLE]
    return {"lookups": s["lookups"], "hbm_hits": s["hbm"]["hits"], "ddr_hits": s["ddr"]["hits"],
            "ssd_hits": s["ssd"]["hits"], "created": s["ssd"]["created"], "ssd_reads": s["ssd"]["read_rows"],
            "hbm_resident": s["hbm"]["resident_rows"], "ddr_resident": s["ddr"]["resident_rows"],
            "ssd_write_rows": s["ssd"]["write_rows"], "hbm_seconds": s["hbm"]["seconds"],
            "ddr_seconds": s["ddr"]["seconds"], "ssd_seconds": s["ssd"]["seconds"]}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counter differences (after - before)."""
    return {k: after[k] - before[k] for k in after}


def fmt_rate(x: float | None) -> str:
    """Rows/s for the table: 12.3M, 456K."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    return f"{x / 1e3:.0f}K"


# ---------------------------------------------------------------------------------- FBGEMM
def fbgemm_python(arg: str | None) -> tuple[str | None, str | None]:
    """(path of the FBGEMM venv's python, None) or (None, why it is unavailable)."""
    path = arg or os.environ.get("EMBCACHE_FBGEMM_PYTHON") or DEFAULT_FBGEMM_PYTHON
    if not os.path.exists(path):
        return None, (f"no FBGEMM python at {path!r}: create the venv as in the docstring of bench/bench_cache.py "
                      "or pass --fbgemm-python")
    probe = subprocess.run([path, "-c", "import fbgemm_gpu, torch; print(fbgemm_gpu.__version__, torch.__version__)"],
                           capture_output=True, text=True, timeout=300, check=False)
    if probe.returncode != 0:
        return None, f"{path} cannot import fbgemm_gpu: {probe.stderr.strip().splitlines()[-1:]}"
    return path, None


class FbgemmServer:
    """``bench/fbgemm_tbe.py --serve`` in the FBGEMM venv: one timed repeat per request.

    Raises:
        RuntimeError: the process failed to start or to answer (its stderr is in the message).
    """

    def __init__(self, py: str, dense: Sequence[np.ndarray], rows: int, dim: int, batch: int, update_rows: int,
                 lookup_rows: int, work_dir: str) -> None:
        ids_path = os.path.join(work_dir, "fbgemm-ids.npy")
        np.save(ids_path, np.concatenate(list(dense)))
        self.stderr_path = os.path.join(work_dir, "fbgemm-stderr.txt")
        cmd = [py, os.path.join(HERE, "fbgemm_tbe.py"), "--serve", "--indices", ids_path, "--rows", str(rows),
               "--dim", str(dim), "--batch", str(batch), "--update-rows", str(update_rows),
               "--lookup-rows", str(lookup_rows), "--lr", str(LR), "--eps", str(EPS),
               "--threads", str(torch.get_num_threads())]
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         bufsize=1)
        self._expect("ready")

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            with open(self.stderr_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"fbgemm_tbe.py exited with rc {self.proc.returncode}: {tail}")
        return line.strip()

    def _expect(self, what: str) -> None:
        line = self._readline()
        if line != what:
            raise RuntimeError(f"fbgemm_tbe.py said {line!r}, expected {what!r}")

    def ask(self, command: str) -> str:
        """Send one request line, return the answer line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._readline()

    def seconds(self, command: str) -> float:
        """Seconds of one repeat of ``command`` ("fwd_bwd sum", "fwd none", ...), timed in the subprocess."""
        return float(self.ask(command))

    def info(self) -> dict[str, Any]:
        """Versions and settings of the FBGEMM side, and whether its updates changed the weights."""
        import json

        out: dict[str, Any] = json.loads(self.ask("info"))
        return out

    def close(self) -> None:
        """Ask the process to quit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------- all hot
_BARE: dict[str, Any] = {}


def bare_step(weights: np.ndarray, idx: np.ndarray, grads: np.ndarray, lr: float) -> None:
    """``weights[idx[i]] -= lr * grads[i]`` for each i in order: the memory traffic of a step's
    update and nothing more (numba, software prefetch 8 rows ahead as in ``embcache.fused``)."""
    if "kernel" not in _BARE:
        import numba

        from embcache.fused import _prefetch_intrinsic

        prefetch = _prefetch_intrinsic()

        @numba.njit(nogil=True, error_model="numpy")  # type: ignore[misc]
        def kernel(w: Any, ix: Any, g: Any, lr32: Any) -> None:  # pragma: no cover - compiled
            n, d = g.shape
            for i in range(n):
                if i + 8 < n:
                    for k in range(0, d, 16):
                        prefetch(w, ix[i + 8], k)
                r = ix[i]
                for j in range(d):
                    w[r, j] = w[r, j] - lr32 * g[i, j]

        _BARE["kernel"] = kernel
    _BARE["kernel"](weights, idx, grads, np.float32(lr))


def run_all_hot(batch: int, dim: int, ids: np.ndarray, args: argparse.Namespace, work_dir: str,
                fb_py: str | None, fb_reason: str | None) -> dict[str, Any]:
    """All rows in HBM: lookup vs index_select, lookup+update vs FBGEMM, repeats interleaved."""
    uniq = np.unique(ids)
    n = len(uniq)
    batches = split_batches(ids, batch)
    keys = [torch.from_numpy(b) for b in batches]
    dense = [np.searchsorted(uniq, b).astype(np.int64) for b in batches]
    dense_t = [torch.from_numpy(d) for d in dense]
    rows = len(keys) * batch
    n_upd = max(1, min(len(keys), args.update_rows // batch))
    rb = row_bytes_of(dim, work_dir)
    path = os.path.join(work_dir, f"hot-{batch}-{dim}")
    cfg = CacheConfig(hbm_bytes=(n + 64) * rb, ddr_bytes=0, path=path, store="rocksdb", device="cpu")
    result: dict[str, Any] = {"batch": batch, "dim": dim, "table_rows": n, "trace_accesses": rows, "row_bytes": rb}
    fb: FbgemmServer | None = None
    if fb_py is not None:
        try:
            fb = FbgemmServer(fb_py, dense, n, dim, batch, n_upd * batch, rows, work_dir)
        except (RuntimeError, OSError) as exc:
            fb_reason = str(exc)
    cache = EmbeddingCache(cfg, [table_config(dim)])
    try:
        assert cache.capacity_rows(TABLE)["hbm"] >= n
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            cache.lookup(TABLE, torch.from_numpy(uniq[i:i + batch]))
        result["warmup_seconds"] = time.perf_counter() - t0
        s0 = stats_of(cache)
        assert s0["hbm_resident"] == n, f"warm-up left {s0['hbm_resident']} of {n} rows in HBM"

        out = torch.empty(batch, dim)
        gen = torch.Generator().manual_seed(args.seed)
        weights = torch.rand(n, dim, generator=gen)
        # The cache keeps its rows on huge pages (embcache/hostmem.py); the ceiling is the issue's
        # plain torch tensor. index_select over huge-page memory is measured too, so the table
        # shows what of the ratio is the memory's and what the cache's.
        weights_huge = host_zeros((n, dim), torch.float32)
        weights_huge.copy_(weights)
        grads = torch.randn(batch, dim, generator=gen) * 0.1

        def cache_lookup() -> None:
            for k in keys:
                cache.lookup(TABLE, k, out=out)

        def ceiling_over(rows_of: torch.Tensor) -> Callable[[], None]:
            def ceiling() -> None:
                for ix in dense_t:
                    torch.index_select(rows_of, 0, ix, out=out)
            return ceiling

        def cache_update() -> None:
            for k in keys[:n_upd]:
                cache.lookup(TABLE, k, out=out)
                cache.apply_gradients(TABLE, k, grads)

        weights_np, grads_np = weights.numpy(), grads.numpy()

        def bound() -> None:  # the lookup's gather, then the update's bare read-modify-write
            for ix, ix_np in zip(dense_t[:n_upd], dense[:n_upd], strict=True):
                torch.index_select(weights, 0, ix, out=out)
                bare_step(weights_np, ix_np, grads_np, LR)

        def remote(command: str) -> Callable[[], float]:
            assert fb is not None
            return lambda: fb.seconds(command)

        modes = ("sum", "none")
        look_fns: dict[str, Callable[[], object]] = {"cache": cache_lookup, "ceiling": ceiling_over(weights),
                                                     "ceiling_huge_pages": ceiling_over(weights_huge)}
        upd_fns: dict[str, Callable[[], object]] = {"cache": cache_update, "bound": bound}
        if fb is not None:
            look_fns |= {f"fbgemm_{m}": remote(f"fwd {m}") for m in modes}
            upd_fns |= {f"fbgemm_{m}": remote(f"fwd_bwd {m}") for m in modes}
        remote_names = {f"fbgemm_{m}" for m in modes}

        times = interleaved_timings(look_fns, args.repeats, warmup=1, self_timed=remote_names)
        s1 = stats_of(cache)
        d = delta(s1, s0)
        assert d["hbm_hits"] == d["lookups"] > 0, f"not all hot: {d}"
        result["lookup"] = rate_summary(rows, times["cache"])
        result["ceiling"] = rate_summary(rows, times["ceiling"])
        result["ceiling_huge_pages"] = rate_summary(rows, times["ceiling_huge_pages"])
        result["lookup_ratio"] = result["lookup"]["rows_per_s"] / result["ceiling"]["rows_per_s"]
        result["all_hot_verified"] = True
        print(f"  lookup {fmt_rate(result['lookup']['rows_per_s'])} rows/s, index_select ceiling "
              f"{fmt_rate(result['ceiling']['rows_per_s'])} rows/s: {result['lookup_ratio']:.2f}x "
              f"(index_select over huge pages {fmt_rate(result['ceiling_huge_pages']['rows_per_s'])} rows/s)",
              flush=True)

        upd = interleaved_timings(upd_fns, args.repeats, warmup=1, self_timed=remote_names)
        s2 = stats_of(cache)
        d = delta(s2, s1)
        assert d["hbm_hits"] == d["lookups"] and d["ssd_reads"] == 0, f"not all hot during updates: {d}"
        result["lookup_update"] = rate_summary(n_upd * batch, upd["cache"])
        result["update_bound"] = rate_summary(n_upd * batch, upd["bound"])
        print(f"  lookup+update {fmt_rate(result['lookup_update']['rows_per_s'])} rows/s; index_select + bare "
              f"read-modify-write {fmt_rate(result['update_bound']['rows_per_s'])} rows/s", flush=True)
        if fb is not None:
            fwd = {m: rate_summary(rows, times[f"fbgemm_{m}"]) for m in modes}
            fwd_bwd = {m: rate_summary(n_upd * batch, upd[f"fbgemm_{m}"]) for m in modes}
            best = max(modes, key=lambda m: fwd_bwd[m]["rows_per_s"])
            info = fb.info()
            assert all(info["weights_changed"].values()), f"FBGEMM's backward did not update: {info}"
            result["fbgemm"] = {"available": True, "info": info, "forward": fwd, "forward_backward": fwd_bwd,
                                "reference_mode": best,
                                "forward_backward_rows_per_s": fwd_bwd[best]["rows_per_s"],
                                "forward_rows_per_s": max(f["rows_per_s"] for f in fwd.values())}
    finally:
        if fb is not None:
            fb.close()
        cache.close()
        shutil.rmtree(path, ignore_errors=True)

    if fb is None:
        result["fbgemm"] = {"available": False, "reason": fb_reason}
    f = result["fbgemm"]
    if f.get("available"):
        result["lookup_update_ratio"] = result["lookup_update"]["rows_per_s"] / f["forward_backward_rows_per_s"]
        result["lookup_vs_fbgemm_forward"] = result["lookup"]["rows_per_s"] / f["forward_rows_per_s"]
        print("  FBGEMM " + ", ".join(
            f"{m.upper()}: fwd+bwd {fmt_rate(f['forward_backward'][m]['rows_per_s'])} rows/s, "
            f"fwd {fmt_rate(f['forward'][m]['rows_per_s'])} rows/s" for m in f["forward"]), flush=True)
        print(f"  lookup+update / FBGEMM fwd+bwd ({f['reference_mode'].upper()}): {result['lookup_update_ratio']:.2f}x",
              flush=True)
    else:
        result["lookup_update_ratio"] = None
        print(f"  FBGEMM unavailable: {f.get('reason')}", flush=True)
    return result


# ---------------------------------------------------------------------------------- tiered
class DictLRU:
    """The Python peer: an OrderedDict LRU of float32 rows in front of a store.

    Per batch: unique keys (numpy), a Python loop over them (dict lookup, move_to_end), one
    ``get_many`` for the misses, insertion of the fetched rows and LRU eviction key by key,
    then a gather of the batch's rows into ``out``.
    """

    def __init__(self, store: Store, table: str, capacity: int, dim: int) -> None:
        self.store = store
        self.table = table
        self.capacity = capacity
        self.weight_bytes = 4 * dim
        self.rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self.hits = 0
        self.accesses = 0

    def lookup(self, keys: np.ndarray, out: np.ndarray) -> None:
        """Rows of ``keys`` (int64 [n]) into ``out`` (float32 [n, dim])."""
        uniq, inverse = np.unique(keys, return_inverse=True)
        inverse = inverse.reshape(-1)
        od = self.rows
        get, to_end = od.get, od.move_to_end
        found: list[Any] = [None] * len(uniq)
        miss: list[int] = []
        for i, k in enumerate(uniq.tolist()):
            r = get(k)
            if r is None:
                miss.append(i)
            else:
                to_end(k)
                found[i] = r
        missed = 0
        if miss:
            mkeys = uniq[miss]
            _, records = self.store.get_many(self.table, mkeys)
            fetched = list(np.ascontiguousarray(records[:, :self.weight_bytes]).view(np.float32))
            for i, k, r in zip(miss, mkeys.tolist(), fetched, strict=True):
                found[i] = r
                od[k] = r
            while len(od) > self.capacity:
                od.popitem(last=False)
            missed = int(np.bincount(inverse, minlength=len(uniq))[miss].sum())
        np.take(np.stack(found), inverse, axis=0, out=out)
        self.accesses += len(keys)
        self.hits += len(keys) - missed


def prefill_store(dim: int, uniq: np.ndarray, path: str, seed: int, store: str = "rocksdb") -> float:
    """Write rows for every id in ``uniq`` through a cache without memory tiers; returns seconds."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    cfg = CacheConfig(hbm_bytes=0, ddr_bytes=0, path=path, store=store, device="cpu")
    with EmbeddingCache(cfg, [table_config(dim)]) as cache:
        step = 1 << 17
        for i in range(0, len(uniq), step):
            k = torch.from_numpy(uniq[i:i + step])
            cache.assign(TABLE, k, (torch.rand(k.numel(), dim, generator=gen) - 0.5) / math.sqrt(dim))
        cache.flush()
    return time.perf_counter() - t0


def passes_of(batches: list[np.ndarray], budget: int) -> list[tuple[Keyset, list[np.ndarray]]]:
    """Consecutive batches grouped into passes whose keysets hold at most ``budget`` keys (setup, untimed)."""
    passes: list[tuple[Keyset, list[np.ndarray]]] = []
    group: list[np.ndarray] = []
    seen = np.empty(0, dtype=np.int64)
    for b in batches:
        grown = np.union1d(seen, b)
        if group and grown.size > budget:
            passes.append((Keyset.from_keys(torch.from_numpy(np.concatenate(group))), group))
            group, grown = [], np.unique(b)
        group.append(b)
        seen = grown
    if group:
        passes.append((Keyset.from_keys(torch.from_numpy(np.concatenate(group))), group))
    return passes


def read_modify_write(store: Store, keys: np.ndarray, grads: torch.Tensor, out: np.ndarray, wb: int) -> None:
    """The RocksDB peer of lookup + update: one multi-get of the batch's unique keys, the rows into
    ``out``, row-wise AdaGrad on them in numpy (duplicate keys' gradients summed, as the cache
    does: ``s += mean(g*g); w -= lr * g / (sqrt(s) + eps)``), one multi-put of the changed records."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    inverse = inverse.reshape(-1)
    _, records = store.get_many(TABLE, uniq)
    w = records[:, :wb].view(np.float32)  # views into records: updating them updates what is put back
    acc = records[:, wb:wb + 4].view(np.float32)[:, 0]
    np.take(w, inverse, axis=0, out=out)
    g = torch.zeros(len(uniq), grads.shape[1]).index_add_(0, torch.from_numpy(inverse), grads).numpy()
    acc += (g * g).mean(axis=1)
    w -= (LR * g) / (np.sqrt(acc)[:, None] + EPS)
    store.put_many(TABLE, uniq, records)


def _redis_names(keys: np.ndarray) -> list[bytes]:
    raw = keys.astype("<i8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]


def load_redis(client: Any, store: Store, ids: np.ndarray, wb: int) -> None:
    """Copy the float32 weights of ``ids`` from ``store`` into Redis, one value of bytes per key (8-byte key)."""
    for start in range(0, len(ids), REDIS_LOAD_CHUNK):
        chunk = ids[start:start + REDIS_LOAD_CHUNK]
        found, records = store.get_many(TABLE, chunk)
        assert found.all(), "the store lacks rows the Redis peer should hold"
        data = np.ascontiguousarray(records[:, :wb]).tobytes()
        client.mset({k: data[i * wb:(i + 1) * wb] for i, k in enumerate(_redis_names(chunk))})


def redis_get(client: Any, keys: np.ndarray, out: np.ndarray, dim: int) -> bool:
    """The Redis peer of the tiered lookup: MGET of the batch's unique keys, rows gathered into ``out``.

    Returns False when a key was missing."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    values = client.mget(_redis_names(uniq))
    if any(v is None for v in values):
        return False
    rows = np.frombuffer(b"".join(values), dtype=np.float32).reshape(len(uniq), dim)
    np.take(rows, inverse.reshape(-1), axis=0, out=out)
    return True


def run_tier_sweep(batch: int, dim: int, ids: np.ndarray, prefilled: str, n_distinct: int, fractions: Sequence[float],
                   args: argparse.Namespace, work_dir: str) -> list[dict[str, Any]]:
    """Tiered lookup throughput and per-tier hit rates at several tier sizes (HBM = f, DDR = 10 f of the rows).

    Same trace, warm-up and timed segments as :func:`run_tiered`; at each size the cache (a fresh
    copy of the prefilled store) alternates segment by segment with RocksDB direct (one shared
    read-only copy), so each point has its own reference measured beside it.
    """
    batches, warm, segments = warm_and_segments(ids, batch, args.segments)
    per = len(segments[0])
    seg_rows = per * batch
    rb = row_bytes_of(dim, work_dir)
    wb = 4 * dim
    keys = {id(b): torch.from_numpy(b) for b in batches}
    out = torch.empty(batch, dim)
    out_np = np.empty((batch, dim), dtype=np.float32)
    rocks_path = os.path.join(work_dir, f"sweep-{batch}-{dim}-rocksdb")
    shutil.rmtree(rocks_path, ignore_errors=True)
    shutil.copytree(prefilled, rocks_path)
    rocks = open_store("rocksdb", os.path.join(rocks_path, STORE_SUBDIR))
    points: list[dict[str, Any]] = []
    try:
        for seg in segments[:1]:  # RocksDB direct's warm-up
            for b in seg:
                rocks.get_many(TABLE, b)
        for k, frac in enumerate(fractions):
            hbm_rows = math.ceil(frac * n_distinct)
            ddr_rows = min(DDR_PER_HBM * hbm_rows, n_distinct - hbm_rows)
            path = os.path.join(work_dir, f"sweep-{batch}-{dim}-{k}")
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(prefilled, path)
            cfg = CacheConfig(hbm_bytes=hbm_rows * rb, ddr_bytes=ddr_rows * rb, path=path, store="rocksdb",
                              device="cpu")
            t_point = time.perf_counter()
            with EmbeddingCache(cfg, [table_config(dim)]) as cache:
                cap = cache.capacity_rows(TABLE)
                for b in warm:
                    cache.lookup(TABLE, keys[id(b)], out=out)
                before = stats_of(cache)
                secs: dict[str, list[float]] = {"cache": [], "rocksdb": []}
                for seg in segments:
                    t0 = time.perf_counter()
                    for b in seg:
                        cache.lookup(TABLE, keys[id(b)], out=out)
                    secs["cache"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    for b in seg:
                        _, records = rocks.get_many(TABLE, b)
                        out_np[...] = records[:, :wb].view(np.float32)
                    secs["rocksdb"].append(time.perf_counter() - t0)
                d = delta(stats_of(cache), before)
            shutil.rmtree(path, ignore_errors=True)
            point = {"hbm_fraction": frac, "ddr_fraction": ddr_rows / n_distinct, "hbm_rows": cap["hbm"],
                     "ddr_rows": cap["ddr"], "cache": rate_summary(seg_rows, secs["cache"]),
                     "rocksdb": rate_summary(seg_rows, secs["rocksdb"]),
                     "hit_rates": {t: d[f"{t}_hits"] / d["lookups"] for t in ("hbm", "ddr", "ssd")},
                     "store_rows_read_per_lookup": d["ssd_reads"] / d["lookups"]}
            point["vs_rocksdb"] = point["cache"]["rows_per_s"] / point["rocksdb"]["rows_per_s"]
            points.append(point)
            h = point["hit_rates"]
            print(f"  [tier sweep {k + 1}/{len(fractions)}] HBM {frac:.1%} / DDR {point['ddr_fraction']:.1%}: "
                  f"{fmt_rate(point['cache']['rows_per_s'])} rows/s ({point['vs_rocksdb']:.2f}x RocksDB direct), "
                  f"hits HBM {h['hbm']:.1%} DDR {h['ddr']:.1%} SSD {h['ssd']:.1%} "
                  f"({time.perf_counter() - t_point:.0f} s)", flush=True)
    finally:
        rocks.close()
        shutil.rmtree(rocks_path, ignore_errors=True)
    return points


def run_tiered(batch: int, dim: int, ids: np.ndarray, prefilled: str, prefilled_lmdb: str, n_distinct: int,
               args: argparse.Namespace,
               work_dir: str) -> dict[str, Any]:
    """HBM 1% / DDR 10% / rest in RocksDB: the cache vs RocksDB direct vs a Python dict LRU.

    Each contender gets its own copy of the prefilled store; all three are open at once, warm up
    on the same batches, then run the timed segments in turn (segment i of each before segment
    i + 1 of any), so that they see the same machine load.
    """
    batches, warm, segments = warm_and_segments(ids, batch, args.segments)
    n_warm, n_seg, per = len(warm), len(segments), len(segments[0])
    seg_rows = per * batch
    rb = row_bytes_of(dim, work_dir)
    hbm_rows = math.ceil(0.01 * n_distinct)
    ddr_rows = math.ceil(0.10 * n_distinct)
    result: dict[str, Any] = {
        "batch": batch, "dim": dim, "stored_rows": n_distinct, "hbm_rows": hbm_rows, "ddr_rows": ddr_rows,
        "warmup_accesses": n_warm * batch, "timed_accesses": n_seg * seg_rows, "segments": n_seg,
    }
    # the pass contender: each segment split into passes whose keysets fit in half of HBM + DDR
    # (the README's advice: the next pass's keyset is staged while this one's is pinned)
    budget = (hbm_rows + ddr_rows) // 2
    warm_passes = passes_of(warm, budget)
    seg_passes = [passes_of(seg, budget) for seg in segments]
    result["pass_budget_rows"] = budget
    result["passes_per_segment"] = statistics.median(len(p) for p in seg_passes)
    paths = {name: os.path.join(work_dir, f"tier-{batch}-{dim}-{name}")
             for name in ("cache", "ahead", "passes", "update", "rocksdb", "rmw", "lru")}
    paths["lmdb"] = os.path.join(work_dir, f"tier-{batch}-{dim}-lmdb")
    for name, p in paths.items():
        shutil.rmtree(p, ignore_errors=True)
        shutil.copytree(prefilled_lmdb if name == "lmdb" else prefilled, p)
    cfg = CacheConfig(hbm_bytes=hbm_rows * rb, ddr_bytes=ddr_rows * rb, path=paths["cache"], store="rocksdb",
                      device="cpu")
    cache = EmbeddingCache(cfg, [table_config(dim)])
    ahead_cache = EmbeddingCache(dataclasses.replace(cfg, path=paths["ahead"]), [table_config(dim)])
    pass_cache = EmbeddingCache(dataclasses.replace(cfg, path=paths["passes"]), [table_config(dim)])
    update_cache = EmbeddingCache(dataclasses.replace(cfg, path=paths["update"]), [table_config(dim)])
    rocks = open_store("rocksdb", os.path.join(paths["rocksdb"], STORE_SUBDIR))
    rmw = open_store("rocksdb", os.path.join(paths["rmw"], STORE_SUBDIR))
    redis_srv: RedisServer | None = None
    lru_store = open_store("rocksdb", os.path.join(paths["lru"], STORE_SUBDIR))
    lmdb = open_store("lmdb", os.path.join(paths["lmdb"], STORE_SUBDIR))
    profile = cProfile.Profile() if args.profile else None
    try:
        cap = cache.capacity_rows(TABLE)
        assert cap == {"hbm": hbm_rows, "ddr": ddr_rows}, cap
        lru = DictLRU(lru_store, TABLE, hbm_rows + ddr_rows, dim)
        out = torch.empty(batch, dim)
        out_np = np.empty((batch, dim), dtype=np.float32)
        keys = {id(b): torch.from_numpy(b) for b in batches}
        wb = 4 * dim
        found_all = [True]
        grads = torch.randn(batch, dim, generator=torch.Generator().manual_seed(args.seed + 7)) * 0.1
        redis_client: Any = None
        try:
            redis_srv = RedisServer(os.path.join(work_dir, f"redis-{batch}-{dim}"))
            redis_client = redis_srv.client()
            t0 = time.perf_counter()
            load_redis(redis_client, rocks, np.unique(ids), wb)
            result["redis_load_seconds"] = time.perf_counter() - t0
            result["redis_parser"] = redis_srv.parser
        except RedisUnavailable as exc:
            result["redis"] = {"available": False, "reason": str(exc)}
            print(f"  Redis peer skipped: {exc}", flush=True)

        def update_lookup(b: np.ndarray) -> None:
            update_cache.lookup(TABLE, keys[id(b)], out=out)
            update_cache.apply_gradients(TABLE, keys[id(b)], grads)

        def rmw_lookup(b: np.ndarray) -> None:
            read_modify_write(rmw, b, grads, out_np, wb)

        def redis_lookup(b: np.ndarray) -> None:
            found_all[0] &= redis_get(redis_client, b, out_np, dim)

        def cache_lookup(b: np.ndarray) -> None:
            cache.lookup(TABLE, keys[id(b)], out=out)

        def ahead_segment(seg: list[np.ndarray]) -> None:
            # the next 2 batches are staged by the background worker while this one is looked up
            for b in LookAhead(ahead_cache, seg, lambda b: {TABLE: keys[id(b)]}, depth=2):
                ahead_cache.lookup(TABLE, keys[id(b)], out=out)

        in_order = [warm, *segments]
        pass_of_segment = {id(seg): ps for seg, ps in zip(in_order, [warm_passes, *seg_passes], strict=True)}
        next_first = {id(seg): pass_of_segment[id(nxt)][0][0] for seg, nxt in itertools.pairwise(in_order)}

        def pass_segment(seg: list[np.ndarray]) -> None:
            # HugeCTR-style passes: the next pass's keyset is staged in the background while this
            # one trains. The next segment's first pass is prefetched during this segment's last
            # pass and waited for here, inside this timing; only the warm-up's first has no head start.
            passes = pass_of_segment[id(seg)]
            if seg is warm:
                pass_cache.prefetch({TABLE: passes[0][0]})
            ahead: PrefetchFuture | None = None
            for i, (ks, pass_batches) in enumerate(passes):
                pass_cache.begin_pass({TABLE: ks})
                following = passes[i + 1][0] if i + 1 < len(passes) else next_first.get(id(seg))
                if following is not None:
                    ahead = pass_cache.prefetch({TABLE: following})
                for b in pass_batches:
                    pass_cache.lookup(TABLE, keys[id(b)], out=out)
                pass_cache.end_pass()
            if ahead is not None:
                ahead.result()

        def rocks_lookup(b: np.ndarray) -> None:
            found, records = rocks.get_many(TABLE, b)
            out_np[...] = records[:, :wb].view(np.float32)
            found_all[0] &= bool(found.all())

        def lmdb_lookup(b: np.ndarray) -> None:
            found, records = lmdb.get_many(TABLE, b)
            out_np[...] = records[:, :wb].view(np.float32)
            found_all[0] &= bool(found.all())

        def lru_lookup(b: np.ndarray) -> None:
            lru.lookup(b, out_np)

        def per_batch(fn: Callable[[np.ndarray], None]) -> Callable[[list[np.ndarray]], None]:
            def run(seg: list[np.ndarray]) -> None:
                for b in seg:
                    fn(b)
            return run

        contenders: dict[str, Callable[[list[np.ndarray]], None]] = {
            "cache": per_batch(cache_lookup), "cache_lookahead": ahead_segment, "cache_passes": pass_segment,
            "rocksdb": per_batch(rocks_lookup), "lmdb": per_batch(lmdb_lookup),
            "dict_lru": per_batch(lru_lookup),
            "cache_update": per_batch(update_lookup), "rocksdb_rmw": per_batch(rmw_lookup)}
        if redis_client is not None:
            contenders["redis"] = per_batch(redis_lookup)
        warm_s: dict[str, float] = {}
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn(warm)
            warm_s[name] = time.perf_counter() - t0
        seg_stats = [stats_of(cache)]
        lru_marks = [(lru.hits, lru.accesses)]
        seg_s: dict[str, list[float]] = {name: [] for name in contenders}
        for seg in segments:
            for name, fn in contenders.items():
                prof = profile if name == "cache" else None
                if prof is not None:
                    prof.enable()
                t0 = time.perf_counter()
                fn(seg)
                seg_s[name].append(time.perf_counter() - t0)
                if prof is not None:
                    prof.disable()
            seg_stats.append(stats_of(cache))
            lru_marks.append((lru.hits, lru.accesses))
        assert found_all[0], "RocksDB direct missed keys: the store was not prefilled with every id"
        total = delta(seg_stats[-1], seg_stats[0])
        assert total["created"] == 0, "rows were created: the store was not prefilled with every id"
        per_seg = [delta(seg_stats[i + 1], seg_stats[i]) for i in range(n_seg)]
        for name in contenders:
            result[name] = rate_summary(seg_rows, seg_s[name]) | {"warmup_seconds": warm_s[name]}
        result["cache_hit_rates"] = {t: total[f"{t}_hits"] / total["lookups"] for t in ("hbm", "ddr", "ssd")}
        result["cache_hit_rates_per_segment"] = [
            {t: d[f"{t}_hits"] / d["lookups"] for t in ("hbm", "ddr", "ssd")} for d in per_seg]
        result["cache_resident"] = {"hbm": seg_stats[-1]["hbm_resident"], "ddr": seg_stats[-1]["ddr_resident"]}
        result["cache_store_rows_read_per_lookup"] = total["ssd_reads"] / total["lookups"]
        result["cache_store_rows_written"] = total["ssd_write_rows"]
        # time the cache itself attributes to each tier (its stats' "seconds"), timed part only
        result["cache_tier_seconds"] = {t: total[f"{t}_seconds"] for t in ("hbm", "ddr", "ssd")}
        result["cache_timed_seconds"] = sum(seg_s["cache"])
        result["dict_lru_hit_rate"] = (lru_marks[-1][0] - lru_marks[0][0]) / (lru_marks[-1][1] - lru_marks[0][1])
        if profile is not None:
            result["cache_profile"] = profile_summary(profile)
        ahead = ahead_cache.stats()[TABLE]
        result["cache_lookahead_hit_rates"] = {t: ahead[t]["hits"] / ahead["lookups"] for t in ("hbm", "ddr", "ssd")}
        ps = pass_cache.stats()[TABLE]
        result["cache_passes_hit_rates"] = {t: ps[t]["hits"] / ps["lookups"] for t in ("hbm", "ddr", "ssd")}
        result["cache_passes_begin_wait_seconds"] = ps["pass"]["wait_seconds"]
        us = update_cache.stats()[TABLE]
        result["cache_update_hit_rates"] = {t: us[t]["hits"] / us["lookups"] for t in ("hbm", "ddr", "ssd")}
        # the two updaters applied the same gradients to the same rows in the same order: compare some rows
        probe = np.unique(ids)[:: max(1, n_distinct // 2048)]
        mine = update_cache.lookup(TABLE, torch.from_numpy(probe)).numpy()
        theirs = rmw.get_many(TABLE, probe)[1][:, :wb].view(np.float32)
        result["update_max_abs_diff_vs_rmw"] = float(np.abs(mine - theirs).max())
        assert result["update_max_abs_diff_vs_rmw"] < 1e-4, (
            f"embcache's updates and the RocksDB read-modify-write differ by {result['update_max_abs_diff_vs_rmw']}")
    finally:
        cache.close()
        ahead_cache.close()
        pass_cache.close()
        update_cache.close()
        rocks.close()
        rmw.close()
        lru_store.close()
        lmdb.close()
        if redis_srv is not None:
            redis_srv.close()
        for p in paths.values():
            shutil.rmtree(p, ignore_errors=True)
    # RocksDB direct reads each distinct key of a batch once; the cache reads only its misses. If
    # memory work cost nothing, the cache could beat RocksDB direct by at most this factor.
    unique = sum(len(np.unique(b)) for seg in segments for b in seg) / (n_seg * seg_rows)
    result["rocksdb_rows_read_per_lookup"] = unique
    result["speedup_bound_if_memory_were_free"] = unique / max(result["cache_store_rows_read_per_lookup"], 1e-12)
    result["vs_rocksdb"] = result["cache"]["rows_per_s"] / result["rocksdb"]["rows_per_s"]
    result["lookahead_vs_rocksdb"] = result["cache_lookahead"]["rows_per_s"] / result["rocksdb"]["rows_per_s"]
    result["passes_vs_rocksdb"] = result["cache_passes"]["rows_per_s"] / result["rocksdb"]["rows_per_s"]
    result["vs_dict_lru"] = result["cache"]["rows_per_s"] / result["dict_lru"]["rows_per_s"]
    result["vs_lmdb"] = result["cache"]["rows_per_s"] / result["lmdb"]["rows_per_s"]
    result["update_vs_rmw"] = result["cache_update"]["rows_per_s"] / result["rocksdb_rmw"]["rows_per_s"]
    if result.get("redis", {}).get("available", True):
        result["redis"]["available"] = True
        result["vs_redis"] = result["cache"]["rows_per_s"] / result["redis"]["rows_per_s"]
        print(f"  Redis MGET (unique keys, all rows in Redis) {fmt_rate(result['redis']['rows_per_s'])} rows/s: "
              f"embcache {result['vs_redis']:.2f}x", flush=True)
    uh = result["cache_update_hit_rates"]
    print(f"  lookup + row-wise AdaGrad update: embcache {fmt_rate(result['cache_update']['rows_per_s'])} rows/s "
          f"(hits HBM {uh['hbm']:.1%} DDR {uh['ddr']:.1%} SSD {uh['ssd']:.1%}), RocksDB read-modify-write "
          f"{fmt_rate(result['rocksdb_rmw']['rows_per_s'])} rows/s: {result['update_vs_rmw']:.2f}x "
          f"(rows agree to {result['update_max_abs_diff_vs_rmw']:.1e})", flush=True)
    hr = result["cache_hit_rates"]
    print(f"  embcache {fmt_rate(result['cache']['rows_per_s'])} rows/s (hits: HBM {hr['hbm']:.1%}, "
          f"DDR {hr['ddr']:.1%}, SSD {hr['ssd']:.1%}); RocksDB direct {fmt_rate(result['rocksdb']['rows_per_s'])} "
          f"rows/s; LMDB direct {fmt_rate(result['lmdb']['rows_per_s'])} "
          f"rows/s; dict LRU {fmt_rate(result['dict_lru']['rows_per_s'])} rows/s (hit "
          f"{result['dict_lru_hit_rate']:.1%})", flush=True)
    ah = result["cache_lookahead_hit_rates"]
    print(f"  embcache + LookAhead(depth 2) {fmt_rate(result['cache_lookahead']['rows_per_s'])} rows/s "
          f"({result['lookahead_vs_rocksdb']:.2f}x RocksDB direct; lookups served by SSD {ah['ssd']:.1%})", flush=True)
    ph = result["cache_passes_hit_rates"]
    print(f"  embcache + passes (prefetch) {fmt_rate(result['cache_passes']['rows_per_s'])} rows/s "
          f"({result['passes_vs_rocksdb']:.2f}x RocksDB direct; {result['passes_per_segment']} passes per segment; "
          f"hits HBM {ph['hbm']:.1%} DDR {ph['ddr']:.1%} SSD {ph['ssd']:.1%})", flush=True)
    print(f"  embcache / RocksDB direct {result['vs_rocksdb']:.2f}x, / dict LRU {result['vs_dict_lru']:.2f}x; "
          f"store rows read per lookup: embcache {result['cache_store_rows_read_per_lookup']:.3f}, RocksDB direct "
          f"{unique:.3f} (bound {result['speedup_bound_if_memory_were_free']:.1f}x)", flush=True)
    return result


def profile_summary(profile: cProfile.Profile, top: int = 15) -> dict[str, Any]:
    """Top functions of a cProfile run by own time and by cumulative time."""
    st = pstats.Stats(profile)
    root = os.path.dirname(HERE)
    entries = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = os.path.relpath(file, root) if file.startswith(root) else file
        entries.append({"function": f"{where}:{line}({name})", "calls": nc, "own_s": tt, "cumulative_s": ct})
    return {"total_s": st.total_tt,  # type: ignore[attr-defined]
            "top_by_own_time": sorted(entries, key=lambda e: e["own_s"], reverse=True)[:top],
            "top_by_cumulative_time": sorted(entries, key=lambda e: e["cumulative_s"], reverse=True)[:top]}


# ---------------------------------------------------------------------------------- report
def summary_rows(hot: list[dict[str, Any]], tiered: list[dict[str, Any]],
                 sweep: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per (case, reference) with the ratio and whether the target is met."""
    rows: list[dict[str, Any]] = []

    def add(case: str, value: float, ref_name: str, ref: float | None, target: float | None) -> None:
        ratio = value / ref if ref else None
        met = None if ratio is None or target is None else ratio >= target
        rows.append({"case": case, "rows_per_s": value, "reference": ref_name, "reference_rows_per_s": ref,
                     "ratio": ratio, "target": target, "met": met})

    for r in hot:
        tag = f"B={r['batch']:,} d={r['dim']}"
        add(f"all-hot lookup {tag}", r["lookup"]["rows_per_s"], "index_select (ceiling)",
            r["ceiling"]["rows_per_s"], TARGETS["lookup"])
        if "ceiling_huge_pages" in r:
            add(f"all-hot lookup {tag}", r["lookup"]["rows_per_s"], "index_select over huge pages",
                r["ceiling_huge_pages"]["rows_per_s"], None)
    for r in hot:
        tag = f"B={r['batch']:,} d={r['dim']}"
        fb = r["fbgemm"]
        name = f"FBGEMM CPU TBE fwd+bwd ({fb['reference_mode'].upper()})" if fb.get("available") else "FBGEMM CPU TBE"
        add(f"all-hot lookup+update {tag}", r["lookup_update"]["rows_per_s"], "index_select (ceiling)",
            r["ceiling"]["rows_per_s"], TARGETS["lookup_update"])
        if "update_bound" in r:
            add(f"all-hot lookup+update {tag}", r["lookup_update"]["rows_per_s"],
                "index_select + bare read-modify-write (a step's memory traffic)",
                r["update_bound"]["rows_per_s"], None)
        add(f"all-hot lookup+update {tag}", r["lookup_update"]["rows_per_s"], name,
            fb.get("forward_backward_rows_per_s"), None)
    for r in tiered:
        tag = f"B={r['batch']:,} d={r['dim']}"
        add(f"tiered lookup {tag}", r["cache"]["rows_per_s"],
            f"bound of free memory tiers (RocksDB direct x {r['speedup_bound_if_memory_were_free']:.2f})",
            r["rocksdb"]["rows_per_s"] * r["speedup_bound_if_memory_were_free"], TARGETS["tiered"])
        add(f"tiered lookup {tag}", r["cache"]["rows_per_s"], "RocksDB multi-get direct",
            r["rocksdb"]["rows_per_s"], None)
        for label, key in (("tiered lookup + LookAhead", "cache_lookahead"),
                           ("tiered lookup, passes + prefetch", "cache_passes")):
            add(f"{label} {tag}", r[key]["rows_per_s"], "plain tiered lookup (same case)", r["cache"]["rows_per_s"],
                TARGETS["prefetch"])
            add(f"{label} {tag}", r[key]["rows_per_s"], "RocksDB multi-get direct", r["rocksdb"]["rows_per_s"], None)
        add(f"tiered lookup {tag}", r["cache"]["rows_per_s"], "LMDB get direct (same rows)",
            r["lmdb"]["rows_per_s"], None)
        add(f"tiered lookup {tag}", r["cache"]["rows_per_s"], "Python dict LRU + RocksDB",
            r["dict_lru"]["rows_per_s"], None)
        redis = r.get("redis", {})
        add(f"tiered lookup {tag}", r["cache"]["rows_per_s"],
            "Redis MGET, all rows in Redis" if redis.get("available") else
            f"Redis MGET (skipped: {redis.get('reason', 'not run')})", redis.get("rows_per_s"), None)
        add(f"tiered lookup + row-wise AdaGrad update {tag}", r["cache_update"]["rows_per_s"],
            "RocksDB read-modify-write direct", r["rocksdb_rmw"]["rows_per_s"], None)
    for pt in sweep or []:
        add(f"tiered lookup, HBM {pt['hbm_fraction']:.1%} / DDR {pt['ddr_fraction']:.1%} B={pt['batch']:,} "
            f"d={pt['dim']}", pt["cache"]["rows_per_s"], "RocksDB multi-get direct (same sweep point)",
            pt["rocksdb"]["rows_per_s"], None)
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    body = []
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else format_ratio(r["ratio"], r["target"])
        target = "—" if r["target"] is None else f">= {r['target']:g}x"
        met = "n/a" if r["met"] is None else ("yes" if r["met"] else "**no**")
        body.append([r["case"], fmt_rate(r["rows_per_s"]), r["reference"], fmt_rate(r["reference_rows_per_s"]),
                     ratio, target, met])
    return markdown_table(["case", "embcache rows/s", "reference", "reference rows/s", "ratio", "target", "met?"],
                          body)


def render_hits(tiered: list[dict[str, Any]]) -> str:
    """Per-tier hit rates of the tiered runs as a Markdown table."""
    body = []
    for r in tiered:
        h = r["cache_hit_rates"]
        body.append([f"B={r['batch']:,} d={r['dim']}", f"{r['stored_rows']:,}", f"{r['hbm_rows']:,}",
                     f"{r['ddr_rows']:,}", f"{h['hbm']:.1%}", f"{h['ddr']:.1%}", f"{h['ssd']:.1%}",
                     f"{r['dict_lru_hit_rate']:.1%}", f"{r['cache_store_rows_read_per_lookup']:.3f}",
                     f"{r['rocksdb_rows_read_per_lookup']:.3f}", f"{r['speedup_bound_if_memory_were_free']:.1f}x",
                     f"{r['cache_passes_hit_rates']['ssd']:.1%}", f"{r['passes_per_segment']:g}",
                     f"{r['cache_update_hit_rates']['ssd']:.1%}"])
    return markdown_table(["tiered case", "rows stored", "HBM rows", "DDR rows", "HBM hits", "DDR hits", "SSD reads",
                           "dict LRU hits", "store reads/key: embcache", "RocksDB direct", "bound",
                           "SSD reads with passes", "passes per segment", "SSD reads, lookup + update"], body)


def render_sweep(sweep: list[dict[str, Any]]) -> str:
    """The tier-size sweep as a Markdown table."""
    body = [[f"{p['hbm_fraction']:.1%} ({p['hbm_rows']:,})", f"{p['ddr_fraction']:.1%} ({p['ddr_rows']:,})",
             fmt_rate(p["cache"]["rows_per_s"]), fmt_rate(p["rocksdb"]["rows_per_s"]), format_ratio(p["vs_rocksdb"]),
             f"{p['hit_rates']['hbm']:.1%}", f"{p['hit_rates']['ddr']:.1%}", f"{p['hit_rates']['ssd']:.1%}",
             f"{p['store_rows_read_per_lookup']:.3f}"] for p in sweep]
    return markdown_table(["HBM (rows)", "DDR (rows)", "embcache rows/s", "RocksDB direct rows/s", "ratio",
                           "HBM hits", "DDR hits", "SSD reads", "store reads/key"], body)


def plot_sweep(sweep: list[dict[str, Any]], path: str, title: str) -> None:
    """Throughput (with RocksDB direct beside it) and per-tier hit rates against the HBM size (DDR = 10x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [100 * p["hbm_fraction"] for p in sweep]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4))
    for key, label, style in (("cache", "embcache tiered lookup", "-o"), ("rocksdb", "RocksDB direct", "--s")):
        y = [p[key]["rows_per_s"] for p in sweep]
        lo = [p[key]["rows_per_s"] - p[key]["rows_per_s_min"] for p in sweep]
        hi = [p[key]["rows_per_s_max"] - p[key]["rows_per_s"] for p in sweep]
        ax.errorbar(x, y, yerr=[lo, hi], fmt=style, capsize=3, label=label)
    for p, xv in zip(sweep, x, strict=True):
        ax.annotate(format_ratio(p["vs_rocksdb"]), (xv, p["cache"]["rows_per_s"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{v:g}%\n(DDR {100 * p['ddr_fraction']:.0f}%)" for v, p in zip(x, sweep, strict=True)])
    ax.minorticks_off()
    ax.set_xlabel("HBM tier (share of the stored rows); DDR = 10x HBM")
    ax.set_ylabel("rows/s (median; bars: min-max)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("throughput", fontsize=10)
    bottom = np.zeros(len(sweep))
    for tier, color in (("hbm", "tab:green"), ("ddr", "tab:blue"), ("ssd", "tab:red")):
        vals = np.array([100 * p["hit_rates"][tier] for p in sweep])
        bx.bar(range(len(sweep)), vals, 0.6, bottom=bottom, color=color, label=tier.upper() if tier != "ssd" else
               "SSD (store reads)")
        bottom += vals
    bx.set_xticks(range(len(sweep)), [f"{v:g}%" for v in x])
    bx.set_xlabel("HBM tier (share of the stored rows)")
    bx.set_ylabel("share of lookups (%)")
    bx.set_ylim(0, 100)
    bx.legend(fontsize=8, loc="lower right")
    bx.set_title("where lookups were served", fontsize=10)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(hot: list[dict[str, Any]], tiered: list[dict[str, Any]], path: str, title: str) -> None:
    """Bar chart (log rows/s) of each case against its references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, list[str], list[dict[str, float | None]]]] = []
    if hot:
        panels.append(("all-hot lookup", [f"B={r['batch']}\nd={r['dim']}" for r in hot],
                       [{"embcache": r["lookup"]["rows_per_s"], "index_select ceiling": r["ceiling"]["rows_per_s"],
                         "FBGEMM fwd": r["fbgemm"].get("forward_rows_per_s")} for r in hot]))
        panels.append(("all-hot lookup + row-wise AdaGrad update", [f"B={r['batch']}\nd={r['dim']}" for r in hot],
                       [{"embcache": r["lookup_update"]["rows_per_s"],
                         "FBGEMM fwd+bwd": r["fbgemm"].get("forward_backward_rows_per_s")} for r in hot]))
    if tiered:
        panels.append(("tiered lookup (HBM 1% / DDR 10% / RocksDB)",
                       [f"B={r['batch']}\nd={r['dim']}" for r in tiered],
                       [{"embcache": r["cache"]["rows_per_s"],
                         "embcache + LookAhead": r.get("cache_lookahead", {}).get("rows_per_s"),
                         "embcache + passes": r.get("cache_passes", {}).get("rows_per_s"),
                         "RocksDB direct": r["rocksdb"]["rows_per_s"],
                         "LMDB direct": r.get("lmdb", {}).get("rows_per_s"),
                         "Redis MGET": r.get("redis", {}).get("rows_per_s"),
                         "dict LRU": r["dict_lru"]["rows_per_s"]} for r in tiered]))
        panels.append(("tiered lookup + row-wise AdaGrad update", [f"B={r['batch']}\nd={r['dim']}" for r in tiered],
                       [{"embcache": r["cache_update"]["rows_per_s"],
                         "RocksDB read-modify-write": r["rocksdb_rmw"]["rows_per_s"]} for r in tiered]))
    colors = {"embcache": "#1f77b4", "embcache + LookAhead": "#17becf", "embcache + passes": "#9467bd",
              "index_select ceiling": "#7f7f7f",
              "FBGEMM fwd": "#ff7f0e",
              "FBGEMM fwd+bwd": "#ff7f0e", "RocksDB direct": "#2ca02c", "LMDB direct": "#8c564b", "dict LRU": "#d62728",
              "Redis MGET": "#e377c2", "RocksDB read-modify-write": "#2ca02c"}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6), squeeze=False)
    for ax, (name, labels, groups) in zip(axes[0], panels, strict=True):
        series = [name for name in groups[0] if any(g[name] for g in groups)]  # drop peers not run
        width = 0.8 / len(series)
        for j, s in enumerate(series):
            vals = [g[s] or 0.0 for g in groups]
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
            bars = ax.bar(xs, vals, width, label=s, color=colors.get(s))
            for b, v in zip(bars, vals, strict=True):
                if v:
                    ax.annotate(fmt_rate(v), (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                                fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("rows/s")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7, loc="upper left", ncol=min(len(series), 2))
        ax.grid(axis="y", which="both", alpha=0.3)
        positive = [v for g in groups for v in g.values() if v]
        ax.set_ylim(min(positive) / 3, max(positive) * 20)  # room for the legend
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 8,192, dim 64, short traces, 3 repeats (< 3 min)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="batch sizes (default 8192,65536; quick: 8192)")
    ap.add_argument("--dims", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="dims (default 64,128; quick: 64)")
    ap.add_argument("--cases", default="hot,tiered", help="which cases: hot, tiered (comma-separated)")
    ap.add_argument("--hot-accesses", type=int, default=None, help="all-hot trace length (default 2^22; quick 2^19)")
    ap.add_argument("--tier-accesses", type=int, default=None,
                    help="tiered trace length, half warm-up (default 6M; quick 1M)")
    ap.add_argument("--update-rows", type=int, default=None, help="rows per repeat of lookup+update (default 2^18)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7; quick 3)")
    ap.add_argument("--segments", type=int, default=None, help="timed segments of the tiered run (default 8; quick 4)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch and numba threads for every contender (default 1; 0 keeps the libraries' defaults)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fbgemm-python", default=None, help="python of a venv with fbgemm-gpu-cpu")
    ap.add_argument("--work-dir", default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--profile", action="store_true", help="cProfile the cache's tiered lookup (into the JSON)")
    ap.add_argument("--sweep", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="HBM shares of the tier-size sweep, DDR = 10x (default 0.005,0.01,0.02,0.04; quick 0.01,0.04; "
                    "'0' skips it)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"),
                    help="results directory (default bench/results): cache.json/.md/.png and cache-tiers.png "
                    "(quick: cache-quick.*, cache-quick-tiers.png)")
    args = ap.parse_args(argv)
    q = args.quick
    args.batches = args.batches or ([8192] if q else [8192, 65536])
    args.dims = args.dims or ([64] if q else [64, 128])
    args.hot_accesses = args.hot_accesses or (1 << 19 if q else 1 << 22)
    args.tier_accesses = args.tier_accesses or (1_000_000 if q else 6_000_000)
    args.update_rows = args.update_rows or (1 << 16 if q else 1 << 18)
    args.repeats = args.repeats or (3 if q else 7)
    args.segments = args.segments or (4 if q else 8)
    args.sweep = [f for f in (args.sweep or (QUICK_SWEEP_HBM_FRACTIONS if q else SWEEP_HBM_FRACTIONS)) if f > 0]
    cases = set(args.cases.split(","))
    stem = os.path.join(args.out, "cache-quick" if q else "cache")
    out_json = stem + ".json"

    set_threads(args.threads)
    started = time.perf_counter()
    info = machine_info(("redis", "hiredis"), script=__file__, argv=sys.argv[1:] if argv is None else argv)
    info["numba_threads"] = numba_threads()
    info["embcache_source_sha256"] = source_digest()  # the working tree may differ from git_commit
    print(f"embcache benchmark ({'quick' if q else 'full'}): batches {args.batches}, dims {args.dims}, "
          f"torch threads {torch.get_num_threads()}, load {info['loadavg_at_start'][0]:.2f}", flush=True)
    fb_py, fb_reason = fbgemm_python(args.fbgemm_python) if "hot" in cases else (None, "not run")
    print(f"FBGEMM: {fb_py or fb_reason}", flush=True)
    own_tmp = args.work_dir is None
    work_dir = tempfile.mkdtemp(prefix="embcache-bench-") if own_tmp else args.work_dir
    os.makedirs(work_dir, exist_ok=True)
    hot: list[dict[str, Any]] = []
    tiered: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    try:
        if "hot" in cases:
            ids = zipf_ids(args.hot_accesses, args.seed)
            for dim in args.dims:
                for batch in args.batches:
                    print(f"[all hot] batch {batch:,}, dim {dim} ({args.hot_accesses:,} accesses, "
                          f"{len(np.unique(ids)):,} distinct ids)", flush=True)
                    hot.append(run_all_hot(batch, dim, ids, args, work_dir, fb_py, fb_reason))
        if "tiered" in cases:
            ids = zipf_ids(args.tier_accesses, args.seed + 1)
            uniq = np.unique(ids)
            for dim in args.dims:
                prefilled = os.path.join(work_dir, f"prefill-{dim}")
                shutil.rmtree(prefilled, ignore_errors=True)
                secs = prefill_store(dim, uniq, prefilled, args.seed)
                prefilled_lmdb = prefilled + "-lmdb"  # the same rows (same seed) in LMDB, for the LMDB peer
                shutil.rmtree(prefilled_lmdb, ignore_errors=True)
                prefill_store(dim, uniq, prefilled_lmdb, args.seed, store="lmdb")
                print(f"[tiered] store prefilled with {len(uniq):,} rows of dim {dim} in {secs:.1f} s", flush=True)
                for batch in args.batches:
                    print(f"[tiered] batch {batch:,}, dim {dim} ({args.tier_accesses:,} accesses, half warm-up)",
                          flush=True)
                    r = run_tiered(batch, dim, ids, prefilled, prefilled_lmdb, len(uniq), args, work_dir)
                    r["prefill_seconds"] = secs
                    tiered.append(r)
                if args.sweep and dim == args.dims[0]:
                    sb = args.batches[0]
                    shares = ", ".join(f"{f:.1%}" for f in args.sweep)
                    print(f"[tier sweep] batch {sb:,}, dim {dim}: HBM {shares} of the rows, DDR {DDR_PER_HBM}x HBM",
                          flush=True)
                    for pt in run_tier_sweep(sb, dim, ids, prefilled, len(uniq), args.sweep, args, work_dir):
                        sweep.append({"batch": sb, "dim": dim, **pt})
                shutil.rmtree(prefilled, ignore_errors=True)
                shutil.rmtree(prefilled_lmdb, ignore_errors=True)
    finally:
        if own_tmp:
            shutil.rmtree(work_dir, ignore_errors=True)

    rows = summary_rows(hot, tiered, sweep)
    table = render_table(rows)
    hits = render_hits(tiered) if tiered else ""
    sweep_md = render_sweep(sweep) if sweep else ""
    info["loadavg_at_end"] = list(os.getloadavg())
    elapsed = time.perf_counter() - started
    command = info["command"]
    result = {
        "benchmark": "embcache cache lookup / lookup+update vs ceiling and peers",
        "command": command,
        "mode": "quick" if q else "full",
        "machine": info,
        "workload": {"key_space": KEY_SPACE, "zipf_alpha": ALPHA, "id_map": "rank * 0x9E3779B97F4A7C15 ^ salt (int64)",
                     "seed": args.seed, "hot_accesses": args.hot_accesses, "tier_accesses": args.tier_accesses,
                     "optimizer": "rowwise_adagrad", "lr": LR, "eps": EPS, "device": "cpu",
                     "repeats": args.repeats, "segments": args.segments, "update_rows": args.update_rows},
        "targets": TARGETS,
        "summary": rows,
        "all_hot": hot,
        "tiered": tiered,
        "tier_sweep": sweep,
        "elapsed_seconds": elapsed,
        "notes": [
            "rows/s are medians over repeats after a discarded warm-up (tiered: over timed segments after a "
            "warm-up half of the trace)",
            "all-hot table = the distinct ids of the trace (HBM holds all of them); key space 10M sparse int64 ids",
            "tiered: HBM 1% / DDR 10% of the ids in the store (= the distinct ids of the trace); the store's files "
            "are in the OS page cache (freshly written), so RocksDB reads are warm",
            "FBGEMM reference = the faster of pooling SUM (bag size 1) and NONE, forward + backward with fused "
            "EXACT_ROWWISE_ADAGRAD; fbgemm-gpu-cpu 1.9.0 fails to load with torch 2.13 (undefined symbol "
            "torch::autograd::_wrap_outputs; it is built for torch 2.14), 1.8.0 is the matching release",
            "the machine may be shared: see loadavg_at_start/at_end",
            "tiered lookup + update: lookup then apply_gradients (row-wise AdaGrad) per batch; the RocksDB peer "
            "reads the batch's unique keys (one multi-get), updates the rows in numpy and writes them back (one "
            "multi-put); the updated rows of both are checked to agree",
            "Redis peer: every stored row's float32 weights as one value of bytes per key in a private redis-server "
            "on 127.0.0.1 (no persistence), MGET of the batch's unique keys; skipped with the reason when "
            "redis-server or redis-py is missing",
            f"tier sweep: HBM at {', '.join(f'{f:.1%}' for f in args.sweep)} of the stored rows, DDR {DDR_PER_HBM}x "
            "HBM, batch and dim of the first tiered case; each point alternates with RocksDB direct",
        ],
    }
    write_json(out_json, result)
    sweep_section = ""
    if sweep:
        sweep_section = (f"\n## Throughput vs tier sizes (`{os.path.basename(stem)}-tiers.png`)\n\n"
                         f"Batch {sweep[0]['batch']:,}, dim {sweep[0]['dim']}, DDR = {DDR_PER_HBM}x HBM; median of "
                         f"{args.segments} segments.\n\n{sweep_md}\n")
    with open(stem + ".md", "w") as f:
        f.write(f"# embcache benchmark ({result['mode']})\n\nCommand: `{result['command']}`  \n"
                f"Machine: {info['cpu_model']}, {info['cpu_count']} cores, torch {info['packages']['torch']}, "
                f"commit {str(info['git_commit'])[:7]}{' (dirty tree)' if info['git_dirty'] else ''}, "
                f"{info['started_at']}\n\n{table}\n\n{hits}\n{sweep_section}")
    if sweep:
        plot_sweep(sweep, stem + "-tiers.png",
                   f"embcache tiered lookup vs tier sizes ({result['mode']}): batch {sweep[0]['batch']:,}, dim "
                   f"{sweep[0]['dim']}, Zipf({ALPHA}) over 10M ids, {torch.get_num_threads()} thread(s)")
    plot(hot, tiered, stem + ".png",
         f"embcache ({result['mode']}): {info['cpu_count']} cores, {torch.get_num_threads()} thread(s) per contender, "
         f"Zipf({ALPHA}) over 10M ids, row-wise AdaGrad, median of repeats")
    print()
    print(table)
    if hits:
        print()
        print(hits)
    if sweep_md:
        print()
        print(sweep_md)
    print(f"\nwrote {out_json}, {stem}.md, {stem}.png{f', {stem}-tiers.png' if sweep else ''} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
