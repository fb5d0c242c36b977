"""The fused Triton probe (embcache/index/triton_probe.py) gives what TorchIndex's torch ops give, bit for bit.

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported); on a machine with one it runs compiled on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

triton_probe = pytest.importorskip("embcache.index.triton_probe")

from embcache import CacheConfig, EmbeddingCache, TableConfig  # noqa: E402
from embcache.index import TorchIndex, mix64  # noqa: E402
from embcache.optim import state_width  # noqa: E402

from .realcuda import REAL_CUDA  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if REAL_CUDA else [])


@pytest.fixture(params=DEVICES)
def dev(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """Where the kernel runs: the CPU under the interpreter, a real GPU compiled."""
    d = torch.device(request.param, 0) if request.param == "cuda" else torch.device("cpu")
    if d.type == "cpu" and not triton_probe.interpreted():
        pytest.skip("triton compiles here (TRITON_INTERPRET unset): the kernel cannot run on CPU tensors")
    yield d


def pair(capacity: int, device: torch.device) -> tuple[TorchIndex, TorchIndex]:
    """A fused index and one in torch ops, to be given the same operations."""
    fused, plain = TorchIndex(capacity, device, fused=True), TorchIndex(capacity, device, fused=False)
    assert fused.fused and not plain.fused
    return fused, plain


def both(a: TorchIndex, b: TorchIndex, op: str, *args: Any) -> None:
    getattr(a, op)(*args)
    getattr(b, op)(*args)


def distinct_keys(n: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.unique(torch.randint(-(1 << 62), 1 << 62, (n + n // 10 + 8,), generator=g))
    return k[torch.randperm(k.numel(), generator=g)][:n].to(device)


def test_find_matches_the_torch_ops_under_churn(dev: torch.device) -> None:
    fused, plain = pair(3000, dev)
    keys = distinct_keys(5000, 1, dev)
    both(fused, plain, "insert", keys[:2800], torch.arange(2800, device=dev))
    both(fused, plain, "erase", keys[:900])
    both(fused, plain, "insert", keys[2800:3700], torch.arange(2800, 3700, device=dev))
    # present, erased, never inserted, duplicates; a batch that is not a multiple of the block
    q = torch.cat((keys[:1500], keys[4000:4300], keys[1000:1100], keys[1000:1100], keys[:1]))
    assert q.numel() % triton_probe.BLOCK != 0
    got, want = fused.find(q), plain.find(q)
    assert torch.equal(got, want)
    assert int((want >= 0).sum()) == 600 + 2 * 100  # keys[900:1500] and both copies of keys[1000:1100]
    assert torch.equal(fused.find(q[:1]), plain.find(q[:1]))


def crowded_keys(index: TorchIndex, want: int, seed: int) -> torch.Tensor:
    """``want`` distinct keys whose two buckets are both among buckets 2 and 3: more than the 16
    entries there, so the rest go to the stash."""
    g = torch.Generator().manual_seed(seed)
    found = []
    while sum(int(f.numel()) for f in found) < want:
        k = torch.randint(-(1 << 62), 1 << 62, (1 << 21,), generator=g)
        h = mix64(k)
        b1, b2 = index._bucket(h, False), index._bucket(h, True)
        found.append(k[((b1 == 2) | (b1 == 3)) & ((b2 == 2) | (b2 == 3))])
    return torch.unique(torch.cat(found))[:want]


def test_stashed_keys_are_found(dev: torch.device) -> None:
    fused, plain = pair(200, dev)  # 46 buckets: about one key in 500 has both buckets among two given ones
    crowd = crowded_keys(fused, 30, 7).to(dev)
    others = distinct_keys(100, 8, dev)
    keys = torch.cat((crowd, others))
    both(fused, plain, "insert", keys, torch.arange(keys.numel(), device=dev))
    assert fused.n_stashed == plain.n_stashed >= 30 - 16
    q = torch.cat((keys, distinct_keys(300, 9, dev)))  # and keys never inserted, probing the stash too
    got = fused.find(q)
    assert torch.equal(got, plain.find(q))
    assert torch.equal(got[:keys.numel()], torch.arange(keys.numel(), device=dev))  # every stashed key found
    both(fused, plain, "erase", crowd[:10])
    assert torch.equal(fused.find(q), plain.find(q))


def records(freq: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``freq`` (float32) and ``last`` (int64) as a tier keeps them: strided views of
    24-byte row records (key, last, then freq and flags)."""
    meta = torch.zeros(freq.numel(), 3, dtype=torch.int64, device=freq.device)
    f, la = meta.view(torch.float32)[:, 4], meta[:, 1]
    f.copy_(freq)
    la.copy_(last)
    return f, la


@pytest.mark.parametrize("once", [False, True])  # once: a row counts one access per tick
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 5, 64, 130])
def test_touch_and_gather_match_the_torch_ops_bitwise(dev: torch.device, dtype: torch.dtype, dim: int,
                                                      once: bool) -> None:
    fused, plain = pair(500, dev)
    keys = distinct_keys(450, 3, dev)
    both(fused, plain, "insert", keys[:400], torch.arange(400, device=dev))
    g = torch.Generator().manual_seed(dim)
    rows = torch.randn(500, dim, generator=g).to(dtype).to(dev)
    freq = torch.rand(500, generator=g).to(dev) * 1e6
    last = torch.randint(70, 78, (500,), generator=g).to(dev)  # some rows already touched at ``now`` (77)
    # duplicates (each occurrence counts), misses, a repeated hot key
    q = torch.cat((keys[:300], keys[380:450], keys[:50], keys[7:8].repeat(40)))
    inc, now = 1.2345678912345678e10, 77  # more mantissa bits than a float32 holds
    outs, states, counts = [], [], []
    for index in (fused, plain):
        out = torch.full((q.numel(), dim), -7.0, device=dev)  # misses' rows must stay as they were
        f, la = records(freq, last)
        slots, hits = index.find_touch_gather(q, f, la, inc, now, rows, out, once=once)
        outs.append(out)
        states.append((slots, f, la))
        counts.append(hits)
    assert counts[0] == counts[1] == 300 + 20 + 50 + 40
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][300:370][20:], torch.full((50, dim), -7.0, device=dev))
    for a, b in zip(states[0], states[1], strict=True):
        assert torch.equal(a, b)
    f, la = records(freq, last)
    slots, hits = fused.find_touch(q, f, la, inc, now, once=once)  # without the gather
    assert hits == counts[1] and torch.equal(slots, states[1][0])
    assert torch.equal(f, states[1][1]) and torch.equal(la, states[1][2])


