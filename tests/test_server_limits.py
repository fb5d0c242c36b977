"""Limits of one embcache-server process: a full store, TLS mismatches, overload isolation.

Real server processes on 127.0.0.1 (:class:`~embcache.server.local.LocalServer`), real clients.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embcache.client import Client, TLSMismatchError, UnavailableError
from embcache.errors import StoreFullError
from embcache.ring import ShardMap
from embcache.rpc import codec, wire
from embcache.rpc.errors import ERROR_TYPE_KEY, MAP_VERSION_KEY
from embcache.rpc.v1 import embcache_pb2 as pb
from embcache.rpc.v1 import embcache_pb2_grpc as pb_grpc
from embcache.server.local import LocalServer, wait_serving
from embcache.server.servicer import SERVICE_NAME

START_TIMEOUT = 300  # seconds: server start-up (imports) on a loaded 2-core machine


def test_a_full_lmdb_map_is_store_full_error_at_the_client(tmp_path: Path) -> None:
    """LMDB's map full (the disk full is the same error type, see test_stores) reaches a client as StoreFullError."""
    (tmp_path / "server.toml").write_text('[cache]\nstore = "lmdb"\nstore_options = { map_size = 1048576 }\n')
    server = LocalServer(tmp_path / "store", tables=["name=t,dim=64"], workdir=tmp_path / "run",
                         args=["--config", str(tmp_path / "server.toml"), "--hbm-bytes", "0", "--ddr-bytes", "100000"],
                         start_timeout=START_TIMEOUT).start()
    try:
        with Client([server.address]) as c:
            with pytest.raises(StoreFullError, match="MDB_MAP_FULL"):
                for start in range(0, 200_000, 4096):  # 1 MiB of map holds a few thousand rows of 64 floats
                    keys = torch.arange(start, start + 4096)
                    c.assign("t", keys, torch.ones(4096, 64))
                    c.flush()
            assert c.lookup("t", [0]).shape == (1, 64), "the server still answers"
    finally:
        server.stop()


def test_a_tls_mismatch_says_tls_at_once(tmp_path: Path) -> None:
    """Plaintext to TLS, TLS to plaintext, a wrong CA or name, no client certificate: TLSMismatchError in seconds.

    The clients keep the default wait_for_ready and a long connect_timeout: without the check each
    would wait 60 s and raise DeadlineExceededError.
    """
    pytest.importorskip("cryptography")
    from tests.test_server_e2e import _certs

    (tmp_path / "good").mkdir()
    (tmp_path / "other").mkdir()
    certs, other = _certs(tmp_path / "good"), _certs(tmp_path / "other")
    tls_server = LocalServer(tmp_path / "tls", tables=["name=t,dim=4"], wait_health=False, workdir=tmp_path / "r1",
                             args=["--hbm-bytes", "20000", "--ddr-bytes", "40000", "--tls-cert", str(certs["server"]),
                                   "--tls-key", str(certs["server_key"]), "--tls-client-ca", str(certs["ca"])],
                             start_timeout=START_TIMEOUT)
    plain_server = LocalServer(tmp_path / "plain", tables=["name=t,dim=4"], workdir=tmp_path / "r2",
                               args=["--hbm-bytes", "20000", "--ddr-bytes", "40000"], start_timeout=START_TIMEOUT)
    tls_server.start()
    plain_server.start()
    mtls = {"tls_ca": str(certs["ca"]), "tls_cert": str(certs["client"]), "tls_key": str(certs["client_key"])}
    try:
        wait_serving(tls_server.address, START_TIMEOUT, grpc.ssl_channel_credentials(
            certs["ca"].read_bytes(), certs["client_key"].read_bytes(), certs["client"].read_bytes()))
        with Client([tls_server.address], **mtls) as c:  # the right credentials work
            assert c.lookup("t", [1]).shape == (1, 4)
        cases: list[tuple[str, dict[str, Any], str]] = [
            (tls_server.address, {}, "speaks TLS and this client plaintext"),
            (tls_server.address, {**mtls, "tls_ca": str(other["ca"])}, "does not verify against tls_ca"),
            (tls_server.address, {**mtls, "tls_server_name": "elsewhere.test"}, "does not verify against tls_ca"),
            (tls_server.address, {"tls_ca": str(certs["ca"])}, "wants a client certificate"),
            (plain_server.address, {"tls_ca": str(certs["ca"])}, "does not \\(plaintext"),
        ]
        for address, kwargs, match in cases:
            t0 = time.monotonic()
            with pytest.raises(TLSMismatchError, match=match) as info:
                Client([address], connect_timeout=60, timeout=60, **kwargs)
            assert time.monotonic() - t0 < 20, (match, time.monotonic() - t0)
            assert isinstance(info.value, UnavailableError) and "TLS" in str(info.value)
        with Client([plain_server.address]) as c:  # and a plaintext client of a plaintext server is fine
            assert c.lookup("t", [1]).shape == (1, 4)
    finally:
        tls_server.stop()
        plain_server.stop()


