"""The method table: every method the benchmarks know, defined once: its name, summary, and
what each command that offers it builds (:mod:`.registry` looks them up).

A name means the same communication (and, for ``train``, the same optimizer) wherever it
appears: ``signsgd_mv`` is the majority vote of the gradients' signs in ``bandwidth`` (the
collective alone), ``ddp-step`` (the DDP hook), ``train`` (hook + SGD) and ``plan`` (its bytes
and time by the cost model). Builders by command:

* ``bandwidth``: ``(grad, world_size) -> (call, bytes)`` (:mod:`.collective`);
* ``ddp-step``: ``(args, device) -> StepSetup`` (:mod:`.ddp`);
* ``deepspeed-step``: ``(args) -> (step, stats, params, stateful)`` (:mod:`.deepspeed`);
* ``train`` and ``train:fsdp`` (``--strategy fsdp``): ``(net, config) -> Setup``
  (:mod:`.training`, :mod:`.local_steps`);
* ``plan``: ``(cluster, workload) -> Traffic`` (:mod:`.traffic`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from signmuon.benchmarks.methods import collective, ddp, deepspeed, local_steps, traffic, training
from signmuon.optim import SignMuon, SignSGDMV, SignumMV

__all__ = ["METHODS", "RENAMED", "Method"]

_BW, _DDP, _DS, _TRAIN, _FSDP, _PLAN = "bandwidth", "ddp-step", "deepspeed-step", "train", "train:fsdp", "plan"


@dataclasses.dataclass(frozen=True)
class Method:
    """One method: what it does, and what each command that runs it builds."""

    summary: str
    """One line for ``--help``."""
    builders: Mapping[str, Callable]
    """Command -> its builder of this method (see the module's docstring)."""
    tuned_as: str | None = None
    """A swept method whose optimizer and default learning rate this one shares: ``train``
    takes that method's tuned factor (marked '~')."""
    plan_baseline: str = "allreduce"
    """The fp32 schedule ``plan`` compares it with (speed-up, crossover); itself for a baseline."""
    plan_as: str | None = None
    """A training method's traffic as ``plan`` models it (one of ``names_for("plan")``), for
    projections of its runs to other links; None where the plan has no model of it."""

    @property
    def commands(self) -> tuple[str, ...]:
        return tuple(self.builders)


def _adamw(p, s):
    return torch.optim.AdamW(p, lr=2e-3 * s)


def _powersgd_adamw(rank: int) -> Method:
    """torch's PowerSGD hook at ``matrix_approximation_rank=rank`` with AdamW, in ``train``."""
    return Method(f"PowerSGD (rank {rank}) + AdamW", {_TRAIN: training.powersgd(rank, _adamw)})


def _rounds(
    summary: str, period: int, *, fsdp: bool = False, inner: str = "adamw", plan_as: str | None = None, **options
) -> Method:
    """A rounds method of ``train`` (:func:`.local_steps.rounds`), its FSDP2 form where ``fsdp``;
    its learning rate is the swept one of its inner optimizer (``inner``); ``plan_as``: its
    traffic in the plan (node-aware rounds every ``period`` steps)."""
    builders = {_TRAIN: local_steps.rounds(period, inner=getattr(local_steps, inner), **options)}
    if fsdp:
        builders[_FSDP] = local_steps.sharded_rounds(period, options.get("pseudo_gradient", "mean"))
    return Method(summary, builders, tuned_as=inner, plan_as=plan_as)


METHODS: dict[str, Method] = {
    # full-precision and low-precision all-reduce
    "allreduce": Method(
        "fp32 mean all-reduce (DDP's default; SGD in ddp-step)",
        {_BW: collective.allreduce, _DDP: ddp.allreduce, _DS: deepspeed.engine(None), _PLAN: traffic.allreduce()},
    ),
    "bf16_allreduce": Method("bf16 all-reduce", {_BW: collective.bf16_allreduce, _PLAN: traffic.allreduce(2)}),
    "allreduce_node": Method(
        "fp32 all-reduce in two levels: inside each node, then between nodes", {_PLAN: traffic.node_allreduce}
    ),
    "fp16_allreduce": Method("torch's fp16 compression hook", {_DDP: ddp.fp16_allreduce, _PLAN: traffic.allreduce(2)}),
    "int8_sum_allreduce": Method(
        "int8 signs summed by an all-reduce (the SignMuon paper's vote)", {_BW: collective.int8_sum_allreduce}
    ),
    "powersgd_r1": Method("PowerSGD, rank 1", {_BW: collective.powersgd(1), _DDP: ddp.powersgd(1)}),
    "powersgd_r4": Method("PowerSGD, rank 4", {_BW: collective.powersgd(4), _PLAN: traffic.allreduce(4, 4)}),
    "ef_1bit": Method("error-feedback scaled signs (1-bit Adam's compressed_allreduce)", {_BW: collective.ef_1bit}),
    # the vote
    "signsgd_mv": Method(
        "majority vote of the gradients' signs, fast ties (one bit per entry)",
        {
            _BW: collective.vote(),
            _DDP: ddp.sign_vote(0.0),
            _TRAIN: training.sign_vote(momentum=0.0, lr=1e-3),
            _FSDP: training.sharded(optimizer=SignSGDMV, lr=1e-3),
            _DS: deepspeed.engine("SignSGDMV"),
            _PLAN: traffic.vote(),
        },
    ),
    "signsgd_mv_exact": Method("the same vote with tie='exact' (ties vote 0)", {_BW: collective.vote("exact")}),
    "signsgd_mv_allgather": Method(
        "the vote by one all-gather of every rank's packed signs", {_BW: collective.vote("exact", "all_gather")}
    ),
    "signsgd_mv_node": Method(
        "node-aware vote: fp32 inside a node, one bit between nodes",
        {_BW: collective.node_vote, _DDP: ddp.sign_vote(0.0, node_aware=True), _PLAN: traffic.node_vote()},
    ),
    "signsgd_mv_in_step": Method(
        "SignSGDMV voting in step() (vote_in_step)", {_DS: deepspeed.engine("SignSGDMV", overlap_backward=False)}
    ),
    "ddp_signsgd_mv": Method("SignSGDMV's hook under DDP (deepspeed-step's reference)", {_DS: deepspeed.ddp_hook}),
    "zero2_adamw": Method("DeepSpeed's own ZeRO-2 over every rank, AdamW", {_DS: deepspeed.zero_adamw}),
    "zero1_signum_mv": Method(
        "ZeRO-1 inside each node, SignumMV voted between nodes", {_DS: deepspeed.zero(1, "SignumMV")}
    ),
    "zero2_signum_mv": Method(
        "ZeRO-2 inside each node, SignumMV voted between nodes", {_DS: deepspeed.zero(2, "SignumMV")}
    ),
    "zero2_signum_mv_coin": Method(
        "zero2_signum_mv with zeros='coin' (one bit per entry, exact zeros too)",
        {_DS: deepspeed.zero(2, "SignumMV", {"zeros": "coin"})},
    ),
    "zero2_signmuon": Method(
        "ZeRO-2 inside each node, SignMuon voted between nodes", {_DS: deepspeed.zero(2, "SignMuon")}
    ),
    "signum_mv": Method(
        "Signum-MV: the vote of each worker's momentum signs",
        {
            _PLAN: traffic.vote(),
            _DDP: ddp.sign_vote(0.9),
            _TRAIN: training.sign_vote(momentum=0.9, lr=1e-3),
            _FSDP: training.sharded(optimizer=SignumMV, lr=1e-3, momentum=0.9),
        },
    ),
    "signum_mv_node": Method(
        "Signum-MV, node-aware",
        {
            _DDP: ddp.sign_vote(0.9, node_aware=True),
            _TRAIN: training.sign_vote(momentum=0.9, lr=1e-3, node_aware=True),
            _PLAN: traffic.node_vote(),
        },
    ),
    "signum_mv_optim": Method(
        "Signum-MV as the SignumMV optimizer with its own hook",
        {_TRAIN: training.sign_optimizer(optimizer=SignumMV, lr=1e-3, momentum=0.9)},
    ),
    "signmuon": Method(
        "SignMuon: Newton-Schulz on each worker's momentum, signs voted",
        {
            _DDP: ddp.sign_muon(),
            _TRAIN: training.sign_optimizer(lr=2e-3),
            _FSDP: training.sharded(optimizer=SignMuon, lr=2e-3),
            _DS: deepspeed.engine("SignMuon"),
            _PLAN: traffic.vote(newton_schulz=True),
        },
    ),
    "signmuon_node": Method(
        "SignMuon, node-aware (Newton-Schulz split in the node)",
        {
            _DDP: ddp.sign_muon(node_aware=True),
            _TRAIN: training.sign_optimizer(node_aware=True, lr=2e-3),
            _PLAN: traffic.node_vote(newton_schulz=True),
        },
        tuned_as="signmuon",
    ),
    "signmuon_polar": Method(
        "SignMuon with the polar step after the vote", {_TRAIN: training.sign_optimizer(lr=2e-3, polar_after_vote=True)}
    ),
    # Per-layer step sizes: the SignMuon paper's lr/sqrt(fan_in), and Muon's own lr kept.
    "signmuon_fan_in": Method(
        "SignMuon with lr_scaling='fan_in'", {_TRAIN: training.sign_optimizer(lr=0.016, lr_scaling="fan_in")}
    ),
    "signmuon_muon_lr": Method(
        "SignMuon with lr_scaling='muon'", {_TRAIN: training.sign_optimizer(lr=0.02, lr_scaling="muon")}
    ),
    # sharded models (FSDP2) in ddp-step; train takes --strategy fsdp instead
    "fsdp_reduce_scatter": Method(
        "FSDP2 over every rank, fp32 reduce-scatter, SGD with momentum", {_DDP: ddp.fsdp(None)}
    ),
    "hsdp_allreduce": Method(
        "FSDP2 inside each node, its shards all-reduced in fp32 between nodes (HSDP)",
        {_PLAN: traffic.hsdp},
        plan_baseline="hsdp_allreduce",
    ),
    "fsdp_signum_mv": Method(
        "FSDP2 inside each node, Signum-MV voted between nodes during backward",
        {_DDP: ddp.fsdp(SignumMV), _PLAN: traffic.sharded_vote()},
        plan_baseline="hsdp_allreduce",
    ),
    "fsdp_signmuon": Method(
        "FSDP2 inside each node, SignMuon voted between nodes during backward",
        {_DDP: ddp.fsdp(SignMuon), _PLAN: traffic.sharded_vote(newton_schulz=True)},
        plan_baseline="hsdp_allreduce",
    ),
    "fsdp_signum_mv_in_step": Method(
        "fsdp_signum_mv voting in opt.step(), after backward (register_fsdp_vote(during_backward=False))",
        {_DDP: ddp.fsdp(SignumMV, during_backward=False), _PLAN: traffic.sharded_vote(during_backward=False)},
        plan_baseline="hsdp_allreduce",
    ),
    "fsdp_signmuon_in_step": Method(
        "fsdp_signmuon voting in opt.step(), after backward",
        {
            _DDP: ddp.fsdp(SignMuon, during_backward=False),
            _PLAN: traffic.sharded_vote(newton_schulz=True, during_backward=False),
        },
        plan_baseline="hsdp_allreduce",
    ),
    # optimizers on the fp32 all-reduce, and their compressed variants
    "adamw": Method(
        "DDP + AdamW", {_TRAIN: training.allreduce(_adamw), _FSDP: training.sharded(_adamw)}, plan_as="allreduce"
    ),
    "sgd": Method(
        "DDP + SGD with momentum",
        {_TRAIN: training.allreduce(lambda p, s: torch.optim.SGD(p, lr=0.1 * s, momentum=0.9))},
    ),
    "muon_adamw": Method(
        "DDP + torch's Muon (matrices) and AdamW (the rest)",
        {_TRAIN: training.allreduce(local_steps.muon_adamw, routed=True)},
    ),
    # PowerSGD at rank 4 keeps its old name; ranks 1 and 2 were added to tune it per rank
    "powersgd_adamw": _powersgd_adamw(4),
    "powersgd_adamw_r1": _powersgd_adamw(1),
    "powersgd_adamw_r2": _powersgd_adamw(2),
    "fp16_adamw": Method(
        "torch's fp16 compression hook + AdamW", {_TRAIN: training.half_allreduce(torch.float16, _adamw)}
    ),
    "bf16_adamw": Method(
        "torch's bf16 compression hook + AdamW", {_TRAIN: training.half_allreduce(torch.bfloat16, _adamw)}
    ),
    # local steps
    "local_sgd_8": Method("local SGD, averaging every 8 steps", {_TRAIN: local_steps.periodic(8)}),
    "local_sgd_32": Method("local SGD, averaging every 32 steps", {_TRAIN: local_steps.periodic(32)}),
    "dppf_8": Method(
        "DPPF every 8 steps (pull 0.5, push 0.05)", {_TRAIN: local_steps.periodic(8, pull=0.5, push=0.05)}
    ),
    "dppf_32": Method(
        "DPPF every 32 steps (pull 0.5, push 0.05)", {_TRAIN: local_steps.periodic(32, pull=0.5, push=0.05)}
    ),
    "dppf_8_wide": Method(
        "DPPF every 8 steps (pull 0.5, push 0.2)", {_TRAIN: local_steps.periodic(8, pull=0.5, push=0.2)}
    ),
    "dppf_32_wide": Method(
        "DPPF every 32 steps (pull 0.5, push 0.2)", {_TRAIN: local_steps.periodic(32, pull=0.5, push=0.2)}
    ),
    # rounds with AdamW inside (node-aware where the run is laid out in nodes)
    "local_adamw_8": _rounds("AdamW locally, plain averaging every 8 steps", 8, pseudo_gradient=None),
    "local_adamw_32": _rounds("AdamW locally, plain averaging every 32 steps", 32, pseudo_gradient=None),
    "diloco_8": _rounds("DiLoCo: AdamW inside, outer Nesterov step every 8 steps (fp32 rounds)", 8, fsdp=True),
    "diloco_32": _rounds("DiLoCo, outer step every 32 steps (fp32 rounds)", 32, fsdp=True),
    "diloco_8_stream4": _rounds(
        "streaming fp32 rounds: diloco_8 in 4 fragments, each issued 1 step before it lands",
        8,
        fragments=4,
        sync_delay=1,
    ),
    "diloco_vote_8": _rounds(
        "DiLoCo every 8 steps, pseudo-gradient as a sign vote (one bit)", 8, pseudo_gradient="sign_vote"
    ),
    "diloco_vote_32": _rounds(
        "DiLoCo every 32 steps, pseudo-gradient as a sign vote (one bit)", 32, pseudo_gradient="sign_vote"
    ),
    "diloco_vote_ef_8": _rounds(
        "DiLoCo every 8 steps, sign vote with error feedback (one bit)",
        8,
        pseudo_gradient="sign_vote_ef",
        fsdp=True,
        plan_as="diloco_vote_node",
    ),
    "diloco_vote_ef_8_stream4": _rounds(
        "streaming one-bit rounds: diloco_vote_ef_8 in 4 fragments, each issued 1 step before it lands",
        8,
        pseudo_gradient="sign_vote_ef",
        fragments=4,
        sync_delay=1,
    ),
    "diloco_vote_ef_32": _rounds(
        "DiLoCo every 32 steps, sign vote with error feedback (one bit)", 32, pseudo_gradient="sign_vote_ef"
    ),
    "diloco_ef_8": _rounds(
        "DiLoCo every 8 steps, error-feedback scaled signs (one bit)", 8, pseudo_gradient="scaled_sign"
    ),
    "muloco_8": _rounds(
        "MuLoCo: torch's Muon (and AdamW) inside, DiLoCo's outer step every 8 steps", 8, inner="muon_adamw"
    ),
    "muloco_32": _rounds("MuLoCo, DiLoCo's outer step every 32 steps", 32, inner="muon_adamw"),
    "muloco_vote_ef_8": _rounds(
        "MuLoCo every 8 steps, sign vote with error feedback (one bit)",
        8,
        pseudo_gradient="sign_vote_ef",
        inner="muon_adamw",
    ),
    "muloco_vote_ef_32": _rounds(
        "MuLoCo every 32 steps, sign vote with error feedback (one bit)",
        32,
        pseudo_gradient="sign_vote_ef",
        inner="muon_adamw",
    ),
    "diloco_ef_32": _rounds(
        "DiLoCo every 32 steps, error-feedback scaled signs (one bit)", 32, pseudo_gradient="scaled_sign"
    ),
    "dppf_outer_8": _rounds(
        "DPPF around DiLoCo's consensus every 8 steps (pull 0.5, push 0.05)", 8, pull=0.5, push=0.05
    ),
    "dppf_outer_32": _rounds(
        "DPPF around DiLoCo's consensus every 32 steps (pull 0.5, push 0.05)", 32, pull=0.5, push=0.05
    ),
    # the cost model's node-aware rounds (train runs them node-aware when laid out in nodes)
    "diloco_node": Method(
        "node-aware DiLoCo: the node's all-reduce every step, fp32 rounds between nodes", {_PLAN: traffic.rounds()}
    ),
    "diloco_vote_node": Method(
        "node-aware DiLoCo with one-bit rounds between nodes", {_PLAN: traffic.rounds(one_bit=True)}
    ),
}

# Names the benchmarks used before the registry, and the one that replaced each.
RENAMED = {
    "fp32_allreduce": "allreduce",
    "vote_fast": "signsgd_mv",
    "vote_exact": "signsgd_mv_exact",
    "allgather_1bit": "signsgd_mv_allgather",
    "vote_node": "signsgd_mv_node",
    "sign_vote": "signsgd_mv",
    "sign_vote_node": "signsgd_mv_node",
    "fp16": "fp16_allreduce",
    "powersgd": "powersgd_r1",
}
