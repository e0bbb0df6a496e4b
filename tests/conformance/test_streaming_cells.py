"""Conformance of streaming rounds (torchft's streaming DiLoCo: fragments F, sync_delay τ,
update_alpha α): each cell against the single-process simulation of :mod:`.rounds_world`, or
refused on every rank. Run by ``test_rounds_cells``' two spawns, in their process groups, so
they cost no spawn of their own."""

from __future__ import annotations

from .cells import Cell
from .rounds_world import AVERAGER, CONSENSUS, DCP_DIRECT, HOLDS, STATE, STEP, Run, rounds_cell

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
        rounds_cell(
            AVERAGER,
            STATE,
            "streaming DiLoCo under local_sgd, warm-up 2, a DCP checkpoint after step 5 with a fragment's round "
            "in flight, loaded into fresh objects",
            Run(ddp=True, warmup=2, period=4, steps=9, resume_after=4, dcp="fresh", **STREAM),
            "one file per rank",
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "streaming DiLoCo under local_sgd, warm-up 2, a DCP checkpoint after step 5 with a fragment's round "
            "in flight, loaded into the running objects",
            Run(ddp=True, warmup=2, period=4, steps=9, resume_after=4, dcp="running", **STREAM),
            "one file per rank",
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "streaming DiLoCo in a plain loop, resumed after step 5 with a fragment's round in flight from a "
            "torch.save file per rank of the model's, inner optimizer's and averager's state_dict()",
            Run(period=4, steps=9, resume_after=4, **STREAM),
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "streaming DiLoCo in a plain loop, a DCP checkpoint after step 5 with a fragment's round in flight "
            "(dcp.save of the model's, inner optimizer's and averager's state_dict()), loaded into fresh objects",
            Run(period=4, steps=9, resume_after=4, dcp="direct", **STREAM),
            DCP_DIRECT,
        ),
    ]


def streaming_four_rank_cells() -> list[Cell]:
    nodes = dict(ddp=True, per_node=2)  # 2 nodes x 2 ranks
    own = dict(pairs=True)  # ranks 0, 1 and ranks 2, 3: a process group each
    return [
        rounds_cell(
            AVERAGER,
            HOLDS,
            "streaming DiLoCo on four ranks, the consensus asked for with a fragment's round in flight",
            Run(period=4, steps=9, **STREAM),
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "streaming DiLoCo on four ranks under local_sgd, warm-up 2, resumed with a fragment's round in flight",
            Run(ddp=True, warmup=2, period=4, steps=9, resume_after=4, **STREAM),
        ),
        rounds_cell(
            AVERAGER,
            HOLDS,
            "node-aware streaming DiLoCo (2 x 2), the consensus asked for with a fragment's round in flight",
            Run(period=4, steps=9, **nodes, **STREAM),
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "node-aware streaming DiLoCo (2 x 2) under local_sgd, warm-up 2, resumed with a fragment's round in flight",
            Run(warmup=2, period=4, steps=9, resume_after=4, **nodes, **STREAM),
        ),
        rounds_cell(
            CONSENSUS,
            STEP,
            "node-aware streaming DiLoCo (2 x 2), node 1's step more takes a fragment's round, node 0 asks for the consensus",
            Run(period=4, steps=4, ahead=(2, 3), **nodes, **STREAM),
            "different call, steps, parameters, shapes (rank 0: call=consensus_state_dict, steps=4",
        ),
        rounds_cell(
            AVERAGER,
            "who votes",
            "streaming DiLoCo over a process group of one's own (ranks 0, 1 and 2, 3), a round in flight",
            Run(period=4, steps=9, **own, **STREAM),
        ),
        rounds_cell(
            CONSENSUS,
            STEP,
            "streaming DiLoCo over a process group of one's own, rank 0's step more takes a fragment's round, "
            "rank 1 asks for the consensus",
            Run(period=4, steps=4, ahead=(0, 2), **own, **STREAM),
            "different call, steps, parameters, shapes (rank 0: call=a local-step round, steps=5",
        ),
        rounds_cell(
            AVERAGER,
            STEP,
            "streaming DiLoCo over a process group of one's own, rank 1 lands a round a step ahead, "
            "rank 0 asks for the consensus with it in flight",
            Run(period=4, steps=5, ahead=(1, 3), **own, **STREAM),
            "different call, steps, parameters, shapes (rank 0: call=consensus_state_dict, steps=5",
        ),
    ]