# ---------------------------------------------------------------------- overload isolation
def _map_version(address: str) -> int:
    """The shard map version the server holds (0: none; keyed calls must carry it)."""
    with grpc.insecure_channel(address) as channel:
        state = pb_grpc.EmbeddingCacheServiceStub(channel).GetShardMap(pb.GetShardMapRequest(), timeout=30)
    return ShardMap.from_json(state.current).version if state.current else 0


def _stalled_streams(address: str, count: int, release: threading.Event, table: str = "w",
                     map_version: int | None = None) -> tuple[grpc.Channel, list[grpc.Future]]:
    """``count`` ApplyGradientsStream calls that each send one chunk, then stall until ``release`` is set.

    They carry the shard map version the server holds (keyed calls need it).
    """
    if map_version is None:
        map_version = _map_version(address)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.EmbeddingCacheServiceStub(channel)
    chunk = pb.ApplyGradientsRequest(tables=[pb.TableValues(
        table=table, keys=codec.encode_tensor(np.arange(4)), values=codec.encode_tensor(np.ones((4, 4), np.float32)))])

    def body() -> Iterator[pb.ApplyGradientsRequest]:
        yield chunk
        release.wait(120)

    metadata = ((MAP_VERSION_KEY, str(map_version)),)
    return channel, [stub.ApplyGradientsStream.future(body(), timeout=120, metadata=metadata) for _ in range(count)]


def _lookup_latencies(client: Client, rounds: int, health: Any = None) -> list[float]:
    keys = torch.arange(512)
    out = []
    for i in range(rounds):
        t0 = time.perf_counter()
        client.lookup("t", keys)
        out.append(time.perf_counter() - t0)
        if health is not None and i % 20 == 0:
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return out


def _p99(values: list[float]) -> float:
    return float(np.percentile(np.asarray(values), 99))


STALLED = 64


def test_stalled_streams_take_no_thread_from_lookups_or_health(tmp_path: Path) -> None:
    """64 client streams that send a chunk and stall: another client's lookups keep their p99, health stays SERVING.

    The streams run on their own pool (4 threads here), the rest wait in its queue holding no
    thread; once released they all complete (queued, not refused). The p99 ratio is the best of
    up to 3 rounds (unloaded, then loaded, each time): on a shared 2-core machine one stray
    10 ms pause among 300 lookups is the p99.
    """
    server = LocalServer(tmp_path / "store", tables=["name=t,dim=64", "name=w,dim=4"], workdir=tmp_path / "run",
                         args=["--hbm-bytes", "4000000", "--ddr-bytes", "4000000", "--workers", "8",
                               "--stream-workers", "4"], start_timeout=START_TIMEOUT).start()
    release = threading.Event()
    channels: list[grpc.Channel] = []
    ratios = []
    try:
        health_channel = grpc.insecure_channel(server.address)
        channels.append(health_channel)
        health = health_pb2_grpc.HealthStub(health_channel)
        with Client([server.address]) as client:
            _lookup_latencies(client, 50)  # warm-up
            for _ in range(3):
                release.clear()
                before = client.lookup("w", torch.arange(4))
                unloaded = _lookup_latencies(client, 300, health)
                channel, streams = _stalled_streams(server.address, STALLED, release)
                channels.append(channel)
                time.sleep(1.0)  # every stream has sent its chunk: 4 hold the stream threads, 60 wait
                assert not any(f.done() for f in streams)
                t0 = time.monotonic()
                loaded = _lookup_latencies(client, 300, health)
                for _ in range(20):  # health is answered at once with every stream thread busy
                    h0 = time.perf_counter()
                    assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING
                    assert time.perf_counter() - h0 < 1.0
                assert time.monotonic() - t0 < 25, "measured while the streams were still stalled"
                assert not any(f.done() for f in streams), "no stream was refused or cut (the idle limit is 30 s)"
                release.set()
                for f in streams:
                    f.result(timeout=60)  # every stream, queued or not, was applied once released
                assert not torch.equal(before, client.lookup("w", torch.arange(4)))
                ratios.append(_p99(loaded) / _p99(unloaded))
                print(f"lookup p99 unloaded {_p99(unloaded) * 1e3:.2f} ms, with {STALLED} stalled streams "
                      f"{_p99(loaded) * 1e3:.2f} ms: {ratios[-1]:.2f}x")
                if ratios[-1] < 2.0:
                    break
        assert min(ratios) < 3.0, ratios
    finally:
        release.set()
        for channel in channels:
            channel.close()
        server.stop()


