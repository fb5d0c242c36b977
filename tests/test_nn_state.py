"""embcache.nn modules in state_dict()/load_state_dict(): a saved and resumed model keeps its embeddings.

Train, ``torch.save(model.state_dict())``, build a new model over a new cache (which already holds
other rows of its own), ``load_state_dict(torch.load(...))``: the rows (weights and optimizer
state) and the next step's loss are those of the original.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from embcache import TableConfig
from embcache.nn import STATE_KEY, CachedEmbedding, CachedEmbeddingBagCollection

TABLES = [TableConfig("t", 4, optimizer="adagrad", lr=0.1, seed=1),
          TableConfig("u", 3, optimizer="adam", lr=0.05, seed=2)]


class Model(nn.Module):
    def __init__(self, cache: Any, **persist: Any) -> None:
        super().__init__()
        self.ebc = CachedEmbeddingBagCollection(cache, {"a": "t", "b": "u"}, **persist)
        self.emb = CachedEmbedding(cache, "t", **persist)
        self.head = nn.Linear(4 + 3 + 4, 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        out = self.ebc({"a": a, "b": b})
        return self.head(torch.cat([out["a"], out["b"], self.emb(c)], dim=1)).square().mean()


def batch(seed: int, n_keys: int = 50) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, n_keys, (6, 2), generator=gen), torch.randint(0, n_keys, (6, 3), generator=gen),
            torch.randint(0, n_keys, (6,), generator=gen))


def train(model: Model, seeds: list[int], n_keys: int = 50) -> list[float]:
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    losses = []
    for seed in seeds:
        opt.zero_grad()
        loss = model(*batch(seed, n_keys))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def all_rows(cache: Any, n: int = 200) -> dict[str, torch.Tensor]:
    return {t.name: cache.lookup(t.name, torch.arange(n)).clone() for t in TABLES}


def records(cache: Any) -> dict[str, dict[int, bytes]]:
    """Every stored row, whole (weights and optimizer state), by key."""
    return {t.name: {int(k): r.tobytes() for ks, rs, _ in cache.export_rows(t.name, lambda x: x == x)
                     for k, r in zip(ks, rs, strict=True)} for t in TABLES}


@pytest.mark.parametrize("persist", ["rows", "checkpoint"])
def test_save_and_resume_keeps_rows_and_the_next_step(make_cache: Any, tmp_path: Any, persist: str) -> None:
    opts: dict[str, Any] = {"persist": persist}
    if persist == "checkpoint":
        opts["checkpoint_dir"] = tmp_path / "ckpt"
    cache = make_cache(hbm_rows=4, ddr_rows=8, tables=TABLES, path=str(tmp_path / "a"))
    torch.manual_seed(0)
    model = Model(cache, **opts)
    train(model, [1, 2, 3])
    torch.save(model.state_dict(), tmp_path / "model.pt")
    saved = records(cache)
    assert set(saved["t"]) and set(saved["u"])
    if persist == "checkpoint":
        assert len(os.listdir(tmp_path / "ckpt")) == 1  # the collection's checkpoint
    # a new cache that already went its own way: other rows, other optimizer state, keys the saved one lacks
    other = make_cache(hbm_rows=4, ddr_rows=8, tables=TABLES, path=str(tmp_path / "b"))
    resumed = Model(other, **opts)
    train(resumed, [7, 8], n_keys=120)
    assert records(other) != saved
    result = resumed.load_state_dict(torch.load(tmp_path / "model.pt"))  # weights_only: plain tensors and dicts
    assert not result.missing_keys and not result.unexpected_keys
    assert records(other) == saved  # the same stored rows, bit for bit: weights and optimizer state
    assert torch.equal(resumed.head.weight, model.head.weight)
    before = all_rows(cache)
    for t, rows in all_rows(other).items():  # keys never written come from the initializer alike
        assert torch.equal(rows, before[t]), t
    # the next step: same loss, same rows
    assert train(resumed, [4]) == train(model, [4])
    for t, rows in all_rows(other).items():
        assert torch.equal(rows, all_rows(cache)[t]), t


def test_state_dict_entries_and_persist_none(make_cache: Any, tmp_path: Any) -> None:
    cache = make_cache(tables=TABLES)
    model = Model(cache)
    assert sorted(model.state_dict()) == [f"ebc.{STATE_KEY}", f"emb.{STATE_KEY}", "head.bias", "head.weight"]
    plain = Model(cache, persist="none")  # the cache persists itself (flush/checkpoint): the old empty state
    assert sorted(plain.state_dict()) == ["head.bias", "head.weight"]
    plain.load_state_dict(model.state_dict())  # ignores the rows, as it saves none
    with pytest.raises(RuntimeError, match=f"Missing key.*ebc.{STATE_KEY}"):
        model.load_state_dict(plain.state_dict())  # an old state_dict without rows: strict says so
    assert model.load_state_dict(plain.state_dict(), strict=False).missing_keys == [f"ebc.{STATE_KEY}",
                                                                                   f"emb.{STATE_KEY}"]
    with pytest.raises(Exception, match="persist"):
        CachedEmbedding(cache, "t", persist="everything")
    with pytest.raises(Exception, match="checkpoint_dir"):
        CachedEmbedding(cache, "t", persist="checkpoint")


def test_table_too_large_for_the_state_dict_warns_and_is_left_out(make_cache: Any) -> None:
    cache = make_cache(tables=TABLES)
    model = Model(cache, max_state_bytes=64)
    train(model, [1])
    with pytest.warns(RuntimeWarning, match="max_state_bytes"):
        state = model.state_dict()
    assert state[f"ebc.{STATE_KEY}"]["persist"] == "omitted"
    with pytest.warns(RuntimeWarning, match="does not hold the rows"):
        model.load_state_dict(state)


def test_a_cache_without_export_warns_loudly(make_cache: Any) -> None:
    class Remote:  # what the modules see of an embcache.Client: no export_rows/import_rows
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.device = inner.device
            for m in ("lookup", "apply_gradients", "lookup_many", "apply_gradients_many", "tables"):
                setattr(self, m, getattr(inner, m))

    remote = Remote(make_cache(tables=TABLES))
    model = Model(remote)
    with pytest.warns(RuntimeWarning, match="does NOT hold the tables"):
        state = model.state_dict()
    with pytest.warns(RuntimeWarning, match="does not hold the rows"):
        model.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f"ebc.{STATE_KEY}" not in Model(remote, persist="none").state_dict()


def test_loading_into_a_table_of_another_layout_fails(make_cache: Any, tmp_path: Any) -> None:
    model = Model(make_cache(tables=TABLES, path=str(tmp_path / "a")))
    other = [TableConfig("t", 4, optimizer="sgd", seed=1), TABLES[1]]
    resumed = Model(make_cache(tables=other, path=str(tmp_path / "b")))
    with pytest.raises(RuntimeError, match="table 't' was saved with other optimizer"):
        resumed.load_state_dict(model.state_dict())
