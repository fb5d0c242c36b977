"""embcache.nn with TorchRec: KeyedJaggedTensor input, KeyedTensor output, EmbeddingBagConfig, DLRM.

The duck-typed path (a minimal KJT-like class) runs everywhere; the tests on torchrec itself
skip when torchrec is not installed (it is an optional extra: see README, "torch modules").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from embcache import ConfigError, InvalidKeysError, TableConfig
from embcache.nn import CachedEmbeddingBagCollection, tables_from_torchrec


@dataclass
class MiniKJT:
    """The least of a KeyedJaggedTensor the collection reads: keys, values, lengths, weights."""

    _keys: list[str]
    _values: torch.Tensor
    _lengths: torch.Tensor
    _weights: torch.Tensor | None = None

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.cat([self._lengths.new_zeros(1), self._lengths.cumsum(0)])

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)


def test_kjt_like_input_equals_the_mapping_input(make_cache: Any) -> None:
    cache = make_cache(tables=[TableConfig("t", 4, optimizer="sgd", lr=1.0, seed=1),
                               TableConfig("u", 3, optimizer="sgd", lr=1.0, seed=2)])
    features, modes = {"a": "t", "b": "t", "c": "u"}, {"a": "sum", "b": "mean", "c": "sum"}
    ebc = CachedEmbeddingBagCollection(cache, features, mode=modes)
    # B = 3 bags per feature, key-major as torchrec lays them out; "x" is an extra feature (ignored)
    lengths = {"a": [2, 0, 1], "x": [1, 1, 1], "b": [1, 3, 1], "c": [2, 2, 0]}
    values = {f: torch.randint(0, 20, (sum(v),)) for f, v in lengths.items()}
    weights = {f: torch.rand(sum(v)) for f, v in lengths.items()}
    flat_lengths = torch.tensor([n for v in lengths.values() for n in v])
    kjt = MiniKJT(list(lengths), torch.cat(list(values.values())), flat_lengths, torch.cat(list(weights.values())))
    dict_batch = {"a": (values["a"], offsets_of(lengths["a"]), weights["a"]),
                  "c": (values["c"], offsets_of(lengths["c"]), weights["c"])}
    with pytest.raises(NotImplementedError):  # weights reach the mean feature "b", which refuses them as torch does
        ebc(kjt)
    unweighted = MiniKJT(kjt._keys, kjt._values, kjt._lengths, None)
    ref = CachedEmbeddingBagCollection(cache, features, mode=modes)
    with torch.no_grad():
        got = ebc(unweighted)
        want = ref({"a": (values["a"], offsets_of(lengths["a"])), "b": (values["b"], offsets_of(lengths["b"])),
                    "c": (values["c"], offsets_of(lengths["c"]))})
    assert list(_as_dict(got)) == ["a", "b", "c"]
    for f in want:
        assert torch.equal(_as_dict(got)[f], want[f]), f
    # weights flow through (sum features) and the backward updates the table like the dict path
    ebc2 = CachedEmbeddingBagCollection(cache, {"a": "t", "c": "u"})
    kjt2 = MiniKJT(["a", "c"], torch.cat([values["a"], values["c"]]), torch.tensor(lengths["a"] + lengths["c"]),
                   torch.cat([weights["a"], weights["c"]]))
    before = cache.lookup("t", torch.arange(20)).clone()
    out = _as_dict(ebc2(kjt2))
    with torch.no_grad():
        want2 = ebc2({"a": dict_batch["a"], "c": dict_batch["c"]})
    assert torch.equal(out["a"], want2["a"]) and torch.equal(out["c"], want2["c"])
    out["a"].sum().backward()
    grad = torch.zeros(20, 4)
    grad.index_add_(0, values["a"], weights["a"].unsqueeze(1).expand(-1, 4))
    torch.testing.assert_close(cache.lookup("t", torch.arange(20)), before - grad)  # SGD, lr 1


def _as_dict(out: Any) -> dict[str, torch.Tensor]:
    return out if isinstance(out, dict) else out.to_dict()


def test_bad_kjt_like_input_raises_before_touching_the_cache(make_cache: Any) -> None:
    cache = make_cache(tables=[TableConfig("t", 4)])
    ebc = CachedEmbeddingBagCollection(cache, ["t"])
    with pytest.raises(InvalidKeysError, match="lacks features"):
        ebc(MiniKJT(["x"], torch.tensor([1]), torch.tensor([1])))
    with pytest.raises(InvalidKeysError, match="lengths sum"):
        ebc(MiniKJT(["t"], torch.tensor([1, 2]), torch.tensor([1])))
    with pytest.raises(InvalidKeysError, match="do not split"):
        ebc(MiniKJT(["t", "x"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1])))
    with pytest.raises(InvalidKeysError):
        ebc(MiniKJT(["t"], torch.tensor([1.0]), torch.tensor([1])))
    assert cache.stats()["t"]["lookups"] == 0


@dataclass
class FakeConfig:
    name: str
    embedding_dim: int
    feature_names: list[str]
    pooling: Any = "SUM"
    num_embeddings: int = 10


def test_from_torchrec_configs(make_cache: Any) -> None:
    configs = [FakeConfig("t", 4, ["a", "b"]), FakeConfig("u", 3, ["c"], pooling="MEAN")]
    cache = make_cache(tables=tables_from_torchrec(configs, optimizer="adagrad", lr=0.1))
    assert [(t.name, t.dim, t.optimizer) for t in cache.tables().values()] == [("t", 4, "adagrad"), ("u", 3, "adagrad")]
    ebc = CachedEmbeddingBagCollection.from_torchrec(cache, configs)
    assert ebc.features == {"a": "t", "b": "t", "c": "u"} and ebc.modes == {"a": "sum", "b": "sum", "c": "mean"}
    assert ebc.embedding_bag_configs() == configs
    # num_embeddings is no bound: key 10**12 is a row like any other
    out = ebc(MiniKJT(["a", "b", "c"], torch.tensor([10**12, 1, 2, 3]), torch.tensor([1, 1, 2])))
    assert _as_dict(out)["c"].shape == (1, 3)
    plain = CachedEmbeddingBagCollection(cache, {"a": "t", "c": "u"}, mode={"a": "sum", "c": "mean"})
    assert [(c.name, c.embedding_dim, c.feature_names, c.pooling) for c in plain.embedding_bag_configs()] == [
        ("t", 4, ["a"], "SUM"), ("u", 3, ["c"], "MEAN")]
    with pytest.raises(ConfigError, match="dim"):
        CachedEmbeddingBagCollection.from_torchrec(cache, [FakeConfig("t", 5, ["a"])])
    with pytest.raises(ConfigError, match="pooling"):
        CachedEmbeddingBagCollection.from_torchrec(cache, [FakeConfig("t", 4, ["a"], pooling="NONE")])
    with pytest.raises(ConfigError, match="appears in tables"):
        CachedEmbeddingBagCollection.from_torchrec(cache, [FakeConfig("t", 4, ["a"]), FakeConfig("u", 3, ["a"])])
    with pytest.raises(ConfigError, match="mode per feature"):
        CachedEmbeddingBagCollection(cache, {"a": "t"}, mode={"b": "sum"})


# ---------------------------------------------------------------------- torchrec itself (optional)
def assign_rows(cache: Any, table: str, weight: torch.Tensor) -> None:
    """Make keys 0..n-1 of an SGD table hold ``weight``'s rows (its records are the float32 weights)."""
    records = weight.detach().to(torch.float32).contiguous().numpy().view(np.uint8)
    cache.import_rows(table, torch.arange(weight.shape[0]), records)