def test_a_stalled_stream_is_cut_after_the_idle_time_and_applies_nothing(tmp_path: Path) -> None:
    server = LocalServer(tmp_path / "store", tables=["name=w,dim=4"], workdir=tmp_path / "run",
                         args=["--hbm-bytes", "200000", "--ddr-bytes", "200000", "--stream-workers", "2",
                               "--stream-idle-seconds", "1"], start_timeout=START_TIMEOUT).start()
    release = threading.Event()
    channel = None
    try:
        with Client([server.address]) as client:
            before = client.lookup("w", torch.arange(4))
            t0 = time.monotonic()
            channel, streams = _stalled_streams(server.address, 3, release)
            for f in streams:  # two run at once, the third after a cut: each cut 1 s after its chunk
                with pytest.raises(grpc.RpcError) as info:
                    f.result(timeout=30)
                assert info.value.code() == grpc.StatusCode.CANCELLED, info.value
            took = time.monotonic() - t0
            assert 1.0 <= took < 10, took
            assert torch.equal(client.lookup("w", torch.arange(4)), before), "a cut stream applied nothing"
            # streams the client cancels, or whose deadline passes, mid-way: gRPC ends their requests
            # like a finished stream's, and half of them used to be applied
            stub = pb_grpc.EmbeddingCacheServiceStub(channel)
            chunk = pb.ApplyGradientsRequest(tables=[pb.TableValues(table="w", keys=codec.encode_tensor(np.arange(4)),
                                                                    values=codec.encode_tensor(np.ones((4, 4),
                                                                                                       np.float32)))])

            version = _map_version(server.address)

            def stalled() -> Iterator[pb.ApplyGradientsRequest]:
                yield chunk
                release.wait(30)

            for i in range(8):
                call = stub.ApplyGradientsStream.future(stalled(), timeout=0.4 if i % 2 else 30,
                                                        metadata=((MAP_VERSION_KEY, str(version)),))
                if not i % 2:
                    time.sleep(0.3)
                    call.cancel()
                with pytest.raises(grpc.FutureCancelledError if not i % 2 else grpc.RpcError):
                    call.result(timeout=30)
                time.sleep(0.2)
            assert torch.equal(client.lookup("w", torch.arange(4)), before), "a cancelled stream applied nothing"
            client.apply_gradients("w", torch.arange(4), torch.ones(4, 4))  # and the server serves on
            assert not torch.equal(client.lookup("w", torch.arange(4)), before)
    finally:
        release.set()
        if channel is not None:
            channel.close()
        server.stop()


