"""Small helpers shared by the benchmarks: timing, machine and version info, tables, JSON.

Only the standard library is imported at module level (numpy/torch lazily), so a benchmark's
helper process running in another virtual environment (e.g. ``bench/fbgemm_tbe.py`` in an
FBGEMM venv without embcache) can import this file too.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from importlib import metadata
from typing import Any

__all__ = [
    "interleaved_timings",
    "machine_info",
    "markdown_table",
    "package_versions",
    "rate_summary",
    "timings",
    "write_json",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the repository (read-only), or None outside a checkout."""
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None


def machine_info(packages: Sequence[str] = ("torch", "numpy", "numba", "rocksdict", "lmdb")) -> dict[str, Any]:
    """Machine, OS, Python, package versions, thread settings, load and git commit."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": _mem_total_bytes(),
        "python": sys.version.split()[0],
        "packages": package_versions(packages),
        "git_commit": git_commit(),
        "loadavg_at_start": list(os.getloadavg()),
        "unix_time": time.time(),
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda_available"] = torch.cuda.is_available()
    except ImportError:
        pass
    return info


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
