"""bench/ab.py: the noise rule, the case extractors on real results, and one tiny A/B run end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import ab

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# the smallest cache benchmark: all-hot cases only, one batch size and dim, 2 repeats (a few seconds a run)
TINY_CACHE = ("cache:--cases hot --hot-accesses 16384 --repeats 2 --update-rows 4096 --sweep 0 --batches 4096 "
              "--dims 8")


def _fig(value: float, lo: float | None = None, hi: float | None = None) -> ab.Case:
    return {"kind": "embcache", "unit": "rows/s", "value": value, "lo": value if lo is None else lo,
            "hi": value if hi is None else hi}


def test_noise_rule_flags_only_separated_intervals() -> None:
    base = [_fig(100), _fig(110), _fig(105)]
    slower = ab.compare(base, [_fig(90), _fig(99), _fig(95)])
    assert slower["verdict"] == "slower" and slower["ratio"] == pytest.approx(95 / 105)
    assert slower["ratio_low"] == pytest.approx(90 / 110) and slower["ratio_high"] == pytest.approx(99 / 100)
    assert slower["base"]["spread_pct"] == pytest.approx(100 * 10 / 105) and slower["base"]["interval_from"] == "rounds"
    # head's best round is above base's worst: not flagged, however low its median
    assert ab.compare(base, [_fig(80), _fig(85), _fig(101)])["verdict"] == "within noise"
    assert ab.compare(base, [_fig(111), _fig(120), _fig(115)])["verdict"] == "faster"
    # one round: each run's own repeats give the interval
    one = ab.compare([_fig(100, 90, 110)], [_fig(95, 92, 99)])
    assert one["verdict"] == "within noise" and one["head"]["interval_from"] == "repeats of the one run"
    assert ab.compare([_fig(100, 98, 102)], [_fig(90, 88, 97)])["verdict"] == "slower"
    missing = ab.compare(base, [])
    assert missing["verdict"] == "missing in head" and missing["ratio"] is None


@pytest.mark.parametrize("name", ["cache", "dlrm", "server"])
def test_extractors_find_every_throughput_of_a_committed_result(name: str) -> None:
    path = RESULTS / f"{name}-quick.json"
    if not path.exists():
        pytest.skip(f"no {path.name} committed")
    cases = ab.extract(name, json.loads(path.read_text()))
    assert len(cases) >= 3, cases
    assert {c["kind"] for c in cases.values()} == {"embcache", "peer"}
    for c in cases.values():
        assert 0 < c["lo"] <= c["value"] <= c["hi"], c
    if name == "server":
        assert "embcache pull, 4 client threads" in cases and cases["gRPC echo push, 1 client thread"]["kind"] == "peer"
    if name == "dlrm":
        assert cases["DLRM kaggle: torch"]["kind"] == "peer" and cases["DLRM kaggle: cache"]["unit"] == "samples/s"


def test_generic_extractor_reads_rates_with_min_and_max() -> None:
    doc: dict[str, Any] = {"machine": {"x_per_s": 1, "x_per_s_min": 1, "x_per_s_max": 1},
                           "results": [{"keys_per_s": 5.0, "keys_per_s_min": 4.0, "keys_per_s_max": 6.0}],
                           "other": {"rows_per_s": 3.0}}
    assert ab.extract("newthing", doc) == {"results[0] keys_per_s": {"kind": "embcache", "unit": "keys/s",
                                                                     "value": 5.0, "lo": 4.0, "hi": 6.0}}


def _worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_ab_smoke_base_head_on_the_tiny_cache_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One round of base = HEAD (a temporary worktree) against this checkout: every case has both sides."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    before = sorted(p.name for p in RESULTS.glob("ab-*"))
    assert ab.main(["--base", "HEAD", "--bench", "cache", "--rounds", "1", "--out", str(tmp_path),
                    "--bench-args", TINY_CACHE]) == 0
    doc = json.loads((tmp_path / "ab-cache.json").read_text())
    assert (tmp_path / "ab-cache.md").read_text().startswith("# A/B: cache")
    assert (tmp_path / "ab-cache.png").stat().st_size > 0
    assert sorted(p.name for p in RESULTS.glob("ab-*")) == before  # the repository's results are left alone
    names = {c["case"] for c in doc["cases"]}
    assert {"all-hot lookup B=4,096 d=8", "all-hot lookup+update B=4,096 d=8"} <= names
    for c in doc["cases"]:
        assert c["base"]["median"] > 0 and c["head"]["median"] > 0, c
        assert c["ratio"] == pytest.approx(c["head"]["median"] / c["base"]["median"])
        assert c["verdict"] in ("slower", "faster", "within noise")
    # each side imported its own tree's package; the base's worktree is gone afterwards
    base_tree, head_tree = doc["base"]["tree"], doc["head"]["tree"]
    assert doc["base"]["temporary_worktree"] and doc["head"]["tree"] == str(ROOT)
    by_side = {r["side"]: r for r in doc["runs"]}
    assert by_side["base"]["embcache_file"].startswith(base_tree + "/embcache/")
    assert by_side["head"]["embcache_file"].startswith(head_tree + "/embcache/")
    assert not Path(base_tree).exists() and base_tree not in _worktrees()
    out = capsys.readouterr().out
    assert "[1/2] cache round 1/1 base" in out and "[2/2] cache round 1/1 head" in out
