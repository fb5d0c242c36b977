"""Hybrid-parallel DLRM training: the dense part data-parallel under torchrun, the embeddings on server shards.

Run from the repository root (2 ranks, 2 embcache-server shards on 127.0.0.1, ~1 min on 2 CPUs)::

    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/hybrid_parallel.py
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/hybrid_parallel.py --shards 3 --passes 3
    .venv/bin/torchrun ... examples/hybrid_parallel.py --servers host1:50051,host2:50051   # an existing fleet

This is the split of the large-scale recommender papers (HugeCTR, Mudigere et al. 2021, the
113B-parameter DLRM on DGX A100): the embedding tables are too large for one worker and are
*model-parallel*, each row on one shard, picked by the client's consistent hash; the dense MLPs
are small and *data-parallel*, replicated on every rank and kept equal by DistributedDataParallel
(gloo on CPU, all-reduce of the gradients). Each rank reads its own slice of every batch.

Per step, on every rank: one Lookup per shard for all 8 features (``CachedEmbeddingBagCollection``
over ``embcache.Client``), the dense forward, ``loss.backward()`` (DDP all-reduces the dense
gradients; the embedding backward sends one ApplyGradients per shard, which the servers apply with
the tables' own optimizer), then the dense optimizer step. Each rank pushes the gradients of its
own samples, so a row touched by both ranks gets both updates in that step (with SGD exactly the
step of the summed gradient, as a data-parallel all-reduce with ``sum``).

Passes: rank 0 gathers every rank's keyset of the next pass, stages it (``prefetch``) while the
current pass trains, and wraps each pass in ``begin_pass``/``end_pass``; barriers keep the ranks
out of a pass until it has begun.

Without ``--servers``, rank 0 starts the shards (``embcache.server.local.LocalServer``, each on
its own store in a temporary directory) and stops them at the end. Prints the loss per pass and
rank, the per-shard hit rates, and checks that the ranks' dense weights are identical: every rank
all-gathers every rank's parameters and compares them, and exits with 1 if any differ.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from embcache import Keyset, TableConfig  # noqa: E402
from embcache.client import Client  # noqa: E402
from embcache.nn import CachedEmbeddingBagCollection  # noqa: E402
from examples.dlrm import DLRM  # noqa: E402

N_DENSE = 13


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="", help="comma-separated host:port of running shards (default: start some)")
    p.add_argument("--shards", type=int, default=2, help="shards to start when --servers is not given (default 2)")
    p.add_argument("--features", type=int, default=8, help="categorical features, one table each (default 8)")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension (default 16)")
    p.add_argument("--vocab", type=int, default=200_000, help="ids per feature (Zipf popularity; default 200k)")
    p.add_argument("--passes", type=int, default=2, help="training passes (default 2)")
    p.add_argument("--steps", type=int, default=30, help="steps per pass (default 30)")
    p.add_argument("--batch", type=int, default=512, help="global batch size, split over the ranks (default 512)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of the embeddings (row-wise AdaGrad)")
    p.add_argument("--seed", type=int, default=0)
    return p


def make_batch(args: argparse.Namespace, p: int, step: int, rank: int, world: int
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """This rank's slice of batch ``step`` of pass ``p``: dense [b, 13], ids per feature [b, 1], labels [b].

    Labels come from a hidden model of the dense features and a per-id effect, so the loss can fall.
    """
    rng = np.random.default_rng([args.seed, p, step])
    b = args.batch
    dense = rng.standard_normal((b, N_DENSE)).astype(np.float32)
    ids = {f"f{i}": (rng.zipf(1.2, b) % args.vocab).astype(np.int64) for i in range(args.features)}
    effect = sum(np.sin(v * (i + 1) * 0.37) for i, v in enumerate(ids.values()))
    logit = dense[:, 0] - 0.5 * dense[:, 1] + 0.8 * effect - 0.5
    labels = (rng.random(b) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    part = slice(rank * b // world, (rank + 1) * b // world)
    return (torch.from_numpy(dense[part]), {f: torch.from_numpy(v[part, None]) for f, v in ids.items()},
            torch.from_numpy(labels[part]))


def pass_keyset(args: argparse.Namespace, p: int, rank: int, world: int) -> dict[str, Keyset]:
    """The unique ids (with counts) this rank's slice of pass ``p`` looks up, per table."""
    ids: dict[str, list[torch.Tensor]] = {}
    for step in range(args.steps):
        for f, v in make_batch(args, p, step, rank, world)[1].items():
            ids.setdefault(f"t_{f}", []).append(v.reshape(-1))
    return {t: Keyset.from_keys(torch.cat(v)) for t, v in ids.items()}


def replicas_identical(module: nn.Module) -> bool:
    """Whether every rank holds bit-identical parameters of ``module`` (a collective: every rank calls it).

    Each rank all-gathers every rank's flattened parameters and compares them all, so each rank
    reaches the same verdict from the same data.
    """
    flat = torch.cat([q.detach().reshape(-1).to(torch.float64) for q in module.parameters()])  # lossless
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered[1:])


