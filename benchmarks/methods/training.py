"""What ``train`` builds for each method: how a freshly initialised network becomes the model,
optimizer and statistics one rank trains with (:class:`Setup`), the builders of the methods
that all-reduce or vote every step (local steps: :mod:`.local_steps`); and the run's settings
(:class:`TrainConfig`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.benchmarks.methods.hooks import counted_powersgd_hook, fsdp_traffic, shard_blocks
from signmuon.comm_hooks import (
    ByzantineFault,
    CommStats,
    SignVoteState,
    VoteConfig,
    allreduce_hook,
    sign_vote_hook,
)
from signmuon.optim import (
    LocalStepAverager,
    SignMuon,
    muon_param_groups,
    node_mesh,
    register_fsdp_vote,
)

__all__ = [
    "STRATEGIES",
    "Builder",
    "Setup",
    "TrainConfig",
    "allreduce",
    "ddp",
    "half_allreduce",
    "powersgd",
    "sharded",
    "sign_optimizer",
    "sign_vote",
    "vote_config",
]

STRATEGIES = ("ddp", "fsdp")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """One training run."""

    steps: int = 300
    """Optimizer steps (every rank takes the same number)."""
    batch_size: int = 64
    """Global batch; each of M ranks takes batch_size // M examples per step."""
    seed: int = 0
    """Model initialisation and data order; equal seeds give equal runs."""
    eval_every: int = 100
    """Steps between evaluations on the held-out split."""
    byzantine: int = 0
    """Ranks 0..k-1 send flipped signs to the vote (sign-vote methods; robustness runs)."""
    task: str = "digits"
    """``digits``, ``charlm`` or ``cifar10``."""
    data_dir: str | None = None
    """Where a task that reads from disk finds its data (cifar10)."""
    device: str = "cpu"
    """Where to train: ``cpu``, or ``cuda`` (each rank on its LOCAL_RANK's GPU)."""
    arch: str = "resnet18"
    """cifar10's model: ``resnet18`` or ``resnet50``."""
    progress: bool = False
    """Show a progress bar on rank 0."""
    ranks_per_node: int | None = None
    """L for the node-aware (``*_node``) methods; None reads torchrun's LOCAL_WORLD_SIZE."""
    lr_scale: float = 1.0
    """Multiplies every learning rate of the method (the learning-rate sweep's knob), on top of
    the tuned factor when ``tuned_lr``."""
    tuned_lr: bool = True
    """Start from the factor the learning-rate sweep chose for this task and method
    (``benchmarks/methods/tuned.py``); False: the method's default learning rate."""
    size: str = "small"
    """charlm's model size (``small``, ``medium``: about 14M parameters)."""
    clip_grad_norm: float | None = None
    """``clip_grad_norm_(max_norm)`` before each step, as nanoGPT does (None: no clipping)."""
    pull_push: tuple[float, float] | None = None
    """(pull, push) for the DPPF methods instead of their own (the pull/push sweep's knob);
    local SGD (pull 1, push 0) keeps its own."""
    vote_zeros: str = "abstain"
    """The vote methods' zero rule (``VoteConfig.zeros``): ``abstain`` or ``coin``."""
    outer_lr: float = 0.7
    """The DiLoCo methods' outer learning rate (DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """The DiLoCo methods' outer Nesterov momentum (DiLoCo's 0.9; 0 is plain SGD)."""
    outer_scale_block: int = 0
    """Entries per scale of the one-bit rounds' voted signs (``OuterStep.scale_block``; 0: per tensor)."""
    outer_scale_bits: int = 32
    """Bits those scales travel in (``OuterStep.scale_bits``): 32, 16 or 8."""
    strategy: str = "ddp"
    """``ddp`` (replicas) or ``fsdp``: FSDP2's ``fully_shard`` per block; ``adamw`` shards over
    every rank, the vote methods over each node (``ranks_per_node``) and vote between nodes, the
    DiLoCo methods over each node with rounds between nodes."""

    @classmethod
    def from_args(cls, args, **fields) -> "TrainConfig":
        """The run a command's parsed options describe: every field ``args`` has an option of the
        same name for, then ``fields``."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **fields})


@dataclasses.dataclass(kw_only=True)
class Setup:
    """A method's training objects on one rank."""

    model: nn.Module
    """What the training loop calls (DDP-wrapped, or the FSDP2-sharded network)."""
    optimizer: torch.optim.Optimizer
    """What the training loop steps."""
    stats: CommStats
    """Counts the bytes this rank sends."""
    averager: LocalStepAverager | None = None
    """For local SGD / DPPF: evaluation uses its consensus model (the workers' average)."""
    votes: bool = False
    """Whether the gradients go through our vote, whose pack / vote / unpack / wait are timed."""


def ddp(net: nn.Module) -> DDP:
    """DDP on whatever device the network was put on."""
    device = next(net.parameters()).device
    return DDP(net, device_ids=[device.index] if device.type == "cuda" else None)


