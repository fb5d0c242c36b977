"""What an installed embcache tells about itself: one version everywhere, its license, its types; and what a
core install (no extras) holds and runs."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

import embcache

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def _pyproject_version() -> str:
    return str(_project()["version"])


def test_one_version_from_the_package_metadata() -> None:
    assert embcache.__version__ == _pyproject_version()


@pytest.mark.parametrize(("module", "prog"), [("embcache", "embcache"), ("embcache.server", "embcache-server"),
                                              ("embcache.demo", "embcache-demo")])
def test_every_command_says_its_version(module: str, prog: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{prog} {_pyproject_version()}"


def test_license_and_type_marker_ship_with_the_package() -> None:
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert (Path(embcache.__file__).parent / "py.typed").exists()
    assert "py.typed" in (ROOT / "pyproject.toml").read_text()


# ---------------------------------------------------------------------------------------- the core install

_SERVER_MODULES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf")
_OPTIONAL_MODULES = (*_SERVER_MODULES, "matplotlib")


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_core_dependencies_leave_the_server_and_the_plots_to_extras() -> None:
    project = _project()
    core, extras = _names(project["dependencies"]), project["optional-dependencies"]
    assert {"torch", "numpy", "numba", "rocksdict", "lmdb", "tqdm", "prometheus-client"} <= core
    assert not core & {"grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "matplotlib", "redis"}
    assert {"grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf"} <= _names(extras["server"])
    assert "matplotlib" in _names(extras["sizing"])
    # ./dev test installs ".[test,bench]": that must still bring every extra the tests use
    for extra in ("test", "bench"):
        bundled = next((r for r in extras[extra] if r.startswith("embcache[")), "")
        assert {"server", "sizing"} <= set(bundled[len("embcache["):-1].split(",")), extra
    assert project["scripts"]["embcache-server"] == "embcache.cli:server_main"
    assert 'pip install "./[server]"' in (ROOT / "deploy" / "docker" / "Dockerfile").read_text()  # the server image


# Run in a fresh interpreter: the server's and the plots' modules cannot be imported, as in a core install.
_BLOCKED = f"""
import importlib.abc, importlib.util, sys
BLOCK = {_OPTIONAL_MODULES!r}
def blocked(name):
    return any(name == b or name.startswith(b + ".") for b in BLOCK)
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if blocked(name):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if blocked(name) else _find_spec(name, package)
"""

# What a core install must do (run both under the blocker above and in the fresh venv of the slow test).
_CORE_CHECKS = """
import sys, tempfile, torch
import embcache
from embcache import *  # noqa: F403  (takes only the names the installed extras allow)
from embcache import CacheConfig, EmbeddingCache, TableConfig, cli
from embcache.metrics import register_metrics
from embcache.nn import CachedEmbeddingBagCollection
from prometheus_client import CollectorRegistry, generate_latest

with tempfile.TemporaryDirectory() as d:
    with EmbeddingCache(CacheConfig(hbm_bytes=1 << 12, ddr_bytes=1 << 13, path=d, device="cpu"),
                        [TableConfig(name="t", dim=4, optimizer="adagrad")]) as cache:
        registry = CollectorRegistry()
        register_metrics(cache, registry=registry)
        ebc = CachedEmbeddingBagCollection(cache, {"f": "t"})
        ebc({"f": torch.randint(0, 100, (8, 3))})["f"].sum().backward()
        assert b"embcache_lookups_total" in generate_latest(registry)
for name in ("Client", "DataLossError"):
    try:
        getattr(embcache, name)
    except ImportError as exc:
        assert "pip install 'embcache[server]'" in str(exc), exc
    else:
        raise AssertionError(f"embcache.{name} without gRPC")
try:
    import embcache.server  # noqa: F401
except ImportError as exc:
    assert "pip install 'embcache[server]'" in str(exc), exc
else:
    raise AssertionError("embcache.server without gRPC")
assert cli.main(["reshard", "--servers", "a:1", "--add", "b:1"]) == 2
assert cli.server_main(["--path", d]) == 2
try:
    cli.main(["sizing", "trace.npy"])
except SystemExit as exc:
    assert "pip install 'embcache[sizing]'" in str(exc.code), exc.code
else:
    raise AssertionError("embcache sizing without matplotlib")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "grpc_health", "grpc_reflection", "matplotlib")
                or m.startswith("google.protobuf"))
