"""embcache.nn on real RocksDB and LMDB stores: torch's outputs and gradients, training transparency, errors.

Tiers hold a few rows (HBM 4, DDR 8) while batches touch dozens to hundreds of keys, so rows
go to disk and come back between (and within) steps. The reference is always torch itself:
``nn.EmbeddingBag`` / ``nn.Embedding`` holding the cache's own rows, trained by a torch optimizer
(or, for row-wise AdaGrad, which torch lacks, a few lines of the same formula on torch's sparse
gradient).
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from embcache import (
    CacheConfig,
    ConfigError,
    EmbcacheError,
    EmbeddingCache,
    InvalidKeysError,
    NonFiniteGradientError,
    TableConfig,
    UnknownTableError,
)
from embcache.init import init_rows
from embcache.keyset import keysets_from_batches
from embcache.nn import CachedEmbedding, CachedEmbeddingBag, CachedEmbeddingBagCollection, CacheLike

from .conftest import row_bytes
from .realcuda import REAL_CUDA

DIM = 8
N = 40  # keys 0..N-1 in the output / gradient comparisons (the torch table's rows)

# torch.optim.Adagrad on sparse gradients warns about sparse invariant checks; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


class CountingCache:
    """A real cache underneath; counts the calls the modules make and keeps the keys they pass."""

    def __init__(self, cache: EmbeddingCache) -> None:
        self.inner = cache
        self.calls: Counter[str] = Counter()
        self.looked_up: list[dict[str, torch.Tensor]] = []

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def tables(self) -> dict[str, TableConfig]:
        return self.inner.tables()

    def lookup(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        self.calls["lookup"] += 1
        self.looked_up.append({table: keys.clone()})
        return self.inner.lookup(table, keys)

    def lookup_many(self, keys: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.calls["lookup_many"] += 1
        self.looked_up.append({t: k.clone() for t, k in keys.items()})
        return self.inner.lookup_many(keys)

    def apply_gradients(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        self.calls["apply_gradients"] += 1
        self.inner.apply_gradients(table, keys, grads)

    def apply_gradients_many(self, updates: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.calls["apply_gradients_many"] += 1
        self.inner.apply_gradients_many(updates)


def sgd1(name: str = "t", dim: int = DIM) -> TableConfig:
    """SGD with lr=1: a backward changes a row by exactly minus its gradient."""
    return TableConfig(name=name, dim=dim, optimizer="sgd", lr=1.0, seed=3)


def rows_of(cache: Any, table: str = "t", n: int = N) -> torch.Tensor:
    return cache.lookup(table, torch.arange(n)).clone()


def torch_bag(cache: Any, table: str = "t", n: int = N, **kw: Any) -> nn.EmbeddingBag:
    """torch's EmbeddingBag holding the cache's current rows of keys 0..n-1."""
    return nn.EmbeddingBag.from_pretrained(rows_of(cache, table, n), freeze=False, **kw)


def offsets_of(lengths: list[int]) -> torch.Tensor:
    if not lengths:
        return torch.empty(0, dtype=torch.int64)
    return torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)


# ---------------------------------------------------------------------- outputs and gradients vs torch
@st.composite
def bag_batches(draw: Any) -> dict[str, Any]:
    """A batch in one of torch's input forms, with duplicate keys in and across bags, empty bags."""
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    form = draw(st.sampled_from(["1d", "2d", "last_offset"]))
    keys_st = st.integers(0, N - 1) if draw(st.booleans()) else st.integers(0, 5)  # few keys: many duplicates
    if form == "2d":
        n_bags, length = draw(st.integers(0, 6)), draw(st.integers(1, 5))
        flat = draw(st.lists(keys_st, min_size=n_bags * length, max_size=n_bags * length))
        input = torch.tensor(flat, dtype=torch.int64).view(n_bags, length)
        offsets = None
    else:
        lengths = draw(st.lists(st.integers(0, 5), min_size=0 if form == "1d" else 1, max_size=7))
        flat = draw(st.lists(keys_st, min_size=sum(lengths), max_size=sum(lengths)))
        extra = draw(st.lists(keys_st, max_size=3)) if form == "last_offset" else []  # after the last bag
        input = torch.tensor(flat + extra, dtype=torch.int64)
        offsets = offsets_of(lengths)
        if form == "last_offset":
            offsets = torch.cat([offsets, torch.tensor([sum(lengths)])]) if lengths else torch.tensor([0])
    if draw(st.booleans()):
        input = input.to(torch.int32)
        offsets = offsets.to(torch.int32) if offsets is not None else None
    psw = None
    if mode == "sum" and draw(st.booleans()):
        psw = torch.tensor(draw(st.lists(st.floats(-2, 2, width=32), min_size=input.numel(),
                                         max_size=input.numel())), dtype=torch.float32).view(input.shape)
    padding = draw(st.one_of(st.none(), keys_st)) if mode != "max" or draw(st.booleans()) else None
    return {"mode": mode, "include_last_offset": form == "last_offset", "input": input, "offsets": offsets,
            "psw": psw, "padding_idx": padding}


@pytest.fixture
def bag_cache(make_cache: Any) -> EmbeddingCache:
    return make_cache(hbm_rows=4, ddr_rows=8, tables=[sgd1()])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=bag_batches(), seed=st.integers(0, 2**16))
