"""embcache.Client against real embcache-server processes on 127.0.0.1 (1 shard and 3 shards).

The servers are module-scoped; each test works on tables of its own (created through the
client), so tests do not see each other's rows. Where a test needs a server to misbehave on
cue (refuse a call, lose a reply, hold requests), a small gRPC proxy in the test process stands
in front of the real servers and forwards everything else byte for byte.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from embcache import CacheConfig, EmbeddingCache, Keyset, LookAhead, TableConfig
from embcache.client import (
    Client,
    DeadlineExceededError,
    PermissionDeniedError,
    RemoteError,
    UnavailableError,
    resolve_shards,
)
from embcache.errors import (
    BatchTooLargeError,
    CheckpointExistsError,
    ConfigError,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    NonFiniteGradientError,
    PassStateError,
    TableConflictError,
    UnknownTableError,
)
from embcache.rpc.errors import NOT_APPLIED_KEY
from embcache.server.local import LocalServer, wait_serving

# Small tiers: most rows live in the store, so rows move between tiers during the tests.
SERVER_ARGS = ["--hbm-bytes", "20000", "--ddr-bytes", "40000", "--store", "rocksdb", "--max-batch-keys", "50000"]
START_TIMEOUT = 300  # seconds: server start-up (imports) on a loaded 2-core machine
_names = itertools.count()


def _start_all(servers: list[LocalServer]) -> list[LocalServer]:
    for s in servers:  # launch together: start-up (imports) overlaps
        s.launch()
    return [s.wait_ready() for s in servers]


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """One server with a 64 KiB message limit: batches of a few thousand rows are already chunked."""
    base = tmp_path_factory.mktemp("one")
    server = LocalServer(base / "store", args=[*SERVER_ARGS, "--max-message-bytes", "65536"], metrics=True,
                         workdir=base / "run", start_timeout=START_TIMEOUT)
    _start_all([server])
    yield server
    server.stop()


def _three(base: Path) -> Iterator[list[LocalServer]]:
    servers = [LocalServer(base / f"store{i}", args=SERVER_ARGS, metrics=True, workdir=base / f"run{i}",
                           start_timeout=START_TIMEOUT) for i in range(3)]
    _start_all(servers)
    yield servers
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def three_shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalServer]]:
    yield from _three(tmp_path_factory.mktemp("three"))


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """One server with a 64 KiB message limit and room for tens of thousands of rows: keysets of many messages."""
    base = tmp_path_factory.mktemp("roomy")
    server = LocalServer(base / "store", args=["--hbm-bytes", "3000000", "--ddr-bytes", "6000000", "--store", "rocksdb",
                                               "--max-message-bytes", "65536"], metrics=True, workdir=base / "run",
                         start_timeout=START_TIMEOUT)
    _start_all([server])
    yield server
    server.stop()


@pytest.fixture(params=[1, 3], ids=["1shard", "3shards"])
def client(request: pytest.FixtureRequest) -> Iterator[Client]:
    servers = ([request.getfixturevalue("one_shard")] if request.param == 1
               else request.getfixturevalue("three_shards"))
    with Client([s.address for s in servers], timeout=120) as c:  # generous: first calls compile kernels
        _SERVERS[id(c)] = servers
        yield c
        del _SERVERS[id(c)]


_SERVERS: dict[int, list[LocalServer]] = {}


def client_servers(c: Client) -> list[LocalServer]:
    """The server processes behind a client made by the ``client`` fixture."""
    return _SERVERS[id(c)]


def _tables(*specs: tuple[int, str]) -> list[TableConfig]:
    """Fresh table names (unique in this module)."""
    return [TableConfig(name=f"t{next(_names)}", dim=dim, optimizer=opt, lr=0.05, seed=11) for dim, opt in specs]


def _keys(rng: np.random.Generator, n: int) -> np.ndarray:
    """Zipf-like ids with duplicates, plus a few extreme ones."""
    keys = (rng.zipf(1.3, n) % 5000).astype(np.int64)
    keys[rng.random(n) < 0.02] = rng.integers(-2**62, 2**62, 1)
    return keys


def _pinned(c: Client, table: str) -> int:
    """Rows of ``table`` pinned on all shards (by passes, prefetches and leases)."""
    s = c.stats()[table]
    return int(s["hbm"]["pinned_rows"] + s["ddr"]["pinned_rows"])


def _rpc_count(server: LocalServer, method: str, code: str = "OK") -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    pattern = rf'embcache_rpc_request_duration_seconds_count\{{code="{code}",method="{method}"\}} ([0-9.e+]+)'
    m = re.search(pattern, text)
    return int(float(m.group(1))) if m else 0


def _streams_served(server: LocalServer, method: str) -> int:
    """Server-streaming calls counted as OK, or CANCELLED when the client dropped the call after its last reply."""
    return _rpc_count(server, method) + _rpc_count(server, method, "CANCELLED")


# ---------------------------------------------------------------------- differential
def test_random_ops_match_the_embedded_cache(client: Client, tmp_path: Path) -> None:
    """The same random op sequence through the client and through an embedded cache gives the same rows."""
    tables = _tables((8, "adagrad"), (4, "sgd"), (16, "adam"))
    for cfg in tables:
        assert client.create_table(cfg) is True
    ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=10_000, ddr_bytes=20_000, device="cpu"),
                         tables)
    rng = np.random.default_rng(5)
    try:
        for step in range(40):
            cfg = tables[rng.integers(len(tables))]
            keys = _keys(rng, int(rng.integers(1, 400)))
            op = ["lookup", "lookup_many", "apply", "apply_many", "assign"][step % 5]
            if op == "lookup":
                got, want = client.lookup(cfg.name, keys), ref.lookup(cfg.name, torch.from_numpy(keys))
                assert got.dtype == torch.float32 and got.device.type == "cpu"
                assert torch.equal(got, want), step
            elif op == "lookup_many":
                batch = {t.name: _keys(rng, 50 + 10 * i) for i, t in enumerate(tables)}
                got_many = client.lookup_many(batch)
                want_many = ref.lookup_many({n: torch.from_numpy(k) for n, k in batch.items()})
                for n in batch:
                    assert torch.equal(got_many[n], want_many[n]), (step, n)
            elif op == "apply":
                grads = torch.from_numpy(rng.standard_normal((keys.size, cfg.dim)).astype(np.float32))
                client.apply_gradients(cfg.name, torch.from_numpy(keys), grads)
                ref.apply_gradients(cfg.name, torch.from_numpy(keys), grads)
            elif op == "apply_many":
                ups = {}
                for t in tables[:2]:
                    k = _keys(rng, 120)
                    ups[t.name] = (torch.from_numpy(k), torch.randn(k.size, t.dim, generator=torch.Generator()
                                                                    .manual_seed(step)))
                client.apply_gradients_many(ups)
                ref.apply_gradients_many(ups)
            else:
                rows = torch.from_numpy(rng.standard_normal((keys.size, cfg.dim)).astype(np.float32))
                client.assign(cfg.name, keys, rows)
                ref.assign(cfg.name, torch.from_numpy(keys), rows)
        every = np.arange(-3, 5000, dtype=np.int64)
        for cfg in tables:
            assert torch.equal(client.lookup(cfg.name, every), ref.lookup(cfg.name, torch.from_numpy(every)))
    finally:
        ref.close()


def test_batches_above_the_message_limit_are_split_and_stay_exact(one_shard: LocalServer, tmp_path: Path) -> None:
    """Lookups become several requests; a write becomes one client stream applied as one request."""
    (cfg,) = _tables((16, "adagrad"))
    ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=10_000, ddr_bytes=20_000, device="cpu"),
                         [cfg])
    with Client([one_shard.address]) as c:
        c.create_table(cfg)
        rng = np.random.default_rng(3)
        keys = rng.integers(0, 3000, 9000)  # 9000 x (64 + 8) bytes: ~10 messages of 64 KiB; duplicates span chunks
        grads = torch.from_numpy(rng.standard_normal((keys.size, cfg.dim)).astype(np.float32))
        lookups, streams = _rpc_count(one_shard, "Lookup"), _rpc_count(one_shard, "ApplyGradientsStream")
        assert torch.equal(c.lookup(cfg.name, keys), ref.lookup(cfg.name, torch.from_numpy(keys)))
        assert _rpc_count(one_shard, "Lookup") - lookups >= 9
        c.apply_gradients(cfg.name, keys, grads)
        ref.apply_gradients(cfg.name, torch.from_numpy(keys), grads)
        assert _rpc_count(one_shard, "ApplyGradientsStream") == streams + 1
        # AdaGrad is not linear in the gradient: applying the chunks separately would differ
        assert torch.equal(c.lookup(cfg.name, np.arange(3000)), ref.lookup(cfg.name, torch.arange(3000)))
        rows = torch.from_numpy(rng.standard_normal((keys.size, cfg.dim)).astype(np.float32))
        c.assign(cfg.name, keys, rows)  # duplicates across chunks: the last one wins, as embedded
        ref.assign(cfg.name, torch.from_numpy(keys), rows)
        assert torch.equal(c.lookup(cfg.name, np.arange(3000)), ref.lookup(cfg.name, torch.arange(3000)))
    ref.close()


def test_many_tables_cost_one_request_per_shard(three_shards: list[LocalServer]) -> None:
    tables = _tables((8, "sgd"), (4, "sgd"), (4, "adagrad"))
    with Client([s.address for s in three_shards]) as c:
        for cfg in tables:
            c.create_table(cfg)
        rng = np.random.default_rng(0)
        batch = {t.name: rng.integers(0, 10**6, 500) for t in tables}
        before = [_rpc_count(s, "Lookup") for s in three_shards]
        rows = c.lookup_many(batch)
        assert [_rpc_count(s, "Lookup") - b for s, b in zip(three_shards, before, strict=True)] == [1, 1, 1]
        assert {n: tuple(r.shape) for n, r in rows.items()} == {t.name: (500, t.dim) for t in tables}
        before = [_rpc_count(s, "ApplyGradients") for s in three_shards]
        c.apply_gradients_many({n: (k, torch.ones(k.size, rows[n].shape[1])) for n, k in batch.items()})
        assert [_rpc_count(s, "ApplyGradients") - b for s, b in zip(three_shards, before, strict=True)] == [1, 1, 1]
        after = c.lookup_many(batch)
        for t in tables:  # one gradient of ones per occurrence: SGD moves every coordinate by -lr * count
            if t.optimizer == "sgd":
                counts = np.unique(batch[t.name], return_inverse=True, return_counts=True)
                occ = torch.from_numpy(counts[2][counts[1]].astype(np.float32))[:, None]
                assert torch.allclose(after[t.name], rows[t.name] - t.lr * occ, atol=1e-6)
        # each shard holds the keys the ring gives it, and only those
        shard = c.shard_of(batch[tables[0].name])
        per_shard = [s["hbm"]["hits"] + s["ddr"]["hits"] + s["ssd"]["hits"] + s["ssd"]["created"]
                     for s in (st[tables[0].name] for st in c.shard_stats())]
        assert per_shard == [2 * int((shard == i).sum()) for i in range(3)]


def test_assign_many_checks_every_table_first_and_sends_one_request_per_shard(three_shards: list[LocalServer],
                                                                             tmp_path: Path) -> None:
    """assign_many: bad input in any table sends nothing; good input is one Assign per shard carrying every
    table, and gives the rows (and the reset optimizer state) of the embedded cache's assign."""
    tables = _tables((8, "adagrad"), (4, "sgd"))
    names = [t.name for t in tables]
    ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=10_000, ddr_bytes=20_000, device="cpu"),
                         tables)
    rng = np.random.default_rng(7)
    keys = {t.name: _keys(rng, 300) for t in tables}
    rows = {t.name: torch.from_numpy(rng.standard_normal((300, t.dim)).astype(np.float32)) for t in tables}
    try:
        with Client([s.address for s in three_shards]) as c:
            for cfg in tables:
                c.create_table(cfg)
            c.apply_gradients_many({n: (keys[n], torch.ones(300, rows[n].shape[1])) for n in names})
            before = c.lookup_many(keys)
            sent = [_rpc_count(s, "Assign") for s in three_shards]
            good = {n: (keys[n], rows[n]) for n in names}
            for bad, error, match in [
                ({**good, names[1]: (keys[names[1]], torch.full((300, 4), float("nan")))}, InvalidRowsError, "NaN"),
                ({**good, names[1]: (keys[names[1]], torch.ones(300, 5))}, InvalidRowsError, r"shape \[300, 4\]"),
                ({**good, names[1]: (np.array([1.5]), torch.ones(1, 4))}, InvalidKeysError, "integer"),
                ({**good, "nope": (keys[names[0]], rows[names[0]])}, UnknownTableError, "nope"),
            ]:
                with pytest.raises(error, match=match):
                    c.assign_many(bad)
            assert [_rpc_count(s, "Assign") for s in three_shards] == sent
            unchanged = c.lookup_many(keys)
            assert all(torch.equal(unchanged[n], before[n]) for n in names)
            c.assign_many(good)
            assert [_rpc_count(s, "Assign") - b for s, b in zip(three_shards, sent, strict=True)] == [1, 1, 1]
            for n in names:
                ref.assign(n, torch.from_numpy(keys[n]), rows[n])
            got = c.lookup_many(keys)
            for n in names:  # duplicates: the last one wins, as embedded
                assert torch.equal(got[n], ref.lookup(n, torch.from_numpy(keys[n]))), n
            # the optimizer state was reset too: the same gradients move both alike
            grads = {n: torch.full((300, rows[n].shape[1]), 0.5) for n in names}
            c.apply_gradients_many({n: (keys[n], grads[n]) for n in names})
            ref.apply_gradients_many({n: (torch.from_numpy(keys[n]), grads[n]) for n in names})
            got = c.lookup_many(keys)
            for n in names:
                assert torch.equal(got[n], ref.lookup(n, torch.from_numpy(keys[n]))), n
    finally:
        ref.close()


