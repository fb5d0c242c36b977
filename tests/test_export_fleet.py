"""Delta export of a parameter-server fleet through the client: real ``embcache-server``
processes on 127.0.0.1 (one RocksDB, one LMDB). The fleet's version equals the union of the
shards' rows; a client that dies between streaming and committing loses nothing; rows moved by a
reshard land in the next delta of the shard that took them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from embcache.client import Client
from embcache.errors import UnknownTableError
from embcache.export import ExportFormatError, latest_version, load_model, read_table
from embcache.rpc.v1 import embcache_pb2 as pb
from embcache.rpc.v1 import embcache_pb2_grpc as pb_grpc
from embcache.server.local import LocalServer

START_TIMEOUT = 300
SPEC = "name=t,dim=8,optimizer=adagrad,lr=0.25,seed=7"
ARGS = ["--hbm-bytes", "20000", "--ddr-bytes", "20000"]  # small tiers: most rows live in the stores


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[LocalServer]]:
    servers = [LocalServer(tmp_path / f"s{i}", tables=[SPEC], args=[*ARGS, "--store", ("lmdb", "rocksdb")[i]],
                           workdir=tmp_path / f"run{i}", start_timeout=START_TIMEOUT) for i in range(2)]
    for s in servers:
        s.launch()
    for s in servers:
        s.wait_ready()
    yield servers
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


def _train(client: Client, keys: np.ndarray, value: float) -> None:
    client.lookup("t", keys)
    client.apply_gradients("t", keys, torch.full((keys.size, 8), value))


def _folded_equals_the_fleet(client: Client, directory: Path) -> np.ndarray:
    _, model = load_model(str(directory), with_state=False)
    rows = model["t"]
    assert torch.equal(torch.from_numpy(rows.weights), client.lookup("t", rows.keys))
    return rows.keys


def test_fleet_export_is_the_union_of_the_shards_and_loses_nothing(fleet: list[LocalServer], tmp_path: Path) -> None:
    a, b = (s.address for s in fleet)
    out = tmp_path / "exports"
    with Client([a, b], timeout=120, connect_timeout=START_TIMEOUT) as client:
        keys = np.arange(0, 400, dtype=np.int64)
        _train(client, keys, 1.0)
        assert set(client.shard_of(keys).tolist()) == {0, 1}  # both shards hold rows
        first = client.export_delta(out, with_state=True)
        assert (first.version, first.kind, first.rows) == (1, "full", 400)
        v1 = latest_version(str(out))
        assert v1 is not None and set(v1.covers["shards"]) == {a, b} and v1.covers["steps"]["t"] == 400
        assert np.array_equal(read_table(v1, "t", with_state=True)["state"], np.ones((400, 8), np.float32))

        changed = np.array([3, 150, 399, 1000, 1001], dtype=np.int64)
        _train(client, changed, 2.0)
        second = client.export_delta(out)
        v2 = latest_version(str(out))
        assert (second.version, second.kind) == (2, "delta") and v2 is not None
        assert read_table(v2, "t")["keys"].tolist() == changed.tolist()
        assert _folded_equals_the_fleet(client, out).tolist() == sorted({*keys.tolist(), 1000, 1001})

        # a client that streamed the shards' changes and died before committing them
        _train(client, np.array([7, 8], dtype=np.int64), 3.0)
        for address in (a, b):
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.EmbeddingCacheServiceStub(channel)
                replies = list(stub.ExportDelta(pb.ExportDeltaRequest(chain=str(v2.covers["chain"]), base_version=2)))
                assert not replies[0].full
        _train(client, np.array([9], dtype=np.int64), 3.0)
        third = client.export_delta(out)
        v3 = latest_version(str(out))
        assert (third.version, third.kind) == (3, "delta") and v3 is not None
        assert read_table(v3, "t")["keys"].tolist() == [7, 8, 9]

        # resharding onto one shard: the rows that moved are changes of the shard that took them
        client.reshard([a], progress=False)
        fourth = client.export_delta(out)
        v4 = latest_version(str(out))
        assert fourth.kind == "delta" and v4 is not None
        moved = read_table(v4, "t")["keys"]
        assert moved.size > 0 and set(moved.tolist()) <= {*keys.tolist(), 1000, 1001}
        _folded_equals_the_fleet(client, out)

        with pytest.raises(UnknownTableError):
            client.export_delta(out, tables=["nope"])
        (tmp_path / "file").write_text("x")
        with pytest.raises(ExportFormatError, match="not a directory"):
            client.export_delta(tmp_path / "file")
