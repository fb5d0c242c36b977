"""The server's stack dump (``kill -USR1``): every thread, named, the main thread first."""

from __future__ import annotations

import faulthandler
import io
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from embcache import CacheConfig, Client, TableConfig
from embcache.server.settings import ServerSettings
from embcache.server.stacks import dump_stacks


def test_every_thread_is_dumped_by_name_even_past_faulthandlers_100() -> None:
    # A 16-core server runs more than 100 Python threads (64 gRPC workers, 32 stream workers, its
    # own); faulthandler stops at 100 and cut the main thread on an H100 node.
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, name=f"worker-{i:03d}", daemon=True) for i in range(120)]
    for t in threads:
        t.start()
    try:
        out = io.StringIO()
        n = dump_stacks(out)
        text = out.getvalue()
        with tempfile.TemporaryFile("w+") as f:  # what faulthandler makes of the same threads
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            fh = f.read()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert n >= 121 and text.count("\nThread 0x") == n
    assert all(f"(worker-{i:03d}, daemon):" in text for i in range(120))
    first = text.index("\nThread 0x")
    assert text[first:].split("\n")[1].endswith("(MainThread):")  # the main thread first
    assert "in test_every_thread_is_dumped_by_name_even_past_faulthandlers_100\n" in text
    assert fh.rstrip().endswith("...")  # faulthandler: cut at 100 threads



class _StopNeverReported:
    """The real gRPC server, whose stop (called for real) is never reported done: the case the
    shutdown bounds (gRPC's own shutdown stuck), which a handler blocked in the cache does not
    make (gRPC reports the stop once it has cancelled the calls; the flush then waits for them)."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def stop(self, grace: float | None) -> threading.Event:
        self._server.stop(grace)
        return threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def test_a_shutdown_whose_calls_never_end_prints_every_thread_by_name_and_still_flushes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """A real server in this process. A Lookup waits for its table's lock, which the test holds;
    gRPC's stop is never reported done. Past the grace period and the slack, shutdown says so and
    prints every thread's stack, the stuck handler's by its thread's name; it then flushes, once
    the lock is let go, and the rows assigned before are on disk."""
    from embcache import EmbeddingCache
    from embcache.server import serve

    monkeypatch.setattr(serve, "_STOP_SLACK_SECONDS", 0.5)
    cache_cfg = {"path": str(tmp_path / "store"), "hbm_bytes": 1 << 20, "ddr_bytes": 1 << 20}
    running = serve.start_server(ServerSettings(listen="127.0.0.1:0", metrics_port=-1, grace_seconds=0.2,
                                                torch_threads=1, cache=cache_cfg,
                                                tables=[TableConfig(name="t", dim=4)]))
    running.server = _StopNeverReported(running.server)  # type: ignore[assignment]
    client = Client([f"127.0.0.1:{running.port}"], timeout=60, retries=0)
    rows = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    client.assign("t", [1, 2], rows)
    lock = running.cache._tables["t"].lock
    lock.__enter__()
    outcome: list[object] = []
    call = threading.Thread(target=lambda: outcome.append(_try(lambda: client.lookup("t", [1, 2]))))
    call.start()
    stopping = threading.Thread(target=running.shutdown)
    try:
        deadline = time.monotonic() + 60
        while running.servicer.metrics._started["Lookup"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the Lookup reached the server (it then waits for the lock)
        time.sleep(0.2)
        with caplog.at_level(logging.INFO, logger="embcache.server"):
            stopping.start()
            stopping.join(0.2 + 0.5 + 5.0)  # grace + slack + the dump; then the flush waits for the lock
            err = capfd.readouterr().err
            assert stopping.is_alive()
    finally:
        lock.__exit__(None, None, None)
        stopping.join(60)
        call.join(60)
        client.close()
    assert not stopping.is_alive()
    assert "gRPC calls still not finished" in caplog.text
    first = err.index("\nThread 0x")
    assert err[first:].split("\n")[1].endswith("(MainThread):")  # the main thread first
    stuck = err[err.index("(embcache-rpc"):]
    assert "in lookup\n" in stuck[:stuck.find("\nThread 0x")]  # a gRPC worker, named, inside the cache
    assert outcome and isinstance(outcome[0], BaseException)  # cancelled: never an OK without rows
    with EmbeddingCache(CacheConfig(**cache_cfg), [TableConfig(name="t", dim=4)]) as cache:  # flushed, closed
        assert torch.equal(cache.lookup("t", torch.tensor([1, 2])), rows)


def _try(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except BaseException as exc:  # the outcome itself is what the test checks
        return exc