# ---------------------------------------------------------------------- passes, tables, stats, files
def test_pass_protocol_through_the_client(client: Client) -> None:
    (cfg,) = _tables((8, "sgd"))
    client.create_table(cfg)
    keys = np.arange(0, 600, 3)
    ks = Keyset.from_keys(torch.from_numpy(np.concatenate([keys, keys[:50]])))
    staged = client.prefetch({cfg.name: ks})
    result = staged.result(timeout=60)
    assert set(result) == {cfg.name} and result[cfg.name]["staged_rows"] >= 0
    report = client.begin_pass({cfg.name: ks})
    assert report[cfg.name]["keyset_rows"] == keys.size
    with pytest.raises(PassStateError):
        client.begin_pass({cfg.name: ks})
    rows = client.lookup(cfg.name, keys)
    client.lookup(cfg.name, [10**9])  # outside the keyset: still served, and counted
    stats = client.stats()[cfg.name]["pass"]
    assert stats["active"] is True and stats["keyset_rows"] == keys.size and stats["outside_keyset"] == 1
    assert stats["pinned_rows"] == report[cfg.name]["pinned_rows"]
    assert client.end_pass().result(timeout=60) >= 0
    with pytest.raises(PassStateError):
        client.end_pass()
    assert client.stats()[cfg.name]["pass"]["active"] is False
    assert torch.equal(client.lookup(cfg.name, keys), rows)
    cancelled = client.prefetch({cfg.name: keys})
    cancelled.cancel()
    client.begin_pass({cfg.name: keys[:10]})  # a cancelled prefetch leaves nothing that blocks the next pass
    client.end_pass().result(timeout=60)


