"""The matrix the docs show is the suite's: docs/reliability.md's table is made from the
committed JSON (tests/test_benchmarks_report.py holds the page to it), and here that JSON is
held to the cells the suite defines, each holding its promise. After adding a cell, run the
suite with ``SIGNMUON_CONFORMANCE_JSON`` set to the committed file, then ``signmuon-bench report``."""

import importlib
import json
import pkgutil
from pathlib import Path

import tests.conformance as suite
from tests.conformance.cells import Cell

COMMITTED = Path(__file__).parents[2] / "benchmarks" / "results" / "2026-12-06-conformance.json"


def suite_cells() -> list[Cell]:
    """Every cell of the suite: what each test module's ``*_cells()`` functions return (its
    ``test_*`` functions run them, so they are not cell lists)."""
    cells = []
    for module in pkgutil.iter_modules(suite.__path__):
        if module.name.startswith("test_") and module.name != "test_matrix":
            loaded = importlib.import_module(f"tests.conformance.{module.name}")
            for name, fn in sorted(vars(loaded).items()):
                if (
                    name.endswith("_cells")
                    and not name.startswith("test_")
                    and callable(fn)
                    and getattr(fn, "__module__", None) == loaded.__name__
                ):
                    cells += fn()
    return cells


def test_the_committed_matrix_is_the_suites():
    committed = json.loads(COMMITTED.read_text())
    names = {row["name"] for row in committed["cells"]}
    defined = {cell.name for cell in suite_cells()}
    assert names == defined, (
        f"cells not in {COMMITTED.name}: {sorted(defined - names)}; cells no longer in the suite: {sorted(names - defined)}"
    )
    broken = [row["name"] for row in committed["cells"] if not row["holds"]]
    assert not broken, f"the committed matrix records broken cells: {broken}"
