"""Conformance of DeepSpeed ZeRO-1/2 with the vote between nodes (2 nodes x 2 ranks, one spawn):
each cell equals the single-process node-level reference of tests/zero_world.py on every rank
(SignumMV bit for bit, SignMuon to float tolerance), or raises its refusal on every rank."""

from __future__ import annotations

import shutil
import tempfile
from functools import partial

import torch
import torch.distributed as dist

from signmuon.integrations.deepspeed import initialize
from tests.zero_world import ds_config, node_reference, train_engine, zero_model

from . import ddp_world
from .cells import Cell, check_cells

WORLD = 4
MUON_ATOL = 1e-6  # SignMuon: Newton–Schulz in other processes, the same float32 math


def _entry(stage: int, name: str = "SignumMV") -> str:
    return f"{name}, DeepSpeed ZeRO-{stage}"


def _folder() -> str:
    made = [tempfile.mkdtemp(prefix="signmuon-zero-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, 0)
    return made[0]


def _done(folder: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def trained(rank, world_size, stage, gas, steps=3, name="SignumMV", ahead=False, **vote):
    model = zero_model(seed=rank)  # each rank its own init: rank 0's must reach every node
    config = ds_config(stage, gas, name)
    config["vote"] |= vote
    engine, zero_optimizer, _, _ = initialize(model=model, config=config)
    if ahead and rank == 3:  # one rank of node 1 a step ahead, as after loading another step's files
        ours = zero_optimizer.optimizer
        getattr(ours, "optimizer", ours).steps_taken = 1  # SignMuon's base steps ours
    return train_engine(engine, model, rank, steps, gas)[-1]


def last_reference(world_size, gas, steps=3, ranks_per_node=2, muon=False):
    return node_reference(world_size, gas, steps=steps, ranks_per_node=ranks_per_node, muon=muon)[-1]


def nan_on_one_rank(rank, world_size, stage, raise_=False, name="SignumMV"):
    model = zero_model()
    config = ds_config(stage, 1, name)
    if raise_:
        config["vote"]["nonfinite"] = "raise"
    engine, _, _, _ = initialize(model=model, config=config)
    history = train_engine(engine, model, rank, 3, 1, bad_step=1)
    return {"nan step moved nothing": torch.tensor(all(torch.equal(a, b) for a, b in zip(history[0], history[1])))}


def nothing_moved(world_size):
    return {"nan step moved nothing": torch.tensor(True)}


def resumed(rank, world_size, stage, load_ranks_per_node=2, name="SignumMV"):
    folder = _folder()
    try:
        model = zero_model()
        engine, _, _, _ = initialize(model=model, config=ds_config(stage, 2, name))
        train_engine(engine, model, rank, 2, 2)
        engine.save_checkpoint(folder, tag="t")
        model = zero_model(seed=100 + rank)
        config = ds_config(stage, 2, name)
        config["vote"]["ranks_per_node"] = load_ranks_per_node
        engine, _, _, _ = initialize(model=model, config=config)
        engine.load_checkpoint(folder, tag="t")
        return train_engine(engine, model, rank, 2, 2, start=2)[-1]
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
    return cells + out_of_step_cells() + muon_cells()


def out_of_step_cells() -> list[Cell]:
    """One rank a step ahead: the overflow check, all-reduced over every rank, also compares the steps
    (every rank raises before any votes)."""
    return [
        Cell(
            _entry(stage, name),
            "ranks out of step",
            "rank 3 (node 1, local rank 1) a step ahead of the others: refused on every rank",
            partial(trained, stage=stage, gas=1, steps=1, name=name, ahead=True),
            refusal="VoteMismatchError",
        )
        for name in ("SignumMV", "SignMuon")
        for stage in (1, 2)
    ]


def muon_cells() -> list[Cell]:
    """SignMuon on the flat partitions: each matrix cut across them goes to its owner for Newton–Schulz."""
    muon = dict(name="SignMuon")
    cells = []
    for stage, gas in ((1, 1), (2, 2)):
        cells.append(
            Cell(
                _entry(stage, "SignMuon"),
                "who votes",
                f"2 nodes x 2 ranks, accumulation {gas}: the first matrix cut mid-row between the partitions",
                partial(trained, stage=stage, gas=gas, **muon),
                partial(last_reference, gas=gas, muon=True),
                atol=MUON_ATOL,
            )
        )
    for ranks_per_node, case in (
        (4, "one node of 4 ranks: no vote, the sign of Newton–Schulz of the node's momentum"),
        (1, "4 nodes of one rank: nothing partitioned, every rank owns every matrix and votes"),
    ):
        run = partial(trained, stage=2, gas=1, ranks_per_node=ranks_per_node, **muon)
        reference = partial(last_reference, gas=1, ranks_per_node=ranks_per_node, muon=True)
        cells.append(Cell(_entry(2, "SignMuon"), "who votes", case, run, reference, atol=MUON_ATOL))
    cells.append(
        Cell(
            _entry(2, "SignMuon"),
            "what runs after the hook",
            "NaN in one tensor on one rank of node 0: every rank skips the step",
            partial(nan_on_one_rank, stage=2, **muon),
            nothing_moved,
        )
    )
    cells.append(
        Cell(
            _entry(1, "SignMuon"),
            "whose state comes back",
            "save_checkpoint after 2 of 4 steps, a fresh engine loads: each rank's pieces of the node's momentum",
            partial(resumed, stage=1, **muon),
            partial(last_reference, gas=2, steps=4, muon=True),
            atol=MUON_ATOL,
        )
    )
    return cells


def test_zero_cells():  # and stage 0's cells, in the same process group (DeepSpeed's init is paid once)
    check_cells(zero_cells() + stage0_cells() + mpu_cells(), WORLD, timeout=600)


# --- ZeRO stage 0: the flat vote over DeepSpeed's data-parallel group, in the same spawn -------


def _stage0_config(name: str, gas: int = 1, **params) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 5,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": name, "params": {"lr": ddp_world.LR, "momentum": ddp_world.BETA, **params}},
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
        "vote": {"tie": "exact"},
    }


def _stage0_steps(engine, rank, config: ddp_world.Config, start: int, stop: int) -> None:
    use_extra = rank not in config.unused_on
    for step in range(start, stop):
        for micro in range(config.micro):
            x, y = ddp_world.batch(rank, step, micro)
            engine.backward(torch.nn.functional.cross_entropy(engine(x, use_extra), y))
            engine.step()


def stage0_trained(rank, world_size, config, overlap=True, frozen=False, resume_at=0, ahead=False):
    """``config`` through a stage-0 engine; with ``resume_at``, saved there and loaded into a fresh engine."""
    torch.set_num_threads(1)
    net = ddp_world.Net()
    if frozen:
        net.extra.requires_grad_(False)
    ds = _stage0_config(config.entry, config.micro)
    engine, optimizer, _, _ = initialize(model=net, config=ds, overlap_backward=overlap)
    if ahead and rank == 3:
        optimizer.steps_taken = 1  # as after loading another step's files on one rank
    steps = config.steps[rank]
    if not resume_at:
        _stage0_steps(engine, rank, config, 0, steps)
        return [p.detach().clone() for p in net.parameters()]
    folder = _folder()
    try:
        _stage0_steps(engine, rank, config, 0, resume_at)
        engine.save_checkpoint(folder, tag="t")
        net = ddp_world.Net()
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)  # another start: everything must come from the checkpoint
        engine, _, _, _ = initialize(model=net, config=ds, overlap_backward=overlap)
        engine.load_checkpoint(folder, tag="t")
        _stage0_steps(engine, rank, config, resume_at, steps)
        return [p.detach().clone() for p in net.parameters()]
    finally:
        _done(folder)


def stage0_bf16(rank, world_size, name, gas, overlap, clip):
    """A stage-0 engine under ``"bf16": {"enabled": true}``: the module's bf16 parameters and our float32 masters."""
    torch.set_num_threads(1)
    net = ddp_world.Net()
    ds = _stage0_config(name, gas) | {"bf16": {"enabled": True}, "gradient_clipping": clip}
    engine, optimizer, _, _ = initialize(model=net, config=ds, overlap_backward=overlap)
    for step in range(3):
        for micro in range(gas):
            x, y = ddp_world.batch(rank, step, micro)
            engine.backward(torch.nn.functional.cross_entropy(engine(x.bfloat16()).float(), y))
            engine.step()
    return {
        "bf16": [p.detach().clone() for p in net.parameters()],
        "master": [optimizer.state[p]["master_weight"].clone() for p in net.parameters()],
    }


def bf16_reference(world_size, name, gas, clip=0.0):
    """The workers in a loop: each a bf16 copy of the float32 masters (which start from the bf16 cast, as
    the engine's), its bf16 gradients of the micro-batches' losses over ``gas`` summed, clipped at ``clip``
    times its own norm (of the float32 norms of its tensors), momentum in float32."""
    from signmuon.optim.newton_schulz import as_matrix, newton_schulz

    torch.set_num_threads(1)
    masters = [p.detach().bfloat16().float() for p in ddp_world.Net().parameters()]
    momenta = [[torch.zeros_like(m) for m in masters] for _ in range(world_size)]
    for step in range(3):
        signs = [torch.zeros_like(m) for m in masters]
        for worker in range(world_size):
            net = ddp_world.Net().bfloat16()
            with torch.no_grad():
                for p, m in zip(net.parameters(), masters):
                    p.copy_(m)
            for micro in range(gas):
                x, y = ddp_world.batch(worker, step, micro)
                (torch.nn.functional.cross_entropy(net(x.bfloat16()).float(), y) / gas).backward()
            if clip:
                norm = torch.stack([p.grad.float().norm() for p in net.parameters()]).norm()
                for p in net.parameters():
                    p.grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))
            for i, p in enumerate(net.parameters()):
                grad, momentum = p.grad.float(), momenta[worker][i]
                momentum.lerp_(grad, 1 - ddp_world.BETA)
                direction = momentum
                if name == "SignMuon":
                    look = grad.lerp(momentum, ddp_world.BETA)
                    direction = newton_schulz(as_matrix(look), 5).view_as(look) if look.dim() >= 2 else look
                signs[i] += torch.sign(direction)
        masters = [m.add(torch.sign(s), alpha=-ddp_world.LR) for m, s in zip(masters, signs)]
    return {"bf16": [m.bfloat16() for m in masters], "master": masters}


