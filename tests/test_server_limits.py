"""Limits of one embcache-server process: a full store, TLS mismatches, overload isolation.

Real server processes on 127.0.0.1 (:class:`~embcache.server.local.LocalServer`), real clients.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from embcache.client import Client, TLSMismatchError, UnavailableError
from embcache.errors import StoreFullError
from embcache.server.local import LocalServer, wait_serving

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