def test_a_reply_over_the_send_limit_is_refused_before_any_row_and_lookups_persist_no_row(tmp_path: Path) -> None:
    """A Lookup whose reply would not fit is refused up front; a lookup of unknown keys writes nothing to the store."""
    server = LocalServer(tmp_path / "store", tables=["name=big,dim=4096", "name=u,dim=8"], workdir=tmp_path / "run",
                         args=["--hbm-bytes", "400000", "--ddr-bytes", "400000", "--max-message-bytes", "4194304"],
                         start_timeout=START_TIMEOUT).start()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.EmbeddingCacheServiceStub(channel)

        def stats() -> dict[str, Any]:
            return dict(json.loads(stub.Stats(pb.StatsRequest(), timeout=30).json))

        before = stats()["big"]
        request = pb.LookupRequest(tables=[pb.TableKeys(table="big", keys=codec.encode_tensor(np.arange(300)))])
        with pytest.raises(grpc.RpcError) as info:  # 300 x 4096 x 4 bytes = 4.7 MiB > 4 MiB
            stub.Lookup(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata() or ())[ERROR_TYPE_KEY] == "BatchTooLargeError"
        assert "send limit" in (info.value.details() or "")
        after = stats()["big"]
        assert after["lookups"] == before["lookups"] and after["ssd"]["created"] == before["ssd"]["created"], \
            "nothing was read or created"
        with Client([server.address]) as client:  # the client splits the same batch below the limit
            assert client.lookup("big", torch.arange(300)).shape == (300, 4096)
            # unknown keys: the initializer's rows, cached clean; a flush writes none of them
            rows = client.lookup("u", torch.arange(10_000, 12_000))
            client.flush()
            u = stats()["u"]
            assert u["ssd"]["created"] == 2000 and u["ssd"]["write_rows"] == 0, u["ssd"]
            assert torch.equal(client.lookup("u", torch.arange(10_000, 12_000)), rows), "the same rows again"
    finally:
        channel.close()
        server.stop()


def _peak_rss(pid: int, field: str = "VmHWM") -> int:
    """The process's peak resident set (VmHWM; VmRSS: the resident set now), bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_peak_rss_stays_within_the_budgets_plus_1_gib_under_the_largest_requests(tmp_path: Path) -> None:
    """The largest Lookup (unknown keys, dim 1: the most rows per byte) and ApplyGradients a 32 MiB limit allows.

    Before lookups were handed to the cache in chunks, one lookup of 8M unknown keys (64 MiB)
    peaked 4.2 GiB above the server's start with 32 MB of tiers. The allowance is deploy/README.md's
    "Sizing a shard": about 1 GiB on a CPU node (a CPU build of torch), about 2 GiB where torch is a
    CUDA build, which maps more at import (this server peaked at 1.2 GiB on an H200 machine, the hot
    tier on the CPU as here; 1.8 GiB with it on the GPU, CUDA's context included).
    """
    budgets = 16_000_000 + 16_000_000
    limit = 32 << 20
    server = LocalServer(tmp_path / "store", tables=["name=d1,dim=1", "name=d64,dim=64"], workdir=tmp_path / "run",
                         args=["--hbm-bytes", "16000000", "--ddr-bytes", "16000000", "--max-message-bytes", str(limit),
                               "--device", "cpu"],
                         start_timeout=START_TIMEOUT).start()
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    channel = grpc.insecure_channel(server.address, options=options)
    try:
        assert server.proc is not None
        start = _peak_rss(server.proc.pid, "VmRSS")
        lookup = channel.unary_unary(f"/{SERVICE_NAME}/Lookup")
        apply = channel.unary_unary(f"/{SERVICE_NAME}/ApplyGradients")
        keys = np.arange(limit // 8 - 8192, dtype=np.int64)  # the most keys one request holds
        reply = lookup(wire.encode_lookup_request([("d1", keys)]), timeout=300)
        assert len(reply) > 4 * keys.size
        rows = limit // (4 * 64 + 8) - 1024
        apply(wire.encode_values_request([("d64", np.arange(10**9, 10**9 + rows, dtype=np.int64),
                                           np.ones((rows, 64), np.float32))]), timeout=300)
        peak = _peak_rss(server.proc.pid)
        print(f"peak RSS {peak >> 20} MiB, {start >> 20} MiB at start, with {budgets >> 20} MiB of tiers")
        allowance = (1 << 30) if torch.version.cuda is None else (2 << 30)
        assert peak < budgets + allowance, (peak, start)
    finally:
        channel.close()
        server.stop()