class TwoWayModelParallel:
    """DeepSpeed's mpu protocol for tensor parallelism of 2 on 4 ranks: model-parallel groups
    {0, 1} and {2, 3}, data-parallel groups {0, 2} and {1, 3} (each rank here holds the whole
    model: only the groups matter to the vote)."""

    def __init__(self) -> None:
        rank = dist.get_rank()
        made = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}
        self.model = made[(0, 1) if rank < 2 else (2, 3)]
        self.data = made[(0, 2) if rank % 2 == 0 else (1, 3)]

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_rank(self):
        return dist.get_rank() % 2

    def get_model_parallel_group(self):
        return self.model

    def get_data_parallel_world_size(self):
        return 2

    def get_data_parallel_rank(self):
        return dist.get_rank() // 2

    def get_data_parallel_group(self):
        return self.data


def stage0_with_mpu(rank, world_size, config, overlap=True):
    torch.set_num_threads(1)
    net = ddp_world.Net()
    ds = _stage0_config(config.entry, config.micro)
    engine, _, _, _ = initialize(model=net, config=ds, overlap_backward=overlap, mpu=TwoWayModelParallel())
    _stage0_steps(engine, rank, config, 0, config.steps[rank])
    return [p.detach().clone() for p in net.parameters()]


def stage0_group_given(rank, world_size, name):
    ds = _stage0_config(name)
    ds["optimizer"]["params"]["process_group"] = None
    initialize(model=ddp_world.Net(), config=ds)