def test_bag_output_and_gradient_equal_torch(bag_cache: EmbeddingCache, batch: dict[str, Any], seed: int) -> None:
    cache = bag_cache
    opts = {"mode": batch["mode"], "include_last_offset": batch["include_last_offset"],
            "padding_idx": batch["padding_idx"]}
    before = rows_of(cache)
    ref = torch_bag(cache, **opts)
    bag = CachedEmbeddingBag(cache, "t", **opts)
    psw_ref = psw = None
    if batch["psw"] is not None:
        psw_ref, psw = batch["psw"].clone().requires_grad_(), batch["psw"].clone().requires_grad_()
    out = bag(batch["input"], batch["offsets"], per_sample_weights=psw)
    ref_input = batch["input"]
    if batch["include_last_offset"]:
        # keys after the last offset belong to no bag; torch's "sum" ignores them too, but its "mean"
        # counts them and its "max" pools them into the last bag, so torch gets them cut off
        end = int(batch["offsets"][-1])
        ref_input = ref_input[:end]
        psw_ref = psw_ref[:end].detach().requires_grad_() if psw_ref is not None else None
    expected = ref(ref_input, batch["offsets"], per_sample_weights=psw_ref)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert torch.equal(out, expected)  # the same rows pooled by the same kernel: bitwise
    if out.numel() == 0:
        return
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) * 0.1
    (expected * upstream).sum().backward()
    (out * upstream).sum().backward()
    after = rows_of(cache)
    grad = ref.weight.grad
    assert grad is not None
    # the keys that belong to a bag (not padding, not after the last offset) are the touched rows
    used = batch["input"].reshape(-1)
    if batch["include_last_offset"]:
        used = used[: int(batch["offsets"][-1])]
    touched = torch.zeros(N, dtype=torch.bool)
    touched[used.long()] = True
    if batch["padding_idx"] is not None:
        touched[batch["padding_idx"]] = False
    torch.testing.assert_close(after[touched] - before[touched], -grad[touched], rtol=0, atol=1e-6)
    assert torch.equal(after[~touched], before[~touched])
    if psw is not None:
        assert psw.grad is not None and psw_ref is not None
        n_ref = psw_ref.numel()
        torch.testing.assert_close(psw.grad.reshape(-1)[:n_ref], psw_ref.grad.reshape(-1), rtol=1e-6, atol=1e-6)
        assert not psw.grad.reshape(-1)[n_ref:].any()


@pytest.fixture
def cuda_bag_cache(fakecuda: Any, make_cache: Any) -> EmbeddingCache:
    return make_cache(hbm_rows=4, ddr_rows=8, tables=[sgd1()], device="cuda")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=bag_batches(), on_device=st.booleans())
def test_bag_output_equals_torch_on_cuda(cuda_bag_cache: EmbeddingCache, batch: dict[str, Any],
                                         on_device: bool) -> None:
    # The forward of every input form with the cache on "cuda" under the stand-in
    # (tests/fakecuda.py), inputs on the host or the device: outputs on the device, torch's values.
    # Backward cannot run there (the stand-in carries no autograd); the test above covers it on CPU.
    cache = cuda_bag_cache
    opts = {"mode": batch["mode"], "include_last_offset": batch["include_last_offset"],
            "padding_idx": batch["padding_idx"]}
    # on a real GPU, torch's CUDA kernel is the reference (its sums differ from the CPU's in the last bits)
    ref_device = "cuda" if REAL_CUDA else "cpu"
    ref = nn.EmbeddingBag.from_pretrained(rows_of(cache).to(ref_device), **opts)
    move = (lambda x: x.cuda() if x is not None else None) if on_device else (lambda x: x)

    def to_ref(x: torch.Tensor | None) -> torch.Tensor | None:
        return x.to(ref_device) if x is not None else None

    with torch.no_grad():
        out = CachedEmbeddingBag(cache, "t", **opts)(move(batch["input"]), move(batch["offsets"]),
                                                      per_sample_weights=move(batch["psw"]))
        ref_input, psw = batch["input"], batch["psw"]
        if batch["include_last_offset"]:
            end = int(batch["offsets"][-1])
            ref_input, psw = ref_input[:end], psw[:end] if psw is not None else None
        expected = ref(to_ref(ref_input), to_ref(batch["offsets"]), per_sample_weights=to_ref(psw))
    assert out.device == cache.device and out.device.type == "cuda"
    assert torch.equal(out.cpu(), expected.cpu())


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_one_key_bags_take_the_gather_path_and_equal_torch(make_cache: Any, mode: str, padding_idx: int | None) -> None:
    """[B, 1] inputs (one categorical value per feature, as DLRM's) pool by a gather; same output and update."""
    cache = make_cache(hbm_rows=4, ddr_rows=8, tables=[sgd1()])
    before = rows_of(cache)
    ref = torch_bag(cache, mode=mode, padding_idx=padding_idx)
    bag = CachedEmbeddingBag(cache, "t", mode=mode, padding_idx=padding_idx)
    input = torch.tensor([[3], [1], [7], [1], [3], [1], [0]])  # duplicates, and the padding key
    psw = torch.linspace(-1.5, 2.0, 7).unsqueeze(1) if mode == "sum" else None
    out = bag(input, per_sample_weights=psw)
    expected = ref(input, per_sample_weights=psw)
    assert torch.equal(out, expected)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (expected * upstream).sum().backward()
    (out * upstream).sum().backward()
    grad = ref.weight.grad
    assert grad is not None
    after = rows_of(cache)  # SGD with lr 1: each used row moved by minus its summed gradient
    torch.testing.assert_close(after - before, -grad, rtol=0, atol=1e-6)
    assert grad[1].abs().sum() > 0 and grad[2].abs().sum() == 0
    if padding_idx is not None:
        assert torch.equal(after[padding_idx], before[padding_idx])


def test_arbitrary_int64_keys_pool_like_torch_on_their_rows(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=4, ddr_rows=8, tables=[sgd1()])
    pool = torch.tensor([-(2**63), 2**63 - 1, -1, 0, 2**53 + 1, 123456789012345, -7])
    picks = torch.randint(0, pool.numel(), (30,), generator=torch.Generator().manual_seed(1))
    keys, offsets = pool[picks], torch.tensor([0, 4, 4, 11, 20])
    before = cache.lookup("t", pool).clone()
    ref = nn.EmbeddingBag.from_pretrained(before.clone(), freeze=False, mode="mean")
    bag = CachedEmbeddingBag(cache, "t", mode="mean")
    out = bag(keys, offsets)
    assert torch.equal(out, ref(picks, offsets))
    out.sum().backward()
    ref(picks, offsets).sum().backward()
    assert ref.weight.grad is not None
    torch.testing.assert_close(cache.lookup("t", pool) - before, -ref.weight.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (2, 3, 2), (2, 0, 5)])
