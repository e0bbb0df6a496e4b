"""docs/reliability.md lists every promise of the docs with the tests that hold it: every test
and conformance cell it names must exist, so the table cannot rot."""

import ast
import re
from pathlib import Path

from tests.conformance.test_matrix import suite_cells

ROOT = Path(__file__).parents[1]
PAGE = ROOT / "docs" / "reliability.md"
TITLE = "## Every promise, and the test that holds it"


def _table() -> list[str]:
    text = PAGE.read_text()
    assert TITLE in text, f"{PAGE.name} has no section {TITLE!r}"
    section = text.split(TITLE, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 40, f"only {len(rows)} promises listed"
    return rows


def _functions(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}


def test_every_test_the_promise_table_names_exists():
    missing = []
    for row in _table():
        for file, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row):
            path = ROOT / file
            if not path.is_file() or name not in _functions(path):
                missing.append(f"{file}::{name}")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"


def test_every_cell_the_promise_table_names_exists():
    names = [cell.name for cell in suite_cells()]
    missing = [
        piece for row in _table() for piece in re.findall(r'cell "([^"]+)"', row) if not any(piece in n for n in names)
    ]
    assert not missing, f"docs/reliability.md names cells that are not in the suite: {missing}"


def test_every_promise_says_where_it_is_stated_and_what_holds_it():
    for row in _table():
        number, promise, stated, held, status = [part.strip() for part in row.strip("|").split(" | ")][:5]
        assert promise and stated, row
        assert re.search(r"`tests/[\w/]+\.py::\w+`|cell \"", held), f"promise {number} names no test: {row}"
        assert status.split(":")[0] in ("holds", "fixed", "narrowed"), f"promise {number}: status {status!r}"
