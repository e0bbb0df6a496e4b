"""Conformance of streaming rounds (torchft's streaming DiLoCo: fragments F, sync_delay τ,
update_alpha α): each cell against the single-process simulation of :mod:`.rounds_world`, or
refused on every rank. Run by ``test_rounds_cells``' two spawns, in their process groups, so
they cost no spawn of their own."""

from __future__ import annotations

from .cells import Cell
from .rounds_world import AVERAGER, HOLDS, STATE, STEP, Run, rounds_cell

STREAM = dict(fragments=2, delay=1, alpha=0.5)


def streaming_two_rank_cells() -> list[Cell]:
    return [
        rounds_cell(
            AVERAGER,
            HOLDS,
            "streaming DiLoCo (F=2, τ=1, α=0.5), tied embedding and head",
            Run(period=4, steps=9, **STREAM),
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "streaming DiLoCo under local_sgd, warm-up 2, resumed after step 5 with a fragment's round in flight",
            Run(ddp=True, warmup=2, period=4, steps=9, resume_after=4, **STREAM),
        ),
        rounds_cell(
            AVERAGER,
            STEP,
            "streaming DiLoCo, rank 1 lands a round a step ahead, rank 0 asks for the consensus with it in flight",
            Run(period=4, steps=5, ahead=(1,), **STREAM),
            "different call, steps, parameters, shapes (rank 0: call=consensus_state_dict, steps=5",
        ),
    ]


def streaming_four_rank_cells() -> list[Cell]:
    return []
