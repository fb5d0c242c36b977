"""embcache.nn under torch.compile: a model holding the modules compiles (inductor, CPU) and trains as in eager.

The modules' forwards are ``torch.compiler.disable``d (see "torch.compile" in embcache.nn): the
dense layers around them compile, the cache calls run eagerly at a graph break, and their autograd
node hands the gradients to the cache from the compiled backward.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch
from torch import nn

from embcache import TableConfig
from embcache.nn import CachedEmbedding, CachedEmbeddingBag, CachedEmbeddingBagCollection

DIM = 8


class Model(nn.Module):
    def __init__(self, cache: Any) -> None:
        super().__init__()
        self.user = CachedEmbedding(cache, "t")
        self.hist = CachedEmbeddingBag(cache, "t", mode="mean")
        self.ebc = CachedEmbeddingBagCollection(cache, {"a": "u", "b": "u"})
        self.mlp = nn.Sequential(nn.Linear(4 * DIM, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user: torch.Tensor, hist: torch.Tensor, hist_offsets: torch.Tensor,
                a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ebc = self.ebc({"a": a, "b": b})
        x = torch.cat([self.user(user), self.hist(hist, hist_offsets), ebc["a"], ebc["b"]], dim=1)
        return self.mlp(x).squeeze(1)


def batches(steps: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        b = 8 + 4 * (step % 2)  # two batch sizes: the compiled graph is reused or recompiled, not wrong
        lengths = torch.randint(0, 4, (b,), generator=gen)
        hist = torch.randint(0, 60, (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        out.append((torch.randint(0, 60, (b,), generator=gen), hist, offsets,
                    torch.randint(0, 30, (b, 2), generator=gen), torch.randint(0, 30, (b, 3), generator=gen),
                    torch.randint(0, 2, (b,), generator=gen).float()))
    return out


def test_compiled_model_trains_like_eager(make_cache: Any, tmp_path: Any) -> None:
    tables = [TableConfig("t", DIM, optimizer="adagrad", lr=0.1, seed=1),
              TableConfig("u", DIM, optimizer="rowwise_adagrad", lr=0.1, seed=2)]
    caches = [make_cache(hbm_rows=8, ddr_rows=16, tables=tables, path=str(tmp_path / name))
              for name in ("eager", "compiled")]
    torch.manual_seed(0)
    eager = Model(caches[0])
    model = Model(caches[1])
    model.mlp.load_state_dict(eager.mlp.state_dict())
    compiled = torch.compile(model)  # the default backend: inductor
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (eager, model)]
    data = batches(5)
    for step, (*inputs, labels) in enumerate(data):
        losses, outs = [], []
        for m, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad()
            outs.append(m(*inputs))
            loss = nn.functional.binary_cross_entropy_with_logits(outs[-1], labels)
            loss.backward()  # also steps the looked-up rows in the cache
            opt.step()
            losses.append(loss)
        assert "Compiled" in type(outs[1].grad_fn).__name__  # the dense part did compile
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7, msg=f"step {step}")
    for table, n in (("t", 60), ("u", 30)):
        torch.testing.assert_close(caches[1].lookup(table, torch.arange(n)), caches[0].lookup(table, torch.arange(n)),
                                   rtol=1e-6, atol=1e-7)
    assert caches[1].stats()["t"]["lookups"] == caches[0].stats()["t"]["lookups"]
    # eval under no_grad compiles too and updates nothing
    before = caches[1].lookup("u", torch.arange(30)).clone()
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*data[0][:-1]), eager.eval()(*data[0][:-1]), rtol=1e-6, atol=1e-7)
    assert torch.equal(caches[1].lookup("u", torch.arange(30)), before)


def test_import_embcache_does_not_import_dynamo(tmp_path: Any) -> None:
    """The forwards are disabled for Dynamo when the first module is built, so the server and CLI skip its import."""
    code = f"""
import sys, embcache, embcache.nn
assert "torch._dynamo" not in sys.modules, "imported by import embcache"
from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.nn import CachedEmbedding, CachedEmbeddingBagCollection
config = CacheConfig(hbm_bytes=1 << 20, ddr_bytes=1 << 20, path={str(tmp_path)!r})
with EmbeddingCache(config, [TableConfig("t", 4)]) as c:
    CachedEmbedding(c, "t")
assert CachedEmbeddingBagCollection.forward._torchdynamo_disable
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
