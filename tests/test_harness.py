"""The test harness's own tools, for runs on other machines (``scripts/gpu-check.sh`` on a lent GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_failure_log_gets_each_failure_with_its_traceback(tmp_path: Path) -> None:
    # A run cut at its time limit can lose pytest's summary; the log keeps what failed, and why.
    (tmp_path / "test_x.py").write_text("def test_a():\n    assert 1 + 1 == 3, 'on purpose'\n\n"
                                        "def test_b():\n    pass\n")
    log = tmp_path / "failures.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not a worker of this run
    env.update(EMBCACHE_FAILURE_LOG=str(log), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-o", "addopts=", str(tmp_path / "test_x.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = log.read_text()
    assert text.count("==== ") == 1 and "test_x.py::test_a (call)" in text
    assert "AssertionError: on purpose" in text and "test_b" not in text