def stage0_cells() -> list[Cell]:
    cells = []
    for name in ("SignumMV", "SignMuon"):
        entry, atol = _entry(0, name), (MUON_ATOL if name == "SignMuon" else 0.0)

        def cell(klass, case, config, **options):
            run = partial(stage0_trained, config=config, **options)
            return Cell(entry, klass, case, run, partial(ddp_world.simulate, config), atol=atol, per_rank=True)

        flat = ddp_world.Config(name, (3,) * WORLD)
        unused = ddp_world.Config(name, (3,) * WORLD, unused_on=(1,))
        cells += [
            cell("who votes", "4 ranks, the vote overlapped with backward: DeepSpeed's data-parallel group", flat),
            cell("who votes", "4 ranks, overlap_backward=False: the vote in step()", flat, overlap=False),
            Cell(
                entry,
                "who votes",
                "process_group in the config's optimizer params: refused on every rank, naming the mpu",
                partial(stage0_group_given, name=name),
                refusal="process_group: the vote runs over DeepSpeed's data-parallel group (engine.data_parallel_group)"
                "; to vote over other ranks, give deepspeed's mpu",
            ),
            cell("who has a gradient", "a head unused on rank 1, overlapped: rank 1 abstains on it", unused),
            cell("who has a gradient", "a head unused on rank 1, vote in step(): it abstains", unused, overlap=False),
            cell(
                "who has a gradient",
                "a frozen head (requires_grad=False before initialize): it stays put",
                ddp_world.Config(name, (3,) * WORLD, unused_on=tuple(range(WORLD))),
                frozen=True,
            ),
            cell(
                "what the hook is handed",
                "gradient_accumulation_steps=2: voted once, at the boundary",
                ddp_world.Config(name, (3,) * WORLD, micro=2),
            ),
            cell(
                "whose state comes back",
                "save_checkpoint after 2 of 4 steps, a fresh engine loads: each rank its own momentum",
                ddp_world.Config(name, (4,) * WORLD),
                resume_at=2,
            ),
            Cell(
                entry,
                "ranks out of step",
                "rank 3 a step ahead of the others: refused on every rank",
                partial(stage0_trained, config=flat, ahead=True),
                refusal="VoteMismatchError",
            ),
        ]
        # SignumMV with the vote overlapped, SignMuon with it in step(): one engine each (their start-up is the cost)
        overlap, clip, how = (
            (True, 1.0, "overlapped, gradient_clipping=1.0")
            if name == "SignumMV"
            else (False, 0.3, "vote in step(), gradient_clipping=0.3 (each worker at its own norm)")
        )
        cells.append(
            Cell(
                entry,
                "what the hook is handed",
                f"bf16, gradient_accumulation_steps=2, {how}: the bf16 gradients voted once, float32 master weights",
                partial(stage0_bf16, name=name, gas=2, overlap=overlap, clip=clip),
                partial(bf16_reference, name=name, gas=2, clip=0.0 if overlap else clip),
                atol=atol,
            )
        )
    return cells


def mpu_cells() -> list[Cell]:
    """Last in the spawn: DeepSpeed keeps a given mpu in its module state, where later engines find it."""
    cells = []
    for name in ("SignumMV", "SignMuon"):
        subgroups = ddp_world.Config(name, (3,) * WORLD, groups=((0, 2), (1, 3)))
        cells.append(
            Cell(
                _entry(0, name),
                "who votes",
                "deepspeed.initialize(mpu=...) with data-parallel groups {0, 2} and {1, 3}: each votes alone",
                partial(stage0_with_mpu, config=subgroups),
                partial(ddp_world.simulate, subgroups),
                atol=MUON_ATOL if name == "SignMuon" else 0.0,
                per_rank=True,
            )
        )
    return cells
