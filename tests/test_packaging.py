"""What an installed embcache tells about itself: one version everywhere, its license, its types."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import embcache

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_version() -> str:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


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