def test_embedding_output_and_gradient_equal_torch(make_cache: Any, shape: tuple[int, ...]) -> None:
    cache = make_cache(hbm_rows=4, ddr_rows=8, tables=[sgd1()])
    gen = torch.Generator().manual_seed(len(shape))
    input = torch.randint(0, 9, shape, generator=gen)  # few keys: duplicates
    before = rows_of(cache)
    ref = nn.Embedding.from_pretrained(before.clone(), freeze=False)
    emb = CachedEmbedding(cache, "t")
    out, expected = emb(input), ref(input)
    assert out.shape == (*shape, DIM) and torch.equal(out, expected)
    upstream = torch.randn(out.shape, generator=gen)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    delta = rows_of(cache) - before
    torch.testing.assert_close(delta, -ref.weight.grad, rtol=0, atol=1e-6)
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[input.reshape(-1)] = False
    assert torch.equal(delta[untouched], torch.zeros_like(delta[untouched]))


def test_embedding_padding_key_is_zero_and_never_looked_up(make_cache: Any) -> None:
    counting = CountingCache(make_cache(tables=[sgd1()]))
    before = rows_of(counting.inner)
    emb = CachedEmbedding(counting, "t", padding_idx=5)
    input = torch.tensor([[5, 1, 5], [2, 2, 5]])
    out = emb(input)
    assert torch.equal(out[input == 5], torch.zeros(3, DIM))
    assert torch.equal(out[0, 1], before[1]) and torch.equal(out[1, 0], before[2])
    assert counting.looked_up[-1]["t"].tolist() == [1, 2]
    out.sum().backward()
    after = rows_of(counting.inner)
    assert torch.equal(after[5], before[5]) and not torch.equal(after[2], before[2])


def test_bag_ignores_padding_and_keys_after_the_last_offset(make_cache: Any) -> None:
    counting = CountingCache(make_cache(tables=[sgd1()]))
    bag = CachedEmbeddingBag(counting, "t", mode="mean", include_last_offset=True, padding_idx=-1)
    bag(torch.tensor([3, -1, 4, -1, 9, 8]), torch.tensor([0, 2, 2, 4]))
    assert counting.looked_up[-1]["t"].tolist() == [3, 4]  # -1 is padding; 9 and 8 follow the last offset
    # bags of zero keys (where torch's 2-D path fails): zeros, and no round trip for nothing
    calls = counting.calls.copy()
    assert torch.equal(bag(torch.empty(3, 0, dtype=torch.int64)), torch.zeros(3, DIM))
    assert counting.calls == calls


def test_modules_hold_no_parameters_and_their_rows_as_extra_state(make_cache: Any) -> None:
    cache = make_cache(tables=[sgd1(), sgd1("u", 4)])
    modules = [CachedEmbedding(cache, "t"), CachedEmbeddingBag(cache, "t"),
               CachedEmbeddingBagCollection(cache, {"a": "t", "b": "u"})]
    for m in modules:
        assert list(m.parameters()) == [] and list(m.buffers()) == [] and list(m.state_dict()) == ["_extra_state"]
        assert CachedEmbedding(cache, "t", persist="none").state_dict() == {}  # the rows: tests/test_nn_state.py
    model = nn.Sequential(modules[1], nn.Linear(DIM, 1))
    assert [p.shape for p in model.parameters()] == [torch.Size([1, DIM]), torch.Size([1])]
    assert "table='t'" in repr(modules[1]) and "mode='mean'" in repr(modules[1])
    # a deep copy of the model (EMA, SWA) shares the cache: it reads and trains the same rows
    twin = copy.deepcopy(model)
    assert twin[0].cache is cache and twin[1].weight is not model[1].weight
    before = rows_of(cache)
    twin[0](i64(1, 2), i64(0)).sum().backward()
    assert torch.equal(model[0](i64(1), i64(0))[0], rows_of(cache)[1]) and not torch.equal(rows_of(cache), before)
    assert copy.deepcopy(modules[2]).cache is cache


# ---------------------------------------------------------------------- transparency: training equals torch
class RowwiseAdagrad:
    """Row-wise AdaGrad (embcache/optim.py's formula) on torch's sparse gradient of ``weight``; with
    ``momentum``, its momentum-scaled variant (``rowwise_adagrad_momentum``)."""

    def __init__(self, weight: torch.Tensor, lr: float, eps: float, momentum: float | None = None) -> None:
        self.weight, self.lr, self.eps, self.momentum = weight, lr, eps, momentum
        self.acc = torch.zeros(weight.shape[0], 1)
        self.m = torch.zeros_like(weight)

    def step(self) -> None:
        assert self.weight.grad is not None
        grad = self.weight.grad.coalesce()
        idx, g = grad.indices()[0], grad.values()
        with torch.no_grad():
            self.acc[idx] += (g * g).mean(dim=1, keepdim=True)
            denom = self.acc[idx].sqrt().add_(self.eps)
            multiplier = torch.full_like(denom, self.lr).div_(denom)
            if self.momentum is None:
                self.weight[idx] = self.weight[idx] - multiplier * g
            else:  # momentum-scaled: m = beta * m + multiplier * g; w -= m (the touched rows' m only)
                self.m[idx] = self.m[idx] * self.momentum + multiplier * g
                self.weight[idx] = self.weight[idx] - self.m[idx]