def test_torchrec_kjt_gives_a_keyed_tensor(make_cache: Any) -> None:
    torchrec = pytest.importorskip("torchrec")
    cache = make_cache(tables=[TableConfig("t", 4), TableConfig("u", 3)])
    ebc = CachedEmbeddingBagCollection(cache, {"a": "t", "c": "u"})
    kjt = torchrec.KeyedJaggedTensor(keys=["a", "c"], values=torch.tensor([1, 2, 3, 4, 5]),
                                     lengths=torch.tensor([2, 0, 1, 2], dtype=torch.int32))
    out = ebc(kjt)
    assert isinstance(out, torchrec.KeyedTensor) and out.keys() == ["a", "c"] and out.values().shape == (2, 7)
    mini = ebc(MiniKJT(["a", "c"], kjt.values(), kjt.lengths()))
    assert isinstance(mini, torchrec.KeyedTensor)  # with torchrec installed, KJT-like input gives a KeyedTensor too
    assert torch.equal(mini.values(), out.values())
    assert isinstance(ebc({"a": (kjt.values()[:2], torch.tensor([0, 2])), "c": torch.tensor([[3], [4]])}), dict)


def test_torchrec_dlrm_with_the_cached_collection_trains_like_torchrec(make_cache: Any) -> None:
    torchrec = pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM

    configs = [torchrec.EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=60, feature_names=["f0", "f1"]),
               torchrec.EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f2"])]
    torch.manual_seed(0)
    ref = DLRM(embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=configs),
               dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    cached = copy.deepcopy(ref)
    # tiers of a few rows: rows go to disk and come back between steps
    cache = make_cache(hbm_rows=8, ddr_rows=16, tables=tables_from_torchrec(configs, optimizer="sgd", lr=0.1))
    for name, bag in ref.sparse_arch.embedding_bag_collection.embedding_bags.items():
        assign_rows(cache, name, bag.weight)
    cached.sparse_arch.embedding_bag_collection = CachedEmbeddingBagCollection.from_torchrec(cache, configs)
    assert not any("embedding_bags" in n for n, _ in cached.named_parameters())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)  # the torchrec tables' rows too
    opt = torch.optim.SGD(cached.parameters(), lr=0.1)  # the dense part: the cache steps the rows
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        lengths = torch.randint(0, 4, (3 * 16,), generator=gen)
        sizes = lengths.view(3, 16).sum(1).tolist()
        values = torch.cat([torch.randint(0, n, (s,), generator=gen) for n, s in zip([60, 60, 40], sizes, strict=True)])
        kjt = torchrec.KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)
        dense, labels = torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen).float()
        losses = []
        for model, o in ((ref, opt_ref), (cached, opt)):
            o.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), labels)
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7), step
    for name, bag in ref.sparse_arch.embedding_bag_collection.embedding_bags.items():
        n = bag.weight.shape[0]
        torch.testing.assert_close(cache.lookup(name, torch.arange(n)), bag.weight.detach(), rtol=1e-5, atol=1e-6)


