"""Resharding a parameter-server fleet while it trains: rows move, nothing is lost, no key has two homes.

Real ``embcache-server`` processes on 127.0.0.1. A training loop applies deterministic SGD
gradients (dyadic numbers, so every update is exact) through a client while the fleet goes from
2 to 3 shards and back; replaying the same updates on an embedded cache must give the same rows,
bit for bit: a row re-initialized or reverted by a move would differ. A client made before the
reshard, still routing by the old shard list, is redirected. A source shard killed in the middle
of a migration is restarted and the migration resumed.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache import reshard as reshard_module
from embcache.client import Client
from embcache.errors import ConfigError, EmbcacheError
from embcache.ring import ShardMap
from embcache.rpc.errors import ERROR_TYPE_KEY, MAP_VERSION_KEY
from embcache.rpc.v1 import embcache_pb2 as pb
from embcache.rpc.v1 import embcache_pb2_grpc as pb_grpc
from embcache.server.local import LocalServer

START_TIMEOUT = 300
CFG = TableConfig(name="t", dim=8, optimizer="sgd", lr=0.5, seed=7)
SPEC = "name=t,dim=8,optimizer=sgd,lr=0.5,seed=7"
ARGS = ["--hbm-bytes", "20000", "--ddr-bytes", "40000"]  # small tiers: rows move between tiers and the store
N_KEYS = 3000


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[LocalServer]]:
    servers = [LocalServer(tmp_path / f"s{i}", tables=[SPEC], args=[*ARGS, "--store", "rocksdb" if i % 2 else "lmdb"],
                           metrics=True, workdir=tmp_path / f"run{i}", start_timeout=START_TIMEOUT) for i in range(3)]
    for s in servers:
        s.launch()
    for s in servers:
        s.wait_ready()
    yield servers
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


def _grads(step: int, keys: np.ndarray) -> torch.Tensor:
    """Dyadic gradients (multiples of 1/64 below 1): SGD with lr 0.5 updates exactly."""
    k = keys.astype(np.int64)[:, None]
    j = np.arange(CFG.dim)[None, :]
    return torch.from_numpy(((k * 7 + j * 3 + step) % 17 - 8).astype(np.float32) / 64)


class _Trainer:
    """Applies deterministic gradients through a client on a thread, logging each acknowledged step."""

    def __init__(self, client: Client, seed: int) -> None:
        self.client, self.rng = client, np.random.default_rng(seed)
        self.log: list[tuple[np.ndarray, torch.Tensor]] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        step = 0
        try:
            while not self.stop.is_set():
                keys = self.rng.integers(0, N_KEYS, 256)
                self.client.lookup("t", keys)
                grads = _grads(step, keys)
                self.client.apply_gradients("t", keys, grads)
                self.log.append((keys, grads))
                step += 1
        except BaseException as exc:  # reported by the test
            self.error = exc

    def __enter__(self) -> _Trainer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(120)

    def steps(self) -> int:
        return len(self.log)


def _reference(tmp_path: Path, log: list[tuple[np.ndarray, torch.Tensor]]) -> torch.Tensor:
    """The rows of every key after replaying ``log`` on an embedded cache."""
    with EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=1 << 24, ddr_bytes=1 << 24), [CFG]) as ref:
        for keys, grads in log:
            ref.apply_gradients("t", keys, grads)
        return ref.lookup("t", np.arange(N_KEYS)).to("cpu", copy=True)  # a client's rows are on the host


def _wait_steps(trainer: _Trainer, more: int, timeout: float = 120) -> None:
    target = trainer.steps() + more
    deadline = time.monotonic() + timeout
    while trainer.steps() < target and trainer.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert trainer.error is None, trainer.error
    assert trainer.steps() >= target, "training stalled"


def test_reshard_2_3_2_while_training_keeps_every_update(fleet: list[LocalServer], tmp_path: Path) -> None:
    a, b, c = (s.address for s in fleet)
    with Client([a, b], timeout=120, connect_timeout=START_TIMEOUT) as trainer_client, \
            Client([a, b], timeout=120) as operator, Client([a, b], timeout=120) as stale:
        assert stale.lookup("t", np.arange(10)).shape == (10, 8)  # routes by its own list (map version 0)
        with _Trainer(trainer_client, seed=1) as trainer:
            _wait_steps(trainer, 20)
            up = operator.reshard([a, b, c], progress=False)
            moved = sum(up.moved_rows.values())
            # every row that left was deleted from its source: those of the first copy, and rows first
            # written during it (copied with the rows written meanwhile, once frozen)
            assert up.version == 2 and moved > 0 and moved <= up.deleted_rows <= moved + up.delta_rows
            assert up.pause_seconds < up.total_seconds
            _wait_steps(trainer, 20)
            assert trainer_client.shard_map.version == 2  # redirected by the servers while training
            down = operator.reshard([a, b], progress=False)
            assert down.version == 3 and sum(down.moved_rows.values()) > 0
            _wait_steps(trainer, 20)
        assert trainer.error is None, trainer.error
        expected = _reference(tmp_path, trainer.log)
        got = operator.lookup("t", np.arange(N_KEYS))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)  # nothing lost, re-initialized or reverted
        # a client made before any reshard is redirected on its first call, and reads the same rows
        torch.testing.assert_close(stale.lookup("t", np.arange(N_KEYS)), expected, rtol=0, atol=0)
        assert stale.shard_map.version == 3
        # the third server left the fleet: it refuses every key, and holds no row any more
        with grpc.insecure_channel(c) as channel:
            lookup = channel.unary_unary("/embcache.rpc.v1.EmbeddingCacheService/Lookup",
                                         request_serializer=pb.LookupRequest.SerializeToString,
                                         response_deserializer=pb.LookupResponse.FromString)
            req = pb.LookupRequest(tables=[pb.TableKeys(table="t", keys=_tensor(np.arange(5)))])
            for version in ("1", "2", "3"):
                with pytest.raises(grpc.RpcError) as info:
                    lookup(req, metadata=((MAP_VERSION_KEY, version),), timeout=30)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert dict(info.value.trailing_metadata())[ERROR_TYPE_KEY] == "WrongShardError"
        assert operator.shard_stats() and len(operator.servers) == 2
        # no reshard to a third list while one is pending is tested below; a no-op reshard changes nothing
        assert operator.reshard([a, b], progress=False).moved_rows == {}


def _tensor(keys: np.ndarray) -> pb.Tensor:
    from embcache.rpc import codec

    return codec.encode_tensor(keys.astype(np.int64))


def _exported(server: LocalServer) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^embcache_migration_rows_total\{direction="exported"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("victim", [0, 2], ids=["source", "target"])
def test_a_migration_survives_a_killed_shard_and_resumes(fleet: list[LocalServer], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, victim: int) -> None:
    a, b, c = (s.address for s in fleet)
    with Client([a, b], timeout=120, connect_timeout=START_TIMEOUT) as client:
        log: list[tuple[np.ndarray, torch.Tensor]] = []
        keys = np.arange(N_KEYS)
        for step in range(3):
            grads = _grads(step, keys)
            client.apply_gradients("t", keys, grads)
            log.append((keys, grads))
        client.flush()
        failure: list[BaseException] = []

        def migrate() -> None:
            try:
                client.reshard([a, b, c], progress=False)
            except BaseException as exc:
                failure.append(exc)
        # small export batches, each imported slowly: the copy takes many messages, and a shard is killed
        # in the middle of it
        original = reshard_module._copy

        class SlowBar:
            def update(self, n: int) -> None:
                time.sleep(0.05)

        def slow_copy(client: Client, shards: Any, source: str, table: str, version: int, batch_rows: int,
                      deadline: float, bar: Any, written_only: bool = False) -> int:
            return original(client, shards, source, table, version, 20, deadline, SlowBar(), written_only)
        monkeypatch.setattr(reshard_module, "_copy", slow_copy)
        worker = threading.Thread(target=migrate)
        worker.start()
        deadline = time.monotonic() + 120
        while _exported(fleet[0]) == 0 and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.is_alive(), "the copy ended before a shard could be killed in the middle of it"
        fleet[victim].kill()  # the source (or the new shard), mid-migration
        fleet[victim].start()  # and back: a call to it waits for it (wait_for_ready), a stream it served broke
        worker.join(300)
        assert not worker.is_alive()
        monkeypatch.setattr(reshard_module, "_copy", original)
        # the pending migration survived the crash; a write to a moving key meanwhile is not lost
        old_map, new_map = ShardMap(1, {a: a, b: b}), ShardMap(2, {a: a, b: b, c: c})
        moving = keys[old_map.owned_by(keys, a) & new_map.owned_by(keys, c)][:5]
        assert moving.size == 5
        landed = threading.Event()

        def write_moving() -> None:
            with Client([a, b], timeout=120) as other:
                other.apply_gradients("t", moving, _grads(99, moving))
            landed.set()
        writer = threading.Thread(target=write_moving)
        writer.start()
        time.sleep(1.0)
        if failure:  # the copy broke with the shard: the migration is pending
            assert isinstance(failure[0], EmbcacheError), failure
            with pytest.raises(ConfigError, match="pending"):  # another target is refused meanwhile
                client.reshard([a, c], progress=False)
            report = client.reshard([a, b, c], progress=False)
            assert report.resumed and report.version == 2
        else:  # the killed shard came back between two of the copy's calls, which waited for it
            assert client.reshard([a, b, c], progress=False).moved_rows == {}
        writer.join(120)
        assert landed.is_set()
        log.append((moving, _grads(99, moving)))
        expected = _reference(tmp_path, log)
        torch.testing.assert_close(client.lookup("t", keys), expected, rtol=0, atol=0)


def test_the_reshard_command_adds_and_removes_a_shard(fleet: list[LocalServer]) -> None:
    import subprocess
    import sys

    a, b, c = (s.address for s in fleet)
    with Client([a, b], timeout=120, connect_timeout=START_TIMEOUT) as client:
        keys = np.arange(N_KEYS)
        client.assign("t", keys, torch.from_numpy(np.repeat(keys[:, None], 8, axis=1).astype(np.float32)))

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "embcache", "reshard", "--no-progress", *args],
                                  capture_output=True, text=True, timeout=300)
        up = cli("--servers", f"{a},{b}", "--add", c)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "shard map version 2" in up.stdout and "moved" in up.stdout
        rows = client.lookup("t", keys)  # redirected to the 3-shard map
        assert client.shard_map.version == 2 and len(client.servers) == 3
        assert torch.equal(rows[:, 0], torch.from_numpy(keys.astype(np.float32)))
        bad = cli("--servers", f"{a},{b},{c}", "--remove", "127.0.0.1:1")
        assert bad.returncode == 1 and "is not one of the shards" in bad.stdout
        down = cli("--servers", f"{a},{b},{c}", "--remove", c)
        assert down.returncode == 0, down.stdout + down.stderr
        assert torch.equal(client.lookup("t", keys)[:, 0], torch.from_numpy(keys.astype(np.float32)))
        assert len(client.servers) == 2


def test_two_clients_with_different_lists_route_every_key_to_one_shard(fleet: list[LocalServer]) -> None:
    """The first client's list becomes the fleet's map; a client that resolved another list is given it."""
    a, b, c = (s.address for s in fleet)
    with Client([a, b], timeout=120, connect_timeout=START_TIMEOUT) as first, \
            Client([b, c], timeout=120) as second, Client([a, b, c], timeout=120) as third:
        assert first.shard_map == second.shard_map == third.shard_map
        assert set(second.servers) == set(third.servers) == {a, b}  # c is not in the fleet's map
        keys = np.arange(500)
        first.assign("t", keys, torch.zeros(500, 8))
        second.apply_gradients("t", keys, torch.ones(500, 8))  # lr 0.5: every row becomes -0.5
        third.apply_gradients("t", keys, torch.ones(500, 8))
        for client in (first, second, third):
            assert torch.equal(client.lookup("t", keys), torch.full((500, 8), -1.0))
        with grpc.insecure_channel(c) as channel:  # the shard outside the map got none of those rows
            stats = pb_grpc.EmbeddingCacheServiceStub(channel).Stats(pb.StatsRequest(), timeout=30)
        assert json.loads(stats.json)["t"]["updates"] == json.loads(stats.json)["t"]["assigns"] == 0


def test_an_interrupted_commit_is_finished_by_running_the_reshard_again(fleet: list[LocalServer], tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator dies after one shard committed: clients keep working, the same reshard finishes it."""
    a, b, c = (s.address for s in fleet)
    with Client([a, b], timeout=120, connect_timeout=START_TIMEOUT) as client:
        keys = np.arange(N_KEYS)
        log = [(keys, _grads(0, keys))]
        client.apply_gradients("t", *log[0])
        original = pb_grpc.EmbeddingCacheServiceStub

        class DiesAfterOneCommit(original):  # type: ignore[misc, valid-type]
            commits = 0

            def __init__(self, channel: grpc.Channel) -> None:
                super().__init__(channel)
                inner = self.CommitShardMap

                def commit(*args: Any, **kwargs: Any) -> Any:
                    DiesAfterOneCommit.commits += 1
                    if DiesAfterOneCommit.commits > 1:
                        raise _CoordinatorDied()
                    return inner(*args, **kwargs)
                self.CommitShardMap = commit

        monkeypatch.setattr(pb_grpc, "EmbeddingCacheServiceStub", DiesAfterOneCommit)
        with Client([a, b], timeout=120) as operator, pytest.raises(_CoordinatorDied):
            operator.reshard([a, b, c], progress=False)
        monkeypatch.setattr(pb_grpc, "EmbeddingCacheServiceStub", original)
        versions = sorted(_map_version(s.address) for s in fleet)
        assert versions[0] == 1 and versions[-1] == 2  # one shard on the new map, the others on the old
        # training goes on meanwhile: writes to moving rows wait, the others land (in a thread: they may wait)
        done = threading.Event()

        def train() -> None:
            client.apply_gradients("t", keys, _grads(1, keys))
            done.set()
        writer = threading.Thread(target=train)
        writer.start()
        report = client.reshard([a, b, c], progress=False)
        writer.join(120)
        assert done.is_set() and report.version == 2
        assert [_map_version(s.address) for s in fleet] == [2, 2, 2]
        log.append((keys, _grads(1, keys)))
        torch.testing.assert_close(client.lookup("t", keys), _reference(tmp_path, log), rtol=0, atol=0)


