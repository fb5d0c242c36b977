"""Serving mode (``embcache-server --serve DIR [--follow]``): a real server process over 127.0.0.1
serves an export read-only, follows its new versions atomically, and refuses every write.

The trainer here is a reference model (a torch weight matrix per table, trained with SGD) that
writes its versions with :func:`embcache.export.write_version`: a full version, then deltas of the
rows it changed and the keys it deleted. The last test has the real trainer side: an
EmbeddingCache exporting its own deltas with ``export_delta`` while the server follows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.client import Client
from embcache.errors import ConfigError, ReadOnlyError
from embcache.export import TablePart, write_version
from embcache.rpc.errors import ERROR_TYPE_KEY
from embcache.rpc.v1 import embcache_pb2 as pb
from embcache.server.auth import ROLES
from embcache.server.handlers import SERVICE_NAME
from embcache.server.local import LocalServer
from embcache.server.main import load_settings
from embcache.tier import resident_row_bytes

START_TIMEOUT = 300  # seconds: server start-up (imports) on a loaded 2-core machine
SMALL = ["--hbm-bytes", "4000", "--ddr-bytes", "8000"]  # a few dozen rows in memory: the rest in the store
FOLLOW = ["--follow", "--follow-interval-seconds", "0.05"]
TABLES = {"user": (4, "float32"), "item": (3, "float16")}


class Trainer:
    """A reference model: per table a weight matrix over a fixed key space, trained with SGD; some
    keys are deleted on the way. :meth:`export` writes version 1 in full, then deltas."""

    def __init__(self, directory: Path, n_keys: int = 300, seed: int = 0) -> None:
        self.directory = str(directory)
        self.g = torch.Generator().manual_seed(seed)
        self.keys = {t: torch.arange(n_keys, dtype=torch.int64) * 7 + 3 for t in TABLES}
        self.weights = {t: torch.randn(n_keys, dim, generator=self.g).to(getattr(torch, dtype))
                        for t, (dim, dtype) in TABLES.items()}
        self.alive = {t: torch.ones(n_keys, dtype=torch.bool) for t in TABLES}
        self.changed = {t: torch.ones(n_keys, dtype=torch.bool) for t in TABLES}
        self.gone = {t: torch.zeros(n_keys, dtype=torch.bool) for t in TABLES}
        self.version = 0

    def step(self, batch: int = 40, lr: float = 0.5) -> None:
        """One SGD step on a random batch of each table; a few keys are deleted."""
        for t, w in self.weights.items():
            idx = torch.randperm(w.shape[0], generator=self.g)[:batch]
            idx = idx[self.alive[t][idx]]
            grads = torch.randn(idx.numel(), w.shape[1], generator=self.g)
            w[idx] = (w[idx].float() - lr * grads).to(w.dtype)
            self.changed[t][idx] = True
            dead = idx[:3]
            self.alive[t][dead] = False
            self.changed[t][dead] = False
            self.gone[t][dead] = True

    def export(self) -> int:
        """Write the next version (full first, then a delta); its number."""
        self.version += 1
        kind = "full" if self.version == 1 else "delta"
        parts = {}
        for t, (dim, dtype) in TABLES.items():
            rows = self.changed[t] & self.alive[t]
            parts[t] = TablePart(config=TableConfig(name=t, dim=dim, dtype=dtype).to_dict(),
                                 keys=self.keys[t][rows].numpy(), weights=self.weights[t][rows],
                                 deleted=self.keys[t][self.gone[t]].numpy())
            self.changed[t][:] = False
            self.gone[t][:] = False
        write_version(self.directory, self.version, kind, parts,
                      base_version=self.version - 1 if kind == "delta" else None)
        return self.version

    def expected(self, table: str) -> torch.Tensor:
        """Every key's row as served: its weights (float32), zeros for a deleted key."""
        return torch.where(self.alive[table][:, None], self.weights[table].float(), 0.0)


