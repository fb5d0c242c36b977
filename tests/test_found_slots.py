"""An update reuses the slots its lookup found (embcache/engine/found.py), and only while nothing moved.

Each test runs two caches through the same calls: one updates with the very keys tensor it looked
up (the slots may be reused), the other with a copy (a new object: always probed). Their rows must
stay bitwise equal, and the counter of reuses says which path ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from embcache import EmbeddingCache, TableConfig
from embcache.errors import NonFiniteGradientError
from embcache.nn import CachedEmbedding

DIM = 8


def _reused(cache: EmbeddingCache, table: str = "t") -> int:
    return cache._tables[table].found.reused


def _placement(cache: EmbeddingCache, table: str = "t") -> int:
    return cache._tables[table].hbm.placement


def _pair(make_cache: Any, tmp_path: Any, device: str, **kw: Any) -> tuple[EmbeddingCache, EmbeddingCache]:
    kw.setdefault("hbm_rows", 32)
    kw.setdefault("ddr_rows", 16)
    return (make_cache(path=str(tmp_path / "same"), device=device, **kw),
            make_cache(path=str(tmp_path / "copy"), device=device, **kw))


def _rows(cache: EmbeddingCache, n: int = 48) -> torch.Tensor:
    with torch.no_grad():
        return cache.lookup("t", torch.arange(n)).cpu()


def test_update_after_lookup_reuses_its_slots_and_equals_a_probed_update(device: str, make_cache: Any,
                                                                          tmp_path: Any) -> None:
    same, copy = _pair(make_cache, tmp_path, device)
    gen = torch.Generator().manual_seed(0)
    for cache in (same, copy):
        cache.lookup("t", torch.arange(20))  # all resident in HBM from here on
    for step in range(6):
        keys = torch.randint(0, 20, (30,), generator=gen)  # duplicates: summed either way
        grads = torch.randn(30, DIM, generator=gen)
        for cache, k in ((same, keys), (copy, keys.clone())):
            cache.lookup("t", keys)
            if step % 2:
                cache.apply_gradients("t", k, grads)
            else:
                cache.apply_gradients_many({"t": (k, grads)})
        assert _reused(same) == step + 1 and _reused(copy) == 0
        assert torch.equal(_rows(same, 20), _rows(copy, 20))


def test_a_lookup_with_misses_or_of_other_keys_is_not_reused(device: str, make_cache: Any, tmp_path: Any) -> None:
    cache = make_cache(hbm_rows=32, ddr_rows=16, device=device, path=str(tmp_path / "c"))
    keys = torch.arange(10)
    cache.lookup("t", keys)  # misses: placed now, but nothing remembered
    cache.apply_gradients("t", keys, torch.ones(10, DIM))
    assert _reused(cache) == 0
    cache.lookup("t", keys)
    cache.lookup("t", torch.arange(5))  # the last lookup is the one remembered
    cache.apply_gradients("t", keys, torch.ones(10, DIM))
    assert _reused(cache) == 0
    with torch.inference_mode():  # no version counter: never remembered
        inf_keys = torch.arange(10)
    cache.lookup("t", inf_keys)
    cache.apply_gradients("t", inf_keys, torch.ones(10, DIM))
    cache.lookup("t", keys.numpy())  # numpy arrays can change unseen: never remembered
    cache.apply_gradients("t", keys.numpy(), torch.ones(10, DIM))
    assert _reused(cache) == 0


# Each change between a lookup and the update of the same keys tensor: the placement of HBM rows
# (insert, remove, clear, a resize), or the keys tensor itself.
def _delete_one(c: EmbeddingCache, keys: torch.Tensor) -> None:
    c.delete("t", keys[:1].clone())


def _delete_other(c: EmbeddingCache, keys: torch.Tensor) -> None:
    c.delete("t", torch.tensor([40]))


def _place_new(c: EmbeddingCache, keys: torch.Tensor) -> None:
    c.assign("t", torch.tensor([41, 42]), torch.ones(2, DIM))


def _resize(c: EmbeddingCache, keys: torch.Tensor) -> None:
    c.create_table(TableConfig(name="u", dim=DIM, optimizer="adagrad", lr=0.1, seed=3))


def _mutate_keys(c: EmbeddingCache, keys: torch.Tensor) -> None:
    keys[0] = 40  # resident too: same length, same data pointer, a new version


def _mutate_view(c: EmbeddingCache, keys: torch.Tensor) -> None:
    keys[2:4].fill_(41)  # through a view: the version counter is shared


def _resize_keys(c: EmbeddingCache, keys: torch.Tensor) -> None:
    keys.resize_(4)


CHANGES: list[Callable[[EmbeddingCache, torch.Tensor], None]] = [
    _delete_one, _delete_other, _place_new, _resize, _mutate_keys, _mutate_view, _resize_keys]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
def test_every_change_between_lookup_and_update_falls_back_to_a_probe(device: str, make_cache: Any,
                                                                       tmp_path: Any, change: Any) -> None:
    same, copy = _pair(make_cache, tmp_path, device, hbm_rows=64)
    for cache in (same, copy):
        cache.lookup("t", torch.arange(41))  # all in HBM, 23 slots free
    for cache in (same, copy):
        keys = torch.arange(12)
        cache.lookup("t", keys)
        tier, before = cache._tables["t"].hbm, _placement(cache)
        change(cache, keys)
        if change not in (_mutate_keys, _mutate_view, _resize_keys):  # HBM's placement changed
            assert cache._tables["t"].hbm is not tier or _placement(cache) != before
        k = keys if cache is same else keys.clone()
        cache.apply_gradients("t", k, torch.full((k.numel(), DIM), 0.5))
    assert _reused(same) == 0 and _reused(copy) == 0
    assert torch.equal(_rows(same), _rows(copy))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["lookup", "update", "delete", "assign", "mutate"]),
                              st.integers(0, 2**31 - 1)), min_size=4, max_size=14))
def test_random_calls_give_the_rows_of_probed_updates(make_cache: Any, tmp_path_factory: Any,
                                                      ops: list[tuple[str, int]]) -> None:
    # A lookup's keys kept and reused by later updates, with deletes, new rows (some evicting:
    # 8 HBM rows for 48 keys) and in-place writes to the keys between them.
    base = tmp_path_factory.mktemp("h")
    same = make_cache(hbm_rows=8, ddr_rows=8, path=str(base / "same"))
    copy = make_cache(hbm_rows=8, ddr_rows=8, path=str(base / "copy"))
    keys = {c: torch.arange(6) for c in (same, copy)}
    for op, seed in ops:
        rng = np.random.default_rng(seed)
        new = torch.from_numpy(rng.integers(0, 48, 6))
        grads = torch.from_numpy(rng.standard_normal((6, DIM)).astype(np.float32))
        at = int(rng.integers(0, 6))
        for c in (same, copy):
            if op == "lookup":
                keys[c] = new.clone()
                c.lookup("t", keys[c])
            elif op == "update":
                c.apply_gradients("t", keys[c] if c is same else keys[c].clone(), grads)
            elif op == "delete":
                c.delete("t", new[:2].unique())
            elif op == "assign":
                c.assign("t", new, grads)
            else:
                keys[c][at] = int(new[0])
    assert _reused(copy) == 0
    assert torch.equal(_rows(same), _rows(copy))


def test_a_cached_embedding_hands_its_lookup_keys_to_its_update(make_cache: Any) -> None:
    cache = make_cache(hbm_rows=32, ddr_rows=16)
    emb = CachedEmbedding(cache, "t")
    input = torch.tensor([[1, 2, 3], [3, 4, 1]])
    emb(input).sum().backward()  # misses on the first pass: probed
    reused = _reused(cache)
    emb(input).sum().backward()
    assert _reused(cache) == reused + 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradients_change_nothing_on_the_reused_fused_path(make_cache: Any, bad: float) -> None:
    # on the CPU the fused kernel checks the gradients in its first pass, before any row is written
    cache = make_cache(hbm_rows=32, ddr_rows=16)
    keys = torch.arange(20)
    cache.lookup("t", keys)
    before = _rows(cache, 20)
    flags = cache._tables["t"].hbm.flags.clone()
    grads = torch.ones(20, DIM)
    grads[19, DIM - 1] = bad
    cache.lookup("t", keys)
    with pytest.raises(NonFiniteGradientError):
        cache.apply_gradients("t", keys, grads)
    assert _reused(cache) == 1
    assert torch.equal(_rows(cache, 20), before) and torch.equal(cache._tables["t"].hbm.flags, flags)
    grads[19, DIM - 1] = 1.0
    cache.apply_gradients("t", keys, grads)  # the same call with finite gradients goes through
    assert not torch.equal(_rows(cache, 20), before)