def embedding_optimizer(name: str, weight: torch.Tensor, lr: float) -> Any:
    if name == "sgd":
        return torch.optim.SGD([weight], lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad([weight], lr=lr, eps=1e-10)
    if name == "rowwise_adagrad_momentum":
        return RowwiseAdagrad(weight, lr, 1e-10, momentum=0.9)  # TableConfig's default beta1
    return RowwiseAdagrad(weight, lr, 1e-10)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def training_batches(steps: int, n_keys: int, unique: bool, seed: int = 0, bags: int = 16) -> Iterator[Batch]:
    """Bags of 0-6 keys; skewed keys (duplicates in and across bags) or no key twice in a batch."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(0, 7, (bags,), generator=gen)
        n = int(lengths.sum())
        if unique:
            keys = torch.randperm(n_keys, generator=gen)[:n]
        else:
            keys = (torch.rand(n, generator=gen) ** 3 * n_keys).long()  # power-law-ish popularity
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        yield keys, offsets, torch.randn(bags, generator=gen)


@dataclass
class Trained:
    """What :func:`train_both` observed: per-step losses of both models, torch's final rows, pass facts."""

    ref_losses: list[torch.Tensor]
    losses: list[torch.Tensor]
    ref_rows: torch.Tensor
    keyset_rows: list[int] = field(default_factory=list)  # unique keys of each pass
    staged_rows: int = 0  # rows the background prefetches read from the store into memory
    pinned_rows: list[int] = field(default_factory=list)  # rows begin_pass pinned, per pass


def train_both(cache: EmbeddingCache, optimizer: str, lr: float, passes: list[list[Batch]],
               n_keys: int = 300, protocol: bool = False) -> Trained:
    """Train torch's model and the cached one on the same data, step by step.

    With ``protocol`` the cached model runs the pass protocol: each pass's keyset is computed
    with ``embcache.keyset.keysets_from_batches``, the next pass is prefetched in the background
    while the current one trains, and ``begin_pass`` / ``end_pass`` frame every pass (the
    write-backs of ``end_pass`` overlap the next pass too). torch trains the same steps in order.
    """
    torch.manual_seed(0)
    head_ref = nn.Linear(DIM, 1)
    head = copy.deepcopy(head_ref)
    ref = nn.EmbeddingBag.from_pretrained(rows_of(cache, n=n_keys), freeze=False, mode="sum", sparse=True)
    bag = CachedEmbeddingBag(cache, "t", mode="sum")
    emb_opt = embedding_optimizer(optimizer, ref.weight, lr)
    dense_ref, dense = torch.optim.SGD(head_ref.parameters(), lr=0.05), torch.optim.SGD(head.parameters(), lr=0.05)
    out = Trained([], [], ref.weight)
    keysets = [keysets_from_batches(batches, lambda b: {"t": b[0]}, progress=False) for batches in passes]
    out.keyset_rows = [len(ks["t"]) for ks in keysets]
    prefetches = [cache.prefetch(keysets[0])] if protocol else []
    write_backs = []
    for p, batches in enumerate(passes):
        if protocol:
            out.pinned_rows.append(cache.begin_pass(keysets[p])["t"]["pinned_rows"])  # adopts the prefetch
            if p + 1 < len(passes):
                prefetches.append(cache.prefetch(keysets[p + 1]))  # stages while this pass trains
        for keys, offsets, y in batches:
            loss_ref = ((head_ref(ref(keys, offsets)).squeeze(1) - y) ** 2).mean()
            ref.weight.grad = None
            dense_ref.zero_grad()
            loss_ref.backward()
            emb_opt.step()
            dense_ref.step()
            loss = ((head(bag(keys, offsets)).squeeze(1) - y) ** 2).mean()
            dense.zero_grad()
            loss.backward()  # the embedding rows are updated here, inside the cache
            dense.step()
            out.ref_losses.append(loss_ref.detach())
            out.losses.append(loss.detach())
        if protocol:
            write_backs.append(cache.end_pass())
    for f in write_backs:
        f.result(timeout=60)  # a failed background write-back fails the test
    out.staged_rows = sum(int(f.result(timeout=60)["t"]["staged_rows"]) for f in prefetches)
    out.ref_rows = ref.weight.detach()
    return out


HBM_ROWS, DDR_ROWS = 4, 12  # 16 rows in memory per table
# (steps, bags per step) of each pass in the pass-protocol runs: passes of 2-3 bags per step have
# keysets of 7-18 rows, most of which fit in HBM+DDR; passes of 12-16 bags keysets of 65-168 rows
# (begin_pass pins the hottest 16, the others are served through the store and evicted again)
PASS_PLAN = [(2, 2), (3, 16), (1, 3), (2, 2), (4, 16), (2, 3), (3, 12), (2, 2)]


def training_data(passes: bool, unique: bool, n_keys: int = 300) -> list[list[Batch]]:
    """The batches of each pass: PASS_PLAN's passes, or one pass of 30 steps of 16 bags."""
    if not passes:
        return [list(training_batches(30, n_keys, unique))]
    return [list(training_batches(steps, n_keys, unique, seed=100 + p, bags=bags))
            for p, (steps, bags) in enumerate(PASS_PLAN)]


def touched_keys(data: list[list[Batch]], n_keys: int = 300) -> torch.Tensor:
    """Bool [n_keys]: the keys some batch looked up (and so trained)."""
    touched = torch.zeros(n_keys, dtype=torch.bool)
    for batches in data:
        for keys, _, _ in batches:
            touched[keys] = True
    return touched


def assert_rows_went_to_disk_and_back(cache: EmbeddingCache, run: Trained, protocol: bool) -> None:
    """Training moved rows through every tier (and changed them: the comparison was not vacuous)."""
    cfg = cache.tables()["t"]
    initial = init_rows(cfg.initializer, float(cfg.init_scale or 0), cfg.seed, torch.arange(300), DIM)
    assert (rows_of(cache, n=300) - initial).abs().max() > 1e-3
    s = cache.stats()["t"]
    assert s["hbm"]["capacity_rows"] == HBM_ROWS and s["ddr"]["capacity_rows"] == DDR_ROWS
    assert s["ssd"]["write_rows"] > 100 and s["ssd"]["hits"] > 100  # evicted dirty rows, read back later
    if protocol:
        memory = HBM_ROWS + DDR_ROWS
        assert s["pass"]["started"] == len(PASS_PLAN) and not s["pass"]["active"]
        assert min(run.keyset_rows) <= memory < max(run.keyset_rows)  # passes that fit, and passes that do not
        # every pass pinned all of its keyset that memory holds: nothing stayed pinned from the pass before
        assert run.pinned_rows == [min(k, memory) for k in run.keyset_rows]
        assert run.staged_rows > 0  # the background prefetches did read rows from the store
        assert s["hbm"]["pinned_rows"] + s["ddr"]["pinned_rows"] == 0


CASES = ["one_pass", "passes_with_prefetch"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "rowwise_adagrad_momentum"])
def test_training_through_the_cache_equals_torch(make_cache: Any, optimizer: str, case: str) -> None:
    """Skewed keys, duplicates in every batch; ~200 rows touched with 16 in memory.

    ``passes_with_prefetch``: the cached model trains in passes (keysets from
    ``embcache.keyset``, the next pass prefetched during the current one, begin_pass / end_pass);
    the loss must still equal torch's at every step.
    """
    protocol = case == "passes_with_prefetch"
    cfg = TableConfig(name="t", dim=DIM, optimizer=optimizer, lr=0.05, seed=5)
    cache = make_cache(hbm_rows=HBM_ROWS, ddr_rows=DDR_ROWS, tables=[cfg])
    data = training_data(protocol, unique=False)
    run = train_both(cache, optimizer, 0.05, data, protocol=protocol)
    # SGD: torch adds each duplicate's -lr*g_i to the row one after the other (its sparse gradient
    # is not coalesced); the cache sums duplicates first and adds -lr*sum once: last-bit
    # differences, hence 1e-6 relative. (Adagrad and row-wise AdaGrad coalesce first, like the cache.)
    tol = 1e-6 if optimizer == "sgd" else 1e-5
    assert len(run.losses) == sum(len(b) for b in data)
    for step, (a, b) in enumerate(zip(run.ref_losses, run.losses, strict=True)):
        assert abs(float(a) - float(b)) <= tol * abs(float(a)), f"step {step}: torch {float(a)} cached {float(b)}"
    touched = touched_keys(data)
    rows = rows_of(cache, n=300)
    torch.testing.assert_close(rows[touched], run.ref_rows[touched], rtol=tol, atol=tol)
    assert torch.equal(rows[~touched], run.ref_rows[~touched])  # never trained: still the initial rows
    assert_rows_went_to_disk_and_back(cache, run, protocol)


