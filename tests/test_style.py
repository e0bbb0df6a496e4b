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


MOST_LINES = 350
NOT_PRODUCT = ("tests", "benchmarks/results", "benchmarks/out", "build", "dist", "site")


def test_every_product_file_is_at_most_350_lines():
    """A file a reader can hold in one sitting: split longer ones along a seam (a module per
    concern, re-exporting what users import)."""
    sources = [
        p
        for p in sorted(ROOT.rglob("*"))
        if p.suffix in (".py", ".sh")
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)  # .venv, .git, .cache
        and not any(p.relative_to(ROOT).as_posix().startswith(folder + "/") for folder in NOT_PRODUCT)
    ]
    assert len(sources) > 100 and ROOT / "benchmarks" / "gpu_check.sh" in sources
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, f"over {MOST_LINES} lines: {long}"