def test_keysets_above_the_message_limit_are_chunked_and_the_pass_is_exact(roomy: LocalServer,
                                                                          tmp_path: Path) -> None:
    """A keyset five times the 64 KiB limit goes in chunks (PrefetchStream, BeginPassStream) and the pass
    stages, pins, places and serves exactly as an embedded cache of the same capacities given it whole."""
    (cfg,) = _tables((8, "adagrad"))
    with Client([roomy.address], timeout=120) as c:
        c.create_table(cfg)
        cap, rb = c.capacity_rows(cfg.name), c.row_bytes(cfg.name)
        ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=cap["hbm"] * rb,
                                         ddr_bytes=cap["ddr"] * rb, device="cpu"), [cfg])
        try:
            assert ref.capacity_rows(cfg.name) == cap and ref.row_bytes(cfg.name) == rb
            rng = np.random.default_rng(7)
            # more keys than HBM holds, fewer than both tiers (sized from the capacities: a fixed
            # count broke when rows shrank)
            keys = np.unique(rng.integers(-2**62, 2**62, cap["hbm"] + cap["ddr"] // 2))
            counts = np.minimum(rng.zipf(1.5, keys.size), 10**6).astype(np.int64)
            ks = Keyset(torch.from_numpy(keys), torch.from_numpy(counts))
            assert keys.size * 16 > 4 * 65536, "several messages' worth of keys and counts"
            assert cap["hbm"] < keys.size <= cap["hbm"] + cap["ddr"], "the hottest in HBM, the rest in DDR"
            warm = rng.choice(keys, 3000)  # some history, so staging meets resident rows
            assert torch.equal(c.lookup(cfg.name, warm), ref.lookup(cfg.name, torch.from_numpy(warm)))
            streams = {"PrefetchStream": _streams_served(roomy, "PrefetchStream"),
                       "BeginPassStream": _rpc_count(roomy, "BeginPassStream")}

            got_pf, want_pf = c.prefetch({cfg.name: ks}).result(timeout=120), ref.prefetch({cfg.name: ks}).result(60)
            assert [got_pf[cfg.name][k] for k in ("staged_rows", "leased_rows")] == \
                [want_pf[cfg.name][k] for k in ("staged_rows", "leased_rows")]
            report = c.begin_pass({cfg.name: ks})
            assert report == ref.begin_pass({cfg.name: ks})
            assert report[cfg.name] == {"keyset_rows": keys.size, "pinned_rows": keys.size}
            deadline = time.monotonic() + 30  # a stream's call is counted once it ends, just after its last reply
            while _streams_served(roomy, "PrefetchStream") == streams["PrefetchStream"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _streams_served(roomy, "PrefetchStream") - streams["PrefetchStream"] == 1
            assert _rpc_count(roomy, "BeginPassStream") - streams["BeginPassStream"] == 1
            got, want = c.stats()[cfg.name], ref.stats()[cfg.name]
            for tier in ("hbm", "ddr"):
                assert got[tier]["resident_rows"] == want[tier]["resident_rows"]
                assert got[tier]["pinned_rows"] == want[tier]["pinned_rows"]
                # each tier holds the same keys (ResidentKeys streams them in chunks below the limit)
                assert torch.equal(torch.sort(c.resident_keys(cfg.name, tier)).values,
                                   torch.sort(ref.resident_keys(cfg.name, tier)).values), tier
            assert got["pass"]["keyset_rows"] == want["pass"]["keyset_rows"] == keys.size

            # training within the pass, inside and outside the keyset, gives the embedded cache's rows
            for step in range(3):
                batch = np.concatenate([rng.choice(keys, 4000), rng.integers(0, 1000, 50)])
                rows = c.lookup(cfg.name, batch)
                assert torch.equal(rows, ref.lookup(cfg.name, torch.from_numpy(batch))), step
                grads = torch.sin(rows) + 0.1
                c.apply_gradients(cfg.name, batch, grads)
                ref.apply_gradients(cfg.name, torch.from_numpy(batch), grads)
            got, want = c.stats()[cfg.name], ref.stats()[cfg.name]
            assert got["pass"]["outside_keyset"] == want["pass"]["outside_keyset"] == 150
            c.end_pass().result(timeout=120)
            ref.end_pass().result(60)
            assert _pinned(c, cfg.name) == 0
            assert torch.equal(c.lookup(cfg.name, keys), ref.lookup(cfg.name, torch.from_numpy(keys)))
        finally:
            ref.close()
            if c.stats()[cfg.name]["pass"]["active"]:  # failed within the pass: leave the server usable
                c.end_pass().result(timeout=120)


def test_lookahead_over_the_client_gives_the_rows_of_the_embedded_cache(client: Client, tmp_path: Path) -> None:
    """LookAhead leases each upcoming batch on the servers; training through it gives the same rows, and
    nothing stays pinned after the loop, however it ends."""
    (cfg,) = _tables((8, "adagrad"))
    client.create_table(cfg)
    ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=10_000, ddr_bytes=20_000, device="cpu"),
                         [cfg])
    servers = client_servers(client)
    rng = np.random.default_rng(11)
    batches = [_keys(rng, 300) for _ in range(10)]
    leases = sum(_rpc_count(s, "PrefetchBatch") for s in servers)
    try:
        for wait in (False, True):
            seen = 0
            for keys in LookAhead(client, batches, lambda b: {cfg.name: b}, depth=2, wait=wait):
                rows = client.lookup(cfg.name, keys)
                assert torch.equal(rows, ref.lookup(cfg.name, torch.from_numpy(keys))), (wait, seen)
                grads = torch.sin(rows) + 0.1
                client.apply_gradients(cfg.name, keys, grads)
                ref.apply_gradients(cfg.name, torch.from_numpy(keys), grads)
                seen += 1
            assert seen == len(batches)
            assert _pinned(client, cfg.name) == 0, wait
        every = np.unique(np.concatenate(batches))
        assert torch.equal(client.lookup(cfg.name, every), ref.lookup(cfg.name, torch.from_numpy(every)))
        # one lease per batch on each shard that owns some of its keys
        assert sum(_rpc_count(s, "PrefetchBatch") for s in servers) - leases >= 2 * len(batches)
        for i, _ in enumerate(LookAhead(client, batches, lambda b: {cfg.name: b}, depth=3)):
            if i == 2:
                break  # leaving early cancels the leases of the batches not reached
        assert _pinned(client, cfg.name) == 0
    finally:
        ref.close()


_HOLDER = """
import sys, time
import numpy as np
from embcache import Client
c = Client([sys.argv[1]], lease_ttl=float(sys.argv[3]), timeout=120)
c.prefetch_batch({sys.argv[2]: np.arange(int(sys.argv[4]))}).result(timeout=120)
print("held", flush=True)
time.sleep(600)
"""


def test_a_lease_is_released_by_release_cancel_and_its_ttl(roomy: LocalServer, tmp_path: Path) -> None:
    (cfg,) = _tables((4, "sgd"))
    keys = np.arange(0, 3000, 3)
    with Client([roomy.address], timeout=120, lease_ttl=1.0) as c:
        c.create_table(cfg)
        lease = c.prefetch_batch({cfg.name: keys})
        result = lease.result(timeout=120)[cfg.name]
        assert result["staged_rows"] + result["leased_rows"] == keys.size
        assert _pinned(c, cfg.name) == keys.size
        time.sleep(3.5)  # three and a half TTLs: the client's renewals keep the lease
        assert _pinned(c, cfg.name) == keys.size
        lease.release()
        assert _pinned(c, cfg.name) == 0, "unpinned when release() returns"
        lease.release()  # idempotent

        # cancel, with a keyset above the message limit (sent in chunks: PrefetchBatchStream)
        streams = _rpc_count(roomy, "PrefetchBatchStream")
        big = c.prefetch_batch({cfg.name: np.arange(100_000, 120_000)})
        assert _rpc_count(roomy, "PrefetchBatchStream") == streams + 1
        big.cancel()
        assert big.done() and _pinned(c, cfg.name) == 0
        done = c.prefetch_batch({cfg.name: keys})
        done.result(timeout=120)
        assert _pinned(c, cfg.name) == keys.size
        assert done.cancel() is False and _pinned(c, cfg.name) == 0  # finished: not cancelled, but unpinned
        assert c.prefetch_batch({cfg.name: []}).result(timeout=10)[cfg.name]["staged_rows"] == 0

        # a client process killed while it holds a lease: the server unpins its rows once the TTL runs out
        script = tmp_path / "holder.py"
        script.write_text(_HOLDER)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                         os.environ.get("PYTHONPATH")]))}
        holder = subprocess.Popen([sys.executable, str(script), roomy.address, cfg.name, "2.0", "500"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            ready, _, _ = select.select([holder.stdout], [], [], START_TIMEOUT)
            assert ready and holder.stdout is not None
            line = holder.stdout.readline()
            assert line.strip() == b"held", line + (holder.stdout.read() if holder.poll() is not None else b"")
            time.sleep(4)  # two TTLs: its renewals keep it
            assert _pinned(c, cfg.name) == 500
        finally:
            holder.kill()
            holder.wait()
        t0 = time.monotonic()
        while _pinned(c, cfg.name) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        assert _pinned(c, cfg.name) == 0 and time.monotonic() - t0 < 30
        assert "expired after 2.0 s without a renewal" in roomy.log()


def test_the_read_only_methods_of_the_embedded_cache(client: Client, tmp_path: Path) -> None:
    tables = _tables((8, "adagrad"), (16, "adam"))
    for cfg in tables:
        client.create_table(cfg)
    ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=10_000, ddr_bytes=20_000, device="cpu"),
                         tables)
    try:
        for cfg in tables:
            assert client.row_bytes(cfg.name) == ref.row_bytes(cfg.name)
            per = [s[cfg.name] for s in client.shard_stats()]
            want = {t: sum(p[t]["capacity_rows"] for p in per) for t in ("hbm", "ddr")}
            assert client.capacity_rows(cfg.name) == want
    finally:
        ref.close()
    name = tables[0].name
    keys = np.arange(40)
    client.lookup(name, keys)
    hbm, ddr = client.resident_keys(name, "hbm"), client.resident_keys(name, "ddr")
    assert hbm.dtype == ddr.dtype == torch.int64
    total = client.stats()[name]
    assert hbm.numel() == total["hbm"]["resident_rows"] and ddr.numel() == total["ddr"]["resident_rows"]
    assert 0 < hbm.numel() + ddr.numel() == len(set(hbm.tolist()) | set(ddr.tolist()))
    assert set(hbm.tolist()) | set(ddr.tolist()) <= set(keys.tolist())
    with pytest.raises(ConfigError, match="tier"):
        client.resident_keys(name, "ssd")
    for call in (lambda: client.row_bytes("nope"), lambda: client.capacity_rows("nope"),
                 lambda: client.resident_keys("nope", "hbm")):
        with pytest.raises(UnknownTableError):
            call()
    # what the client leaves out, and its docstring says why
    missing = {n for n in dir(EmbeddingCache) if not n.startswith("_")} - set(dir(Client))
    assert missing == {"config", "restore", "export_rows", "import_rows", "delete_rows", "begin_export",
                       "import_version", "expire_now"}
    for name in missing:
        assert f"``{name}``" in (Client.__doc__ or "")


