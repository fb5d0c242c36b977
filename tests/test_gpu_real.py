"""What only a real GPU can show: autograd through the cache, races between streams, memory given
back, run-to-run bits. Skipped without CUDA (CI has none); tests/test_gpu_path.py runs the rest of
the CUDA path under the stand-in there, and on the GPU too. docs/gpu.md says what ran where.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.syncs import count_syncs
from examples import dlrm

from .conftest import row_bytes
from .realcuda import REAL_CUDA, pinned_in_use

pytestmark = pytest.mark.skipif(not REAL_CUDA, reason="needs a CUDA device (CI has none: tests/test_gpu_path.py "
                                                      "runs the CUDA path under the stand-in)")


_RUNS = itertools.count()


def _tables(dim: int = 8, optimizer: str = "rowwise_adagrad") -> list[TableConfig]:
    return [TableConfig(name=t, dim=dim, optimizer=optimizer, lr=0.05, seed=i + 1) for i, t in enumerate(dlrm.TABLES)]


def _train(device: str, tmp_path: Any, steps: int = 4) -> tuple[list[float], torch.Tensor]:
    """DLRM steps as examples/dlrm.py takes them (ids on the host), with the cache on ``device``."""
    torch.manual_seed(0)
    dim = 8
    cfg = CacheConfig(hbm_bytes=64 * row_bytes(dim, "rowwise_adagrad") * len(dlrm.TABLES),
                      ddr_bytes=64 * row_bytes(dim, "rowwise_adagrad") * len(dlrm.TABLES),
                      path=str(tmp_path / f"run{next(_RUNS)}"), store="rocksdb", device=device)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 13, generator=gen), torch.randint(0, 300, (64, len(dlrm.TABLES)), generator=gen),
                torch.rand(64, generator=gen).round()) for _ in range(steps)]
    losses = []
    with EmbeddingCache(cfg, _tables(dim)) as cache:
        dev = cache.device
        model = dlrm.DLRM(dim, (16,), (16,)).to(dev)
        emb = dlrm.CacheEmbeddings(cache, dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for dense, sparse, labels in batches:
            logits = model(dense.to(dev), emb(sparse))
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(dev))
            opt.zero_grad()
            loss.backward()  # the cache applies row-wise AdaGrad to the rows here
            opt.step()
            losses.append(float(loss.detach()))
        rows = cache.lookup(dlrm.TABLES[0], torch.arange(300)).cpu()
    return losses, rows


def test_dlrm_training_steps_on_the_gpu_match_the_cpu(tmp_path: Any) -> None:
    # The demo's step with backward (the stand-in cannot carry autograd): model on the GPU, ids on
    # the host, the cache's update inside loss.backward(). The same numbers as on the CPU, within
    # the rounding of two devices' kernels.
    gpu_losses, gpu_rows = _train("cuda", tmp_path)
    cpu_losses, cpu_rows = _train("cpu", tmp_path)
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    torch.testing.assert_close(gpu_rows, cpu_rows, rtol=1e-4, atol=1e-5)
    assert not torch.equal(gpu_rows, _train("cpu", tmp_path, steps=0)[1])  # the steps did move the rows


def _race(cache: EmbeddingCache, user: torch.cuda.Stream | None, keys: torch.Tensor, evict: torch.Tensor) -> None:
    """Updates queued behind a long kernel on the caller's stream, then the end-of-pass write-back
    and evictions issued at once: rows whose write-back ran before their update would be stale."""
    ctx = torch.cuda.stream(user) if user is not None else torch.cuda.stream(torch.cuda.current_stream())
    with ctx:
        cache.begin_pass({"t": keys})
        for step in range(3):
            if user is not None:
                torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time queued ahead of the update
            cache.apply_gradients("t", keys, torch.full((keys.numel(), 16), 0.5 + step, device="cuda"))
        cache.end_pass().result()
        for start in range(0, evict.numel(), 64):  # push the updated rows out of HBM and DDR
            cache.lookup("t", evict[start:start + 64])


def test_background_write_back_waits_for_updates_on_the_callers_stream(tmp_path: Any) -> None:
    cfg = TableConfig(name="t", dim=16, optimizer="adagrad", lr=0.1, seed=3)
    rb = row_bytes(16, "adagrad")
    keys, evict = torch.arange(64), torch.arange(1000, 1640)
    made = []
    for name, user in (("side", torch.cuda.Stream()), ("ref", None)):
        c = EmbeddingCache(CacheConfig(hbm_bytes=96 * rb, ddr_bytes=96 * rb, path=str(tmp_path / name),
                                       device="cuda"), [cfg])
        _race(c, user, keys, evict)
        torch.cuda.synchronize()
        made.append(c)
    got, want = (c.lookup("t", keys).cpu() for c in made)
    for c in made:
        c.close()
    assert torch.equal(got, want)


def test_resize_and_close_give_gpu_memory_back(tmp_path: Any) -> None:
    # Before: create_table made the new tiers while the old ones lived, so a hot tier above about
    # 45% of the GPU's memory could not be resized. Here the process may use 2 GiB of the GPU and
    # the hot tier takes 1.2 GiB of it.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    base = torch.cuda.memory_allocated()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (base + (2 << 30)) / total))
    try:
        cfg = CacheConfig(hbm_bytes=int(1.2 * (1 << 30)), ddr_bytes=64 << 20, path=str(tmp_path / "c"), device="cuda")
        cache = EmbeddingCache(cfg, [TableConfig(name="t", dim=64, optimizer="sgd", lr=0.1, seed=1)])
        cache.apply_gradients("t", torch.arange(1000), torch.ones(1000, 64, device="cuda"))
        want = cache.lookup("t", torch.arange(1000)).cpu()
        assert torch.cuda.memory_allocated() - base > 1 << 30
        assert cache.create_table(TableConfig(name="u", dim=64, optimizer="sgd", lr=0.1, seed=2))
        torch.testing.assert_close(cache.lookup("t", torch.arange(1000)).cpu(), want, rtol=0, atol=0)
        cache.close()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - base < 16 << 20
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_pinned_memory_stays_a_staging_buffer(tmp_path: Any) -> None:
    # The warm tier is ordinary host memory; what torch's pinned allocator holds is the staging of
    # the largest copies, far below the warm tier's budget (which was pinned, rounded up, before).
    torch.cuda.synchronize()
    torch._C._host_emptyCache()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    rb = row_bytes(64, "adagrad")
    cfg = CacheConfig(hbm_bytes=2048 * rb, ddr_bytes=65536 * rb, path=str(tmp_path / "c"), device="cuda")
    with EmbeddingCache(cfg, [TableConfig(name="t", dim=64, optimizer="adagrad", lr=0.1, seed=1)]) as cache:
        for start in range(0, 40000, 4000):  # rows through HBM into DDR and the store, and back
            cache.lookup("t", torch.arange(start, start + 4000))
        cache.lookup("t", torch.arange(0, 4000))
        torch.cuda.synchronize()
        held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
        assert held < 65536 * rb // 4, held
    assert pinned_in_use() == 0  # closed: no staging block is still in use


def test_duplicate_keys_update_to_the_same_bits_on_every_run(tmp_path: Any) -> None:
    # CUDA's index_add_ adds duplicates with atomics, in any order; the segment sum does not.
    cfg = TableConfig(name="t", dim=32, optimizer="adagrad", lr=0.1, seed=3)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randint(0, 50, (200_000,), generator=gen).cuda()
    grads = (torch.randn(200_000, 32, generator=gen) * torch.logspace(-4, 4, 32)).cuda()
    rows = []
    for run in range(3):
        with EmbeddingCache(CacheConfig(hbm_bytes=256 * row_bytes(32, "adagrad"), ddr_bytes=0,
                                        path=str(tmp_path / f"r{run}"), device="cuda"), [cfg]) as cache:
            cache.apply_gradients("t", keys, grads)
            rows.append(cache.lookup("t", torch.arange(50)).cpu())
    assert all(torch.equal(r.view(torch.int32), rows[0].view(torch.int32)) for r in rows[1:])


def test_all_hit_lookup_and_update_let_the_cpu_run_ahead(tmp_path: Any) -> None:
    # With the GPU held busy, an all-hit lookup and update return before the GPU gets to them:
    # the host waits for nothing but the hit count's read-back, which the budget allows once.
    rb = row_bytes(16, "rowwise_adagrad")
    cfg = CacheConfig(hbm_bytes=4096 * rb, ddr_bytes=0, path=str(tmp_path / "c"), device="cuda")
    with EmbeddingCache(cfg, [TableConfig(name="t", dim=16, optimizer="rowwise_adagrad", lr=0.1, seed=1)]) as cache:
        keys = torch.arange(2048).cuda()
        cache.lookup("t", keys)
        grads = torch.ones(2048, 16, device="cuda")
        with count_syncs() as syncs:
            out = cache.lookup("t", keys)
            cache.apply_gradients("t", keys, grads)
        assert out.is_cuda
        assert len(syncs) <= 3, syncs.where