@pytest.mark.parametrize("case", CASES)
def test_sgd_training_is_bitwise_equal_without_duplicate_keys(make_cache: Any, case: str) -> None:
    """With no key twice in a batch the arithmetic is torch's, operation for operation.

    Duplicates are where the two differ: torch's sparse SGD adds each occurrence's -lr*g_i to
    the row one after the other (``index_add_`` of the uncoalesced gradient), while the cache
    sums a key's gradients first and subtracts lr*sum once; float addition is not associative,
    so with duplicates the rows (and then the losses) differ in the last bits. Without
    duplicates both compute w - lr*g for each row, and the pass protocol (prefetch, pins,
    write-back while training) must not change a bit of it.
    """
    protocol = case == "passes_with_prefetch"
    cache = make_cache(hbm_rows=HBM_ROWS, ddr_rows=DDR_ROWS, tables=[TableConfig(name="t", dim=DIM, lr=0.05, seed=5)])
    data = training_data(protocol, unique=True)
    assert all(k.unique().numel() == k.numel() for batches in data for k, _, _ in batches)
    run = train_both(cache, "sgd", 0.05, data, protocol=protocol)
    for step, (a, b) in enumerate(zip(run.ref_losses, run.losses, strict=True)):
        assert torch.equal(a, b), f"step {step}: torch {float(a)!r} cached {float(b)!r}"
    touched = touched_keys(data)
    rows = rows_of(cache, n=300)
    assert torch.equal(rows[touched], run.ref_rows[touched])
    assert torch.equal(rows, run.ref_rows)
    assert_rows_went_to_disk_and_back(cache, run, protocol)


# ---------------------------------------------------------------------- collection
def collection_batch(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 0, 5, 1]
    return {
        "user": (torch.randint(0, 12, (9,), generator=gen), offsets_of(lengths)),
        "user_2d": torch.randint(0, 12, (4, 3), generator=gen),
        "item": (torch.randint(0, 20, (9,), generator=gen), offsets_of(lengths), torch.rand(9, generator=gen)),
    }


FEATURES = {"user": "u", "user_2d": "u", "item": "i"}


def two_tables(optimizer: str = "adagrad") -> list[TableConfig]:
    return [TableConfig(name="u", dim=DIM, optimizer=optimizer, lr=0.1, seed=1),
            TableConfig(name="i", dim=DIM, optimizer=optimizer, lr=0.1, seed=2)]


def test_collection_is_one_round_trip_each_way(make_cache: Any) -> None:
    counting = CountingCache(make_cache(hbm_rows=4, ddr_rows=8, tables=two_tables()))
    ebc = CachedEmbeddingBagCollection(counting, FEATURES)
    for step in range(3):
        batch = collection_batch(step)
        out = ebc(batch)
        assert list(out) == list(FEATURES)
        assert counting.calls == Counter({"lookup_many": step + 1, "apply_gradients_many": step})
        # the shared table's keys of both features, uniqued once
        merged = torch.cat([batch["user"][0], batch["user_2d"].reshape(-1)])
        assert counting.looked_up[-1]["u"].tolist() == sorted(set(merged.tolist()))
        sum(o.sum() for o in out.values()).backward()
        assert counting.calls == Counter({"lookup_many": step + 1, "apply_gradients_many": step + 1})