def test_create_table_is_idempotent_and_refuses_conflicts(client: Client) -> None:
    (cfg,) = _tables((8, "adagrad"))
    assert client.create_table(cfg) is True
    assert client.create_table(cfg) is False
    with pytest.raises(TableConflictError, match="dim"):
        client.create_table(TableConfig(name=cfg.name, dim=9))
    assert client.tables()[cfg.name] == cfg


def test_admission_through_the_fleet(client: Client) -> None:
    # admit_after travels with the table's definition to every shard; a key's lookups all reach
    # its one shard, so the fleet admits exactly as one cache would
    (base,) = _tables((4, "sgd"))
    cfg = TableConfig(**{**base.to_dict(), "admit_after": 2, "unadmitted": "zeros"})
    assert client.create_table(cfg)
    assert client.tables()[cfg.name] == cfg
    keys = np.arange(30)
    assert not client.lookup(cfg.name, keys).any()  # first sight: zeros, nothing kept
    client.apply_gradients(cfg.name, keys, torch.ones(30, 4))  # dropped: not admitted yet
    second = client.lookup(cfg.name, keys)  # admitted now: the initializer's rows, untrained
    assert second.abs().sum(dim=1).gt(0).all()
    client.apply_gradients(cfg.name, keys, torch.ones(30, 4))
    torch.testing.assert_close(client.lookup(cfg.name, keys), second - 0.05, rtol=0, atol=1e-6)
    adm = client.stats()[cfg.name]["admission"]
    assert (adm["unadmitted_lookups"], adm["dropped_updates"], adm["admitted_rows"]) == (30, 30, 30)


