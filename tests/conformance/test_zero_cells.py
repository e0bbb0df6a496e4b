"""Conformance of DeepSpeed ZeRO-1/2 with the vote between nodes (2 nodes x 2 ranks, one spawn):
each cell equals the single-process node-level reference of tests/test_deepspeed_zero.py on
every rank, or raises its refusal on every rank."""

from __future__ import annotations

import shutil
import tempfile
from functools import partial

import torch
import torch.distributed as dist

from signmuon.integrations.deepspeed import initialize
from tests.test_deepspeed_zero import _config, _model, _train, node_reference

from .cells import Cell, check_cells

WORLD = 4


def _entry(stage: int) -> str:
    return f"SignumMV, DeepSpeed ZeRO-{stage}"


def _folder() -> str:
    made = [tempfile.mkdtemp(prefix="signmuon-zero-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, 0)
    return made[0]


def _done(folder: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def trained(rank, world_size, stage, gas, steps=3, **vote):
    model = _model(seed=rank)  # each rank its own init: rank 0's must reach every node
    config = _config(stage, gas)
    config["vote"] |= vote
    engine, _, _, _ = initialize(model=model, config=config)
    return _train(engine, model, rank, steps, gas)[-1]


def last_reference(world_size, gas, steps=3, ranks_per_node=2):
    return node_reference(world_size, gas, steps=steps, ranks_per_node=ranks_per_node)[-1]


def nan_on_one_rank(rank, world_size, stage, raise_=False):
    model = _model()
    config = _config(stage, 1)
    if raise_:
        config["vote"]["nonfinite"] = "raise"
    engine, _, _, _ = initialize(model=model, config=config)
    history = _train(engine, model, rank, 3, 1, bad_step=1)
    return {"nan step moved nothing": torch.tensor(all(torch.equal(a, b) for a, b in zip(history[0], history[1])))}


def nothing_moved(world_size):
    return {"nan step moved nothing": torch.tensor(True)}


def resumed(rank, world_size, stage, load_ranks_per_node=2):
    folder = _folder()
    try:
        model = _model()
        engine, _, _, _ = initialize(model=model, config=_config(stage, 2))
        _train(engine, model, rank, 2, 2)
        engine.save_checkpoint(folder, tag="t")
        model = _model(seed=100 + rank)
        config = _config(stage, 2)
        config["vote"]["ranks_per_node"] = load_ranks_per_node
        engine, _, _, _ = initialize(model=model, config=config)
        engine.load_checkpoint(folder, tag="t")
        return _train(engine, model, rank, 2, 2, start=2)[-1]
    finally:
        _done(folder)


def zero_cells() -> list[Cell]:
    cells = []
    for stage in (1, 2):
        entry = _entry(stage)
        for gas in (1, 2):
            cells.append(
                Cell(
                    entry,
                    "who votes",
                    f"2 nodes x 2 ranks, accumulation {gas}: the N nodes vote their partitions over the rails",
                    partial(trained, stage=stage, gas=gas),
                    partial(last_reference, gas=gas),
                )
            )
        cells.append(
            Cell(
                entry,
                "what runs after the hook",
                "NaN in one tensor on one rank of node 0: every rank skips the step",
                partial(nan_on_one_rank, stage=stage),
                nothing_moved,
            )
        )
        cells.append(
            Cell(
                entry,
                "what runs after the hook",
                "NaN on one rank with nonfinite='raise': every rank raises",
                partial(nan_on_one_rank, stage=stage, raise_=True),
                refusal="NonFiniteError",
            )
        )
        cells.append(
            Cell(
                entry,
                "whose state comes back",
                "save_checkpoint after 2 of 4 steps, a fresh engine loads: each rank's partition momentum",
                partial(resumed, stage=stage),
                partial(last_reference, gas=2, steps=4),
            )
        )
    cells.append(
        Cell(
            _entry(2),
            "whose state comes back",
            "saved on 2 x 2, loaded as 4 x 1: refused on every rank, naming both layouts",
            partial(resumed, stage=2, load_ranks_per_node=1),
            refusal="resume on the same nodes and ranks per node",
        )
    )
    for ranks_per_node, case in (
        (4, "one node of 4 ranks: no vote, Signum on the node's mean gradient"),
        (1, "4 nodes of one rank: nothing partitioned, every rank votes"),
    ):
        run = partial(trained, stage=2, gas=1, ranks_per_node=ranks_per_node)
        reference = partial(last_reference, gas=1, ranks_per_node=ranks_per_node)
        cells.append(Cell(_entry(2), "who votes", case, run, reference))
    cells.append(
        Cell(
            _entry(2),
            "who votes",
            "ranks_per_node=3 on 4 ranks: refused on every rank",
            partial(trained, stage=2, gas=1, ranks_per_node=3),
            refusal="must be one number that divides",
        )
    )
    return cells


def test_zero_cells():
    check_cells(zero_cells(), WORLD, timeout=600)