def test_collection_equals_torch_with_a_shared_table(make_cache: Any) -> None:
    """torch: one EmbeddingBag per table, the shared one called for both features, sparse Adagrad."""
    cache = make_cache(hbm_rows=4, ddr_rows=8, tables=two_tables())
    refs = {t: torch_bag(cache, t, n=20, mode="sum", sparse=True) for t in ("u", "i")}
    opt = torch.optim.Adagrad([refs["u"].weight, refs["i"].weight], lr=0.1, eps=1e-10)
    ebc = CachedEmbeddingBagCollection(cache, FEATURES)
    for step in range(4):
        batch = collection_batch(step)
        out = ebc(batch)
        expected = {"user": refs["u"](*batch["user"]), "user_2d": refs["u"](batch["user_2d"]),
                    "item": refs["i"](batch["item"][0], batch["item"][1], per_sample_weights=batch["item"][2])}
        for f in FEATURES:
            torch.testing.assert_close(out[f], expected[f], rtol=1e-5, atol=1e-6)
        upstream = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        sum((e * upstream).sum() for e in expected.values()).backward()
        opt.step()
        sum((o * upstream).sum() for o in out.values()).backward()
    for t in ("u", "i"):
        torch.testing.assert_close(rows_of(cache, t, 20), refs[t].weight.detach(), rtol=1e-5, atol=1e-6)


def test_shared_table_merged_equals_one_module_over_concatenated_input(make_cache: Any, tmp_path: Any) -> None:
    tables = [TableConfig(name="t", dim=DIM, optimizer="adagrad", lr=0.1, seed=4)]
    merged_cache = make_cache(tables=tables, path=str(tmp_path / "a"))
    single_cache = make_cache(tables=tables, path=str(tmp_path / "b"))
    split_cache = make_cache(tables=tables, path=str(tmp_path / "c"))
    a, off_a = torch.tensor([1, 2, 3, 1, 7]), torch.tensor([0, 2])
    b, off_b = torch.tensor([2, 2, 9, 1]), torch.tensor([0, 1, 3])
    upstream = torch.randn(5, DIM, generator=torch.Generator().manual_seed(0))
    out = CachedEmbeddingBagCollection(merged_cache, {"a": "t", "b": "t"})({"a": (a, off_a), "b": (b, off_b)})
    one = CachedEmbeddingBag(single_cache, "t", mode="sum")(torch.cat([a, b]), torch.cat([off_a, off_b + a.numel()]))
    torch.testing.assert_close(torch.cat([out["a"], out["b"]]), one, rtol=0, atol=0)
    (torch.cat([out["a"], out["b"]]) * upstream).sum().backward()
    (one * upstream).sum().backward()
    torch.testing.assert_close(rows_of(merged_cache, n=10), rows_of(single_cache, n=10), rtol=1e-6, atol=1e-7)
    # two separate modules on one table: two AdaGrad steps (documented), not one summed step
    first, second = CachedEmbeddingBag(split_cache, "t", mode="sum"), CachedEmbeddingBag(split_cache, "t", mode="sum")
    (torch.cat([first(a, off_a), second(b, off_b)]) * upstream).sum().backward()
    shared = torch.tensor([1, 2])  # keys in both inputs
    assert (rows_of(split_cache, n=10)[shared] - rows_of(single_cache, n=10)[shared]).abs().max() > 1e-3


def test_collection_accepts_feature_names_as_tables_and_moves_nothing_for_unused_outputs(make_cache: Any) -> None:
    counting = CountingCache(make_cache(tables=[sgd1("u"), sgd1("i")]))
    ebc = CachedEmbeddingBagCollection(counting, ["u", "i"], mode="mean")
    assert ebc.features == {"u": "u", "i": "i"} and ebc.embedding_dims == {"u": DIM, "i": DIM}
    before = rows_of(counting.inner, "u")
    out = ebc({"u": torch.tensor([[1, 2]]), "i": (torch.tensor([3]), torch.tensor([0]))})
    out["i"].sum().backward()  # "u" gets no gradient: its rows are not touched
    assert torch.equal(rows_of(counting.inner, "u"), before)
    assert counting.calls["apply_gradients_many"] == 1


# ---------------------------------------------------------------------- no_grad, eval
def test_no_grad_and_eval_look_up_but_apply_nothing(make_cache: Any) -> None:
    counting = CountingCache(make_cache(tables=[sgd1()]))
    cache = counting.inner
    bag = CachedEmbeddingBag(counting, "t", mode="sum")
    input, offsets = torch.tensor([1, 2, 3, 3]), torch.tensor([0, 2])
    before = rows_of(cache)
    lookups = cache.stats()["t"]["lookups"]
    with torch.no_grad():
        out = bag(input, offsets)
    assert not out.requires_grad and torch.equal(out[0], before[1] + before[2])
    bag.eval()
    head = nn.Linear(DIM, 1)
    out = bag(input, offsets)
    assert not out.requires_grad
    head(out).sum().backward()  # the dense part still trains; the embedding rows do not
    psw = torch.ones(4, requires_grad=True)
    bag(input, offsets, per_sample_weights=psw).sum().backward()  # eval: per-sample weights still get gradients
    assert psw.grad is not None  # a dot product per bag: summed in another order than sum(1) on some CPUs
    torch.testing.assert_close(psw.grad, before[[1, 2, 3, 3]].sum(1))
    assert torch.equal(rows_of(cache), before)
    assert cache.stats()["t"]["lookups"] > lookups  # the lookups did happen
    assert counting.calls["apply_gradients"] == 0
    bag.train()
    bag(input, offsets).sum().backward()
    assert counting.calls["apply_gradients"] == 1 and not torch.equal(rows_of(cache), before)


