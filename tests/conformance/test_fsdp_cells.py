"""The FSDP2 vote's cells (2 nodes x 2 ranks, shards inside each node, the vote between them):
run by ``test_hook_cells.test_who_votes_on_four_ranks`` in the same process group as the DDP
hooks' four-rank cells, so they cost no spawn of their own."""

from functools import partial

from . import fsdp_world
from .cells import Cell
from .ddp_world import Config, simulate


def _fsdp_cell(klass: str, case: str, config: Config, run=None, atol=0.0, **options) -> Cell:
    atol = 1e-6 if config.entry == "SignMuon" else atol
    run = run or partial(fsdp_world.train, config=config, **options)
    return Cell(fsdp_world.ENTRIES[config.entry], klass, case, run, partial(simulate, config), atol=atol, per_rank=True)


def _fsdp_refusal(entry: str, klass: str, case: str, run, refusal: str, bind: bool = True) -> Cell:
    return Cell(fsdp_world.ENTRIES[entry], klass, case, partial(run, entry=entry) if bind else run, refusal=refusal)


def fsdp_cells() -> list[Cell]:
    cells = []
    for entry in fsdp_world.ENTRIES:
        nodes = Config(entry, (3,) * 4, per_node=2)
        cells += [
            _fsdp_cell("who votes", "2 nodes x 2: the node means voted between nodes", nodes),
            _fsdp_refusal(
                entry,
                "who votes",
                "a process_group given to the optimizer besides the mesh: refused on every rank",
                fsdp_world.given_group,
                "process_group",
            ),
            _fsdp_refusal(
                entry,
                "who votes",
                "VoteConfig(ranks_per_node=4) on a mesh of 2 per node: refused on every rank",
                fsdp_world.other_node_size,
                "but the mesh has 2 ranks per node",
            ),
            _fsdp_refusal(
                entry,
                "who has a gradient",
                "a head unused on node 1 (its unit never closes there), voted during backward: refused on every rank",
                partial(fsdp_world.train, config=Config(entry, (3,) * 4, unused_on=(2, 3), per_node=2)),
                "pass during_backward=False",
                bind=False,
            ),
            _fsdp_cell(
                "who has a gradient",
                "a head unused on node 1, voted in step(): that node abstains",
                Config(entry, (3,) * 4, unused_on=(2, 3), per_node=2),
                during_backward=False,
            ),
            _fsdp_cell(
                "who has a gradient",
                "a frozen head (requires_grad=False, left out of the optimizer): it stays put",
                Config(entry, (3,) * 4, unused_on=(0, 1, 2, 3), per_node=2),
                frozen=True,
            ),
            _fsdp_cell(
                "what the hook is handed",
                "2 micro-batches under set_requires_gradient_sync(False)",
                Config(entry, (3,) * 4, micro=2, per_node=2),
            ),
            _fsdp_refusal(
                entry,
                "what the hook is handed",
                "a second backward before step() without set_requires_gradient_sync(False)",
                partial(fsdp_world.second_backward, during_backward=True),
                "set_requires_gradient_sync(False)",
            ),
            _fsdp_cell(
                "whose state comes back",
                "DCP save after 2 of 4 steps, a fresh model and optimizer load: each node's momentum",
                Config(entry, (4,) * 4, per_node=2),
                run=partial(fsdp_world.resumed, config=Config(entry, (4,) * 4, per_node=2)),
            ),
            _fsdp_cell(
                "whose state comes back",
                "torch.save of each rank's optimizer state_dict() to its own file, a fresh optimizer loads it",
                Config(entry, (4,) * 4, per_node=2),
                run=partial(fsdp_world.resumed, config=Config(entry, (4,) * 4, per_node=2), via="torch.save"),
            ),
            _fsdp_refusal(
                entry,
                "whose state comes back",
                "rank 0's optimizer state_dict() file loaded on every rank: refused on every rank, none hangs",
                partial(fsdp_world.resumed, config=Config(entry, (4,) * 4, per_node=2), via="rank 0's file"),
                "rank 3 loads rank 0's; no rank loaded anything): each rank's momentum is its own, so every rank would "
                "resume with the saving rank's. On FSDP shards, save with torch.distributed.checkpoint",
                bind=False,
            ),
            _fsdp_cell(
                "whose state comes back",
                "each rank's own torch.save file of an optimizer state_dict() saved before the mark of who saved "
                "it: loads as before",
                Config(entry, (4,) * 4, per_node=2),
                run=partial(fsdp_world.resumed, config=Config(entry, (4,) * 4, per_node=2), via="torch.save, no mark"),
            ),
            _fsdp_refusal(
                entry,
                "whose state comes back",
                "rank 0's optimizer file saved before the mark, loaded on every rank: refused on every rank",
                partial(fsdp_world.resumed, config=Config(entry, (4,) * 4, per_node=2), via="rank 0's file, no mark"),
                "(rank 1 loads rank 0's, rank 2 loads rank 0's, rank 3 loads rank 0's; no rank loaded anything)",
                bind=False,
            ),
            _fsdp_refusal(
                entry,
                "whose state comes back",
                "rank 0's optimizer file saved before the mark, loaded on rank 2 (the same shard shapes), the "
                "others their own: refused on every rank",
                partial(
                    fsdp_world.resumed,
                    config=Config(entry, (4,) * 4, per_node=2),
                    via="rank 0's file on rank 2, no mark",
                ),
                "(rank 2 loads rank 0's; no rank loaded anything)",
                bind=False,
            ),
            _fsdp_refusal(
                entry,
                "whose state comes back",
                "rank 1's optimizer file loaded on rank 3, which holds no column of the mark (as past 50 ranks a "
                "node): refused on every rank by the momentum",
                partial(
                    fsdp_world.resumed,
                    config=Config(entry, (4,) * 4, per_node=2),
                    via="rank 1's file on rank 3, one mark column",
                ),
                "(rank 3 loads rank 1's; no rank loaded anything)",
                bind=False,
            ),
            _fsdp_refusal(
                entry,
                "ranks out of step",
                "rank 3 a step ahead, voted during backward: refused on every rank",
                partial(fsdp_world.a_step_ahead, during_backward=True),
                "VoteMismatchError",
            ),
        ]
    unmarked = Config("SignumMV", (4,) * 4, per_node=2)
    cells.append(
        _fsdp_refusal(
            "SignumMV",
            "whose state comes back",
            "a DCP checkpoint saved before the mark of who saved it, dcp.load: refused by DCP on every rank",
            partial(fsdp_world.resumed, config=unmarked, via="dcp, no mark"),
            "Missing key in checkpoint state_dict: optim.param_groups.0.signmuon.mark",
            bind=False,
        )
    )
    cells.append(
        _fsdp_cell(
            "whose state comes back",
            "a DCP checkpoint saved before the mark, dcp.load with DefaultLoadPlanner(allow_partial_load=True): "
            "each node's momentum",
            unmarked,
            run=partial(fsdp_world.resumed, config=unmarked, via="dcp, no mark, partial load"),
        )
    )
    cells.append(
        _fsdp_cell(
            "what the hook is handed",
            "2 backwards per step, both reduced, voted in step(): the accumulated node means (rounding apart)",
            Config("SignumMV", (3,) * 4, micro=2, per_node=2),
            atol=1e-6,  # a flipped sign moves an entry by 2 lr
            during_backward=False,
            sync_all=True,
        )
    )
    cells.append(
        _fsdp_refusal(
            "SignumMV",
            "ranks out of step",
            "rank 3 a step ahead, voted in step(): refused on every rank",
            partial(fsdp_world.a_step_ahead, during_backward=False),
            "VoteMismatchError",
        )
    )
    return cells
