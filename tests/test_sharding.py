"""The shard gate alone (embcache.server.sharding.ShardGate over a real embedded cache): routing, migration
states, persistence across a restart, and the rows it exports, imports and deletes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.errors import ConfigError, MigratingError, PassStateError, WrongShardError
from embcache.ring import ShardMap
from embcache.server.sharding import ShardGate

CFG = TableConfig(name="t", dim=4, optimizer="adagrad", lr=0.1, seed=1)
V1 = ShardMap(1, {"a": "h:1", "b": "h:2"})
V2 = ShardMap(2, {"a": "h:1", "b": "h:2", "c": "h:3"})
KEYS = np.arange(2000)


def _cache(path: Path) -> EmbeddingCache:
    return EmbeddingCache(CacheConfig(path=str(path), hbm_bytes=4096, ddr_bytes=8192), [CFG])


def test_routing_is_checked_against_the_map_and_the_keys(tmp_path: Path) -> None:
    with _cache(tmp_path / "a") as cache:
        gate = ShardGate(str(tmp_path / "a"), cache)
        gate.check_read(0, {"t": KEYS})  # never resharded: anything goes
        gate.set_map("a", V1.to_json(), "")
        mine = KEYS[V1.owned_by(KEYS, "a")]
        gate.check_read(1, {"t": mine})
        with pytest.raises(WrongShardError, match="version 0"):
            gate.check_read(0, {"t": mine})
        with pytest.raises(WrongShardError, match="belong to another shard"):
            gate.check_read(1, {"t": KEYS})
        with gate.writing(1, {"t": mine}):
            pass
        with pytest.raises(ConfigError, match="serves shard map version 1"):
            gate.set_map("a", ShardMap(1, {"a": "h:1", "x": "h:9"}).to_json(), "")
        with pytest.raises(ConfigError, match="neither map"):
            ShardGate(str(tmp_path / "a"), cache).set_map("z", V1.to_json(), "")


def test_a_migration_records_writes_freezes_exports_and_survives_a_restart(tmp_path: Path) -> None:
    with _cache(tmp_path / "a") as cache:
        gate = ShardGate(str(tmp_path / "a"), cache)
        gate.set_map("a", V1.to_json(), "")
        mine = KEYS[V1.owned_by(KEYS, "a")]
        leaving = mine[~V2.owned_by(mine, "a")]
        staying = mine[V2.owned_by(mine, "a")]
        assert leaving.size and staying.size
        cache.assign("t", mine, torch.ones(mine.size, 4))
        gate.set_map("a", V1.to_json(), V2.to_json())
        with gate.writing(1, {"t": leaving[:7]}):  # not frozen: allowed, and recorded
            cache.assign("t", leaving[:7], torch.full((7, 4), 2.0))
        with pytest.raises(PassStateError, match="frozen"):
            list(gate.export("t", 2, 100, written_only=True))
        exported = np.concatenate([k for _, k, _, _ in gate.export("t", 2, 100)])
        assert np.array_equal(np.sort(exported), np.sort(leaving))  # every leaving row, none that stays
        gate.set_map("a", V1.to_json(), V2.to_json(), freeze=True)
        with pytest.raises(MigratingError):
            with gate.writing(1, {"t": leaving[:1]}):
                pass
        with gate.writing(1, {"t": staying[:3]}):  # rows that stay are still written
            pass
        written = [(to, k, r) for to, k, r, _ in gate.export("t", 2, 100, written_only=True)]
        assert [to for to, _, _ in written] == ["c"] and np.array_equal(written[0][1], leaving[:7])
        with pytest.raises(PassStateError, match="version 3"):
            list(gate.export("t", 3, 100))
    # a restart keeps the pending, frozen migration; what was written meanwhile is no longer known,
    # so a written-only export sends every leaving row
    with _cache(tmp_path / "a") as cache:
        gate = ShardGate(str(tmp_path / "a"), cache)
        assert gate.pending == V2 and gate.frozen and gate.name == "a"
        with pytest.raises(MigratingError):
            with gate.writing(1, {"t": leaving[:1]}):
                pass
        resent = np.concatenate([k for _, k, _, _ in gate.export("t", 2, 100, written_only=True)])
        assert np.array_equal(np.sort(resent), np.sort(leaving))
        assert gate.commit(2) == leaving.size  # the rows that left are deleted
        assert gate.commit(2) == 0 and gate.pending is None and not gate.frozen  # idempotent
        found, _ = cache._store.get_many("t", leaving)  # type: ignore[union-attr]
        assert not np.asarray(found).any()


def test_imported_rows_replace_stale_copies_and_only_arriving_keys_are_taken(tmp_path: Path) -> None:
    with _cache(tmp_path / "a") as src, _cache(tmp_path / "c") as dst:
        a, c = ShardGate(str(tmp_path / "a"), src), ShardGate(str(tmp_path / "c"), dst)
        a.set_map("a", V1.to_json(), V2.to_json())
        c.set_map("c", V1.to_json(), V2.to_json())
        mine = KEYS[V1.owned_by(KEYS, "a")]
        src.apply_gradients("t", mine, torch.ones(mine.size, 4))  # adagrad: rows and state change
        moving = mine[V2.owned_by(mine, "c")]
        dst.assign("t", moving[:5], torch.full((5, 4), 9.0))  # a stale copy on the new owner
        for to, keys, records, freq in a.export("t", 2, 64):
            assert to == "c"
            assert c.import_rows("t", 2, keys, records, freq) == keys.size
        torch.testing.assert_close(dst.lookup("t", moving), src.lookup("t", moving), rtol=0, atol=0)
        # the optimizer state moved too: the same next update gives the same rows
        src.apply_gradients("t", moving, torch.ones(moving.size, 4))
        dst.apply_gradients("t", moving, torch.ones(moving.size, 4))
        torch.testing.assert_close(dst.lookup("t", moving), src.lookup("t", moving), rtol=0, atol=0)
        with pytest.raises(WrongShardError, match="do not move to this shard"):
            c.import_rows("t", 2, KEYS[V2.owned_by(KEYS, "a")][:3], np.zeros((3, 32), np.uint8),
                          np.zeros(3, np.float32))