# A method turns the freshly initialised network into its Setup.
Builder = Callable[[nn.Module, TrainConfig], Setup]


def _fault(config: TrainConfig) -> ByzantineFault | None:
    return ByzantineFault(ranks=tuple(range(config.byzantine))) if config.byzantine else None


def allreduce(make_opt, routed: bool = False) -> Builder:
    """DDP's fp32 all-reduce with ``make_opt(params, lr_scale)``; ``routed``: params are Muon's groups."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        params = muon_param_groups(net) if routed else net.parameters()
        model = ddp(net)
        stats = CommStats()
        model.register_comm_hook(stats, allreduce_hook)
        return Setup(model=model, optimizer=make_opt(params, config.lr_scale), stats=stats)

    return build


def powersgd(rank: int, make_opt) -> Builder:
    """torch's PowerSGD hook (error feedback, 2 warm-up iterations) with AdamW, one bucket at a
    time on gloo (:func:`serial_powersgd_hook`)."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        model = ddp(net)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        stats = CommStats()
        model.register_comm_hook(state, counted_powersgd_hook(rank, stats))
        return Setup(model=model, optimizer=make_opt(model.parameters(), config.lr_scale), stats=stats)

    return build


def half_allreduce(dtype: torch.dtype, make_opt) -> Builder:
    """torch's fp16 / bf16 compression hook (a half-precision all-reduce) with ``make_opt``."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.fp16_compress_hook if dtype == torch.float16 else default_hooks.bf16_compress_hook
        model = ddp(net)
        stats = CommStats()
        world_size = dist.get_world_size()

        def counting_hook(state, bucket):  # unannotated: DDP checks annotations as objects
            nbytes = 2 * (world_size - 1) * bucket.buffer().numel() * 2 // world_size  # ring, 2-byte entries
            stats.add(nbytes, nbytes)
            return hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
        return Setup(model=model, optimizer=make_opt(model.parameters(), config.lr_scale), stats=stats)

    return build


def vote_config(config: TrainConfig, node_aware: bool = False) -> VoteConfig:
    if node_aware:
        return VoteConfig(
            fault=_fault(config), zeros=config.vote_zeros, hierarchical=True, ranks_per_node=config.ranks_per_node
        )
    return VoteConfig(fault=_fault(config), zeros=config.vote_zeros)


def sign_vote(momentum: float, lr: float, node_aware: bool = False) -> Builder:
    def build(net: nn.Module, config: TrainConfig) -> Setup:
        model = ddp(net)
        state = SignVoteState(momentum=momentum, start_iter=1, vote=vote_config(config, node_aware))
        model.register_comm_hook(state, sign_vote_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr * config.lr_scale)
        return Setup(model=model, optimizer=optimizer, stats=state.stats, votes=True)

    return build


def sign_optimizer(node_aware: bool = False, optimizer: type[SignMuon] = SignMuon, **options) -> Builder:
    """SignMuon (or SignumMV / SignSGDMV) with its own DDP hook; its step takes the sign of
    .grad, so --clip-grad-norm changes nothing (unlike the bare hook's SGD)."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        scaled = {**options, "lr": options["lr"] * config.lr_scale}
        # SignMuon: embeddings and the head on the Signum path, as Muon users route them.
        params = muon_param_groups(net) if optimizer is SignMuon else net.parameters()
        opt = optimizer(params, vote=vote_config(config, node_aware), **scaled)
        model = ddp(net)
        opt.register_comm_hook(model)
        return Setup(model=model, optimizer=opt, stats=opt.comm_state.stats, votes=True)

    return build


def sharded(make_opt=None, optimizer: type | None = None, **options) -> Builder:
    """FSDP2: ``make_opt(params, lr_scale)`` on a model sharded over every rank (the
    full-precision baseline), or ``optimizer`` sharded over each node with the vote between
    nodes (``register_fsdp_vote``). FSDP2's own traffic is counted by :func:`fsdp_traffic`."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(net.parameters()).device
        numel = sum(p.numel() for p in net.parameters())
        if optimizer is None:
            world_size = dist.get_world_size()
            shard_blocks(net, init_device_mesh(device.type, (world_size,)))
            opt, stats, ranks, inside = make_opt(net.parameters(), config.lr_scale), CommStats(), world_size, False
        else:
            mesh = node_mesh(config.ranks_per_node, device_type=device.type)
            shard_blocks(net, mesh["local"])
            scaled = {**options, "lr": options["lr"] * config.lr_scale}
            params = muon_param_groups(net) if optimizer is SignMuon else net.parameters()
            opt = optimizer(params, vote=vote_config(config), **scaled)
            register_fsdp_vote(net, opt, mesh)
            stats, ranks, inside = opt.stats, mesh.shape[1], True
        per_step = fsdp_traffic(numel, ranks)
        opt.register_step_post_hook(lambda *_: stats.add(per_step, per_step, inside_node=inside))
        return Setup(model=net, optimizer=opt, stats=stats, votes=optimizer is not None)

    return build
