"""The docs site: it builds with ``mkdocs build --strict``, every Python example in the docs runs,
and the README's links lead somewhere.

Examples are the ```python blocks of ``docs/**/*.md`` and ``README.md``. Each runs on its own in
a fresh interpreter with an empty working directory (so ``./embcache-data`` and the like are its
own), the checkout first on ``PYTHONPATH``. A block that cannot run here (it needs a server, a
GPU or torchrec) is marked by a ``<!-- no-run: why -->`` comment on the line before its fence;
keep those few.

mkdocs, mkdocs-material and mkdocstrings-python come with the ``docs`` extra (part of ``test``);
without them the build test skips, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NO_RUN = re.compile(r"^<!--\s*no-run\b.*-->\s*$")
FENCE = re.compile(r"^```python\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _blocks() -> list[tuple[str, int, str, bool]]:
    """(page, line of the fence, code, runs) of every ```python block."""
    out = []
    for page in _pages():
        lines = page.read_text().split("\n")
        i = 0
        while i < len(lines):
            if FENCE.match(lines[i]):
                start = i
                j = i + 1
                while not lines[j].startswith("```"):
                    j += 1
                before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
                out.append((str(page.relative_to(ROOT)), start + 1, "\n".join(lines[start + 1:j]) + "\n",
                            not NO_RUN.match(before.strip())))
                i = j
            i += 1
    return out


BLOCKS = _blocks()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


@pytest.mark.parametrize(("page", "line", "code"), [(p, n, c) for p, n, c, runs in BLOCKS if runs],
                         ids=[f"{p}:{n}" for p, n, _, runs in BLOCKS if runs])
def test_example_runs(page: str, line: int, code: str, tmp_path: Path) -> None:
    (tmp_path / "example.py").write_text(code)
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"the example at {page}:{line} failed:\n{proc.stdout}\n{proc.stderr}"


def test_few_examples_are_skipped() -> None:
    skipped = [f"{p}:{n}" for p, n, _, runs in BLOCKS if not runs]
    assert len([b for b in BLOCKS if b[3]]) >= 5
    assert len(skipped) <= 3, f"examples marked no-run: {skipped}"


def test_readme_keeps_the_two_commands_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert "## Two commands" in text and "./dev demo" in text and "./dev test" in text
    for target in LINK.findall(text):
        if "://" in target or target.startswith("#"):
            continue
        assert (ROOT / target.split("#")[0]).exists(), f"README links to {target}, which does not exist"


def test_site_builds_strict(tmp_path: Path) -> None:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None
               or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)]
    if missing:
        message = f"{', '.join(missing)} not installed: pip install -e '.[docs]'"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    site = tmp_path / "site"
    assert (site / "reference" / "cache" / "index.html").read_text().count("apply_gradients") > 1
    plots = re.findall(r'src="([^"]*bench/results/[^"]+\.png)"', (site / "benchmarks" / "index.html").read_text())
    assert plots and all((site / "benchmarks" / p).resolve().exists() for p in plots)
