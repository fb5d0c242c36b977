"""FBGEMM's CPU table-batched embedding (TBE), timed for ``bench/bench_cache.py``.

Runs in a separate virtual environment that has ``fbgemm-gpu-cpu`` (it pins torch to one minor
version: fbgemm-gpu-cpu 1.8.x goes with torch 2.13, 1.9.x with 2.14), for example::

    python3 -m venv /tmp/fbgemm-venv
    /tmp/fbgemm-venv/bin/pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0   # torch's CPU build

``bench_cache.py`` starts it with ``--serve`` and asks for one timed repeat at a time, so that
FBGEMM's repeats alternate with the cache's under the same machine load. By hand::

    /tmp/fbgemm-venv/bin/python bench/fbgemm_tbe.py --indices ids.npy --rows N --dim 64 --batch 8192 --out r.json

One table of ``--rows`` rows on the host (``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``),
``OptimType.EXACT_ROWWISE_ADAGRAD``, one key per bag (``offsets = 0..B``) so that a bag is one
row: pooling ``SUM`` (bag size 1) and pooling ``NONE`` are both set up. ``fwd_bwd``: per batch,
forward, then ``backward`` of a fixed random gradient, which applies row-wise AdaGrad to the rows
in place (FBGEMM fuses the optimizer into the backward). ``fwd``: the forward alone, under
``no_grad``.

Serve protocol (one line each way): ``fwd_bwd MODE`` or ``fwd MODE`` -> the seconds of one repeat
over the batches; ``info`` -> a JSON object (versions, settings, a check that updates change the
weights); ``quit``. The first line written is ``ready``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import package_versions, rate_summary, write_json


class TBEBench:
    """The TBE modules (one per pooling mode) and the batches they are timed on."""

    def __init__(self, args: argparse.Namespace) -> None:
        import fbgemm_gpu
        from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        if args.threads:
            torch.set_num_threads(args.threads)
        ids = torch.from_numpy(np.load(args.indices).astype(np.int64))
        b = args.batch
        self.batch = b
        self.batches = [ids[i:i + b].contiguous() for i in range(0, ids.numel() - b + 1, b)]
        self.offsets = torch.arange(b + 1, dtype=torch.int64)
        gen = torch.Generator().manual_seed(args.seed)
        self.grad = torch.randn(b, args.dim, generator=gen) * 0.1
        self.n_update = max(1, min(len(self.batches), args.update_rows // b))
        self.n_lookup = max(1, min(len(self.batches), args.lookup_rows // b))
        self.modules: dict[str, Any] = {}
        self.before: dict[str, torch.Tensor] = {}
        bound = 1.0 / args.dim ** 0.5
        for name in args.modes.split(","):
            mode = {"sum": PoolingMode.SUM, "none": PoolingMode.NONE}[name]
            emb = SplitTableBatchedEmbeddingBagsCodegen(
                embedding_specs=[(args.rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=args.lr, eps=args.eps,
                pooling_mode=mode)
            with torch.no_grad():
                for w in emb.split_embedding_weights():
                    w.uniform_(-bound, bound, generator=gen)
            self.modules[name] = emb
            self.before[name] = emb.split_embedding_weights()[0][self.batches[0][:4]].clone()
        self.info: dict[str, Any] = {
            "fbgemm_gpu_version": getattr(fbgemm_gpu, "__version__", None),
            "packages": package_versions(["torch", "fbgemm-gpu-cpu", "numpy"]),
            "torch_threads": torch.get_num_threads(),
            "rows": args.rows, "dim": args.dim, "batch": b, "lr": args.lr, "eps": args.eps,
            "optimizer": "EXACT_ROWWISE_ADAGRAD", "location": "HOST", "compute_device": "CPU",
            "bag_size": 1, "modes": list(self.modules),
            "update_rows_per_repeat": self.n_update * b, "lookup_rows_per_repeat": self.n_lookup * b,
        }

    def fwd_bwd(self, mode: str) -> float:
        """Seconds of forward + backward (with the fused optimizer) over the update batches."""
        emb, offsets, grad = self.modules[mode], self.offsets, self.grad
        t0 = time.perf_counter()
        for idx in self.batches[:self.n_update]:
            out = emb(idx, offsets)
            out.backward(grad.view(out.shape))
        return time.perf_counter() - t0

    def fwd(self, mode: str) -> float:
        """Seconds of the forward alone over the lookup batches."""
        emb, offsets = self.modules[mode], self.offsets
        t0 = time.perf_counter()
        with torch.no_grad():
            for idx in self.batches[:self.n_lookup]:
                emb(idx, offsets)
        return time.perf_counter() - t0

    def weights_changed(self) -> dict[str, bool]:
        """Whether the rows of the first keys changed since set-up, per mode (the optimizer ran)."""
        return {m: bool((self.before[m] != e.split_embedding_weights()[0][self.batches[0][:4]]).any())
                for m, e in self.modules.items()}


def serve(bench: TBEBench) -> None:
    """Answer timing requests on stdin/stdout until ``quit`` or end of input."""
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "info":
            print(json.dumps(bench.info | {"weights_changed": bench.weights_changed()}), flush=True)
        elif cmd[0] == "fwd_bwd":
            print(repr(bench.fwd_bwd(cmd[1])), flush=True)
        elif cmd[0] == "fwd":
            print(repr(bench.fwd(cmd[1])), flush=True)
        else:
            print(f"error unknown command {cmd[0]!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--indices", required=True, help=".npy of int64 dense row ids, the batches concatenated")
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--update-rows", type=int, default=1 << 18, help="rows per repeat of forward+backward")
    ap.add_argument("--lookup-rows", type=int, default=1 << 20, help="rows per repeat of the forward alone")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--eps", type=float, default=1e-10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--modes", default="sum,none", help="pooling modes: sum,none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve", action="store_true", help="answer timing requests on stdin (see the docstring)")
    ap.add_argument("--out", default=None, help="JSON result file (without --serve)")
    args = ap.parse_args()
    bench = TBEBench(args)
    if args.serve:
        serve(bench)
        return
    result = dict(bench.info)
    result["results"] = {}
    for mode in bench.modules:
        for _ in range(args.warmup):
            bench.fwd_bwd(mode)
            bench.fwd(mode)
        upd = [bench.fwd_bwd(mode) for _ in range(args.repeats)]
        look = [bench.fwd(mode) for _ in range(args.repeats)]
        result["results"][mode] = {"forward_backward": rate_summary(bench.n_update * bench.batch, upd),
                                   "forward": rate_summary(bench.n_lookup * bench.batch, look)}
    result["weights_changed"] = bench.weights_changed()
    if args.out:
        write_json(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
