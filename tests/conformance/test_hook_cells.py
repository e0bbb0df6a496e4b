"""Conformance of the DDP hooks and the sign-vote optimizers (flat vote): every cell a way users
run them, equal to the single-process reference of :mod:`.ddp_world` or refused on every rank."""

from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import SignVoteState, sign_vote_hook
from signmuon.optim import SignMuon, SignumMV

from . import options_world, scaler_world
from .cells import Cell, check_cells
from .ddp_world import ENTRIES, EXACT, HOOKED, LR, Config, Net, backward, ddp_cell, simulate, train
from .test_fsdp_cells import fsdp_cells
from .test_handed_cells import handed_cells

IN_STEP = ("SignumMV-in-step", "SignMuon-in-step")


def two_rank_cells() -> list[Cell]:
    cells = []
    for entry in HOOKED:
        cells += [
            ddp_cell(
                "who has a gradient",
                "Join: rank 1 runs out of data after 2 of 4 steps",
                Config(entry, (4, 2), join=True),
            ),
            ddp_cell(
                "who has a gradient",
                "find_unused_parameters: a head unused on rank 1",
                Config(entry, unused_on=(1,)),
            ),
            ddp_cell("what the hook is handed", "2 micro-batches under no_sync", Config(entry, micro=2)),
        ]
    for entry in HOOKED[2:]:
        cells += [
            ddp_cell("what runs after the hook", "clip_grad_norm_(0.1) before step()", Config(entry, clip=0.1)),
            ddp_cell(
                "what the optimizer holds",
                "a head added by add_param_group after the hook",
                Config(entry, added_later=True),
            ),
        ]
    for entry in IN_STEP:
        cells += [
            ddp_cell("who has a gradient", "a head without a gradient on rank 1", Config(entry, unused_on=(1,))),
            ddp_cell("what the hook is handed", "2 micro-batches accumulated", Config(entry, micro=2)),
            ddp_cell(
                "what runs after the hook",
                "clip_grad_norm_(0.1) before step(): each worker's momentum sees its clipped gradient",
                Config(entry, clip=0.1),
            ),
        ]
    return cells


NODE_AWARE = {
    "hook-signsgd": "sign_vote_hook, signSGD-MV, node-aware",
    "SignumMV": "SignumMV, node-aware DDP hook",
    "SignMuon": "SignMuon, node-aware DDP hook",
    "SignumMV-in-step": "SignumMV, node-aware vote_in_step",
}


def _node_cell(klass: str, case: str, config: Config) -> Cell:
    atol = 1e-6 if config.entry.startswith("SignMuon") else 0.0
    run, reference = partial(train, config=config), partial(simulate, config)
    return Cell(NODE_AWARE[config.entry], klass, case, run, reference, atol=atol, per_rank=True)


