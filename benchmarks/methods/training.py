"""The training benchmark's methods, one name each: how a freshly initialised network becomes
the model, optimizer and statistics one rank trains with (:class:`Setup`), per method name in
:data:`METHODS`; and the run's settings (:class:`TrainConfig`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import (
    ByzantineFault,
    CommStats,
    SignVoteState,
    VoteConfig,
    allreduce_hook,
    node_layout,
    sign_vote_hook,
)
from signmuon.optim import (
    LocalStepAverager,
    MuonWithAdamW,
    OuterStep,
    SignMuon,
    SignSGDMV,
    SignumMV,
    local_sgd,
    muon_param_groups,
    node_mesh,
    register_fsdp_vote,
)

__all__ = [
    "counted_powersgd_hook",
    "serial_powersgd_hook",
    "FSDP_METHODS",
    "LOCAL_SGD_PULL_PUSH",
    "METHODS",
    "STRATEGIES",
    "Method",
    "Setup",
    "TrainConfig",
    "shard_blocks",
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
    (``benchmarks/tuned.py``); False: the method's default learning rate."""
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


def _ddp(net: nn.Module) -> DDP:
    """DDP on whatever device the network was put on."""
    device = next(net.parameters()).device
    return DDP(net, device_ids=[device.index] if device.type == "cuda" else None)


# A method turns the freshly initialised network into its Setup.
Method = Callable[[nn.Module, TrainConfig], Setup]


def _fault(config: TrainConfig) -> ByzantineFault | None:
    return ByzantineFault(ranks=tuple(range(config.byzantine))) if config.byzantine else None


def _ddp_allreduce(make_opt, routed: bool = False) -> Method:
    """DDP's fp32 all-reduce with ``make_opt(params, lr_scale)``; ``routed``: params are Muon's groups."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        params = muon_param_groups(net) if routed else net.parameters()
        model = _ddp(net)
        stats = CommStats()
        model.register_comm_hook(stats, allreduce_hook)
        return Setup(model=model, optimizer=make_opt(params, config.lr_scale), stats=stats)

    return build


def _powersgd_bytes(bucket: dist.GradBucket, rank: int, world_size: int, min_compression_rate: float = 2.0) -> int:
    """Ring bytes of torch's PowerSGD for one bucket: P and Q for the matrices it compresses,
    the raw values of the tensors it does not (its own ``_should_compress`` rule)."""
    elements = 0
    for g in bucket.gradients():
        matrix = g.reshape(g.shape[0], -1) if g.dim() > 1 else None
        if matrix is not None and matrix.numel() >= (sum(matrix.shape) * rank) * min_compression_rate:
            elements += sum(matrix.shape) * rank
        else:
            elements += g.numel()
    return 2 * (world_size - 1) * elements * 4 // world_size


def serial_powersgd_hook(state, bucket):  # unannotated: DDP checks annotations as objects
    """torch's ``powerSGD_hook``, finished before the next bucket starts.

    Its hook issues the all-reduces of P and Q from future callbacks. gloo pairs collectives by
    the order each rank issues them, so with two buckets in flight one rank's Q all-reduce can
    pair with another rank's next bucket (gloo aborts: "collective mismatch"). Waiting for each
    bucket's future in the hook keeps one order on every rank, at the cost of overlapping
    buckets; NCCL, which orders collectives per stream, needs no such wait.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    result = powerSGD_hook.powerSGD_hook(state, bucket).wait()
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(result)
    return done


def counted_powersgd_hook(rank: int, stats: CommStats):
    """torch's PowerSGD hook (on gloo :func:`serial_powersgd_hook`) adding each bucket's ring
    bytes to ``stats`` (the uncompressed all-reduce until ``start_powerSGD_iter``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    world_size = dist.get_world_size()

    def hook(state, bucket):  # unannotated: DDP checks annotations as objects
        compressed = state.iter >= state.start_powerSGD_iter
        nbytes = (
            _powersgd_bytes(bucket, rank, world_size)
            if compressed
            else (2 * (world_size - 1) * bucket.buffer().numel() * 4 // world_size)
        )
        stats.add(nbytes, nbytes)
        if dist.get_backend() == "gloo":
            return serial_powersgd_hook(state, bucket)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    return hook


def _ddp_powersgd(rank: int, make_opt) -> Method:
    """torch's PowerSGD hook (error feedback, 2 warm-up iterations) with AdamW, one bucket at a
    time on gloo (:func:`serial_powersgd_hook`)."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        model = _ddp(net)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        stats = CommStats()
        model.register_comm_hook(state, counted_powersgd_hook(rank, stats))
        return Setup(model=model, optimizer=make_opt(model.parameters(), config.lr_scale), stats=stats)

    return build