def test_torchrec_dlrm_with_the_cached_collection_compiles(tmp_path: Any) -> None:
    """torch.compile of torchrec's DLRM holding the cached collection: KJT in, KeyedTensor out across
    the graph break; the same losses (bitwise here) and rows as eager. One store: compiling is slow."""
    torchrec = pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM

    from embcache import CacheConfig, EmbeddingCache

    configs = [torchrec.EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=60, feature_names=["f0", "f1"]),
               torchrec.EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f2"])]
    torch.manual_seed(0)
    ref = DLRM(embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=configs),
               dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    caches, models = [], []
    for name in ("eager", "compiled"):
        cache = EmbeddingCache(CacheConfig(hbm_bytes=1 << 20, ddr_bytes=1 << 20, path=str(tmp_path / name)),
                               tables_from_torchrec(configs, optimizer="adagrad", lr=0.1, seed=5))
        model = copy.deepcopy(ref)
        model.sparse_arch.embedding_bag_collection = CachedEmbeddingBagCollection.from_torchrec(cache, configs)
        caches.append(cache)
        models.append(model)
    try:
        runs = [(models[0], torch.optim.SGD(models[0].parameters(), lr=0.1)),
                (torch.compile(models[1]), torch.optim.SGD(models[1].parameters(), lr=0.1))]
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            lengths = torch.randint(0, 4, (3 * 16,), generator=gen)
            sizes = lengths.view(3, 16).sum(1).tolist()
            values = torch.cat([torch.randint(0, n, (s,), generator=gen)
                                for n, s in zip([60, 60, 40], sizes, strict=True)])
            kjt = torchrec.KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)
            dense, labels = torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen).float()
            losses = []
            for model, opt in runs:
                opt.zero_grad()
                loss = nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1), labels)
                loss.backward()
                opt.step()
                losses.append(loss)
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7, msg=f"step {step}")
        for table, n in (("t0", 60), ("t1", 40)):
            torch.testing.assert_close(caches[1].lookup(table, torch.arange(n)),
                                       caches[0].lookup(table, torch.arange(n)), rtol=1e-6, atol=1e-7)
    finally:
        for cache in caches:
            cache.close()