def test_input_errors_are_raised_before_sending(client: Client) -> None:
    (cfg,) = _tables((4, "sgd"))
    client.create_table(cfg)
    keys = np.arange(5)
    before = client.lookup(cfg.name, keys)
    with pytest.raises(UnknownTableError, match="unknown table 'nope'"):
        client.lookup("nope", keys)
    with pytest.raises(InvalidKeysError, match="integer"):
        client.lookup(cfg.name, np.array([1.5, 2.0]))
    with pytest.raises(InvalidKeysError, match="1-D"):
        client.lookup(cfg.name, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(BatchTooLargeError):
        client.lookup(cfg.name, np.zeros(50_001, dtype=np.int64))
    with pytest.raises(InvalidGradientError, match=r"shape \[5, 4\]"):
        client.apply_gradients(cfg.name, keys, torch.ones(5, 3))
    with pytest.raises(NonFiniteGradientError):
        client.apply_gradients(cfg.name, keys, torch.full((5, 4), float("inf")))
    with pytest.raises(InvalidRowsError, match="NaN"):
        client.assign(cfg.name, keys, torch.full((5, 4), float("nan")))
    with pytest.raises(InvalidRowsError, match="out must be"):
        client.lookup(cfg.name, keys, out=torch.empty(4, 4))
    assert torch.equal(client.lookup(cfg.name, keys), before)
    out = torch.empty(5, 4)
    assert client.lookup(cfg.name, keys, out=out) is out and torch.equal(out, before)
    assert client.lookup(cfg.name, []).shape == (0, 4)


def test_stats_are_summed_over_shards(client: Client) -> None:
    (cfg,) = _tables((4, "sgd"))
    client.create_table(cfg)
    client.lookup(cfg.name, np.arange(1000))
    client.lookup(cfg.name, np.arange(500))
    total = client.stats()[cfg.name]
    per = [s[cfg.name] for s in client.shard_stats()]
    assert total["lookups"] == 1500 == sum(p["lookups"] for p in per)
    tiers = total["hbm"]["hits"] + total["ddr"]["hits"] + total["ssd"]["hits"] + total["ssd"]["created"]
    assert tiers == 1500 and total["ssd"]["created"] >= 1000  # a clean row that left memory is created again
    assert total["ssd"]["created"] == sum(p["ssd"]["created"] for p in per)
    assert total["hbm"]["capacity_rows"] == sum(p["hbm"]["capacity_rows"] for p in per)


def test_flush_and_checkpoint(client: Client) -> None:
    (cfg,) = _tables((4, "sgd"))
    client.create_table(cfg)
    client.assign(cfg.name, [1, 2, 3], torch.ones(3, 4))
    client.flush()
    name = f"ckpt-{cfg.name}"
    paths = client.checkpoint(name)
    assert len(paths) == len(client.servers)
    for p in paths:
        assert p.endswith(name if len(paths) == 1 else tuple(f"shard-{i}" for i in range(len(paths))))
        with open(f"{p}/manifest.json") as f:
            assert cfg.name in f.read()
    with pytest.raises(CheckpointExistsError):
        client.checkpoint(name)
    with pytest.raises(PermissionDeniedError, match="checkpoint root"):
        client.checkpoint("../../escape")


def test_client_is_a_backend_of_the_torch_modules(client: Client, tmp_path: Path) -> None:
    """Training a model whose embeddings are served remotely gives the same rows and loss as embedded."""
    from embcache.nn import CachedEmbeddingBagCollection

    tables = _tables((8, "rowwise_adagrad"), (4, "adagrad"))
    for cfg in tables:
        client.create_table(cfg)
    ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=10_000, ddr_bytes=20_000, device="cpu"),
                         tables)
    features = {"f0": tables[0].name, "f1": tables[1].name, "f2": tables[0].name}
    remote, local = CachedEmbeddingBagCollection(client, features), CachedEmbeddingBagCollection(ref, features)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(8 + 4 + 8, generator=g)
    lookups = [_rpc_count(s, "Lookup") for s in client_servers(client)]
    for _ in range(3):
        batch = {f: torch.randint(0, 50, (16, 3), generator=g) for f in features}
        losses = []
        for module in (remote, local):
            out = module(batch)
            loss = (torch.cat([out[f] for f in features], dim=1) @ weight).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    keys = np.arange(50)
    for cfg in tables:
        assert torch.equal(client.lookup(cfg.name, keys), ref.lookup(cfg.name, torch.from_numpy(keys)))
    # one round trip per step and shard for all three features (plus the two lookups just above)
    counts = [_rpc_count(s, "Lookup") - b for s, b in zip(client_servers(client), lookups, strict=True)]
    assert counts == [5] * len(lookups)
    ref.close()


def test_momentum_rowwise_adagrad_and_stochastic_rounding_through_the_fleet(client: Client, tmp_path: Path) -> None:
    """The optimizer and the rounding added by issue 23 give through the server the rows of the
    embedded cache. Stochastic rounding draws from each shard's own count of updates, so the
    bf16 table is compared bitwise where one shard holds it (several shards: each shard is such an
    embedded cache of its part of the batches, which this does not rebuild)."""
    momentum = TableConfig(name=f"t{next(_names)}", dim=8, optimizer="rowwise_adagrad_momentum", lr=0.05, seed=11)
    tables = [momentum]
    if len(client.servers) == 1:
        tables.append(TableConfig(name=f"t{next(_names)}", dim=8, optimizer="rowwise_adagrad_momentum", lr=0.05,
                                  seed=12, dtype="bfloat16", stochastic_rounding=True))
    for cfg in tables:
        assert client.create_table(cfg) is True
    ref = EmbeddingCache(CacheConfig(path=str(tmp_path / "ref"), hbm_bytes=4_000, ddr_bytes=4_000, device="cpu"),
                         tables)
    rng = np.random.default_rng(8)
    try:
        for _ in range(12):
            for cfg in tables:
                keys = _keys(rng, 200)
                grads = torch.from_numpy(rng.standard_normal((keys.size, cfg.dim)).astype(np.float32))
                client.apply_gradients(cfg.name, keys, grads)
                ref.apply_gradients(cfg.name, torch.from_numpy(keys), grads)
        every = np.arange(-3, 5000, dtype=np.int64)
        for cfg in tables:
            assert torch.equal(client.lookup(cfg.name, every), ref.lookup(cfg.name, torch.from_numpy(every)))
    finally:
        ref.close()


def test_shards_resolved_from_a_dns_name(one_shard: LocalServer) -> None:
    from embcache.client import resolve_shards

    port = one_shard.address.rsplit(":", 1)[1]
    shards = resolve_shards(f"dns:///localhost:{port}")
    assert shards and all(addr.endswith(f":{port}") for addr in shards.values())
    assert "localhost" in shards or any(name.startswith("127.") for name in shards)  # named by reverse DNS
    with Client(f"dns:///localhost:{port}", timeout=30) as c:
        if len(shards) == 1:  # localhost may also resolve to ::1, where the server does not listen
            c.create_table(TableConfig(name="dns_t", dim=4))
            assert c.lookup("dns_t", [1, 2]).shape == (2, 4)
    with pytest.raises(ValueError, match="name:port"):
        resolve_shards("dns:///no-port")
    with pytest.raises(ValueError, match="resolve"):
        resolve_shards("dns:///no-such-host.invalid:1")


# ---------------------------------------------------------------------- retries, deadlines, fan-out
_UNARY_METHODS = {"ListTables", "CreateTable", "Lookup", "ApplyGradients", "Assign", "Flush", "Stats", "BeginPass"}
_STREAM_METHODS = {"Prefetch", "EndPass"}  # one request, a stream of replies


def _forwarded(context: grpc.ServicerContext) -> tuple[tuple[str, str], ...]:
    """The call's metadata, as a proxy passes it on (the shard map version, a token)."""
    return tuple((k, v) for k, v in context.invocation_metadata() or () if k.startswith(("embcache-", "authorization")))