def four_rank_cells() -> list[Cell]:
    halves = ((0, 1), (2, 3))
    cells = []
    for entry in NODE_AWARE:
        cells += [
            _node_cell(
                "who votes", "2 nodes x 2: the node means voted between nodes", Config(entry, (3,) * 4, per_node=2)
            ),
            _node_cell(
                "who has a gradient",
                "a head unused on rank 1: its node's mean holds rank 0's alone, over 2",
                Config(entry, (3,) * 4, unused_on=(1,), per_node=2),
            ),
            _node_cell(
                "who has a gradient",
                "a head unused on both ranks of node 1: that node abstains",
                Config(entry, (3,) * 4, unused_on=(2, 3), per_node=2),
            ),
            _node_cell(
                "what the hook is handed",
                "2 micro-batches accumulated (no_sync, set_requires_gradient_sync)",
                Config(entry, (3,) * 4, micro=2, per_node=2),
            ),
        ]
    for entry in ("SignumMV", "SignMuon", "SignumMV-in-step"):
        cells.append(
            _node_cell(
                "what the optimizer holds",
                "2 nodes x 2, 3 parameter groups, each its own lr and weight_decay",
                Config(entry, (3,) * 4, per_node=2, param_groups=True),
            )
        )
    cells.append(
        _node_cell(
            "what the optimizer holds",
            "2 nodes x 2, non_matrix='adamw' (torch's AdamW on every rank's mean gradient), 3 parameter groups",
            Config("SignMuon", (3,) * 4, per_node=2, param_groups=True, non_matrix="adamw"),
        )
    )
    for entry in ("SignumMV", "SignMuon", "SignumMV-in-step"):  # the bare hook's SGD applies the clipped vote
        cells.append(
            _node_cell(
                "what runs after the hook",
                "clip_grad_norm_(0.1) before step()",
                Config(entry, (3,) * 4, clip=0.1, per_node=2),
            )
        )
    for entry in HOOKED + IN_STEP:
        cells.append(
            ddp_cell("who votes", "DDP over data-parallel sub-groups {0,1}, {2,3}", Config(entry, (4,) * 4, halves))
        )
    for entry in HOOKED:
        cells.append(
            ddp_cell(
                "who votes",
                "sub-groups, WORLD given to the state or optimizer",
                Config(entry, (2,) * 4, halves, give_group="world"),
                refusal="reduces over ranks",
            )
        )
    return cells


def overflow_cells() -> list[Cell]:
    """GradScaler, autocast, clipping after unscale_, NaN on one rank: :mod:`.scaler_world`."""
    return scaler_world.scaler_cells()


def ddp_option_cells() -> list[Cell]:
    """DDP's constructor options, parameter groups with their own lr and weight_decay, and what
    :mod:`.options_world` runs (an Embedding in AdamW, channels_last, two models, a reordered load)."""
    static, view = (("static_graph", True),), (("gradient_as_bucket_view", True),)
    tiny = (("bucket_cap_mb", 1e-4),)
    cells = []
    for entry in ("SignumMV", "SignMuon", "hook-signum"):
        cells += [
            ddp_cell(
                "what the hook is handed",
                "static_graph=True, find_unused_parameters, a head unused on rank 1",
                Config(entry, unused_on=(1,), ddp_kwargs=static),
            ),
            ddp_cell(
                "what the hook is handed",
                "gradient_as_bucket_view=True, 2 micro-batches under no_sync, zero_grad(set_to_none=False)",
                Config(entry, micro=2, set_to_none=False, ddp_kwargs=view),
            ),
        ]
    for entry in ("SignSGDMV", "hook-signsgd"):
        cells.append(
            ddp_cell(
                "what the hook is handed",
                "bucket_cap_mb=1e-4 (a bucket per parameter), find_unused_parameters, a head unused on rank 1",
                Config(entry, unused_on=(1,), ddp_kwargs=tiny),
            )
        )
    for entry in ("SignumMV", "SignSGDMV", "SignumMV-in-step"):
        cells.append(
            ddp_cell(
                "what the optimizer holds",
                "3 parameter groups, each its own lr and weight_decay, zero_grad(set_to_none=False)",
                Config(entry, param_groups=True, set_to_none=False),
            )
        )
    for entry in ("SignMuon", "SignMuon-in-step"):
        cells.append(
            ddp_cell(
                "what the optimizer holds",
                "non_matrix='adamw' (torch's AdamW on the mean gradient), 3 parameter groups, each its own lr and weight_decay",
                Config(entry, param_groups=True, non_matrix="adamw"),
            )
        )
    return cells + options_world.option_cells()


def test_hooks_and_optimizers_on_two_ranks():
    check_cells(two_rank_cells() + overflow_cells() + handed_cells() + ddp_option_cells(), 2)


def test_who_votes_on_four_ranks():  # and the FSDP2 cells, 2 nodes x 2, in the same process group
    check_cells(four_rank_cells() + fsdp_cells(), 4)