assert not loaded, loaded
print("core checks passed; embcache from", embcache.__file__)
"""


def test_embedded_use_needs_neither_grpc_nor_matplotlib() -> None:
    out = subprocess.run([sys.executable, "-c", _BLOCKED + _CORE_CHECKS], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "core checks passed" in out.stdout


def _required_or_skip(message: str) -> None:
    """Skip saying why, except under CI=true, where the test must run."""
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (required under CI=true)")
    pytest.skip(message)


def _run(cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def _build_wheel(out: Path) -> Path:
    """The wheel of the source tree (copied first: setuptools writes build/ and egg-info next to it)."""
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "embcache", src / "embcache", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out / "dist"), str(src)]
    try:  # pyproject's build backend here already: build with it, offline
        offline = Version(importlib.metadata.version("setuptools")) >= Version("77")
    except importlib.metadata.PackageNotFoundError:
        offline = False
    built = _run([*cmd, "--no-build-isolation"] if offline else cmd, timeout=300)
    if built.returncode != 0:
        if offline:
            pytest.fail("pip wheel failed:\n" + built.stdout + built.stderr)
        last = (built.stderr.strip().splitlines() or [""])[-1]
        _required_or_skip(f"cannot build the wheel offline (no setuptools>=77 in this environment, and pip "
                          f"could not fetch one for an isolated build): {last}")
    (wheel,) = (out / "dist").glob("embcache-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_with_core_dependencies_runs_the_embedded_example(tmp_path: Path) -> None:
    """The wheel, installed with its core dependencies only into a venv that sees no other packages, runs
    examples/embedded.py; gRPC and matplotlib are not there, and what needs them says which extra to install.

    torch: the version this environment runs (``torch==X.Y.Z``, as ./dev's set-up asks: the local CPU build
    where the machine keeps one). Bytecode is left to the first import (``--no-compile``: the install's own
    compileall of torch took 45 s of 75). About 80-110 s on 2 busy cores, most of it unpacking torch and
    the first run's numba compilation.
    """
    import torch

    with tempfile.TemporaryDirectory(prefix="embcache-wheel-") as tmp:  # ~1.2 GB: removed at once, not kept
        work = Path(tmp)
        wheel = _build_wheel(work)
        venv = work / "venv"
        made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
        assert made.returncode == 0, made.stderr
        assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
        py = str(venv / "bin" / "python")
        installed = _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-compile",
                          str(wheel), f"torch=={torch.__version__.split('+')[0]}"], timeout=600)
        if installed.returncode != 0:
            if "No matching distribution" in installed.stderr or "NewConnectionError" in installed.stderr:
                _required_or_skip("the core dependencies cannot be installed (no index reachable and not in "
                                  "pip's cache): " + installed.stderr.strip().splitlines()[-1])
            pytest.fail("pip install failed:\n" + installed.stdout + installed.stderr)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # not this source tree
        shutil.copy2(ROOT / "examples" / "embedded.py", work / "embedded.py")
        dists = _run([py, "-I", "-c", "import importlib.metadata as m; "
                      "print(sorted(d.metadata['Name'].lower() for d in m.distributions()))"], 120, env=env)
        for extra in ("grpcio", "protobuf", "matplotlib", "grpcio-health-checking", "redis"):
            assert f"'{extra}'" not in dists.stdout, dists.stdout
        for module in _OPTIONAL_MODULES:
            probe = _run([py, "-I", "-c", f"import {module}"], 120, env=env, cwd=work)
            assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, (module, probe.stdout)
        example = _run([py, "-I", str(work / "embedded.py"), "--steps", "30"], 400, env=env, cwd=work)
        assert example.returncode == 0, example.stdout + example.stderr
        first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", example.stdout).groups())  # type: ignore[union-attr]
        assert last < first, example.stdout
        checks = _run([py, "-I", "-c", _CORE_CHECKS], 300, env=env, cwd=work)
        assert checks.returncode == 0, checks.stdout + checks.stderr
        assert str(venv) in checks.stdout  # the installed package, not this source tree
        server = _run([str(venv / "bin" / "embcache-server"), "--version"], 120, env=env, cwd=work)
        assert server.returncode == 2 and "pip install 'embcache[server]'" in server.stderr, server.stderr