def start_shards(n: int, workdir: str) -> tuple[list[Any], list[str]]:
    """Start ``n`` embcache-server processes on 127.0.0.1 (rank 0 only)."""
    from embcache.server.local import LocalServer

    servers = [LocalServer(os.path.join(workdir, f"shard{i}"), workdir=os.path.join(workdir, f"run{i}"),
                           args=["--hbm-bytes", str(8 << 20), "--ddr-bytes", str(16 << 20), "--torch-threads", "1"])
               for i in range(n)]
    for s in servers:
        s.launch()
    for s in servers:
        s.wait_ready()
    return servers, [s.address for s in servers]


def main(argv: Sequence[str] | None = None) -> int:
    """Train (see the module docstring); returns 0 when the ranks end with identical dense weights, else 1."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)  # 2 ranks + 2 servers on 2 cores: intra-op threads would only wait
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # plain python: a world of one
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='embcache-pg-')}",
                                rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # same initial dense weights on every rank (DDP also broadcasts rank 0's)
    servers: list[Any] = []
    workdir = tempfile.mkdtemp(prefix="embcache-hybrid-") if rank == 0 else ""
    addresses = [a for a in args.servers.split(",") if a]
    try:
        if rank == 0 and not addresses:
            servers, addresses = start_shards(args.shards, workdir)
            print(f"[rank 0] started {len(servers)} shards: {addresses}", flush=True)
        box = [addresses]
        dist.broadcast_object_list(box, src=0)
        addresses = box[0]
        client = Client(addresses, timeout=120)
        features = {f"f{i}": f"t_f{i}" for i in range(args.features)}
        if rank == 0:
            for table in features.values():
                client.create_table(TableConfig(name=table, dim=args.dim, optimizer="rowwise_adagrad", lr=args.lr,
                                                seed=7))
        dist.barrier()
        embeddings = CachedEmbeddingBagCollection(client, features, mode="sum")
        dense = DistributedDataParallel(DLRM(args.dim, bottom=(32,), top=(64, 32), features=args.features))
        opt = torch.optim.Adam(dense.parameters(), lr=1e-3)
        loss_fn = nn.BCEWithLogitsLoss()

        def keysets_of(p: int) -> dict[str, Keyset]:
            mine = pass_keyset(args, p, rank, world)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            merged: dict[str, Keyset] = {}
            for ks in gathered:
                for t, k in ks.items():
                    merged[t] = merged[t].merge(k) if t in merged else k
            return merged

        keysets = keysets_of(0)  # a collective: every rank calls it
        staged = client.prefetch(keysets) if rank == 0 else None
        t0 = time.perf_counter()
        for p in range(args.passes):
            nxt = keysets_of(p + 1) if p + 1 < args.passes else None
            if rank == 0:
                report = client.begin_pass(keysets)
                pinned = sum(r["pinned_rows"] for r in report.values())
                if nxt is not None:
                    staged = client.prefetch(nxt)  # the next pass is staged while this one trains
            dist.barrier()  # nobody trains before the pass has begun
            losses = []
            for step in range(args.steps):
                x, ids, y = make_batch(args, p, step, rank, world)
                pooled = embeddings(ids)
                emb = torch.stack([pooled[f] for f in features], dim=1)
                loss = loss_fn(dense(x, emb), y)
                opt.zero_grad()
                loss.backward()  # dense: all-reduce over ranks; embeddings: ApplyGradients per shard
                opt.step()
                losses.append(loss.item())
            dist.barrier()  # every rank's updates are in before the pass ends
            if rank == 0:
                client.end_pass()
                rows = sum(len(k) for k in keysets.values())
                print(f"[pass {p}] keyset {rows:,} rows, pinned {pinned:,}", flush=True)
            print(f"[rank {rank}] pass {p}: loss {np.mean(losses[:5]):.4f} -> {np.mean(losses[-5:]):.4f}", flush=True)
            if nxt is not None:
                keysets = nxt
        seconds = time.perf_counter() - t0
        if staged is not None:
            staged.cancel()
        same = replicas_identical(dense.module)  # DDP must have kept the replicas equal
        if not same:
            print(f"[rank {rank}] dense replicas differ between the {world} ranks", flush=True)
        samples = args.passes * args.steps * args.batch
        dist.barrier()
        if rank == 0:
            for i, shard in enumerate(client.shard_stats()):
                lookups = sum(s["lookups"] for s in shard.values())
                hits = {t: sum(s[t]["hits"] for s in shard.values()) for t in ("hbm", "ddr", "ssd")}
                created = sum(s["ssd"]["created"] for s in shard.values())
                print(f"[shard {i} {addresses[i]}] lookups {lookups:,}: hbm {hits['hbm'] / max(lookups, 1):.1%}, "
                      f"ddr {hits['ddr'] / max(lookups, 1):.1%}, ssd {hits['ssd'] / max(lookups, 1):.1%}, "
                      f"created {created / max(lookups, 1):.1%}", flush=True)
            print(f"[rank 0] {samples:,} samples in {seconds:.1f} s ({samples / seconds:,.0f} samples/s); "
                  f"dense replicas identical: {same}", flush=True)
        client.close()
        return 0 if same else 1
    finally:
        dist.barrier()
        for s in servers:
            s.terminate()
        for s in servers:
            s.stop()
        if workdir:  # rank 0's shard stores and logs: a run leaves nothing behind
            shutil.rmtree(workdir, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
