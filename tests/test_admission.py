"""Admission of new keys (TableConfig.admit_after): a key gets a trained, stored row only once it
has been looked up that many times; before, lookups return the initializer's row (or zeros) and
its gradients are dropped. Differential against a cache without admission that is only given the
updates of admitted keys, with exact counts kept by the test."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.errors import ConfigError
from embcache.metrics import register_metrics
from embcache.rpc.codec import table_from_proto, table_to_proto

N = 3


def _table(admit_after: int, unadmitted: str = "init") -> TableConfig:
    return TableConfig(name="t", dim=8, optimizer="adagrad", lr=0.1, seed=3, admit_after=admit_after,
                       unadmitted=unadmitted)


@pytest.mark.parametrize("unadmitted", ["init", "zeros"])
def test_admitted_keys_train_exactly_as_without_admission(make_cache: Any, tmp_path: Any, unadmitted: str) -> None:
    cache = make_cache(hbm_rows=6, ddr_rows=10, tables=[_table(N, unadmitted)])  # small: rows leave memory
    ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=1 << 20, ddr_bytes=1 << 20, device="cpu"),
                         [_table(0)])
    gen = torch.Generator().manual_seed(7)
    seen: Counter[int] = Counter()
    admitted: set[int] = set()
    try:
        for step in range(60):
            keys = (torch.rand(24, generator=gen) ** 2 * 80).long()  # skewed: some keys admitted soon
            seen.update(keys.tolist())
            admitted |= {k for k, c in seen.items() if c >= N}
            got, want = cache.lookup("t", keys), ref.lookup("t", keys)
            out = torch.tensor([k not in admitted for k in keys.tolist()])
            if unadmitted == "zeros":
                want[out] = 0
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
            grads = torch.randn(24, 8, generator=gen)
            cache.apply_gradients("t", keys, grads)
            ref.apply_gradients("t", keys[~out], grads[~out])  # the reference gets the admitted keys' only
        everything = torch.arange(80)
        seen.update(range(80))  # this lookup counts too
        admitted |= {k for k, c in seen.items() if c >= N}
        final_out = torch.tensor([k not in admitted for k in range(80)])
        want = ref.lookup("t", everything)
        if unadmitted == "zeros":
            want[final_out] = 0
        torch.testing.assert_close(cache.lookup("t", everything), want, rtol=0, atol=0)
        s = cache.stats()["t"]
        assert s["admission"]["admitted_rows"] == len(admitted) > 0
        assert s["admission"]["unadmitted_lookups"] > 0 and s["admission"]["dropped_updates"] > 0
        assert s["ssd"]["created_rows"] == len(admitted)  # rows exist for admitted keys only
        resident = set(cache.resident_keys("t", "hbm").tolist()) | set(cache.resident_keys("t", "ddr").tolist())
        assert resident <= admitted
        cache.flush()
        stored, _ = cache._store.get_many("t", np.arange(80, dtype=np.int64))  # type: ignore[union-attr]
        assert {int(k) for k in np.nonzero(stored)[0]} <= admitted  # nothing stored for keys not admitted
    finally:
        ref.close()


def test_counts_survive_reopen_and_passes_do_not_admit(make_cache: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "adm")
    cache = make_cache(hbm_rows=8, ddr_rows=8, tables=[_table(N)], path=path)
    k = torch.tensor([5, 6])
    for _ in range(N - 1):
        cache.lookup("t", k)
    # a pass's keyset alone admits nothing: its keys are not placed or pinned until admitted
    report = cache.begin_pass({"t": torch.tensor([5, 6, 7])})
    assert report["t"]["pinned_rows"] == 0
    cache.end_pass().result(timeout=30)
    cache.close()
    again = make_cache(hbm_rows=8, ddr_rows=8, tables=[_table(N)], path=path)
    again.lookup("t", k)  # the third lookup, after a restart: admitted now
    again.apply_gradients("t", k, torch.ones(2, 8))
    s = again.stats()["t"]["admission"]
    assert s["admitted_rows"] == 2 and s["dropped_updates"] == 0
    report = again.begin_pass({"t": torch.tensor([5, 6, 7])})
    assert report["t"]["pinned_rows"] == 2  # 5 and 6 are admitted; 7 is not
    again.end_pass().result(timeout=30)


def test_assign_and_stored_rows_count_as_admitted(make_cache: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "adm2")
    cache = make_cache(hbm_rows=2, ddr_rows=2, tables=[_table(0)], path=path)
    cache.apply_gradients("t", torch.arange(10), torch.ones(10, 8))  # rows stored before admission
    before = cache.lookup("t", torch.arange(10)).clone()
    cache.close()
    cache = make_cache(hbm_rows=2, ddr_rows=2, tables=[_table(N)], path=path)  # admission turned on
    torch.testing.assert_close(cache.lookup("t", torch.arange(10)), before, rtol=0, atol=0)
    cache.apply_gradients("t", torch.arange(10), torch.ones(10, 8))
    assert cache.stats()["t"]["admission"]["dropped_updates"] == 0
    rows = torch.randn(3, 8)
    cache.assign("t", torch.tensor([100, 101, 102]), rows)  # an explicit write admits its keys
    cache.lookup("t", torch.arange(20, 40))  # push them out of memory
    torch.testing.assert_close(cache.lookup("t", torch.tensor([100, 101, 102])), rows, rtol=0, atol=0)


def test_admission_is_in_the_metrics_config_and_wire(make_cache: Any) -> None:
    cache = make_cache(tables=[_table(N)])
    cache.lookup("t", torch.tensor([1, 1, 2]))
    cache.apply_gradients("t", torch.tensor([1, 2]), torch.ones(2, 8))
    registry = CollectorRegistry()
    register_metrics(cache, registry)
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    t = (("table", "t"),)
    assert m[("embcache_admission_unadmitted_lookups_total", t)] == 3
    assert m[("embcache_admission_dropped_updates_total", t)] == 2
    assert m[("embcache_admission_admitted_rows_total", t)] == 0
    assert table_from_proto(table_to_proto(_table(N, "zeros"))) == _table(N, "zeros")
    with pytest.raises(ConfigError, match="admit_after"):
        _table(-1)
    with pytest.raises(ConfigError, match="unadmitted"):
        _table(2, "random")


def test_stored_rows_are_not_read_twice_by_the_update_after_a_lookup(make_cache: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "adm3")
    cache = make_cache(hbm_rows=0, ddr_rows=0, tables=[_table(0)], path=path)  # nothing cached
    cache.apply_gradients("t", torch.arange(50), torch.ones(50, 8))  # stored before admission
    cache.close()
    cache = make_cache(hbm_rows=0, ddr_rows=0, tables=[_table(N)], path=path)
    for _ in range(2):
        reads = cache.stats()["t"]["ssd"]["reads"]
        cache.lookup("t", torch.arange(50))
        cache.apply_gradients("t", torch.arange(50), torch.ones(50, 8))  # the lookup's rows, kept aside
        assert cache.stats()["t"]["ssd"]["reads"] == reads + 1  # the lookup's read only
    assert cache.stats()["t"]["admission"]["dropped_updates"] == 0
