"""Small helpers shared by the benchmarks: timing, machine and version info, tables, JSON.

Only the standard library is imported at module level (numpy/torch lazily), so a benchmark's
helper process running in another virtual environment (e.g. ``bench/fbgemm_tbe.py`` in an
FBGEMM venv without embcache) can import this file too.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from importlib import metadata
from typing import Any

__all__ = [
    "PACKAGES",
    "RedisServer",
    "RedisUnavailable",
    "command_line",
    "format_ratio",
    "git_state",
    "gpu_info",
    "interleaved_timings",
    "machine_info",
    "markdown_table",
    "package_versions",
    "rate_summary",
    "timings",
    "write_json",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# versions recorded in every benchmark's header (None where a package is not installed)
PACKAGES = ("torch", "numpy", "numba", "rocksdict", "lmdb", "grpcio")


def timings(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved_timings(fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1,
                        self_timed: Collection[str] = ()) -> dict[str, list[float]]:
    """Like :func:`timings` for several functions, alternating them within each repeat.

    On a shared machine the load changes over seconds; alternating the contenders exposes each
    to the same conditions, so their ratio is steadier than that of back-to-back runs. A function
    named in ``self_timed`` returns its own seconds (e.g. measured in another process), which are
    used instead of the wall time around the call.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            ret = fn()
            elapsed = time.perf_counter() - t0
            out[name].append(float(ret) if name in self_timed else elapsed)  # type: ignore[arg-type]
    return out


def rate_summary(rows: int, seconds: Sequence[float]) -> dict[str, Any]:
    """Rows per second of ``rows`` rows done in each of ``seconds``: median (the headline), min, max, all."""
    rates = [rows / s for s in seconds]
    return {
        "rows_per_s": statistics.median(rates),
        "rows_per_s_min": min(rates),
        "rows_per_s_max": max(rates),
        "rows_per_repeat": rows,
        "seconds": list(seconds),
    }


def package_versions(names: Sequence[str]) -> dict[str, str | None]:
    """Installed versions of distribution ``names`` (None where not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git(*args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the repository (read-only), or None outside a checkout."""
    res = _git("rev-parse", "HEAD")
    return (res.stdout.strip() or None) if res is not None and res.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The checkout measured: HEAD commit, its date, and whether the working tree differs from it.

    ``git_dirty`` is True when ``git status --porcelain`` lists anything (modified, staged or
    untracked files that git does not ignore); ``git_dirty_paths`` names up to 50 of them, so a
    reader can tell whether the difference touched the code measured (``embcache/``, the script).
    """
    commit = git_commit()
    out: dict[str, Any] = {"git_commit": commit, "git_commit_short": commit[:7] if commit else None,
                           "git_commit_date": None, "git_dirty": None, "git_dirty_paths": []}
    if commit is None:
        return out
    res = _git("show", "-s", "--format=%cI", commit)
    if res is not None and res.returncode == 0:
        out["git_commit_date"] = res.stdout.strip() or None
    res = _git("status", "--porcelain")
    if res is not None and res.returncode == 0:
        paths = [line[3:] for line in res.stdout.splitlines() if line.strip()]
        out["git_dirty"] = bool(paths)
        out["git_dirty_paths"] = paths[:50]
    return out


def gpu_info() -> list[dict[str, Any]]:
    """CUDA devices torch sees: name, memory, compute capability (empty without CUDA or torch)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_bytes": int(p.total_memory),
                     "capability": f"{p.major}.{p.minor}"})
    return gpus


def command_line(script: str | None = None, argv: Sequence[str] | None = None) -> str:
    """The command that ran the benchmark, relative to the repository root where it lies inside it.

    Args:
        script: the benchmark's file (default ``sys.argv[0]``).
        argv: its arguments (default ``sys.argv[1:]``); pass them when ``main(argv)`` is called
            in-process (a test), where ``sys.argv`` is the caller's.
    """
    def rel(path: str) -> str:
        full = os.path.abspath(path)
        return os.path.relpath(full, REPO_ROOT) if full.startswith(REPO_ROOT + os.sep) else path

    exe = sys.executable
    exe_rel = rel(exe) if exe else "python"
    return " ".join([exe_rel, rel(script or sys.argv[0]), *(sys.argv[1:] if argv is None else argv)])