class _CoordinatorDied(Exception):
    pass


def _map_version(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        state = pb_grpc.EmbeddingCacheServiceStub(channel).GetShardMap(pb.GetShardMapRequest(), timeout=30)
    return ShardMap.from_json(state.current).version if state.current else 0


def test_flush_settles_the_writes_of_a_shard_that_left_and_reports_what_its_crash_lost(
        fleet: list[LocalServer]) -> None:
    """A removed shard's acknowledged writes are answered for by the shards that took its rows."""
    from embcache.client import DataLossError

    a, b, c = (s.address for s in fleet)
    keys = np.arange(N_KEYS)
    with Client([a, b, c], timeout=60, connect_timeout=START_TIMEOUT) as client:
        on_c = keys[client.shard_of(keys) == 2]
        client.assign("t", keys, torch.zeros(N_KEYS, 8))
        client.flush()
        client.assign("t", on_c, torch.ones(on_c.size, 8))  # acknowledged by c, not flushed
        fleet[2].kill()  # ... and lost: c restarts without it
        fleet[2].start()
        client.assign("t", on_c[:10], torch.full((10, 8), 2.0))  # acknowledged by c's new process
        client.reshard([a, b], progress=False)  # c leaves the fleet; its rows move to a and b
        fleet[2].stop()  # and is gone: nobody can ask it any more
        t0 = time.monotonic()
        with pytest.raises(DataLossError) as info:
            client.flush()
        assert time.monotonic() - t0 < 30  # answered by a and b, not waiting for c
        assert info.value.lost_writes == 1 and info.value.address == c  # the write c's crash lost, only
        client.flush()  # reported once; the new process's write was flushed before c left
        rows = client.lookup("t", on_c)
        assert torch.equal(rows[:10], torch.full((10, 8), 2.0))
        # the rest hold the flushed zeros, or the ones where c had written them back before it crashed
        assert bool(((rows[10:] == 0).all(dim=1) | (rows[10:] == 1).all(dim=1)).all())