def test_collection_under_no_grad(make_cache: Any) -> None:
    counting = CountingCache(make_cache(hbm_rows=4, ddr_rows=8, tables=two_tables()))
    ebc = CachedEmbeddingBagCollection(counting, FEATURES)
    with torch.no_grad():
        out = ebc(collection_batch(0))
    assert all(not o.requires_grad for o in out.values())
    assert counting.calls == Counter({"lookup_many": 1})


# ---------------------------------------------------------------------- errors
def i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


BAG_ERRORS: list[tuple[str, dict[str, Any], dict[str, Any], type[BaseException], str]] = [
    ("float input", {}, {"input": torch.tensor([1.0, 2.0]), "offsets": i64(0)}, InvalidKeysError, "int64 or int32"),
    ("int16 input", {}, {"input": i64(1, 2).short(), "offsets": i64(0)}, InvalidKeysError, "int64 or int32"),
    ("list input", {}, {"input": [1, 2], "offsets": i64(0)}, TypeError, "must be a torch.Tensor"),
    ("0-d input", {}, {"input": torch.tensor(3)}, InvalidKeysError, "1D or 2D"),
    ("3-d input", {}, {"input": torch.zeros(2, 2, 2, dtype=torch.int64)}, InvalidKeysError, "1D or 2D"),
    ("1-d without offsets", {}, {"input": i64(1, 2)}, InvalidKeysError, "offsets has to be a 1D Tensor but got None"),
    ("2-d with offsets", {}, {"input": i64(1, 2).view(1, 2), "offsets": i64(0)}, InvalidKeysError,
     "offsets has to be None"),
    ("2-d offsets", {}, {"input": i64(1, 2), "offsets": i64(0).view(1, 1)}, InvalidKeysError, "1D Tensor"),
    ("float offsets", {}, {"input": i64(1, 2), "offsets": torch.tensor([0.0])}, InvalidKeysError, "offsets must be"),
    ("list offsets", {}, {"input": i64(1, 2), "offsets": [0]}, TypeError, "offsets must be a torch.Tensor"),
    ("offsets[0] != 0", {}, {"input": i64(1, 2), "offsets": i64(1)}, InvalidKeysError, r"offsets\[0\] has to be 0"),
    ("decreasing offsets", {}, {"input": i64(1, 2, 3), "offsets": i64(0, 2, 1)}, InvalidKeysError, "non-decreasing"),
    ("offsets past the end", {}, {"input": i64(1, 2), "offsets": i64(0, 3)}, InvalidKeysError, "can not be greater"),
    ("last offset past the end", {"include_last_offset": True}, {"input": i64(1, 2), "offsets": i64(0, 3)},
     InvalidKeysError, "can not be greater"),
    ("no offsets with include_last_offset", {"include_last_offset": True},
     {"input": i64(1, 2), "offsets": i64()}, InvalidKeysError, "at least 1"),
    ("per_sample_weights in mean mode", {"mode": "mean"},
     {"input": i64(1, 2), "offsets": i64(0), "per_sample_weights": torch.ones(2)}, NotImplementedError, "mode='sum'"),
    ("per_sample_weights in max mode", {"mode": "max"},
     {"input": i64(1, 2), "offsets": i64(0), "per_sample_weights": torch.ones(2)}, NotImplementedError, "mode='sum'"),
    ("per_sample_weights of another shape", {},
     {"input": i64(1, 2), "offsets": i64(0), "per_sample_weights": torch.ones(3)}, InvalidKeysError, "same shape"),
    ("integer per_sample_weights", {},
     {"input": i64(1, 2), "offsets": i64(0), "per_sample_weights": i64(1, 1)}, InvalidKeysError, "floating point"),
    ("list per_sample_weights", {},
     {"input": i64(1, 2), "offsets": i64(0), "per_sample_weights": [1.0, 1.0]}, TypeError, "per_sample_weights"),
]


@pytest.mark.parametrize(("what", "ctor", "call", "error", "match"), BAG_ERRORS, ids=[e[0] for e in BAG_ERRORS])
def test_bad_bag_input_raises_before_touching_the_cache(make_cache: Any, what: str, ctor: dict[str, Any],
                                                       call: dict[str, Any], error: type[BaseException],
                                                       match: str) -> None:
    counting = CountingCache(make_cache(tables=[sgd1()]))
    before = rows_of(counting.inner)
    bag = CachedEmbeddingBag(counting, "t", **{"mode": "sum", **ctor})
    with pytest.raises(error, match=match) as info:
        bag(**call)
    if error is InvalidKeysError:  # torch raises ValueError (or RuntimeError) here; ours is both kinds
        assert isinstance(info.value, ValueError) and isinstance(info.value, EmbcacheError)
    assert counting.calls == Counter()
    assert torch.equal(rows_of(counting.inner), before)


def test_bad_embedding_input(make_cache: Any) -> None:
    counting = CountingCache(make_cache(tables=[sgd1()]))
    emb = CachedEmbedding(counting, "t")
    with pytest.raises(InvalidKeysError, match="int64 or int32"):
        emb(torch.tensor([1.5]))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        emb([1, 2])  # type: ignore[arg-type]
    assert counting.calls == Counter()


def test_bad_collection_batches_raise_before_touching_the_cache(make_cache: Any) -> None:
    counting = CountingCache(make_cache(hbm_rows=4, ddr_rows=8, tables=two_tables()))
    before = {t: rows_of(counting.inner, t) for t in ("u", "i")}
    ebc = CachedEmbeddingBagCollection(counting, FEATURES)
    good = collection_batch(0)
    with pytest.raises(InvalidKeysError, match=r"missing \['item'\]"):
        ebc({f: v for f, v in good.items() if f != "item"})
    with pytest.raises(InvalidKeysError, match=r"unknown \['other'\]"):
        ebc({**good, "other": good["user_2d"]})
    with pytest.raises(TypeError, match="feature 'user'"):
        ebc({**good, "user": [good["user"][0]]})
    with pytest.raises(InvalidKeysError, match=r"feature 'item': offsets\[0\] has to be 0"):
        ebc({**good, "item": (good["item"][0], good["item"][1] + 1)})
    with pytest.raises(TypeError, match="mapping"):
        ebc([good])  # type: ignore[arg-type]
    assert counting.calls == Counter()
    for t in ("u", "i"):
        assert torch.equal(rows_of(counting.inner, t), before[t])


