"""The suite's own rule for skips (tests/conftest.py): listed always, fatal under CI unless expected."""

import os
import shutil
import subprocess
import sys
from pathlib import Path


def _run(folder: Path, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(folder)]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_an_unexpected_skip_fails_under_ci_and_is_listed_everywhere(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\ndef test_skips():\n    pytest.skip('an extra did not install')\n"
    )
    local, ci = _run(tmp_path, ci=False), _run(tmp_path, ci=True)
    assert local.returncode == 0 and "an extra did not install" in local.stdout
    assert ci.returncode == 1, ci.stdout
    assert "skips CI does not expect" in ci.stdout and "test_sample.py::test_skips" in ci.stdout