def test_an_empty_index_finds_nothing(dev: torch.device) -> None:
    fused, _ = pair(100, dev)
    q = distinct_keys(70, 4, dev)
    out = torch.zeros(70, 3, device=dev)
    freq, last = records(torch.zeros(100, device=dev), torch.zeros(100, dtype=torch.int64, device=dev))
    slots, hits = fused.find_touch_gather(q, freq, last, 1.0, 5, torch.ones(100, 3, device=dev), out)
    assert hits == 0 and bool((slots == -1).all()) and not bool(out.any()) and not bool(freq.any())


def test_the_default_is_fused_on_a_gpu_only() -> None:
    assert not TorchIndex(10, "cpu").fused
    if REAL_CUDA:
        assert TorchIndex(10, "cuda").fused
    if not triton_probe.interpreted():  # compiled: CPU tensors cannot reach the kernel
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            TorchIndex(10, "cpu", fused=True)


def test_a_kernel_error_on_the_cpu_is_raised_not_hidden(dev: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    fused, _ = pair(10, dev)
    fused.insert(torch.tensor([5], device=dev), torch.tensor([0], device=dev))

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(triton_probe, "probe", broken)
    if dev.type == "cpu":
        with pytest.raises(RuntimeError, match="kernel bug"):
            fused.find(torch.arange(3, device=dev))
    else:  # on a GPU a kernel that cannot be built falls back to the torch ops, once, with a warning
        with pytest.warns(RuntimeWarning, match="fused Triton probe failed"):
            assert torch.equal(fused.find(torch.arange(3, device=dev)), torch.full((3,), -1, device=dev))
        assert not fused.fused


def test_a_cache_reads_and_trains_the_same_through_the_fused_probe(dev: torch.device, tmp_path: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups and row-wise AdaGrad updates through an HBM tier indexed by the fused probe give the
    rows a cache with the torch-op index gives, bit for bit, hits, misses and evictions included."""
    import embcache.tier as tier

    def run(fused: bool, path: str) -> list[torch.Tensor]:
        def make_index(cap: int, device: torch.device | str,  # the DDR tier's too, where it can
                       slot_keys: torch.Tensor | None = None) -> TorchIndex:
            on_cpu = torch.device(device).type == "cpu"
            return TorchIndex(cap, device, fused=fused and (not on_cpu or triton_probe.interpreted()))

        monkeypatch.setattr(tier, "make_index", make_index)
        table = TableConfig(name="t", dim=16, optimizer="rowwise_adagrad", lr=0.05, seed=1)
        width = state_width("rowwise_adagrad", 16)
        cfg = CacheConfig(hbm_bytes=600 * tier.resident_row_bytes(16, torch.float32, width, dev),
                          ddr_bytes=1200 * tier.resident_row_bytes(16, torch.float32, width, "cpu"), path=path,
                          device=str(dev))
        seen = []
        g = torch.Generator().manual_seed(5)
        with EmbeddingCache(cfg, [table]) as cache:
            assert isinstance(cache._tables["t"].hbm.index, TorchIndex)
            assert cache._tables["t"].hbm.index.fused == fused
            for _ in range(12):
                keys = (torch.randint(0, 3000, (500,), generator=g) ** 2 // 3000).to(dev)  # skewed: hits and misses
                seen.append(cache.lookup("t", keys).cpu())
                cache.apply_gradients("t", keys, torch.randn(500, 16, generator=g).to(dev))
            seen.append(cache.lookup("t", torch.arange(3000, device=dev)).cpu())
        return seen

    got, want = run(True, str(tmp_path / "fused")), run(False, str(tmp_path / "plain"))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_triton_the_kernel_does_not_fit_leaves_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without triton, or with one whose API the kernel's module cannot use (an old release, say),
    the cache must still work on a GPU: the index uses its torch ops (warning in the second case)."""
    from embcache.index import torch_index

    def fails(exc: Exception) -> Any:
        def import_module(name: str) -> Any:
            raise exc
        return import_module

    monkeypatch.setattr(torch_index, "_PROBE", [])
    monkeypatch.setattr(torch_index.importlib, "import_module", fails(ImportError("No module named 'triton'")))
    assert torch_index._triton_probe() is None
    monkeypatch.setattr(torch_index, "_PROBE", [])
    monkeypatch.setattr(torch_index.importlib, "import_module",
                        fails(TypeError("jit() got an unexpected keyword argument 'do_not_specialize'")))
    with pytest.warns(RuntimeWarning, match="fused Triton probe is unavailable"):
        assert torch_index._triton_probe() is None
    assert torch_index._triton_probe() is None  # decided once
    with pytest.raises(ValueError, match="needs triton"):
        TorchIndex(10, "cpu", fused=True)
