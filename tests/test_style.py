"""The formatter and the linter, as CI runs them (pyproject.toml's [tool.ruff])."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff_passes(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_no_formatter_escapes():
    """A handful at most: the formatter's layout is the layout."""
    escapes = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted(ROOT.rglob("*.py"))
        if ".venv" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert len(escapes) <= 5, escapes