def machine_info(packages: Sequence[str] = (), script: str | None = None,
                 argv: Sequence[str] | None = None) -> dict[str, Any]:
    """THE header of every benchmark's JSON (its ``"machine"`` entry): where, with what, and when.

    Call it when the benchmark starts. It records the machine (CPU model, cores, RAM, GPUs), the
    OS, Python, the versions of :data:`PACKAGES` and of ``packages`` (None where not installed),
    the git commit, its date and whether the working tree was dirty (:func:`git_state`), the
    command line (:func:`command_line`), the start time (ISO 8601 UTC and Unix), the load average
    at start, and torch's thread count. ``python -m bench`` reads ``git_commit``, ``git_dirty``
    and ``started_at`` from it to say when each result was measured and whether it is stale.

    Args:
        packages: distributions to record besides :data:`PACKAGES`.
        script: the benchmark's file, for the command line (default ``sys.argv[0]``).
        argv: the benchmark's arguments (default ``sys.argv[1:]``).
    """
    now = time.time()
    names = list(dict.fromkeys([*PACKAGES, *packages]))
    info: dict[str, Any] = {
        "started_at": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds"),
        "unix_time": now,
        "command": command_line(script, argv),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": _mem_total_bytes(),
        "gpus": gpu_info(),
        "python": sys.version.split()[0],
        "packages": package_versions(names),
        **git_state(),
        "loadavg_at_start": list(os.getloadavg()),
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda_available"] = torch.cuda.is_available()
    except ImportError:
        pass
    return info


def format_ratio(ratio: float | None, target: float | None = None) -> str:
    """A ratio as ``1.23x``, with more digits where two would hide which side of 1 or the target it lies.

    ``0.997`` is printed ``0.997x``, not ``1.00x`` (which would read as a tie, or contradict a
    "not met" next to a target of 1x); likewise ``0.8996`` against a 0.9x target. None or NaN
    gives an em dash.
    """
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return "—"
    if math.isinf(ratio):
        return "inf"
    marks = {1.0} | ({float(target)} if target is not None else set())
    for digits in range(2, 6):
        shown = float(f"{ratio:.{digits}f}")
        if all((shown < m) == (ratio < m) and (shown > m) == (ratio > m) for m in marks):
            return f"{ratio:.{digits}f}x"
    return f"{ratio:.5f}x"


class RedisUnavailable(RuntimeError):
    """Redis cannot be used as a peer here; the message says why (shown in the results)."""


class RedisServer:
    """A private ``redis-server`` on 127.0.0.1 (a free port, no persistence) for a benchmark's Redis peer.

    Needs Debian's ``redis-server`` on the PATH and redis-py (with hiredis, the ``bench`` extra).
    ``client()`` opens a redis-py client; ``parser`` names the reply parser redis-py uses
    (``_HiredisParser`` when hiredis is installed); ``close()`` stops the server.

    Raises:
        RedisUnavailable: no ``redis-server`` on the PATH, no redis-py, or the server did not answer.
    """

    def __init__(self, workdir: str, timeout: float = 30.0) -> None:
        if shutil.which("redis-server") is None:
            raise RedisUnavailable("redis-server not found on the PATH (Debian: apt-get install -y redis-server)")
        try:
            import redis
        except ImportError:
            raise RedisUnavailable("redis-py not installed (pip install -e '.[bench]')") from None
        self._redis = redis
        os.makedirs(workdir, exist_ok=True)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RedisUnavailable(f"redis-server did not answer on port {self.port} "
                                               f"(exit {self.proc.poll()})") from None
                    time.sleep(0.05)
            self.parser = type(client.connection_pool.get_connection()._parser).__name__
        except BaseException:
            client.close()
            self.close()
            raise
        client.close()

    def client(self) -> Any:
        """A new redis-py client of this server."""
        return self._redis.Redis(host="127.0.0.1", port=self.port)

    def close(self) -> None:
        """Stop the server (idempotent)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table (cells converted with ``str``), padded for reading as text."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (a temporary file renamed over ``path``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return obj.tolist()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def plot_phase_latency(phases: Mapping[str, Mapping[str, Any]], path: str, title: str, width: float = 6.0) -> None:
    """Bars of each phase's lookup p50 and p99 (``phases[name]["p50_ms"]``, ``["p99_ms"]``), saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(phases)
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(width, 3.5))
    ax.bar(x - 0.2, [phases[k]["p50_ms"] for k in labels], 0.4, label="p50")
    ax.bar(x + 0.2, [phases[k]["p99_ms"] for k in labels], 0.4, label="p99")
    ax.set_xticks(x, labels)
    ax.set_ylabel("lookup latency, ms")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