def test_construction_errors(make_cache: Any) -> None:
    cache = make_cache(tables=[sgd1()])
    for make in (lambda: CachedEmbedding(cache, "nope"), lambda: CachedEmbeddingBag(cache, "nope"),
                 lambda: CachedEmbeddingBagCollection(cache, {"f": "nope"})):
        with pytest.raises(UnknownTableError, match="unknown table 'nope'"):
            make()
    bad: list[tuple[Callable[[], Any], type[BaseException], str]] = [
        (lambda: CachedEmbeddingBag(cache, "t", mode="median"), ConfigError, "mode='median'"),
        (lambda: CachedEmbeddingBag(cache, "t", padding_idx=1.5), ConfigError, "padding_idx"),  # type: ignore[arg-type]
        (lambda: CachedEmbedding(cache, "t", padding_idx=2**63), ConfigError, "padding_idx"),
        (lambda: CachedEmbeddingBagCollection(cache, {}), ConfigError, "at least one"),
        (lambda: CachedEmbeddingBagCollection(cache, "t"), ConfigError, "mapping"),
        (lambda: CachedEmbeddingBagCollection(cache, ["t", "t"]), ConfigError, "unique"),
        (lambda: CachedEmbeddingBagCollection(cache, {"f": 1}), ConfigError, "strings"),  # type: ignore[dict-item]
        (lambda: CachedEmbeddingBagCollection(cache, ["t"], mode="avg"), ConfigError, "mode='avg'"),
        (lambda: CachedEmbeddingBag(object(), "t"), TypeError, "lacks"),  # type: ignore[arg-type]
    ]
    for make, error, match in bad:
        with pytest.raises(error, match=match):
            make()


def test_cache_errors_in_backward_apply_nothing(make_cache: Any) -> None:
    cache = make_cache(tables=[sgd1()])
    bag = CachedEmbeddingBag(cache, "t", mode="sum")
    before = rows_of(cache)
    out = bag(i64(1, 2, 3), i64(0, 1))
    with pytest.raises(NonFiniteGradientError):
        (out * float("nan")).sum().backward()
    assert torch.equal(rows_of(cache), before)
    ebc = CachedEmbeddingBagCollection(cache, {"a": "t"})
    out = ebc({"a": (i64(1, 2, 3), i64(0, 1))})["a"]
    with pytest.raises(NonFiniteGradientError):
        (out * float("inf")).sum().backward()
    assert torch.equal(rows_of(cache), before)


# ---------------------------------------------------------------------- devices
def test_the_embedded_cache_is_cache_like(make_cache: Any) -> None:
    cache: CacheLike = make_cache(tables=[sgd1()])  # mypy checks the protocol; this checks the methods run
    assert set(cache.tables()) == {"t"} and cache.device == torch.device("cpu")


def test_outputs_go_to_the_module_device_not_the_input_device(make_cache: Any) -> None:
    # The model's device decides (TorchRec's rule): a CUDA model fed host ids must get CUDA
    # outputs (examples/dlrm.py crashed in torch.cat otherwise). "meta" stands in for a device
    # other than the input's, which a CPU-only build cannot otherwise give.
    cache = make_cache(tables=[sgd1(), sgd1("u")])
    input, offsets = i64(1, 2, 2, 7), i64(0, 3)
    with torch.no_grad():
        assert CachedEmbeddingBag(cache, "t", mode="sum")(input, offsets).device == cache.device
        assert CachedEmbedding(cache, "t", device="meta")(input).device.type == "meta"
        bag = CachedEmbeddingBag(cache, "t", mode="sum", device="meta")
        out = bag(input, offsets)
        assert out.device.type == "meta" and out.shape == (2, DIM)
        assert "device='meta'" in repr(bag) and bag.output_device == torch.device("meta")
        ebc = CachedEmbeddingBagCollection(cache, ["t", "u"], device=torch.device("meta"))
        outs = ebc({"t": (input, offsets), "u": input.view(2, 2)})
        assert {o.device.type for o in outs.values()} == {"meta"}
    with pytest.raises(ConfigError, match="device"):
        CachedEmbeddingBag(cache, "t", device="gpu0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_with_cpu_and_cuda_inputs(tmp_path: Any, store: str) -> None:
    rb = row_bytes(DIM)
    cfg = CacheConfig(hbm_bytes=4 * rb, ddr_bytes=8 * rb, path=str(tmp_path / "s"), store=store, device="cuda")
    with EmbeddingCache(cfg, [sgd1()]) as cache:
        bag = CachedEmbeddingBag(cache, "t", mode="sum")
        before = rows_of(cache).cpu()
        ref = nn.EmbeddingBag.from_pretrained(before.clone(), freeze=False, mode="sum")
        input, offsets = i64(1, 2, 2, 7), i64(0, 3)
        for device in ("cpu", "cuda"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = bag(input.to(device), offsets.to(device))
            assert out.device == cache.device  # the cache's device, wherever the input was
            torch.testing.assert_close(out.cpu(), ref(input, offsets), rtol=1e-6, atol=1e-6)
        out.sum().backward()
        ref(input, offsets).sum().backward()
        assert ref.weight.grad is not None
        torch.testing.assert_close(rows_of(cache).cpu() - before, -ref.weight.grad, rtol=0, atol=1e-6)
