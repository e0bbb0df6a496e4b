"""The conformance suite's mechanics: a cell, a spawn that runs many cells in one process
group, the comparison of every rank's result with the cell's single-process reference (or of
every rank's error with the refusal it expects), and the matrix the suite writes.

A cell is one (entry point, class, case). Its ``run(rank, world_size)`` runs on every rank of
a spawn and returns tensors (compared with ``reference()``, computed in the test process
without any process group) or raises (compared with ``refusal``, a piece of the message every
rank must raise). Cells of one spawn share its process group, in order: a cell that hangs
fails its whole spawn at the spawn's timeout, never the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tests.harness import run_distributed

__all__ = ["CLASSES", "Cell", "check_cells", "record_path", "run_cells"]

CLASSES = {
    "who votes": "the group comes from where the user already said it, or a mismatch is refused",
    "who has a gradient": "a rank without a gradient abstains and its momentum stays put",
    "what the hook is handed": "accumulation, a second backward, compiled autograd: the definition or a refusal",
    "what runs after the hook": "a step the vote skips or a non-finite gradient is never hidden from the framework",
    "what the optimizer holds": "aliases, tied weights, parameters added later, groups split across optimizers",
    "whose state comes back": "each rank resumes its own momentum, bit-identical to an uninterrupted run",
    "ranks out of step": "a collective reached at different steps raises on every rank",
}
"""The suite's classes of configuration (issue 46), each with what it holds the entry points to."""


@dataclass(frozen=True)
class Cell:
    """One (entry point, class, case) of the suite.

    Attributes:
        entry: the entry point, as the matrix names it (``"SignumMV, DDP hook"``).
        klass: one of :data:`CLASSES`.
        case: the configuration, in a few words.
        run: ``run(rank, world_size)`` on every rank of the spawn: tensors to compare, or raises.
        reference: the single-process reference (``reference(world_size)``), for a cell that
            must equal it; ``None`` for a refusal.
        refusal: a piece of the message every rank must raise, for a cell that must refuse.
        atol: the tolerance of the comparison (0: bit for bit).
        ranks: which ranks' results equal the reference (default: all); ``reference`` then
            returns one result per listed rank when ``per_rank``.
        per_rank: ``reference(world_size)`` returns one result per rank instead of one for all.
    """

    entry: str
    klass: str
    case: str
    run: Callable[[int, int], Any]
    reference: Callable[[int], Any] | None = None
    refusal: str | None = None
    atol: float = 0.0
    per_rank: bool = False

    def __post_init__(self) -> None:
        if self.klass not in CLASSES:
            raise ValueError(f"cell {self.case!r}: class {self.klass!r} is not one of {sorted(CLASSES)}")
        if (self.reference is None) == (self.refusal is None):
            raise ValueError(f"cell {self.case!r}: give exactly one of reference and refusal")

    @property
    def expects(self) -> str:
        return "refused" if self.refusal is not None else "equals reference"

    @property
    def name(self) -> str:
        return f"{self.entry} | {self.klass} | {self.case}"


def _run_all(rank: int, world_size: int, cells: Sequence[Cell]) -> list:
    """Every cell on this rank, in order: ("ok", result) or ("error", "Type: message")."""
    results = []
    for cell in cells:
        torch.manual_seed(0)
        try:
            results.append(("ok", cell.run(rank, world_size)))
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - the comparison inspects type and message
            # (DCP's CheckpointException is a BaseException: uncaught, it would end the whole spawn)
            results.append(("error", f"{type(error).__name__}: {error}"))
        dist.barrier()  # the next cell starts together (a cell's stray collective fails here, not later)
    return results


def run_cells(cells: Sequence[Cell], world_size: int, timeout: float = 300.0) -> list[list]:
    """Run ``cells`` in one spawn of ``world_size`` gloo ranks; per cell, every rank's outcome."""
    per_rank = run_distributed(_run_all, world_size, list(cells), timeout=timeout)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cells))]