def _ddp_half(dtype: torch.dtype, make_opt) -> Method:
    """torch's fp16 / bf16 compression hook (a half-precision all-reduce) with ``make_opt``."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.fp16_compress_hook if dtype == torch.float16 else default_hooks.bf16_compress_hook
        model = _ddp(net)
        stats = CommStats()
        world_size = dist.get_world_size()

        def counting_hook(state, bucket):  # unannotated: DDP checks annotations as objects
            nbytes = 2 * (world_size - 1) * bucket.buffer().numel() * 2 // world_size  # ring, 2-byte entries
            stats.add(nbytes, nbytes)
            return hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
        return Setup(model=model, optimizer=make_opt(model.parameters(), config.lr_scale), stats=stats)

    return build


def _vote(config: TrainConfig, node_aware: bool = False) -> VoteConfig:
    if node_aware:
        return VoteConfig(
            fault=_fault(config), zeros=config.vote_zeros, hierarchical=True, ranks_per_node=config.ranks_per_node
        )
    return VoteConfig(fault=_fault(config), zeros=config.vote_zeros)


def _ddp_sign_vote(momentum: float, lr: float, node_aware: bool = False) -> Method:
    def build(net: nn.Module, config: TrainConfig) -> Setup:
        model = _ddp(net)
        state = SignVoteState(momentum=momentum, start_iter=1, vote=_vote(config, node_aware))
        model.register_comm_hook(state, sign_vote_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr * config.lr_scale)
        return Setup(model=model, optimizer=optimizer, stats=state.stats, votes=True)

    return build


def _ddp_sign_muon(node_aware: bool = False, optimizer: type[SignMuon] = SignMuon, **options) -> Method:
    """SignMuon (or SignumMV / SignSGDMV) with its own DDP hook; its step takes the sign of
    .grad, so --clip-grad-norm changes nothing (unlike the bare hook's SGD)."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        scaled = {**options, "lr": options["lr"] * config.lr_scale}
        # SignMuon: embeddings and the head on the Signum path, as Muon users route them.
        params = muon_param_groups(net) if optimizer is SignMuon else net.parameters()
        opt = optimizer(params, vote=_vote(config, node_aware), **scaled)
        model = _ddp(net)
        opt.register_comm_hook(model)
        return Setup(model=model, optimizer=opt, stats=opt.comm_state.stats, votes=True)

    return build


def shard_blocks(net: nn.Module, mesh) -> nn.Module:
    """``fully_shard`` over ``mesh`` per block (each entry of the network's ``ModuleList``s, or
    each layer with parameters of a top-level ``nn.Sequential``), then the root, as torchtitan does."""
    from torch.distributed.fsdp import fully_shard

    blocks = [block for modules in net.modules() if isinstance(modules, nn.ModuleList) for block in modules]
    if not blocks and isinstance(net, nn.Sequential):
        blocks = [layer for layer in net if any(True for _ in layer.parameters())]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def fsdp_traffic(numel: int, ranks: int) -> int:
    """Bytes one rank sends per step in FSDP2's own collectives on ``ranks`` ranks, fp32: the
    reduce-scatter of the gradients and two all-gathers of the parameters (forward, and backward
    after resharding)."""
    return 3 * (ranks - 1) * numel * 4 // ranks


def _fsdp(make_opt=None, optimizer: type | None = None, **options) -> Method:
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
            opt = optimizer(params, vote=_vote(config), **scaled)
            register_fsdp_vote(net, opt, mesh)
            stats, ranks, inside = opt.stats, mesh.shape[1], True
        per_step = fsdp_traffic(numel, ranks)
        opt.register_step_post_hook(lambda *_: stats.add(per_step, per_step, inside_node=inside))
        return Setup(model=net, optimizer=opt, stats=stats, votes=optimizer is not None)

    return build


def _outer_step(config: TrainConfig, pseudo_gradient: str) -> OuterStep:
    """The DiLoCo methods' outer step: Nesterov SGD (plain SGD at momentum 0) at the run's settings;
    the scale settings go to the methods whose rule has scales (so one run can compare rules)."""
    scaled = pseudo_gradient in OuterStep.SCALED
    return OuterStep(
        optimizer=functools.partial(
            torch.optim.SGD, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer_momentum > 0
        ),
        pseudo_gradient=pseudo_gradient,
        scale_block=config.outer_scale_block if scaled else 0,
        scale_bits=config.outer_scale_bits if scaled else 32,
    )


def _fsdp_rounds(period: int, pseudo_gradient: str = "mean") -> Method:
    """AdamW on a model sharded over each node by FSDP2 (its reduce-scatter every step), and
    DiLoCo's rounds between nodes on each rank's shard, over its rail."""

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        device = next(net.parameters()).device
        mesh = node_mesh(config.ranks_per_node, device_type=device.type)
        shard_blocks(net, mesh["local"])
        opt = _adamw(net.parameters(), config.lr_scale)
        averager = LocalStepAverager(
            period,
            pull=1.0,
            outer=_outer_step(config, pseudo_gradient),
            module=net,
            process_group=mesh["node"].get_group(),
        )
        per_step = fsdp_traffic(sum(p.numel() for p in net.parameters()), mesh.shape[1])

        def after_step(*_) -> None:
            averager.stats.add(per_step, per_step, inside_node=True)
            averager.average_parameters(net.parameters())

        opt.register_step_post_hook(after_step)
        return Setup(model=net, optimizer=opt, stats=averager.stats, averager=averager)

    return build


LOCAL_SGD_PULL_PUSH = (1.0, 0.0)  # (pull, push) of plain periodic averaging


def _local_sgd(period: int, pull: float = 1.0, push: float = 0.0) -> Method:
    """Local SGD with momentum; pull=1, push=0 is plain periodic averaging, else DPPF."""

    is_dppf = (pull, push) != LOCAL_SGD_PULL_PUSH

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        model = _ddp(net)
        pull_push = config.pull_push if is_dppf and config.pull_push is not None else (pull, push)
        averager = LocalStepAverager(period, pull=pull_push[0], push=pull_push[1], module=net)
        opt = local_sgd(model, torch.optim.SGD(model.parameters(), lr=0.05 * config.lr_scale, momentum=0.9), averager)
        return Setup(model=model, optimizer=opt, stats=averager.stats, averager=averager)

    return build


def _adamw(params, lr_scale: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-3 * lr_scale)


def _muon_adamw(params, lr_scale: float) -> torch.optim.Optimizer:
    return MuonWithAdamW(params, lr=0.02 * lr_scale, adamw_lr=2e-3 * lr_scale)


def _rounds(
    period: int, pseudo_gradient: str | None = "mean", pull: float = 1.0, push: float = 0.0, inner=_adamw
) -> Method:
    """``inner`` (AdamW; or torch's Muon with AdamW, MuLoCo) on each worker, a round every
    ``period`` steps: DiLoCo's outer Nesterov step on the pseudo-gradients combined by
    ``pseudo_gradient`` (None: plain averaging, no outer step). Node-aware where the run is laid
    out in nodes (``--ranks-per-node``, torchrun): the inner step on the node's mean gradient
    every step, rounds between nodes on the rails."""

    is_dppf = (pull, push) != LOCAL_SGD_PULL_PUSH

    def build(net: nn.Module, config: TrainConfig) -> Setup:
        model = _ddp(net)
        layout = node_layout(None, config.ranks_per_node) if dist.get_world_size() > 1 else None
        layout = layout if layout is not None and layout.nodes > 1 else None
        pull_push = config.pull_push if is_dppf and config.pull_push is not None else (pull, push)
        outer = None if pseudo_gradient is None else _outer_step(config, pseudo_gradient)
        averager = LocalStepAverager(
            period, pull=pull_push[0], push=pull_push[1], module=net, outer=outer, layout=layout
        )
        params = muon_param_groups(net) if inner is _muon_adamw else model.parameters()
        opt = local_sgd(model, inner(params, config.lr_scale), averager)
        return Setup(model=model, optimizer=opt, stats=averager.stats, averager=averager)

    return build


METHODS: dict[str, Method] = {
    "adamw": _ddp_allreduce(lambda p, s: torch.optim.AdamW(p, lr=2e-3 * s)),
    "sgd": _ddp_allreduce(lambda p, s: torch.optim.SGD(p, lr=0.1 * s, momentum=0.9)),
    "signsgd_mv": _ddp_sign_vote(momentum=0.0, lr=1e-3),
    "signum_mv": _ddp_sign_vote(momentum=0.9, lr=1e-3),
    "signum_mv_optim": _ddp_sign_muon(optimizer=SignumMV, lr=1e-3, momentum=0.9),
    "muon_adamw": _ddp_allreduce(_muon_adamw, routed=True),
    "powersgd_adamw": _ddp_powersgd(4, lambda p, s: torch.optim.AdamW(p, lr=2e-3 * s)),
    "fp16_adamw": _ddp_half(torch.float16, lambda p, s: torch.optim.AdamW(p, lr=2e-3 * s)),
    "bf16_adamw": _ddp_half(torch.bfloat16, lambda p, s: torch.optim.AdamW(p, lr=2e-3 * s)),
    "signmuon": _ddp_sign_muon(lr=2e-3),
    "signmuon_polar": _ddp_sign_muon(lr=2e-3, polar_after_vote=True),
    # Per-layer step sizes: the SignMuon paper's lr/sqrt(fan_in), and Muon's own lr kept.
    "signmuon_fan_in": _ddp_sign_muon(lr=0.016, lr_scaling="fan_in"),
    "signmuon_muon_lr": _ddp_sign_muon(lr=0.02, lr_scaling="muon"),
    "signum_mv_node": _ddp_sign_vote(momentum=0.9, lr=1e-3, node_aware=True),
    "signmuon_node": _ddp_sign_muon(node_aware=True, lr=2e-3),
    "local_sgd_8": _local_sgd(8),
    "local_sgd_32": _local_sgd(32),
    "dppf_8": _local_sgd(8, pull=0.5, push=0.05),
    "dppf_32": _local_sgd(32, pull=0.5, push=0.05),
    "dppf_8_wide": _local_sgd(8, pull=0.5, push=0.2),
    "dppf_32_wide": _local_sgd(32, pull=0.5, push=0.2),
    "local_adamw_8": _rounds(8, pseudo_gradient=None),
    "local_adamw_32": _rounds(32, pseudo_gradient=None),
    "diloco_8": _rounds(8),
    "diloco_32": _rounds(32),
    "diloco_vote_8": _rounds(8, pseudo_gradient="sign_vote"),
    "diloco_vote_32": _rounds(32, pseudo_gradient="sign_vote"),
    "diloco_vote_ef_8": _rounds(8, pseudo_gradient="sign_vote_ef"),
    "diloco_vote_ef_32": _rounds(32, pseudo_gradient="sign_vote_ef"),
    "diloco_ef_8": _rounds(8, pseudo_gradient="scaled_sign"),
    "diloco_ef_32": _rounds(32, pseudo_gradient="scaled_sign"),
    "muloco_8": _rounds(8, inner=_muon_adamw),
    "muloco_32": _rounds(32, inner=_muon_adamw),
    "muloco_vote_ef_8": _rounds(8, pseudo_gradient="sign_vote_ef", inner=_muon_adamw),
    "muloco_vote_ef_32": _rounds(32, pseudo_gradient="sign_vote_ef", inner=_muon_adamw),
    "dppf_outer_8": _rounds(8, pull=0.5, push=0.05),
    "dppf_outer_32": _rounds(32, pull=0.5, push=0.05),
}

# --strategy fsdp: the methods that have a sharded form.
FSDP_METHODS: dict[str, Method] = {
    "adamw": _fsdp(lambda p, s: torch.optim.AdamW(p, lr=2e-3 * s)),
    "signsgd_mv": _fsdp(optimizer=SignSGDMV, lr=1e-3),
    "signum_mv": _fsdp(optimizer=SignumMV, lr=1e-3, momentum=0.9),
    "signmuon": _fsdp(optimizer=SignMuon, lr=2e-3),
    "diloco_8": _fsdp_rounds(8),
    "diloco_32": _fsdp_rounds(32),
    "diloco_vote_ef_8": _fsdp_rounds(8, pseudo_gradient="sign_vote_ef"),
}