# --- refusals that name the remedy ------------------------------------------------------------


def _momentum_differs(rank: int, world_size: int):
    net = Net()
    model = DDP(net)
    model.register_comm_hook(SignVoteState(momentum=0.9 if rank == 0 else 0.5, start_iter=1), sign_vote_hook)
    backward(model, rank, 0, 0, True)


def _split_optimizers(rank: int, world_size: int):
    net = Net()
    model = DDP(net)
    matrices = [p for p in net.parameters() if p.dim() >= 2]
    opt = SignMuon(matrices, lr=LR)
    torch.optim.AdamW([p for p in net.parameters() if p.dim() < 2])
    opt.register_comm_hook(model)
    backward(model, rank, 0, 0, True)


def _one_rank_a_step_ahead(rank: int, world_size: int):
    net = Net()
    model = DDP(net)
    opt = SignumMV(net.parameters(), lr=LR, vote=EXACT)
    opt.register_comm_hook(model)
    opt.steps_taken = 1 if rank == 1 else 0  # as after a step only rank 1 took (a resumed rank one behind)
    backward(model, rank, 0, 0, True)


def _second_backward(rank: int, world_size: int):
    net = Net()
    model = DDP(net)
    opt = SignMuon(net.parameters(), lr=LR, vote=EXACT)
    opt.register_comm_hook(model)
    backward(model, rank, 0, 0, True)
    backward(model, rank, 0, 1, True)  # accumulation without no_sync
    opt.step()


def _lr_differs(rank: int, world_size: int, in_step: bool):
    net = Net()
    kind = SignumMV if in_step else SignMuon
    opt = kind(net.parameters(), lr=0.02 if rank == 1 else LR, vote=EXACT, vote_in_step=in_step)
    if in_step:
        backward(net, rank, 0, 0, True)
        opt.step()
        return
    model = DDP(net)
    opt.register_comm_hook(model)
    backward(model, rank, 0, 0, True)


def refusal_cells() -> list[Cell]:
    return [
        Cell(
            ENTRIES["hook-signum"],
            "who votes",
            "momentum differs between ranks: refused naming the field and each rank's value",
            _momentum_differs,
            refusal="momentum (rank 0: 0.9, rank 1: 0.5)",
        ),
        Cell(
            ENTRIES["SignMuon"],
            "what the optimizer holds",
            "matrices in SignMuon, the rest in AdamW: refused saying how to pass the rest",
            _split_optimizers,
            refusal="non_matrix='adamw'",
        ),
        Cell(
            ENTRIES["SignMuon"],
            "who votes",
            "lr differs on rank 1: SettingsMismatchError names the nested field first, with each rank's value",
            partial(_lr_differs, in_step=False),
            refusal="SettingsMismatchError: SignMuonHookState settings differ between ranks in optimizer.groups[0].lr "
            "(rank 0: 0.01, rank 1: 0.02)",
        ),
        Cell(
            ENTRIES["SignumMV-in-step"],
            "who votes",
            "lr differs on rank 1: SettingsMismatchError names the field first, with each rank's value",
            partial(_lr_differs, in_step=True),
            refusal="SettingsMismatchError: SignumMV settings differ between ranks in groups[0].lr (rank 0: 0.01, rank 1: 0.02)",
        ),
        Cell(
            ENTRIES["SignumMV"],
            "ranks out of step",
            "rank 1 a step ahead of rank 0",
            _one_rank_a_step_ahead,
            refusal="VoteMismatchError",
        ),
        Cell(
            ENTRIES["SignMuon"],
            "what the hook is handed",
            "a second backward before step() without no_sync",
            _second_backward,
            refusal="accumulate micro-batches with their forward and backward under ddp_model.no_sync()",
        ),
    ]


def test_refusals_name_the_remedy():
    check_cells(refusal_cells(), 2)


# --- what DDP hands the hook: a second backward, the Python reducer, requires_grad toggled ------