class _Proxy(grpc.GenericRpcHandler):
    """A gRPC proxy in the test process in front of one real server.

    Forwards the unary calls and the server-streaming pass calls byte for byte, with their embcache
    metadata, and counts them per
    method. ``plan[method]`` lists what to do to that method's next calls instead of forwarding them
    plainly: ``"refuse"`` (UNAVAILABLE,
    not forwarded), ``"refuse_not_applied"`` (the same, marked not applied as a draining server
    marks it), ``"cancel"`` (CANCELLED, not forwarded, as gRPC cancels a call that reaches a server
    as it stops), ``"lose_reply"`` (forwarded and applied, then UNAVAILABLE, as when a connection
    drops before the reply). With a ``barrier``, each Lookup and ApplyGradients waits there until every
    proxy sharing it holds one (and fails with FAILED_PRECONDITION when they never all arrive).
    """

    def __init__(self, target: str, barrier: threading.Barrier | None = None) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.plan: dict[str, list[str]] = {}
        self._barrier = barrier
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(target)
        self._server = grpc.server(ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def _action(self, name: str, context: grpc.ServicerContext) -> str:
        """Count the call and take its planned action; refusals and cancellations abort here."""
        with self._lock:
            self.calls[name] += 1
            todo = self.plan.get(name)
            action = todo.pop(0) if todo else "forward"
        if action == "refuse_not_applied":
            context.set_trailing_metadata(((NOT_APPLIED_KEY, "1"),))
        if action.startswith("refuse"):
            context.abort(grpc.StatusCode.UNAVAILABLE, f"proxy: {name} refused, not forwarded")
        if action == "cancel":
            context.abort(grpc.StatusCode.CANCELLED, f"proxy: {name} cancelled, not forwarded")
        return action

    def service(self, handler_call_details: Any) -> Any:
        method = handler_call_details.method
        name = method.rsplit("/", 1)[-1]
        if name in _STREAM_METHODS:
            forward_stream = self._channel.unary_stream(method)

            def handle_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                self._action(name, context)
                try:
                    yield from forward_stream(request, timeout=120, metadata=_forwarded(context))
                except grpc.RpcError as err:
                    context.set_trailing_metadata(err.trailing_metadata() or ())
                    context.abort(err.code(), err.details() or "")

            return grpc.unary_stream_rpc_method_handler(handle_stream)
        if name not in _UNARY_METHODS:
            return None
        forward = self._channel.unary_unary(method)  # no serializers: bytes both ways

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            action = self._action(name, context)
            if self._barrier is not None and name in ("Lookup", "ApplyGradients"):
                try:
                    self._barrier.wait()
                except threading.BrokenBarrierError:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"proxy: {name} was not in flight together with the other shards' calls")
            try:
                reply = forward(request, timeout=120, metadata=_forwarded(context))
            except grpc.RpcError as err:
                context.set_trailing_metadata(err.trailing_metadata() or ())
                context.abort(err.code(), err.details() or "")
            if action == "lose_reply":
                context.abort(grpc.StatusCode.UNAVAILABLE, f"proxy: {name} applied, reply lost")
            return reply

        return grpc.unary_unary_rpc_method_handler(handle)

    def close(self) -> None:
        self._server.stop(None)
        self._channel.close()


@pytest.fixture(params=[1, 3], ids=["1shard", "3shards"])
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[list[LocalServer], list[_Proxy]]]:
    """The real servers and a proxy in front of each."""
    servers = ([request.getfixturevalue("one_shard")] if request.param == 1
               else request.getfixturevalue("three_shards"))
    proxies = [_Proxy(s.address) for s in servers]
    yield servers, proxies
    for p in proxies:
        p.close()


def _deltas(proxies: list[_Proxy], method: str, before: list[int]) -> list[int]:
    return [p.calls[method] - b for p, b in zip(proxies, before, strict=True)]


def test_idempotent_calls_are_resent_writes_only_when_not_applied(
        proxied: tuple[list[LocalServer], list[_Proxy]], caplog: pytest.LogCaptureFixture) -> None:
    servers, proxies = proxied
    (cfg,) = _tables((4, "sgd"))  # SGD, lr 0.05: a gradient of ones moves every coordinate by exactly -0.05
    keys = np.arange(300)
    through = {s.address: p.address for s, p in zip(servers, proxies, strict=True)}  # same names: same ring
    with Client([s.address for s in servers], timeout=60) as direct, \
            Client(through, timeout=60, backoff=0.01) as c:
        c.create_table(cfg)
        before = direct.lookup(cfg.name, keys)
        assert set(c.shard_of(keys).tolist()) == set(range(len(servers)))
        rest = [1] * (len(servers) - 1)

        # a lookup refused twice by the first shard is resent there (only there) and succeeds
        proxies[0].plan["Lookup"] = ["refuse", "refuse"]
        counts = [p.calls["Lookup"] for p in proxies]
        with caplog.at_level(logging.INFO, logger="embcache.client"):
            caplog.clear()
            assert torch.equal(c.lookup(cfg.name, keys), before)
        assert _deltas(proxies, "Lookup", counts) == [3, *rest]
        assert len([r for r in caplog.records if r.getMessage().startswith("resending Lookup")]) == 2
        proxies[0].plan["Lookup"] = ["cancel"]  # CANCELLED by a stopping server: resent too
        counts = [p.calls["Lookup"] for p in proxies]
        assert torch.equal(c.lookup(cfg.name, keys), before)
        assert _deltas(proxies, "Lookup", counts) == [2, *rest]

        # a write whose reply was lost may have been applied: not resent, it raises (here it was applied)
        proxies[0].plan["ApplyGradients"] = ["lose_reply"]
        counts = [p.calls["ApplyGradients"] for p in proxies]
        with pytest.raises(UnavailableError, match="reply lost"):
            c.apply_gradients(cfg.name, keys, torch.ones(keys.size, 4))
        assert _deltas(proxies, "ApplyGradients", counts) == [1, *rest]
        once = direct.lookup(cfg.name, keys)
        assert torch.allclose(once, before - 0.05, atol=1e-6), "applied exactly once on every shard"

        # a write the server refused before it had any effect (marked not applied) is resent, applied once
        proxies[0].plan["ApplyGradients"] = ["refuse_not_applied"]
        counts = [p.calls["ApplyGradients"] for p in proxies]
        with caplog.at_level(logging.INFO, logger="embcache.client"):
            caplog.clear()
            c.apply_gradients(cfg.name, keys, torch.ones(keys.size, 4))
        assert _deltas(proxies, "ApplyGradients", counts) == [2, *rest]
        assert any("resending ApplyGradients" in r.getMessage() and "(not applied)" in r.getMessage()
                   for r in caplog.records)
        assert torch.allclose(direct.lookup(cfg.name, keys), once - 0.05, atol=1e-6)

        # refused or cancelled without the mark: the client cannot know whether it ran: not resent
        proxies[0].plan["Assign"] = ["refuse", "cancel"]
        counts = [p.calls["Assign"] for p in proxies]
        with pytest.raises(UnavailableError, match="refused"):
            c.assign(cfg.name, keys, torch.zeros(keys.size, 4))
        with pytest.raises(RemoteError, match="CANCELLED"):
            c.assign(cfg.name, keys, torch.zeros(keys.size, 4))
        assert _deltas(proxies, "Assign", counts) == [2, *[2] * len(rest)]

    # resends are bounded by ``retries``
    with Client(through, timeout=60, backoff=0.01, retries=2) as c:
        proxies[0].plan["Lookup"] = ["refuse"] * 3
        counts = [p.calls["Lookup"] for p in proxies]
        with pytest.raises(UnavailableError, match="refused"):
            c.lookup(cfg.name, keys)
        assert _deltas(proxies, "Lookup", counts)[0] == 3