def _serve(tmp_path: Path, directory: Path, *args: str) -> LocalServer:
    return LocalServer(tmp_path / "store", args=["--serve", str(directory), *SMALL, *args], metrics=True,
                       workdir=tmp_path / "run", start_timeout=START_TIMEOUT).start()


def _metric(server: LocalServer, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _wait_version(client: Client, version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (served := client.server_info()[0]["serving_version"]) != version:
        assert served < version, f"server jumped to version {served}, expected {version}"
        assert time.monotonic() < deadline, f"server still serves version {served}, not {version}"
        time.sleep(0.02)


def _assert_serves(client: Client, trainer: Trainer) -> None:
    rows = client.lookup_many({t: trainer.keys[t] for t in TABLES})
    for t in TABLES:
        assert torch.equal(rows[t], trainer.expected(t)), t


@pytest.fixture
def client_of() -> Iterator[Callable[[LocalServer], Client]]:
    made: list[tuple[LocalServer, Client]] = []

    def connect(server: LocalServer) -> Client:
        client = Client([server.address], timeout=30)
        made.append((server, client))
        return client

    yield connect
    for server, client in made:
        client.close()
        server.stop()


def test_serves_a_full_version_exactly_and_refuses_every_write(tmp_path: Path,
                                                               client_of: Callable[[LocalServer], Client]) -> None:
    trainer = Trainer(tmp_path / "export")
    trainer.export()
    stale = tmp_path / "store" / "serving-stale"  # left by a serving process that was killed
    stale.mkdir(parents=True)
    (stale / "embcache.lock").write_text("123")
    server = _serve(tmp_path, tmp_path / "export")
    assert not stale.exists() and len(list((tmp_path / "store").glob("serving-*"))) == 1
    client = client_of(server)
    assert {n: (c.dim, c.dtype, c.optimizer) for n, c in client.tables().items()} == {
        "user": (4, "float32", "sgd"), "item": (3, "float16", "sgd")}
    info = client.server_info()[0]
    assert (info["serving_version"], info["serving_directory"]) == (1, str(tmp_path / "export"))
    _assert_serves(client, trainer)
    _assert_serves(client, trainer)  # again, from the tiers this time

    # unknown keys: the default row (zeros), no row created in memory or in the store
    before = client.stats()
    unknown = torch.arange(10_000, 10_500, dtype=torch.int64)
    assert torch.equal(client.lookup("user", unknown), torch.zeros(500, 4))
    after = client.stats()["user"]
    assert after["ssd"]["created_rows"] == 0 and after["ssd"]["writes"] == before["user"]["ssd"]["writes"]
    assert after["admission"]["unadmitted_lookups"] == 500
    for tier in ("hbm", "ddr"):
        assert not np.isin(client.resident_keys("user", tier).numpy(), unknown.numpy()).any()
    assert after["serving"]["version"] == 1 and after["serving"]["applied_versions"] == 1
    # weights only: a row costs its weights in the store and no optimizer state in memory
    for tier, device in (("hbm", info["device"]), ("ddr", "cpu")):  # HBM is on the GPU where there is one
        row = resident_row_bytes(4, torch.float32, 0, device)
        assert after[tier]["capacity_bytes"] == after[tier]["capacity_rows"] * row

    # every write call, raw: FAILED_PRECONDITION, ReadOnlyError, naming the version served
    channel = grpc.insecure_channel(server.address)
    service = pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"]
    writes = [m for m in service.methods if ROLES[m.name] == "write"]
    assert {m.name for m in writes} >= {"ApplyGradients", "Assign", "CreateTable", "ImportRows", "SetShardMap",
                                        "BeginPass", "Prefetch", "Flush", "Checkpoint", "CommitShardMap"}
    for m in writes:
        request = getattr(pb, m.input_type.name)()
        call = {(False, False): channel.unary_unary, (True, False): channel.stream_unary,
                (False, True): channel.unary_stream, (True, True): channel.stream_stream}[
            (m.client_streaming, m.server_streaming)](f"/{SERVICE_NAME}/{m.name}",
                                                      request_serializer=type(request).SerializeToString,
                                                      response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            reply = call(iter([request]) if m.client_streaming else request, timeout=30)
            if m.server_streaming:
                list(reply)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, m.name
        assert dict(err.value.trailing_metadata())[ERROR_TYPE_KEY] == "ReadOnlyError", m.name
        assert "serves version 1" in (err.value.details() or ""), m.name
    channel.close()
    with pytest.raises(ReadOnlyError, match="serves version 1"):
        client.apply_gradients("user", trainer.keys["user"][:5], torch.ones(5, 4))
    with pytest.raises(ReadOnlyError):
        client.assign("user", trainer.keys["user"][:5], torch.ones(5, 4))
    with pytest.raises(ReadOnlyError):
        client.create_table(TableConfig(name="new", dim=2))
    _assert_serves(client, trainer)  # nothing changed
    assert _metric(server, "embcache_serving_version") == 1
    assert _metric(server, "embcache_serving_versions_applied_total") == 1
    assert _metric(server, "embcache_serving_errors_total") == 0
    assert 0 <= _metric(server, "embcache_serving_version_age_seconds") < 600
    client.close()
    assert server.stop() == 0
    assert not list((tmp_path / "store").glob("serving-*"))  # a clean stop removes its store


def test_follows_each_version_and_waits_for_half_written_ones(tmp_path: Path,
                                                              client_of: Callable[[LocalServer], Client]) -> None:
    export = tmp_path / "export"
    trainer = Trainer(export)
    trainer.export()
    server = _serve(tmp_path, export, *FOLLOW)
    client = client_of(server)
    _assert_serves(client, trainer)
    for _ in range(4):  # after each version the server returns exactly that version's weights
        trainer.step()
        _wait_version(client, trainer.export())
        _assert_serves(client, trainer)
    assert trainer.version == 5 and _metric(server, "embcache_serving_versions_applied_total") == 5

    # a version copied half-way: its files without the manifest, then a truncated file: ignored
    staging = tmp_path / "staging"
    trainer.directory = str(staging)
    trainer.step()
    trainer.export()  # version 6, written elsewhere
    src, dst = staging / "v00000006", export / "v00000006"
    dst.mkdir()
    for f in sorted(os.listdir(src)):
        if f != "manifest.json":
            shutil.copy(src / f, dst / f)
    time.sleep(0.5)  # ten polls
    assert client.server_info()[0]["serving_version"] == 5
    shutil.copy(src / "manifest.json", dst / "manifest.json")
    (dst / "t0000.npz").write_bytes((src / "t0000.npz").read_bytes()[:100])
    time.sleep(0.5)
    assert client.server_info()[0]["serving_version"] == 5
    assert _metric(server, "embcache_serving_errors_total") == 0
    shutil.copy(src / "t0000.npz", dst / "t0000.npz")  # complete now
    _wait_version(client, 6)
    _assert_serves(client, trainer)

    # a foreign manifest: logged and counted, version 6 served on; a new full version starts a new chain
    (export / "v00000007").mkdir()
    (export / "v00000007" / "manifest.json").write_text('{"format": "something-else"}')
    deadline = time.monotonic() + 30
    while _metric(server, "embcache_serving_errors_total") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.server_info()[0]["serving_version"] == 6
    _assert_serves(client, trainer)
    trainer.directory, trainer.version = str(export), 7
    trainer.step()
    for t in TABLES:
        trainer.alive[t][torch.nonzero(trainer.alive[t]).flatten()[:5]] = False  # dropped, not listed as deleted:
        # a full version replaces all
    full = {t: TablePart(config=TableConfig(name=t, dim=d, dtype=dt).to_dict(),
                         keys=trainer.keys[t][trainer.alive[t]].numpy(), weights=trainer.weights[t][trainer.alive[t]])
            for t, (d, dt) in TABLES.items()}
    write_version(str(export), 8, "full", full)
    _wait_version(client, 8)
    _assert_serves(client, trainer)
    assert _metric(server, "embcache_serving_errors_total") == 1
    assert client.stats()["user"]["serving"]["version"] == 8


def test_a_lookup_sees_one_version_while_versions_switch(tmp_path: Path,
                                                         client_of: Callable[[LocalServer], Client]) -> None:
    """Each version sets every row of tables "a" and "c" to its number; between them each lookup reads
    table "b", large enough to take several chunks (the server looks it up 65,536 keys at a time),
    so versions switch while lookups are half done: one answering "a" and "c" from two versions
    would show two numbers."""
    export = tmp_path / "export"
    small, big = np.arange(2000, dtype=np.int64), np.arange(100_000, dtype=np.int64)

    def write(v: int) -> None:
        parts = {t: TablePart(config=TableConfig(name=t, dim=4).to_dict(), keys=small,
                              weights=np.full((small.size, 4), float(v), dtype=np.float32)) for t in ("a", "c")}
        if v == 1:
            parts["b"] = TablePart(config=TableConfig(name="b", dim=4).to_dict(), keys=big,
                                   weights=np.ones((big.size, 4), dtype=np.float32))
        write_version(str(export), v, "full" if v == 1 else "delta", parts, base_version=None if v == 1 else v - 1)

    write(1)
    server = _serve(tmp_path, export, *FOLLOW)
    client = client_of(server)
    seen: list[tuple[set[float], set[float]]] = []
    stop = threading.Event()

    def look() -> None:
        with Client([server.address], timeout=30) as own:
            while not stop.is_set():
                rows = own.lookup_many({"a": small, "b": big, "c": small})
                seen.append((set(rows["a"].unique().tolist()), set(rows["c"].unique().tolist())))

    readers = [threading.Thread(target=look) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for v in range(2, 8):
            write(v)
            _wait_version(client, v)
            time.sleep(0.1)
    finally:
        stop.set()
        for r in readers:
            r.join()
    mixed = [s for s in seen if len(s[0]) != 1 or s[0] != s[1]]
    assert not mixed, mixed
    assert len({next(iter(a)) for a, _ in seen}) >= 3  # the lookups did run across switches


def test_engine_lookups_create_no_rows_and_refresh_keeps_rows_resident(tmp_path: Path) -> None:
    """CacheConfig.lookups_create_rows=False and import_rows(refresh=True), in process."""
    cfgs = [TableConfig(name="z", dim=4, unadmitted="zeros"), TableConfig(name="i", dim=4, seed=5)]
    with EmbeddingCache(CacheConfig(path=str(tmp_path / "s"), hbm_bytes=4000, ddr_bytes=4000,
                                    lookups_create_rows=False), cfgs) as cache:
        stored = torch.arange(10, dtype=torch.int64)
        rows = torch.randn(10, 4)
        for t in ("z", "i"):
            cache.import_rows(t, stored, rows.numpy().view(np.uint8))
        assert torch.equal(cache.lookup("z", stored).cpu(), rows)
        unknown = torch.arange(100, 110)
        assert torch.equal(cache.lookup("z", unknown).cpu(), torch.zeros(10, 4))
        with EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=4000, ddr_bytes=4000),
                            [TableConfig(name="i", dim=4, seed=5)]) as ref:
            assert torch.equal(cache.lookup("i", unknown), ref.lookup("i", unknown))  # the initializer's rows
        stats = cache.stats()
        assert stats["z"]["ssd"]["created_rows"] == stats["i"]["ssd"]["created_rows"] == 0
        assert not np.isin(cache.resident_keys("z", "hbm").numpy(), unknown.numpy()).any()
        assert np.isin(stored.numpy(), cache.resident_keys("z", "hbm").numpy()).all()
        cache.import_rows("z", stored[:4], (rows[:4] + 1).numpy().view(np.uint8), refresh=True)
        assert np.isin(stored.numpy(), cache.resident_keys("z", "hbm").numpy()).all()  # still resident
        assert torch.equal(cache.lookup("z", stored[:4]).cpu(), rows[:4] + 1)
        cache.flush()
        assert cache.stats()["z"]["ssd"]["write_rows"] == 0  # refreshed rows are clean: nothing written back


@pytest.mark.parametrize(("argv", "message"), [
    (["--follow"], "--follow needs --serve"),
    (["--serve", "x", "--table", "name=t,dim=4"], "takes its tables from the export"),
    (["--serve", "x", "--sync"], "read-only"),
    (["--serve", "x", "--follow", "--follow-interval-seconds", "0"], "follow_interval_seconds"),
])
def test_bad_serving_settings_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(argv)


def test_serving_a_missing_or_empty_directory_fails_clearly(tmp_path: Path) -> None:
    from embcache.server.serve import start_server
    from embcache.server.settings import ServerSettings

    with pytest.raises(ConfigError, match="no such directory"):
        start_server(ServerSettings(serve=str(tmp_path / "missing"), cache={"path": str(tmp_path / "store")}))
    (tmp_path / "empty").mkdir()
    done = subprocess.run([sys.executable, "-m", "embcache.server", "--serve", str(tmp_path / "empty"), "--path",
                           str(tmp_path / "store"), "--metrics-port", "-1", "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=START_TIMEOUT,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 2 and "no complete version" in done.stderr, done.stderr
    assert not any(p.name.startswith("serving-") for p in tmp_path.glob("store/*"))


def test_serving_settings_come_from_the_config_file_and_flags_override_them(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[serving]\ndirectory = "exports"\nfollow = true\nfollow_interval_seconds = 0.5\n'
                      'unknown_rows = "init"\n')
    s, _ = load_settings(["--config", str(config)])
    assert (s.serve, s.follow, s.follow_interval_seconds, s.unknown_rows) == ("exports", True, 0.5, "init")
    s, _ = load_settings(["--config", str(config), "--serve", "other", "--unknown-rows", "zeros"])
    assert (s.serve, s.unknown_rows) == ("other", "zeros")
    config.write_text('[serving]\ndirectory = "exports"\nunknown_rows = "random"\n')
    with pytest.raises(ConfigError, match="unknown_rows"):
        load_settings(["--config", str(config)])
    config.write_text('[serving]\npath = "exports"\n')
    with pytest.raises(ConfigError, match=r"unknown \[serving\] keys"):
        load_settings(["--config", str(config)])


def test_a_missing_version_is_reported_once_and_applied_when_it_appears(tmp_path: Path) -> None:
    """In process (no server): the follow loop's order of versions, and its error count."""
    from embcache.server.serving import ServedModel, serving_tables

    export = str(tmp_path / "export")
    cfg = TableConfig(name="t", dim=2).to_dict()

    def part(v: float) -> dict[str, TablePart]:
        return {"t": TablePart(cfg, np.arange(4), np.full((4, 2), v, dtype=np.float32))}

    write_version(export, 1, "full", part(1.0))
    with EmbeddingCache(CacheConfig(path=str(tmp_path / "s"), hbm_bytes=4000, ddr_bytes=4000,
                                    lookups_create_rows=False), serving_tables(export)) as cache:
        model = ServedModel(export, cache)
        assert model.load() == 1
        write_version(export, 3, "delta", part(3.0), base_version=2)  # version 2 not there (yet)
        assert model.poll() == 0 and model.poll() == 0
        assert (model.version, model.errors) == (1, 1)
        assert torch.equal(cache.lookup("t", torch.arange(4)).cpu(), torch.ones(4, 2))
        write_version(export, 2, "delta", part(2.0), base_version=1)
        assert model.poll() == 2 and (model.version, model.errors) == (3, 1)
        assert torch.equal(cache.lookup("t", torch.arange(4)).cpu(), torch.full((4, 2), 3.0))


def test_a_serving_server_follows_a_caches_own_delta_exports(tmp_path: Path,
                                                            client_of: Callable[[LocalServer], Client]) -> None:
    """The issue's test with the real trainer side: an EmbeddingCache (small tiers, rows spread over
    HBM, DDR and the store) trains and calls ``export_delta`` every few steps while the server
    follows; after each version the server returns exactly the cache's weights, deleted keys as
    unknown (zeros)."""
    export = tmp_path / "export"
    tables = [TableConfig(name=t, dim=d, dtype=dt, optimizer="adagrad", lr=0.3, seed=5)
              for t, (d, dt) in TABLES.items()]
    keys = torch.arange(300, dtype=torch.int64) * 7 + 3
    gen = torch.Generator().manual_seed(11)
    with EmbeddingCache(CacheConfig(hbm_bytes=40 * 64, ddr_bytes=80 * 64, path=str(tmp_path / "trainer"),
                                    device="cpu", validate_memory=False), tables) as cache:
        alive = torch.ones(keys.numel(), dtype=torch.bool)
        for t, (dim, _) in TABLES.items():  # every key trained once: every row stored
            cache.apply_gradients(t, keys, torch.randn(keys.numel(), dim, generator=gen))
        assert cache.export_delta(str(export)).kind == "full"
        server = _serve(tmp_path, export, *FOLLOW)
        client = client_of(server)
        for round_ in range(4):
            for _ in range(3):  # a few training steps between exports
                live = keys[alive]
                idx = torch.randperm(live.numel(), generator=gen)[:60]
                for t, (dim, _) in TABLES.items():
                    cache.apply_gradients(t, live[idx], torch.randn(idx.numel(), dim, generator=gen))
            gone = keys[alive][round_ * 5:round_ * 5 + 5]
            for t in TABLES:
                cache.delete_rows(t, gone)
            alive &= ~torch.isin(keys, gone)
            result = cache.export_delta(str(export))
            assert result.kind == "delta"
            _wait_version(client, result.version)
            served = client.lookup_many({t: keys for t in TABLES})
            for t in TABLES:
                expected = torch.where(alive[:, None], cache.lookup(t, keys), 0.0)
                assert torch.equal(served[t], expected), (t, result.version)


def test_a_switch_serves_rows_not_yet_written_and_a_failed_write_is_retried(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: a version's rows are written into the cache after the switch, in chunks; until
    then lookups take them from the overlay, also when a write fails (the next poll writes them
    before it applies a newer version). Its deleted keys are gone at the switch."""
    from embcache.errors import StoreError
    from embcache.server import serving
    from embcache.server.serving import ServedModel, serving_tables

    export = str(tmp_path / "export")
    cfg = TableConfig(name="t", dim=2, dtype="float16").to_dict()
    keys = np.arange(3 * serving._WRITE_CHUNK + 5, dtype=np.int64)

    def part(v: float, deleted: tuple[int, ...] = ()) -> dict[str, TablePart]:
        kept = keys[~np.isin(keys, deleted)]
        return {"t": TablePart(cfg, kept, np.full((kept.size, 2), v, dtype=np.float16),
                               deleted=np.asarray(deleted, dtype=np.int64))}

    write_version(export, 1, "full", part(1.0))
    with EmbeddingCache(CacheConfig(path=str(tmp_path / "s"), hbm_bytes=40_000, ddr_bytes=40_000,
                                    lookups_create_rows=False), serving_tables(export)) as cache:
        model = ServedModel(export, cache)
        assert model.load() == 1
        real, calls = cache.import_rows, []

        def import_rows(table: str, k: Any, records: np.ndarray, *args: Any, **kwargs: Any) -> None:
            calls.append(len(k))
            if len(calls) == 2:
                raise StoreError("injected write failure")
            real(table, k, records, *args, **kwargs)

        monkeypatch.setattr(cache, "import_rows", import_rows)
        write_version(export, 2, "delta", part(2.0, deleted=(7,)), base_version=1)
        assert model.poll() == 1 and (model.version, model.errors) == (2, 1)
        assert max(calls) <= serving._WRITE_CHUNK  # written beside the lookups, a chunk at a time
        want = torch.full((keys.size, 2), 2.0)
        want[7] = 0.0  # deleted: an unknown key's row
        query = torch.from_numpy(keys)
        alone = cache.lookup("t", query).cpu()
        assert not torch.equal(alone, want)  # the failed chunk is not in the cache
        with model.reading() as overlay:
            assert overlay is not None
            rows = cache.lookup("t", query).cpu()
            overlay.patch("t", query, rows)
        assert torch.equal(rows, want) and torch.equal(alone[7], torch.zeros(2))
        write_version(export, 3, "delta", part(3.0, deleted=(7,)), base_version=2)
        assert model.poll() == 1 and (model.version, model.errors) == (3, 1)  # version 2's rows first, then 3
        with model.reading() as overlay:
            assert overlay is None
        want[want == 2.0] = 3.0
        assert torch.equal(cache.lookup("t", query).cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_overlay_patches_exactly_the_rows_it_holds(dtype: torch.dtype) -> None:
    """Keys in any order (repeats included) get the overlay's row converted to float32 exactly;
    the others keep the cache's answer; a table it lacks is left alone."""
    from embcache.server.overlay import Overlay

    keys = np.array([40, 7, 23, 1_000_000_007], dtype=np.int64)  # unsorted, as a version lists them
    rows = (torch.arange(16, dtype=torch.float32).reshape(4, 4) / 8 - 1).to(dtype)
    overlay = Overlay({"t": (keys, rows), "empty": (np.empty(0, np.int64), torch.empty(0, 4, dtype=dtype))})
    assert overlay.rows == 4
    query = torch.tensor([7, 8, 1_000_000_007, 7, -5, 40], dtype=torch.int64)
    out = torch.full((6, 4), 99.0)
    assert overlay.patch("t", query, out) == 4
    assert torch.equal(out[0], rows[1].float()) and torch.equal(out[3], rows[1].float())
    assert torch.equal(out[2], rows[3].float()) and torch.equal(out[5], rows[0].float())
    assert torch.equal(out[[1, 4]], torch.full((2, 4), 99.0))
    assert overlay.patch("other", query, out) == 0 and overlay.patch("empty", query, out) == 0
    with pytest.raises(ValueError, match="3 keys for 4 rows"):
        Overlay({"t": (keys[:3], rows)})


def test_sigkill_while_a_switched_version_is_written_then_a_restart_serves_it_whole(
        tmp_path: Path, client_of: Callable[[LocalServer], Client]) -> None:
    """kill -9 of a following server while a version it switched to is still being written into
    its store (its overlay serving the rows meanwhile): lookups before the kill see that version's
    rows exactly, and a server restarted on the same path serves the newest complete version
    whole, then follows the next one."""
    export = tmp_path / "export"
    keys = np.arange(200_000, dtype=np.int64)  # 200k rows a version: writing them takes a while

    def write(v: int) -> None:
        part = {"a": TablePart(config=TableConfig(name="a", dim=4).to_dict(), keys=keys,
                               weights=np.full((keys.size, 4), float(v), dtype=np.float32))}
        write_version(str(export), v, "full" if v == 1 else "delta", part, base_version=None if v == 1 else v - 1)

    def assert_serves(client: Client, v: int) -> None:
        rows = client.lookup("a", keys)
        assert torch.equal(rows, torch.full((keys.size, 4), float(v))), (v, rows.unique().tolist())

    write(1)
    server = _serve(tmp_path, export, *FOLLOW)
    client = client_of(server)
    caught = 0
    for v in range(2, 8):
        write(v)
        _wait_version(client, v)  # switched to: the rows of version v - 1 were all written before
        if _metric(server, "embcache_serving_pending_rows") > 0:  # v's rows still being written
            sample = keys[::200]  # rows from the overlay and the cache: one version
            assert torch.equal(client.lookup("a", sample), torch.full((sample.size, 4), float(v)))
            if _metric(server, "embcache_serving_pending_rows") > 0:
                server.kill()
                caught = v
                break
        assert_serves(client, v)
    assert caught, "no version was caught while its rows were being written"
    restarted = _serve(tmp_path, export, *FOLLOW)
    again = client_of(restarted)
    assert again.server_info()[0]["serving_version"] == caught
    assert_serves(again, caught)
    write(caught + 1)
    _wait_version(again, caught + 1)
    assert_serves(again, caught + 1)
