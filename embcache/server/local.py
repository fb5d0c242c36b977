"""Run embcache-server processes on this machine: for tests, benchmarks and single-machine examples.

    with LocalServer(path="/tmp/shard0", tables=["name=user,dim=64"]) as server:
        client = embcache.Client([server.address])

Each server binds 127.0.0.1 on a free port (``--listen 127.0.0.1:0``) and reports it through
``--port-file``; :meth:`LocalServer.start` returns once the health service says SERVING.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import embcache

from .main import DIE_WITH_PARENT_ENV

__all__ = ["LocalServer", "wait_serving"]

_PACKAGE_ROOT = str(Path(embcache.__file__).resolve().parents[1])


def wait_serving(address: str, timeout: float, credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
    """Wait until the health service at ``address`` reports SERVING.

    Raises:
        TimeoutError: not SERVING within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    with (grpc.secure_channel(address, credentials, options=list(options)) if credentials is not None
          else grpc.insecure_channel(address)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"embcache-server at {address} not SERVING after {timeout:g} s")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=min(left, 5.0), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)


class LocalServer:
    """An ``embcache-server`` child process on 127.0.0.1 with a free port.

    Args:
        path: the store directory (kept across :meth:`restart`).
        tables: ``--table`` specs (e.g. ``"name=user,dim=64,optimizer=adagrad"``).
        args: further flags (e.g. ``["--hbm-bytes", "1000000", "--sync"]``).
        metrics: serve Prometheus metrics on a free port (see :attr:`metrics_port`).
        start_timeout: seconds :meth:`start` waits for SERVING (default 60).
        env: extra environment variables.
        wait_health: check health before :meth:`start` returns (off for servers that need TLS to talk to).
        workdir: where the port file and log go (default: a new temporary directory, removed by
            :meth:`close` and by leaving a ``with`` block without an exception; a block left by an
            exception keeps it, for the server's log at :attr:`log_path`).
    """

    def __init__(self, path: str | os.PathLike[str], tables: Sequence[str] = (), args: Sequence[str] = (),
                 metrics: bool = False, start_timeout: float = 60.0, env: dict[str, str] | None = None,
                 wait_health: bool = True, workdir: str | os.PathLike[str] | None = None) -> None:
        self.path = os.fspath(path)
        self.tables, self.args = list(tables), list(args)  # public: change them between restarts
        self._metrics, self._timeout, self._env = metrics, start_timeout, dict(env or {})
        self._wait_health = wait_health
        self._own_dir = workdir is None  # made here: close() removes it
        self._dir = os.fspath(workdir) if workdir is not None else tempfile.mkdtemp(prefix="embcache-server-")
        os.makedirs(self._dir, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port = -1
        self._deadline = 0.0
        self._listen_port = 0  # 0 first; a restart reuses the port so clients reconnect to the same address

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        """The server's stdout and stderr."""
        return os.path.join(self._dir, "server.log")

    def log(self) -> str:
        """What the server printed so far."""
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def command(self) -> list[str]:
        """The command line that starts the server."""
        cmd = [sys.executable, "-m", "embcache.server", "--path", self.path, "--listen",
               f"127.0.0.1:{self._listen_port}", "--metrics-port", "0" if self._metrics else "-1",
               "--port-file", os.path.join(self._dir, "port.json")]
        for spec in self.tables:
            cmd += ["--table", spec]
        return cmd + self.args

    def start(self) -> LocalServer:
        """Start the process and wait until it serves (:meth:`launch` then :meth:`wait_ready`).

        Raises:
            RuntimeError: the process exited during start-up (its log is in the message).
            TimeoutError: it did not serve within ``start_timeout``.
        """
        return self.launch().wait_ready()

    def launch(self) -> LocalServer:
        """Start the process without waiting (start several, then :meth:`wait_ready` each)."""
        os.makedirs(self._dir, exist_ok=True)  # (again after close(): a restart)
        port_file = os.path.join(self._dir, "port.json")
        if os.path.exists(port_file):
            os.unlink(port_file)
        env = {**os.environ, **self._env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        # The server stops when this process (the thread starting it) dies, so none is left behind
        # (see embcache.server.main). It arranges that itself: a preexec_fn would make Python fork()
        # rather than vfork(), and gRPC's fork handlers can hang a fork while this process has calls
        # in flight (grpc/grpc#37259).
        env[DIE_WITH_PARENT_ENV] = str(os.getpid())
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)
        self._deadline = time.monotonic() + self._timeout
        return self

    def wait_ready(self) -> LocalServer:
        """Wait for the port file and (unless ``wait_health=False``) health SERVING.

        Raises:
            RuntimeError: the process exited during start-up. TimeoutError: too slow.
        """
        assert self.proc is not None, "launch() first"
        port_file = os.path.join(self._dir, "port.json")
        while not os.path.exists(port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"embcache-server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            if time.monotonic() > self._deadline:
                self.kill()
                raise TimeoutError(f"embcache-server did not start within {self._timeout:g} s:\n{self.log()}")
            time.sleep(0.05)
        with open(port_file) as f:
            info = json.load(f)
        self.port, self.metrics_port = int(info["port"]), int(info["metrics_port"])
        self._listen_port = self.port
        if self._wait_health:
            wait_serving(self.address, max(self._deadline - time.monotonic(), 1.0))
        return self

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful: drain, flush, close) and wait; returns the exit status.

        Raises:
            TimeoutError: still running after ``timeout`` s (it is then killed; the message holds its log).
        """
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc is not None else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # the server prints its threads' stacks to its log
            time.sleep(1.0)
            self.kill()
            raise TimeoutError(f"embcache-server did not stop within {timeout:g} s of SIGTERM; its log, with the "
                               f"stacks of its threads at the end:\n{self.log()[-20000:]}") from None

    def terminate(self) -> None:
        """Send SIGTERM without waiting (stop several servers together, then :meth:`stop` each)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the process stops answering (its sockets stay open), as a hung or overloaded server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> LocalServer:
        """Start again on the same store and port (after :meth:`stop` or :meth:`kill`)."""
        self.kill()
        return self.start()

    def __enter__(self) -> LocalServer:
        return self.start()

    def close(self) -> None:
        """Stop the server (:meth:`stop`, killed if that fails) and remove the work directory made
        for it (a ``workdir`` given stays; the store at ``path`` always stays)."""
        self._end(remove_dir=self._own_dir)

    def _end(self, remove_dir: bool) -> None:
        try:
            self.stop()
        finally:
            self.kill()
            if remove_dir:
                shutil.rmtree(self._dir, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # left by an exception: keep the work directory, whose log tells what went wrong
        self._end(remove_dir=self._own_dir and exc_type is None)
