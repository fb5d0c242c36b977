"""server/: the example configuration starts a real server, and the README's paths exist.

``server/server.example.toml`` is what ``server/README.md`` tells people to start from; these tests
keep it a file the server accepts (also with its commented-out settings switched on) and serves with.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embcache.client import Client
from embcache.server.local import LocalServer
from embcache.server.main import load_settings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "server" / "server.example.toml"
README = ROOT / "server" / "README.md"
START_TIMEOUT = 300  # seconds: server start-up (imports) on a loaded 2-core machine
# a commented-out setting or section header of the example: "# key = value" or "# [section]"
COMMENTED_SETTING = re.compile(r"^# (\[[a-z_]+\]|[a-z_]+ = .*)$")


def test_example_settings_are_what_its_comments_say() -> None:
    s, _ = load_settings(["--config", str(EXAMPLE)])
    assert s.listen == "127.0.0.1:50051" and s.metrics_port == 9400 and s.max_message_bytes == 64 << 20
    assert s.torch_threads == 1 and s.flush_interval_seconds == 5 and not s.sync
    cfg = s.cache_config()
    assert (cfg.path, cfg.store, cfg.hbm_bytes, cfg.ddr_bytes) == ("./embcache-data", "rocksdb", 512 << 20, 2 << 30)
    assert {t.name: (t.dim, t.optimizer) for t in s.tables} == {"user": (64, "rowwise_adagrad"),
                                                              "item": (32, "adagrad")}


def test_example_commented_out_settings_are_valid_too(tmp_path: Path) -> None:
    lines = EXAMPLE.read_text().splitlines()
    switched = [ln for ln in lines if COMMENTED_SETTING.match(ln.split("  #")[0].rstrip())]
    assert len(switched) >= 10, switched  # the optional settings and the [tls] and [auth] sections
    on = [ln[2:] if COMMENTED_SETTING.match(ln.split("  #")[0].rstrip()) else ln for ln in lines]
    config = tmp_path / "all.toml"
    config.write_text("\n".join(on) + "\n")
    s, _ = load_settings(["--config", str(config)])
    assert s.tls_cert == "server.pem" and s.tls_client_ca == "clients-ca.pem"
    assert s.auth_token_files == ["tokens.txt"] and s.auth_readonly_token_files == ["readonly-tokens.txt"]
    assert s.flush_every_updates == 100 and s.sync and s.port_file == "embcache-server.json"
    assert s.cache_config().device == "cpu" and s.checkpoint_root == "./embcache-data/checkpoints"


def test_a_real_server_serves_with_the_example_config(tmp_path: Path) -> None:
    """The server started with the example as it is; only --path, --listen (127.0.0.1, a free port),
    --metrics-port (a free one) and --port-file come from LocalServer's flags, which override the file."""
    server = LocalServer(tmp_path / "store", args=["--config", str(EXAMPLE)], metrics=True, workdir=tmp_path / "run",
                         start_timeout=START_TIMEOUT).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with Client([server.address]) as client:
            tables = client.tables()
            assert (tables["user"].dim, tables["user"].optimizer, tables["user"].seed) == (64, "rowwise_adagrad", 1)
            assert (tables["item"].dim, tables["item"].initializer) == (32, "normal")
            keys = np.arange(1000, 1100)
            rows = client.lookup("user", keys)
            assert rows.shape == (100, 64) and torch.isfinite(rows).all()
            client.apply_gradients("user", keys, torch.ones(100, 64))
            assert not torch.equal(client.lookup("user", keys), rows)
            assert client.lookup("item", keys).shape == (100, 32)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30) as resp:
            assert b"embcache_" in resp.read()
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_server_readme_names_only_files_that_exist() -> None:
    text = README.read_text()
    paths = set(re.findall(r"`((?:server|deploy|embcache|tests|examples)/[A-Za-z0-9_./-]*)`", text))
    assert "server/server.example.toml" in paths and any(p.startswith("deploy/") for p in paths)
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert not missing, missing
