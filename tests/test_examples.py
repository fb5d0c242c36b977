"""The DLRM example end to end at a tiny scale, and its synthetic data generator."""

from __future__ import annotations

import filecmp
import os
import tempfile
from typing import Any

import numpy as np
import pytest

from examples import dlrm
from examples.synthetic import N_DENSE, N_SPARSE, SyntheticConfig, SyntheticDataset, generate_dataset

TINY = ["--passes", "3", "--samples-per-pass", "6000", "--eval-samples", "6000", "--batch", "512", "--dim", "8",
        "--scale", "0.002", "--bottom-mlp", "32", "--top-mlp", "32", "--emb-lr", "0.1", "--lr", "0.005",
        "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One tiny data set shared by the runs (each run reuses it: same options, same data)."""
    return str(tmp_path_factory.mktemp("dlrm") / "data")


def run(mode: str, data: str, path: str) -> dict[str, Any]:
    return dlrm.run(dlrm.build_parser().parse_args([*TINY, "--mode", mode, "--data", data, "--path", path]))


def check_counts(summary: dict[str, Any]) -> None:
    for p in [*summary["passes"], summary["eval"]]:
        c = p["tier_counts"]
        assert c["lookups"] > 0
        assert c["hbm"] + c["ddr"] + c["ssd"] + c["created"] == c["lookups"]


def test_dlrm_cache_mode_end_to_end(data_dir: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    summary = dlrm.main([*TINY, "--mode", "cache", "--data", data_dir, "--path", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "held-out AUC" in out and "| pass |" in out  # the summary table was printed
    assert summary["last_pass_loss"] < summary["first_pass_loss"]
    assert summary["auc"] > 0.6
    check_counts(summary)
    # rows touched over the run exceed what memory holds, yet with prefetch and passes no
    # lookup waits on the store: every pass is staged before it begins
    assert summary["touched_over_memory"] > 1.1
    for p in summary["passes"]:
        assert p["tier_counts"]["ssd"] == 0 and p["tier_counts"]["created"] == 0
        assert p["prefetch_staged_rows"] > 0


def test_dlrm_torch_and_nopass_modes_train_the_same_model(data_dir: str, tmp_path: Any) -> None:
    cache = run("cache-noprefetch", data_dir, str(tmp_path / "a"))
    torch_run = run("torch", data_dir, str(tmp_path / "b"))
    nopass = run("cache-nopass", data_dir, str(tmp_path / "c"))
    # the same data and initial rows: tables in memory and in the cache give the same losses
    for a, b, c in zip(cache["passes"], torch_run["passes"], nopass["passes"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert c["loss"] == pytest.approx(b["loss"], abs=1e-4)
    assert cache["auc"] == pytest.approx(torch_run["auc"], abs=2e-3)
    check_counts(cache)
    check_counts(nopass)
    assert sum(p["tier_counts"]["created"] for p in nopass["passes"]) > 0  # on demand: rows created in lookups


def test_dlrm_momentum_optimizer_in_torch_and_cache_modes(data_dir: str, tmp_path: Any) -> None:
    """``--emb-optimizer rowwise_adagrad_momentum`` trains the same model in memory and through the
    cache; ``--emb-dtype``/``--stochastic-rounding`` are refused where they mean nothing (bfloat16
    training through the example: bench/bench_rounding.py)."""

    def go(mode: str, path: str, *more: str) -> dict[str, Any]:
        return dlrm.run(dlrm.build_parser().parse_args([*TINY, "--emb-optimizer", "rowwise_adagrad_momentum", *more,
                                                        "--mode", mode, "--data", data_dir,
                                                        "--path", str(tmp_path / path)]))

    with pytest.raises(SystemExit, match="float16 or bfloat16"):
        go("cache-nopass", "d", "--stochastic-rounding")
    with pytest.raises(SystemExit, match="cache mode"):
        go("torch", "e", "--emb-dtype", "bfloat16")
    torch_run, cache = go("torch", "a"), go("cache-nopass", "b")
    for a, b in zip(torch_run["passes"], cache["passes"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
    assert cache["auc"] == pytest.approx(torch_run["auc"], abs=2e-3)


def test_temporary_directory_is_removed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    summary = dlrm.run(dlrm.build_parser().parse_args(
        [*TINY, "--passes", "1", "--samples-per-pass", "1024", "--eval-samples", "1024", "--batch", "1024"]))
    assert summary["train_samples"] == 1024
    assert os.listdir(scratch) == []


def test_auc_rank_formula() -> None:
    import torch

    assert dlrm.auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert dlrm.auc(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 1, 1])) == pytest.approx(0.5)  # ties: mean rank
    rng = np.random.default_rng(0)
    s, y = rng.standard_normal(500), rng.integers(0, 2, 500)
    pairs = np.mean([(si > sj) + 0.5 * (si == sj) for si, yi in zip(s, y, strict=True) if yi
                     for sj, yj in zip(s, y, strict=True) if not yj])
    assert dlrm.auc(torch.from_numpy(s), torch.from_numpy(y)) == pytest.approx(pairs)
    assert np.isnan(dlrm.auc(torch.ones(3), torch.ones(3)))


def test_generator_is_deterministic(tmp_path: Any) -> None:
    cfg = SyntheticConfig(seed=3, scale=0.002)
    a = generate_dataset(tmp_path / "a", cfg, [70_000, 1000], progress=False)
    b = generate_dataset(tmp_path / "b", cfg, [70_000, 1000], progress=False)
    c = generate_dataset(tmp_path / "c", SyntheticConfig(seed=4, scale=0.002), [70_000, 1000], progress=False)
    for p in range(2):
        for what in ("dense", "sparse", "label"):
            assert filecmp.cmp(a.path(p, what), b.path(p, what), shallow=False), (p, what)
            assert not filecmp.cmp(a.path(p, what), c.path(p, what), shallow=False), (p, what)
    dense, sparse, label = a.arrays(0)
    assert dense.shape == (70_000, N_DENSE) and dense.dtype == np.float32
    assert sparse.shape == (70_000, N_SPARSE) and sparse.dtype == np.int64
    assert label.shape == (70_000,) and label.dtype == np.float32
    assert abs(float(label.mean()) - cfg.base_rate) < 0.02  # Criteo-like click rate
    assert set(np.unique(label).tolist()) == {0.0, 1.0}
    # ids are sparse int64 (both signs, far beyond the cardinality) and map back to item indices
    assert sparse.min() < -(2**40) and sparse.max() > 2**40
    items = cfg.items_of(np.asarray(sparse))
    assert (items >= 0).all() and (items < np.asarray(cfg.cardinalities)).all()
    for f in (0, 2, 8):
        assert (cfg.ids_of(f, items[:, f]) == sparse[:, f]).all()
    # Zipf popularity: the hottest id of a large feature takes far more than a uniform share
    big = int(np.argmax(cfg.cardinalities))
    _, counts = np.unique(sparse[:, big], return_counts=True)
    assert counts.max() > 100 * len(sparse) / cfg.cardinalities[big]
    assert SyntheticDataset(a.root).samples == [70_000, 1000]
    batches = list(a.batches(1, 300))
    assert [len(x.labels) for x in batches] == [300, 300, 300, 100]


def test_terabyte_scale_has_tens_of_millions_of_ids_per_table(tmp_path: Any) -> None:
    # Criteo Terabyte's largest tables hold tens of millions of ids: scale 4 gets there, and ids
    # drawn from them span that range (the generator keeps no per-item state, so this is cheap).
    cfg = SyntheticConfig(seed=1, scale=4.0)
    assert max(cfg.cardinalities) > 40_000_000
    assert sum(c > 20_000_000 for c in cfg.cardinalities) == 4
    ds = generate_dataset(tmp_path / "tb", cfg, 20_000, passes=1, progress=False)
    _, sparse, _ = ds.arrays(0)
    big = int(np.argmax(cfg.cardinalities))
    items = cfg.items_of(np.asarray(sparse))[:, big]
    assert items.max() > 10_000_000  # the Zipf tail reaches deep into the 41M items
    assert len(np.unique(items)) > 5_000


def test_generator_drifts_between_passes(tmp_path: Any) -> None:
    cfg = SyntheticConfig(seed=0, scale=0.01, drift=0.05)
    ds = generate_dataset(tmp_path / "d", cfg, 20_000, passes=3, progress=False)
    big = int(np.argmax(cfg.cardinalities))
    tops = []
    for p in range(3):
        ids, counts = np.unique(np.asarray(ds.arrays(p)[1][:, big]), return_counts=True)
        tops.append(set(ids[np.argsort(-counts)[:20]].tolist()))
    assert tops[0] != tops[1] != tops[2]  # new ids become hot
    assert len(tops[0] & tops[1]) >= 5  # while much of the hot set stays


def test_embedded_example_trains(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # examples/embedded.py: the core install's example (tests/test_packaging.py runs it from the wheel)
    from examples import embedded

    result = embedded.main(["--steps", "30", "--path", str(tmp_path / "cache")])
    assert result["last_loss"] < result["first_loss"]
    assert "HBM hit ratio" in capsys.readouterr().out
    assert os.listdir(tmp_path / "cache")  # the store lives where --path says


def test_dlrm_with_a_ttl_expires_rows_and_still_trains(data_dir: str, tmp_path: Any) -> None:
    summary = dlrm.run(dlrm.build_parser().parse_args(
        [*TINY, "--mode", "cache-nopass", "--ttl-steps", "2000", "--data", data_dir, "--path", str(tmp_path / "a")]))
    check_counts(summary)
    exp = summary["expiry"]
    assert exp["sweeps"] >= 26 * 3 and exp["expired_hbm"] + exp["expired_ddr"] + exp["expired_store"] > 0
    assert summary["last_pass_loss"] < summary["first_pass_loss"]
    with pytest.raises(SystemExit, match="cache mode"):
        dlrm.run(dlrm.build_parser().parse_args([*TINY, "--mode", "torch", "--ttl-steps", "5", "--data", data_dir,
                                                 "--path", str(tmp_path / "b")]))


def test_dlrm_with_admission_trains_and_counts_what_it_kept_out(data_dir: str, tmp_path: Any) -> None:
    summary = dlrm.run(dlrm.build_parser().parse_args(
        [*TINY, "--mode", "cache-nopass", "--admit-after", "2", "--data", data_dir, "--path", str(tmp_path / "a")]))
    check_counts(summary)
    adm = summary["admission"]
    assert adm["unadmitted_lookups"] > 0 and adm["dropped_updates"] > 0 and adm["admitted_rows"] > 0
    assert summary["last_pass_loss"] < summary["first_pass_loss"]
    with pytest.raises(SystemExit, match="cache mode"):
        dlrm.run(dlrm.build_parser().parse_args([*TINY, "--mode", "torch", "--admit-after", "2", "--data", data_dir,
                                                 "--path", str(tmp_path / "b")]))


def test_dlrm_exports_a_full_version_then_deltas_that_fold_to_the_trained_tables(data_dir: str, tmp_path: Any) -> None:
    from embcache import CacheConfig, EmbeddingCache
    from embcache.export import list_versions, load_model

    out, path = str(tmp_path / "exports"), str(tmp_path / "run")
    summary = dlrm.run(dlrm.build_parser().parse_args(
        [*TINY, "--mode", "cache", "--data", data_dir, "--path", path, "--export-dir", out, "--export-every", "1"]))
    exports = summary["exports"]
    assert [e["kind"] for e in exports] == ["full", "delta", "delta"] and list_versions(out) == [1, 2, 3]
    assert 0 < exports[1]["rows"] < exports[0]["rows"] + exports[1]["rows"]
    _, model = load_model(out)
    with EmbeddingCache(CacheConfig(path=os.path.join(path, "cache"), device="cpu", hbm_bytes=0, ddr_bytes=0)) as cache:
        for name, rows in model.items():
            assert rows.keys.size > 0
            assert np.array_equal(rows.weights, cache.lookup(name, rows.keys).numpy())
    with pytest.raises(ValueError, match="cache mode"):
        dlrm.Trainer(dlrm.build_parser().parse_args([*TINY, "--mode", "torch", "--data", data_dir,
                                                     "--export-dir", out]))
