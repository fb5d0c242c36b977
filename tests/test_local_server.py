"""LocalServer leaves nothing behind: the work directory it made for a server's log and port file
goes with it, unless a failure needs that log.

Real ``embcache-server`` processes on 127.0.0.1; temporary directories go under this test's own
``tmp_path`` (``tempfile.tempdir``), so what is left is counted exactly.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache import Client
from embcache.server.local import LocalServer

START_TIMEOUT = 300  # seconds: server start-up (imports) on a loaded 2-core machine


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory that ``tempfile.mkdtemp`` uses in this test (for LocalServer's work directory)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield scratch


def _server(tmp_path: Path) -> LocalServer:
    return LocalServer(tmp_path / "store", tables=["name=t,dim=4"], start_timeout=START_TIMEOUT)


def test_a_with_block_removes_the_work_directory_it_made_and_keeps_the_store(tmp_path: Path, scratch: Path) -> None:
    with _server(tmp_path) as server:
        workdir = Path(server.log_path).parent
        assert workdir.parent == scratch and workdir.name.startswith("embcache-server-")
        with Client([server.address]) as client:
            client.lookup("t", [1, 2])
    assert not workdir.exists()
    assert list(scratch.iterdir()) == []
    assert any((tmp_path / "store").iterdir())  # the rows stay: only the log and port file went


def test_a_with_block_left_by_an_exception_keeps_the_log(tmp_path: Path, scratch: Path) -> None:
    with pytest.raises(RuntimeError, match="the test failed"), _server(tmp_path) as server:
        log = Path(server.log_path)
        raise RuntimeError("the test failed")
    assert server.proc is not None and server.proc.poll() is not None  # stopped all the same
    assert log.exists() and log.read_text()  # what the server printed, to tell what went wrong


def test_close_removes_it_after_start_and_stop_and_a_restart_makes_it_again(tmp_path: Path, scratch: Path) -> None:
    server = _server(tmp_path).start()
    try:
        server.stop()
        server.close()
        assert list(scratch.iterdir()) == []
        server.restart()  # the same store and port, its work directory made again
        assert Path(server.log_path).exists()
        with Client([server.address]) as client:
            assert client.lookup("t", [1]).shape == (1, 4)
    finally:
        server.close()
    assert list(scratch.iterdir()) == []


def test_a_given_workdir_stays(tmp_path: Path, scratch: Path) -> None:
    server = LocalServer(tmp_path / "store", tables=["name=t,dim=4"], workdir=tmp_path / "run",
                         start_timeout=START_TIMEOUT)
    with server:
        pass
    assert (tmp_path / "run" / "server.log").exists()
