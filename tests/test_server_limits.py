"""Limits of one embcache-server process: a full store, TLS mismatches, overload isolation.

Real server processes on 127.0.0.1 (:class:`~embcache.server.local.LocalServer`), real clients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embcache.client import Client
from embcache.errors import StoreFullError
from embcache.server.local import LocalServer

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