def test_pass_calls_are_resent_only_when_not_applied(proxied: tuple[list[LocalServer], list[_Proxy]],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Prefetch, BeginPass and EndPass refused before they had any effect are resent; refused without the
    mark, they raise, and a begin_pass some shard refused is undone on the shards that began."""
    servers, proxies = proxied
    (cfg,) = _tables((4, "sgd"))
    keys = np.arange(300)
    methods = ("Prefetch", "BeginPass", "EndPass")
    through = {s.address: p.address for s, p in zip(servers, proxies, strict=True)}
    rest = [1] * (len(servers) - 1)
    with Client(through, timeout=60, backoff=0.01) as c:
        c.create_table(cfg)
        assert set(c.shard_of(keys).tolist()) == set(range(len(servers)))
        for m in methods:
            proxies[0].plan[m] = ["refuse_not_applied"]
        counts = {m: [p.calls[m] for p in proxies] for m in methods}
        with caplog.at_level(logging.INFO, logger="embcache.client"):
            caplog.clear()
            assert c.prefetch({cfg.name: keys}).result(timeout=60)[cfg.name]["staged_rows"] >= 0
            assert c.begin_pass({cfg.name: keys})[cfg.name]["keyset_rows"] == keys.size
            assert all(s[cfg.name]["pass"]["active"] for s in c.shard_stats())
            assert c.end_pass().result(timeout=60) >= 0
        assert {m: _deltas(proxies, m, counts[m]) for m in methods} == {m: [2, *rest] for m in methods}
        for m in methods:
            assert any(r.getMessage().startswith(f"resending {m} ") and "(not applied)" in r.getMessage()
                       for r in caplog.records), m
        assert not any(s[cfg.name]["pass"]["active"] for s in c.shard_stats())

        # refused without the mark: the client cannot know whether it ran: not resent
        proxies[0].plan["BeginPass"] = ["refuse"]
        counts = {m: [p.calls[m] for p in proxies] for m in methods}
        with pytest.raises(UnavailableError, match="refused"):
            c.begin_pass({cfg.name: keys})
        assert _deltas(proxies, "BeginPass", counts["BeginPass"]) == [1, *rest]
        assert _deltas(proxies, "EndPass", counts["EndPass"]) == [0, *rest], "the shards that began are ended"
        assert not any(s[cfg.name]["pass"]["active"] for s in c.shard_stats())
        proxies[0].plan["Prefetch"] = ["refuse"]
        with pytest.raises(UnavailableError, match="refused"):
            c.prefetch({cfg.name: keys})
        assert _deltas(proxies, "Prefetch", counts["Prefetch"])[0] == 1  # (the others' calls are cancelled)
        c.begin_pass({cfg.name: keys})  # nothing was left half begun
        c.end_pass().result(timeout=60)


def test_a_hung_shard_fails_at_the_deadline_and_the_client_recovers(three_shards: list[LocalServer]) -> None:
    """A shard SIGSTOPped: a call that needs it raises DeadlineExceededError at about its timeout."""
    (cfg,) = _tables((4, "sgd"))
    addresses = [s.address for s in three_shards]
    timeout = 4.0
    keys = np.arange(300)
    with Client(addresses, timeout=120) as setup:  # the first calls may compile kernels: no short deadline yet
        setup.create_table(cfg)
        before = setup.lookup(cfg.name, keys)
    with Client(addresses, timeout=timeout) as c:
        assert torch.equal(c.lookup(cfg.name, keys), before)
        owner = c.shard_of(keys)
        hung = three_shards[1]
        hung.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceededError, match=re.escape(hung.address)):
                c.lookup(cfg.name, keys)
            elapsed = time.monotonic() - t0
            assert timeout * 0.9 <= elapsed < timeout + 20, elapsed  # wide: the machine is shared
            healthy = owner != 1  # the other shards still answer, each call within its own deadline
            assert torch.equal(c.lookup(cfg.name, keys[healthy]), before[torch.from_numpy(healthy)])
        finally:
            hung.resume()
        wait_serving(hung.address, 120)
        assert torch.equal(c.lookup(cfg.name, keys), before), "the same client works once the shard is back"


def test_requests_to_the_shards_are_in_flight_together(three_shards: list[LocalServer]) -> None:
    """Each shard's proxy holds its request until all three shards' requests have arrived.

    A client that waited for one shard's reply before sending the next request would never get
    all three there at once: the barrier would time out and the call fail.
    """
    barrier = threading.Barrier(3, timeout=60)
    proxies = [_Proxy(s.address, barrier) for s in three_shards]
    tables = _tables((4, "sgd"), (8, "sgd"))
    try:
        with Client([s.address for s in three_shards], timeout=120) as direct, \
                Client({s.address: p.address for s, p in zip(three_shards, proxies, strict=True)},
                       timeout=120) as c:
            for cfg in tables:
                c.create_table(cfg)
            batch = {t.name: np.arange(0, 900, 3) for t in tables}
            rows = c.lookup_many(batch)
            want = direct.lookup_many(batch)
            assert all(torch.equal(rows[n], want[n]) for n in batch)
            c.apply_gradients_many({n: (k, torch.ones(k.size, rows[n].shape[1])) for n, k in batch.items()})
            after = direct.lookup_many(batch)
            assert all(torch.allclose(after[n], want[n] - 0.05, atol=1e-6) for n in batch)
            assert [p.calls["Lookup"] for p in proxies] == [1, 1, 1]
            assert [p.calls["ApplyGradients"] for p in proxies] == [1, 1, 1]
            assert not barrier.broken
    finally:
        for p in proxies:
            p.close()


# ---------------------------------------------------------------------- atomicity under concurrency
def test_concurrent_writers_and_readers_see_whole_write_requests(three_shards: list[LocalServer]) -> None:
    """Writers assign one value to a whole batch of keys, or apply one gradient to all of them, while
    readers read the batch: on each shard (a write is atomic per table and shard), every key of
    every read must hold the same value, or some read saw a write request half applied."""
    (cfg,) = _tables((8, "sgd"))
    addresses = [s.address for s in three_shards]
    keys = np.arange(0, 6000, 3)
    n = keys.size
    with Client(addresses, timeout=120) as setup:
        setup.create_table(cfg)
        setup.assign(cfg.name, keys, torch.zeros(n, 8))  # one value everywhere to start from
        owner = setup.shard_of(keys)
    masks = [torch.from_numpy(owner == i) for i in range(3)]
    assert all(int(m.sum()) > 100 for m in masks)
    torn: list[str] = []
    failures: list[BaseException] = []
    reads = [0, 0]  # reads done entirely while the writers were writing
    writing, written, stop = threading.Event(), threading.Event(), threading.Event()

    def check(rows: torch.Tensor, who: str) -> None:
        for i, m in enumerate(masks):
            part = rows[m]
            if not bool((part == part[0, 0]).all()):
                values = torch.unique(part).tolist()
                torn.append(f"{who}: shard {i} holds {len(values)} different values, e.g. {values[:4]}")

    def reader(r: int) -> None:
        try:
            with Client(addresses, timeout=120) as c:
                while not stop.is_set():
                    during = writing.is_set()
                    check(c.lookup(cfg.name, keys), f"reader {r}")
                    if during and not written.is_set():
                        reads[r] += 1
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    def writer(w: int) -> None:
        try:
            with Client(addresses, timeout=120) as c:
                for step in range(20):
                    if w % 2 == 0:
                        c.assign(cfg.name, keys, torch.full((n, 8), float(1000 * (w + 1) + step)))
                    else:
                        c.apply_gradients(cfg.name, keys, torch.full((n, 8), float(w)))
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    readers = [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in readers:
        t.start()
    writing.set()
    for t in writers:
        t.start()
    for t in writers:
        t.join(300)
    written.set()
    stop.set()
    for t in readers:
        t.join(300)
    assert not failures, failures
    assert not torn, torn[:5]
    assert sum(reads) >= 4, f"only {reads} reads overlapped the writes"
    with Client(addresses, timeout=120) as c:
        check(c.lookup(cfg.name, keys), "final")
    assert not torn, torn


# ---------------------------------------------------------------------- shards from DNS
_NAME = "shards.embcache.test"


class _Dns:
    """A resolver with getaddrinfo's shape for one name: 127.0.0.1 with a list of ports per answer.

    Each call gives the next of ``answers`` (the last one again once they run out).
    """

    def __init__(self, *answers: list[int]) -> None:
        self.answers = [list(a) for a in answers]
        self.asked = 0

    def now(self, ports: list[int]) -> None:
        """Answer ``ports`` from now on."""
        self.answers = [list(ports)]

    def __call__(self, host: str, port: int, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        self.asked += 1
        if host != _NAME:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        ports = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", p)) for p in ports]


@pytest.fixture
def fresh_three(tmp_path: Path) -> Iterator[list[LocalServer]]:
    """Three servers of this test's own (a reshard changes the fleet's map for good)."""
    yield from _three(tmp_path)


def test_shards_from_an_injected_resolver_and_refresh(fresh_three: list[LocalServer]) -> None:
    three_shards = fresh_three
    ports = [s.port for s in three_shards]
    target = f"dns:///{_NAME}:50051"
    dns = _Dns(ports)
    # one host, several ports: each address is a shard, named by its address
    assert resolve_shards(target, dns) == {s.address: s.address for s in three_shards}
    with pytest.raises(ValueError, match="resolve"):
        resolve_shards("dns:///other.embcache.test:1", dns)

    (cfg,) = _tables((4, "sgd"))
    keys = np.arange(3000)
    dns.now(ports[:2])  # one shard not in DNS yet (e.g. its pod not ready)
    with Client(target, resolver=dns, timeout=60) as c:
        assert c.servers == {s.address: s.address for s in three_shards[:2]}
        assert c.shard_map.version == 1  # its list became the fleet's map on the two shards
        c.create_table(cfg)  # on the two shards it knows
        c.assign(cfg.name, keys, torch.from_numpy(np.repeat(keys[:, None], 4, axis=1).astype(np.float32)))
        assert c.refresh_shards() is False  # nothing changed
        dns.now(ports)
        assert c.refresh_shards() is True  # a reshard onto the three: rows move with their keys
        assert c.servers == {s.address: s.address for s in three_shards}
        new = list(c.servers).index(three_shards[2].address)
        assert cfg.name in c.shard_stats()[new], "the new shard was given the table"
        moved = c.shard_of(keys) == new  # consistent hashing: keys move to the new shard only
        assert 0.2 < moved.mean() < 0.45
        rows = c.lookup(cfg.name, keys)[:, 0].numpy()
        assert np.array_equal(rows, keys.astype(np.float32)), "a moved row lost its value"
        assert c.shard_stats()[new][cfg.name]["lookups"] == int(moved.sum())
        dns.now(ports[:2])  # and gone again: its rows move back to the two
        assert c.refresh_shards() is True and len(c.servers) == 2
        assert np.array_equal(c.lookup(cfg.name, keys)[:, 0].numpy(), keys.astype(np.float32))

    # expected_shards: the constructor resolves again until the name gives that many addresses...
    late = _Dns(ports[:1], ports[:1], ports)
    with Client(target, resolver=late, expected_shards=3, timeout=60) as c:
        # ... then routes by the map the servers hold (the two shards the last reshard left)
        assert late.asked == 3 and len(c.servers) == 2 and c.shard_map.version == 3
        # ... and a refresh that finds fewer keeps the shards it has
        late.now(ports[:1])
        with pytest.raises(UnavailableError, match="expected 3"):
            c.refresh_shards()
        assert len(c.servers) == 2 and c.lookup(cfg.name, keys[:10]).shape == (10, 4)
    t0 = time.monotonic()
    with pytest.raises(UnavailableError, match="resolves to 1 addresses"):
        Client(target, resolver=_Dns(ports[:1]), expected_shards=3, connect_timeout=1)
    assert time.monotonic() - t0 < 30
    with pytest.raises(ValueError, match="expected 2 shards"):
        Client([s.address for s in three_shards], expected_shards=2)
    with Client([three_shards[0].address]) as c, pytest.raises(ValueError, match="dns:///"):
        c.refresh_shards()


def test_a_single_server_reached_at_another_address_is_still_that_server(tmp_path: Path) -> None:
    """A one-server fleet holds no routing to disagree about: a client at an alias of its address works."""
    server = LocalServer(tmp_path / "s", tables=["name=t,dim=4"], workdir=tmp_path / "run",
                         start_timeout=START_TIMEOUT).start()
    try:
        alias = f"localhost:{server.port}"
        with Client([server.address], timeout=60) as first, Client([alias], timeout=60) as second:
            first.assign("t", [1, 2], torch.ones(2, 4))
            assert torch.equal(second.lookup("t", [1, 2]), torch.ones(2, 4))
            assert second.servers == {alias: alias}
    finally:
        server.stop()


def test_delete_reaches_the_shards_that_own_the_keys_and_counts_the_rows(three_shards: list[LocalServer]) -> None:
    """Client.delete: one Delete per shard owning keys; the rows go (a lookup gets the initializer's row
    again), the count is of distinct keys that had a row, the write receipts settle at flush; a table
    with a TTL carries it to every shard."""
    (base,) = _tables((4, "sgd"))
    cfg = TableConfig(**{**base.to_dict(), "ttl_steps": 10**9})
    with Client([s.address for s in three_shards]) as c:
        c.create_table(cfg)
        assert all(st[cfg.name]["expiry"]["ttl_steps"] == 10**9 for st in c.shard_stats())
        keys = np.arange(60, dtype=np.int64)
        fresh = c.lookup(cfg.name, keys)
        c.assign(cfg.name, keys, torch.ones(60, 4))
        before = [_rpc_count(s, "Delete") for s in three_shards]
        assert c.delete(cfg.name, np.concatenate([keys[:30], keys[:5], [10**6]])) == 30
        assert [_rpc_count(s, "Delete") - b for s, b in zip(three_shards, before, strict=True)] == [1, 1, 1]
        assert c.delete(cfg.name, keys[:30]) == 0 and c.delete(cfg.name, []) == 0
        got = c.lookup(cfg.name, keys)
        torch.testing.assert_close(got[:30], fresh[:30], rtol=0, atol=0)
        assert bool((got[30:] == 1).all())
        assert sum(st[cfg.name]["expiry"]["deleted"] for st in c.shard_stats()) == 30
        c.flush()  # the Delete receipts settle like any write's
        with pytest.raises(UnknownTableError):
            c.delete("no-such-table", [1])
        with pytest.raises(InvalidKeysError):
            c.delete(cfg.name, np.array([1.5]))


def test_merged_stats_sum_counts_but_not_settings() -> None:
    from embcache.client.merge import merge_stats

    def shard(lookups: int, setting: dict[str, Any] | None, version: int) -> dict[str, Any]:
        return {"t": {"lookups": lookups, "expiry": {"ttl_steps": 100, "ttl_seconds": 0.0, "sweeps": 2},
                      "serving": {"version": version, "directory": "/x", "age_seconds": float(version),
                                  "applied_versions": 1},
                      "policy": {"name": "lrfu", "halflife": 4.0 * lookups, "tuned": True, "setting": setting,
                                 "switches": 1}}}

    tuned = {"halflife_rows": 4.0, "idle_halving": 2.5, "strict": False}
    merged = merge_stats([shard(10, None, 3), shard(30, tuned, 2), shard(20, None, 3)])["t"]
    assert merged["lookups"] == 60
    assert merged["expiry"] == {"ttl_steps": 100, "ttl_seconds": 0.0, "sweeps": 6}
    assert merged["serving"] == {"version": 2, "directory": "/x", "age_seconds": 3.0, "applied_versions": 3}
    assert merged["policy"]["setting"] == tuned and merged["policy"]["halflife"] == 120.0  # the busiest shard's
    assert merged["policy"]["switches"] == 3 and merged["policy"]["shards"] == [None, tuned, None]