def _equal(result: Any, expected: Any, atol: float) -> str | None:
    """None where ``result`` equals ``expected`` (tensors bit for bit, or within ``atol``), else why not."""
    if isinstance(expected, (list, tuple)):
        if not isinstance(result, (list, tuple)) or len(result) != len(expected):
            return f"expected {len(expected)} results, got {type(result).__name__} of {len(result) if hasattr(result, '__len__') else '?'}"
        for i, (r, e) in enumerate(zip(result, expected)):
            why = _equal(r, e, atol)
            if why:
                return f"[{i}] {why}"
        return None
    if isinstance(expected, dict):
        if not isinstance(result, dict) or sorted(result) != sorted(expected):
            return f"expected keys {sorted(expected)}, got {sorted(result) if isinstance(result, dict) else type(result).__name__}"
        for key in expected:
            why = _equal(result[key], expected[key], atol)
            if why:
                return f"[{key!r}] {why}"
        return None
    if torch.is_tensor(expected):
        if not torch.is_tensor(result) or result.shape != expected.shape:
            return f"expected a tensor of shape {tuple(expected.shape)}, got {getattr(result, 'shape', type(result).__name__)}"
        r, e = result.double(), expected.double()
        if atol == 0.0 and torch.equal(r, e) or atol > 0 and torch.allclose(r, e, rtol=0.0, atol=atol):
            return None
        wrong = int((~torch.isclose(r, e, rtol=0.0, atol=atol)).sum()) if atol else int((r != e).sum())
        return f"{wrong} of {e.numel()} entries differ (largest {float((r - e).abs().max()):.3g})"
    return None if result == expected else f"expected {expected!r}, got {result!r}"


def verdict(cell: Cell, outcomes: list, world_size: int) -> str | None:
    """None where every rank's outcome is what ``cell`` promises, else what went wrong."""
    if cell.refusal is not None:
        for rank, (kind, value) in enumerate(outcomes):
            if kind != "error":
                return f"rank {rank} did not refuse (expected {cell.refusal!r})"
            if cell.refusal not in value:
                return f"rank {rank} raised {value!r}, expected a message with {cell.refusal!r}"
        return None
    expected = cell.reference(world_size)
    for rank, (kind, value) in enumerate(outcomes):
        if kind == "error":
            return f"rank {rank} raised {value}"
        why = _equal(value, expected[rank] if cell.per_rank else expected, cell.atol)
        if why:
            return f"rank {rank}: {why}"
    return None


def record_path() -> str:
    """Where the suite writes its matrix: ``$SIGNMUON_CONFORMANCE_JSON``, else benchmarks/out/conformance.json."""
    default = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "out", "conformance.json")
    return os.environ.get("SIGNMUON_CONFORMANCE_JSON", os.path.normpath(default))


def _record(cells: Sequence[Cell], world_size: int, failures: dict[str, str]) -> None:
    """Add ``cells``' rows to the matrix file (read, merged by name, written back)."""
    path = record_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            matrix = json.load(f)
    except (OSError, ValueError):
        matrix = {"kind": "conformance", "classes": CLASSES, "cells": []}
    rows = {row["name"]: row for row in matrix["cells"]}
    for cell in cells:
        rows[cell.name] = {
            "name": cell.name,
            "entry": cell.entry,
            "class": cell.klass,
            "case": cell.case,
            "expects": cell.expects,
            "ranks": world_size,
            "holds": cell.name not in failures,
        }
    matrix["cells"] = sorted(rows.values(), key=lambda row: row["name"])
    with open(path, "w") as f:
        json.dump(matrix, f, indent=1)


def check_cells(cells: Sequence[Cell], world_size: int, timeout: float = 300.0) -> None:
    """Run ``cells`` in one spawn, record them in the matrix, and fail naming every cell that broke its promise."""
    names = [cell.name for cell in cells]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate cells: {sorted({n for n in names if names.count(n) > 1})}")
    outcomes = run_cells(cells, world_size, timeout)
    failures = {}
    for cell, per_rank in zip(cells, outcomes):
        why = verdict(cell, per_rank, world_size)
        if why:
            failures[cell.name] = why
    _record(cells, world_size, failures)
    assert not failures, "\n".join(f"{name}: {why}" for name, why in failures.items())
