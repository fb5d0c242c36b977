"""The embedded cache in a training loop: what the core install (``pip install embcache``) runs.

    python examples/embedded.py [--steps 60] [--path DIR]

A click model over a user table of 5000 rows in an EmbeddingCache whose memory tiers hold about
450 of them (the rest are on disk), trained with row-wise AdaGrad through ``CachedEmbeddingBag``; the cache
applies the embedding updates inside ``loss.backward()``. Needs no server, gRPC or matplotlib.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.nn import CachedEmbeddingBag


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--path", default=None, help="the cache's directory (default: a temporary one)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    users, dim, batch, bag = 2000, 16, 256, 4
    taste = torch.randn(users) * 2  # a hidden model: how likely each user clicks, plus a dense feature's pull
    with tempfile.TemporaryDirectory() as tmp:
        # ~90 rows in the hot tier, ~360 in the warm one (a row here: 178 bytes with its AdaGrad state);
        # the hot tier on the CPU (device="cuda" on a GPU, with the model and batches moved there)
        config = CacheConfig(hbm_bytes=16 << 10, ddr_bytes=64 << 10, path=args.path or tmp, device="cpu")
        tables = [TableConfig(name="user", dim=dim, optimizer="rowwise_adagrad", lr=0.3, seed=1)]
        with EmbeddingCache(config, tables) as cache:
            users_emb = CachedEmbeddingBag(cache, "user", mode="mean")  # a bag: the users sharing a session
            head = torch.nn.Linear(dim + 1, 1)
            opt = torch.optim.Adam(head.parameters(), lr=0.05)
            losses = []
            for _ in range(args.steps):
                keys = (torch.rand(batch, bag) ** 2 * users).long()  # skewed: a few users are hot
                dense = torch.randn(batch, 1)
                labels = torch.bernoulli(torch.sigmoid(taste[keys].mean(1, keepdim=True) + dense)).squeeze(1)
                logits = head(torch.cat([users_emb(keys), dense], 1)).squeeze(1)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
                opt.zero_grad()
                loss.backward()  # the head's gradients; the cache updates the user rows here
                opt.step()
                losses.append(loss.item())
            cache.flush()
            stats = cache.stats()["user"]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    hbm = stats["hbm"]["hits"] / max(stats["lookups"], 1)
    print(f"loss {first:.3f} -> {last:.3f} over {args.steps} steps; HBM hit ratio {hbm:.2f}, "
          f"rows on disk {stats['ssd']['created']}")
    return {"first_loss": first, "last_loss": last, "hbm_hit_ratio": hbm}


if __name__ == "__main__":
    main()
