"""embcache.Client against real embcache-server processes on 127.0.0.1 (1 shard and 3 shards).

The servers are module-scoped; each test works on tables of its own (created through the
client), so tests do not see each other's rows.
"""

from __future__ import annotations

import itertools
import re
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from embcache import CacheConfig, EmbeddingCache, Keyset, TableConfig
from embcache.client import Client, PermissionDeniedError
from embcache.errors import (
    BatchTooLargeError,
    CheckpointExistsError,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    NonFiniteGradientError,
    PassStateError,
    TableConflictError,
    UnknownTableError,
)
from embcache.server.local import LocalServer

# Small tiers: most rows live in the store, so rows move between tiers during the tests.
SERVER_ARGS = ["--hbm-bytes", "20000", "--ddr-bytes", "40000", "--store", "rocksdb", "--max-batch-keys", "50000"]
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
                         workdir=base / "run")
    _start_all([server])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def three_shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalServer]]:
    base = tmp_path_factory.mktemp("three")
    servers = [LocalServer(base / f"store{i}", args=SERVER_ARGS, metrics=True, workdir=base / f"run{i}")
               for i in range(3)]
    _start_all(servers)
    yield servers
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


@pytest.fixture(params=[1, 3], ids=["1shard", "3shards"])
def client(request: pytest.FixtureRequest) -> Iterator[Client]:
    servers = ([request.getfixturevalue("one_shard")] if request.param == 1
               else request.getfixturevalue("three_shards"))
    with Client([s.address for s in servers], timeout=30) as c:
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


def _rpc_count(server: LocalServer, method: str) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    pattern = rf'embcache_rpc_request_duration_seconds_count\{{code="OK",method="{method}"\}} ([0-9.e+]+)'
    m = re.search(pattern, text)
    return int(float(m.group(1))) if m else 0


# ---------------------------------------------------------------------- differential
def test_random_ops_match_the_embedded_cache(client: Client, tmp_path) -> None:
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


def test_batches_above_the_message_limit_are_split_and_stay_exact(one_shard: LocalServer, tmp_path) -> None:
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


def test_create_table_is_idempotent_and_refuses_conflicts(client: Client) -> None:
    (cfg,) = _tables((8, "adagrad"))
    assert client.create_table(cfg) is True
    assert client.create_table(cfg) is False
    with pytest.raises(TableConflictError, match="dim"):
        client.create_table(TableConfig(name=cfg.name, dim=9))
    assert client.tables()[cfg.name] == cfg


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


def test_client_is_a_backend_of_the_torch_modules(client: Client, tmp_path) -> None:
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
