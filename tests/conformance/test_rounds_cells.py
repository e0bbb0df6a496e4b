"""Conformance of local-step rounds (LocalStepAverager, its consensus_state_dict): every cell a way
users run them, equal to a plain single-process simulation of the workers (:mod:`.rounds_world`)
or refused on every rank. The streaming rounds' cells (test_streaming_cells.py) run in these two
spawns too, in the same process groups."""

from __future__ import annotations

from .cells import Cell, check_cells
from .rounds_world import (
    AVERAGER,
    CONSENSUS,
    DCP_DIRECT,
    GRADIENT,
    HOLDS,
    STATE,
    STEP,
    Run,
    node_pairs_as_group,
    rounds_cell,
    shared_data,
)
from .test_streaming_cells import streaming_four_rank_cells, streaming_two_rank_cells


def two_rank_cells() -> list[Cell]:
    dppf = dict(pull=0.6, push=0.02)
    return [
        rounds_cell(AVERAGER, HOLDS, "tied embedding and head, DPPF around DiLoCo's consensus", Run(**dppf)),
        rounds_cell(
            AVERAGER,
            HOLDS,
            "tied embedding and head, DPPF rounds, the optimizer's groups",
            Run(outer=False, grouped=True, **dppf),
        ),
        rounds_cell(
            CONSENSUS,
            HOLDS,
            "GPT-2 from a config (lm_head.weight is transformer.wte.weight), DiLoCo",
            Run(model="gpt2", steps=4),
        ),
        Cell(
            AVERAGER,
            HOLDS,
            "two Parameters over one memory (tied by sharing .data)",
            shared_data,
            refusal="different tensors over the same memory",
        ),
        rounds_cell(AVERAGER, GRADIENT, "DiLoCo, a head without a gradient on rank 1", Run(unused_on=(1,))),
        rounds_cell(
            AVERAGER, GRADIENT, "plain averaging, a head without a gradient on rank 1", Run(outer=False, unused_on=(1,))
        ),
        rounds_cell(
            CONSENSUS,
            STEP,
            "DiLoCo, rank 1 one step ahead (no round due)",
            Run(steps=4, ahead=(1,)),
            "different steps (rank 0: steps=4; rank 1: steps=5)",
        ),
        rounds_cell(
            CONSENSUS,
            STEP,
            "plain averaging, rank 1 one step ahead",
            Run(outer=False, steps=4, ahead=(1,)),
            "different steps (rank 0: steps=4; rank 1: steps=5)",
        ),
        rounds_cell(
            AVERAGER,
            STEP,
            "DiLoCo, rank 1's step more is a round, rank 0 asks for the consensus",
            Run(steps=5, ahead=(1,)),
            "rank 0: call=consensus_state_dict, steps=5; rank 1: call=a local-step round, steps=6",
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "DiLoCo under local_sgd, warm-up 2, resumed after step 5 from the optimizer's state_dict",
            Run(ddp=True, warmup=2, steps=9, resume_after=5),
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "DPPF under local_sgd, warm-up 2, resumed after step 3",
            Run(outer=False, ddp=True, warmup=2, steps=9, resume_after=3, **dppf),
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "DiLoCo resumed from torch's PostLocalSGDOptimizer state (the step alone)",
            Run(ddp=True, warmup=2, steps=9, resume_after=5, torch_state=True),
            "restored without its consensus",
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "DiLoCo in a plain loop, resumed after step 5 (a round not yet due) from a torch.save file per rank "
            "of the model's, inner optimizer's and averager's state_dict()",
            Run(steps=9, resume_after=4),
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "DiLoCo in a plain loop, resumed after step 5 (a round not yet due) from DCP's dcp.save of the model's, "
            "inner optimizer's and averager's state_dict(), loaded the same way",
            Run(steps=9, resume_after=4, dcp="direct"),
            DCP_DIRECT,
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "DiLoCo under local_sgd, warm-up 2, resumed after step 5 (a round not yet due) from DCP's dcp.save of "
            "the model's and the optimizer's state_dict(), loaded the same way",
            Run(ddp=True, warmup=2, steps=9, resume_after=4, dcp="direct"),
            DCP_DIRECT,
        ),
    ]


def four_rank_cells() -> list[Cell]:
    nodes = dict(ddp=True, per_node=2)  # 2 nodes x 2 ranks
    return [
        rounds_cell(
            AVERAGER,
            STATE,
            "node-aware DiLoCo (2 x 2) under local_sgd, warm-up 2, resumed after step 4",
            Run(warmup=2, steps=8, resume_after=4, **nodes),
        ),
        rounds_cell(
            CONSENSUS,
            HOLDS,
            "node-aware DPPF around DiLoCo (2 x 2), tied embedding and head",
            Run(pull=0.6, push=0.02, **nodes),
        ),
        rounds_cell(
            CONSENSUS,
            HOLDS,
            "node-aware one-bit rounds (sign_vote, 2 x 2): a tensor cut by the rails' slices scaled per piece",
            Run(pseudo_gradient="sign_vote", **nodes),
        ),
        rounds_cell(
            CONSENSUS,
            STEP,
            "node-aware DiLoCo (2 x 2), node 1 one step ahead",
            Run(steps=4, ahead=(2, 3), **nodes),
            "rank 1: steps=4; rank 2: steps=5; rank 3: steps=5",
        ),
        Cell(
            AVERAGER,
            "who votes",
            "node-aware rounds given one node's ranks as process_group",
            node_pairs_as_group,
            refusal="leave process_group unset",
        ),
        rounds_cell(
            AVERAGER,
            "who votes",
            "DiLoCo over a process group of one's own (ranks 0, 1 and 2, 3): each pair's outer step alone",
            Run(pairs=True),
        ),
        rounds_cell(
            AVERAGER,
            "who votes",
            "DiLoCo under local_sgd over groups {0, 2} and {1, 3} (DDP over the same group), warm-up 2, "
            "resumed after step 6 from a torch.save file per rank",
            Run(pairs=True, interleaved=True, ddp=True, warmup=2, steps=9, resume_after=5),
        ),
        rounds_cell(
            AVERAGER,
            "who votes",
            "one-bit rounds (pseudo_gradient='sign_vote', ties vote 0) over groups {0, 2} and {1, 3}",
            Run(pairs=True, interleaved=True, pseudo_gradient="sign_vote"),
        ),
        rounds_cell(
            AVERAGER,
            "who votes",
            "DPPF around DiLoCo's consensus over groups {0, 2} and {1, 3}, a head without a gradient on rank 1",
            Run(pairs=True, interleaved=True, pull=0.6, push=0.02, unused_on=(1,)),
        ),
        rounds_cell(
            AVERAGER,
            STATE,
            "DiLoCo over a process group of one's own (ranks 0, 1 and 2, 3), resumed after step 5 from DCP's "
            "dcp.save of the model's, inner optimizer's and averager's state_dict() on all four ranks",
            Run(steps=9, resume_after=4, dcp="direct", pairs=True),
            DCP_DIRECT,
        ),
    ]


def test_rounds_on_two_ranks():
    check_cells(two_rank_cells() + streaming_two_rank_cells(), 2)


def test_node_aware_rounds_on_four_ranks():
    check_cells(four_rank_cells() + streaming_four_rank_cells(), 4)
