"""Every method the benchmarks know, one name each, and which commands run it.

A name means the same communication (and, for ``train``, the same optimizer) wherever it
appears: ``signsgd_mv`` is the majority vote of the gradients' signs in ``bandwidth`` (the
collective alone), ``ddp-step`` (the DDP hook) and ``train`` (hook + SGD). Each command keeps
its implementations keyed by these names; a test checks the two agree. ``--help`` of each
command lists its methods from here; a name from before the registry gets a one-line error
naming its successor.
"""

from __future__ import annotations

import argparse
import dataclasses

__all__ = ["METHODS", "RENAMED", "check_methods", "describe", "names_for"]


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """One method: what it does and the commands that run it."""

    summary: str
    """One line for ``--help``."""
    commands: tuple[str, ...]
    """The signmuon-bench commands that implement it."""


_COLLECTIVE, _DDP, _TRAIN, _DS = "bandwidth", "ddp-step", "train", "deepspeed-step"

METHODS: dict[str, MethodInfo] = {
    # full-precision and low-precision all-reduce
    "allreduce": MethodInfo("fp32 mean all-reduce (DDP's default; SGD in ddp-step)", (_COLLECTIVE, _DDP, _DS)),
    "bf16_allreduce": MethodInfo("bf16 all-reduce", (_COLLECTIVE,)),
    "fp16_allreduce": MethodInfo("torch's fp16 compression hook", (_DDP,)),
    "int8_sum_allreduce": MethodInfo("int8 signs summed by an all-reduce (the SignMuon paper's vote)", (_COLLECTIVE,)),
    "powersgd_r1": MethodInfo("PowerSGD, rank 1", (_COLLECTIVE, _DDP)),
    "powersgd_r4": MethodInfo("PowerSGD, rank 4", (_COLLECTIVE,)),
    "ef_1bit": MethodInfo("error-feedback scaled signs (1-bit Adam's compressed_allreduce)", (_COLLECTIVE,)),
    # the vote
    "signsgd_mv": MethodInfo(
        "majority vote of the gradients' signs, fast ties (one bit per entry)", (_COLLECTIVE, _DDP, _TRAIN, _DS)
    ),
    "signsgd_mv_exact": MethodInfo("the same vote with tie='exact' (ties vote 0)", (_COLLECTIVE,)),
    "signsgd_mv_allgather": MethodInfo("the vote by one all-gather of every rank's packed signs", (_COLLECTIVE,)),
    "signsgd_mv_node": MethodInfo("node-aware vote: fp32 inside a node, one bit between nodes", (_COLLECTIVE, _DDP)),
    "signsgd_mv_in_step": MethodInfo("SignSGDMV voting in step() (vote_in_step)", (_DS,)),
    "ddp_signsgd_mv": MethodInfo("SignSGDMV's hook under DDP (deepspeed-step's reference)", (_DS,)),
    "signum_mv": MethodInfo("Signum-MV: the vote of each worker's momentum signs", (_DDP, _TRAIN)),
    "signum_mv_node": MethodInfo("Signum-MV, node-aware", (_DDP, _TRAIN)),
    "signum_mv_optim": MethodInfo("Signum-MV as the SignumMV optimizer with its own hook", (_TRAIN,)),
    "signmuon": MethodInfo("SignMuon: Newton-Schulz on each worker's momentum, signs voted", (_DDP, _TRAIN, _DS)),
    "signmuon_node": MethodInfo("SignMuon, node-aware (Newton-Schulz split in the node)", (_DDP, _TRAIN)),
    "signmuon_polar": MethodInfo("SignMuon with the polar step after the vote", (_TRAIN,)),
    "signmuon_fan_in": MethodInfo("SignMuon with lr_scaling='fan_in'", (_TRAIN,)),
    "signmuon_muon_lr": MethodInfo("SignMuon with lr_scaling='muon'", (_TRAIN,)),
    # sharded models (FSDP2); train takes --strategy fsdp instead
    "fsdp_reduce_scatter": MethodInfo("FSDP2 over every rank, fp32 reduce-scatter, SGD with momentum", (_DDP,)),
    "fsdp_signum_mv": MethodInfo("FSDP2 inside each node, Signum-MV voted between nodes", (_DDP,)),
    "fsdp_signmuon": MethodInfo("FSDP2 inside each node, SignMuon voted between nodes", (_DDP,)),
    # optimizers on the fp32 all-reduce, and their compressed variants
    "adamw": MethodInfo("DDP + AdamW", (_TRAIN,)),
    "sgd": MethodInfo("DDP + SGD with momentum", (_TRAIN,)),
    "muon_adamw": MethodInfo("DDP + torch's Muon (matrices) and AdamW (the rest)", (_TRAIN,)),
    "powersgd_adamw": MethodInfo("PowerSGD (rank 4) + AdamW", (_TRAIN,)),
    "fp16_adamw": MethodInfo("torch's fp16 compression hook + AdamW", (_TRAIN,)),
    "bf16_adamw": MethodInfo("torch's bf16 compression hook + AdamW", (_TRAIN,)),
    # local steps
    "local_sgd_8": MethodInfo("local SGD, averaging every 8 steps", (_TRAIN,)),
    "local_sgd_32": MethodInfo("local SGD, averaging every 32 steps", (_TRAIN,)),
    "dppf_8": MethodInfo("DPPF every 8 steps (pull 0.5, push 0.05)", (_TRAIN,)),
    "dppf_32": MethodInfo("DPPF every 32 steps (pull 0.5, push 0.05)", (_TRAIN,)),
    "dppf_8_wide": MethodInfo("DPPF every 8 steps (pull 0.5, push 0.2)", (_TRAIN,)),
    "dppf_32_wide": MethodInfo("DPPF every 32 steps (pull 0.5, push 0.2)", (_TRAIN,)),
    # rounds with AdamW inside (node-aware where the run is laid out in nodes)
    "local_adamw_8": MethodInfo("AdamW locally, plain averaging every 8 steps", (_TRAIN,)),
    "local_adamw_32": MethodInfo("AdamW locally, plain averaging every 32 steps", (_TRAIN,)),
    "diloco_8": MethodInfo("DiLoCo: AdamW inside, outer Nesterov step every 8 steps (fp32 rounds)", (_TRAIN,)),
    "diloco_32": MethodInfo("DiLoCo, outer step every 32 steps (fp32 rounds)", (_TRAIN,)),
    "diloco_vote_8": MethodInfo("DiLoCo every 8 steps, pseudo-gradient as a sign vote (one bit)", (_TRAIN,)),
    "diloco_vote_32": MethodInfo("DiLoCo every 32 steps, pseudo-gradient as a sign vote (one bit)", (_TRAIN,)),
    "diloco_vote_ef_8": MethodInfo("DiLoCo every 8 steps, sign vote with error feedback (one bit)", (_TRAIN,)),
    "diloco_vote_ef_32": MethodInfo("DiLoCo every 32 steps, sign vote with error feedback (one bit)", (_TRAIN,)),
    "diloco_ef_8": MethodInfo("DiLoCo every 8 steps, error-feedback scaled signs (one bit)", (_TRAIN,)),
    "muloco_8": MethodInfo("MuLoCo: torch's Muon (and AdamW) inside, DiLoCo's outer step every 8 steps", (_TRAIN,)),
    "muloco_32": MethodInfo("MuLoCo, DiLoCo's outer step every 32 steps", (_TRAIN,)),
    "muloco_vote_ef_8": MethodInfo("MuLoCo every 8 steps, sign vote with error feedback (one bit)", (_TRAIN,)),
    "muloco_vote_ef_32": MethodInfo("MuLoCo every 32 steps, sign vote with error feedback (one bit)", (_TRAIN,)),
    "diloco_ef_32": MethodInfo("DiLoCo every 32 steps, error-feedback scaled signs (one bit)", (_TRAIN,)),
    "dppf_outer_8": MethodInfo("DPPF around DiLoCo's consensus every 8 steps (pull 0.5, push 0.05)", (_TRAIN,)),
    "dppf_outer_32": MethodInfo("DPPF around DiLoCo's consensus every 32 steps (pull 0.5, push 0.05)", (_TRAIN,)),
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


def names_for(command: str) -> tuple[str, ...]:
    """The methods ``command`` runs, in the registry's order."""
    return tuple(name for name, info in METHODS.items() if command in info.commands)


def describe(command: str) -> str:
    """``--help``'s list of ``command``'s methods, one per line."""
    names = names_for(command)
    width = max(map(len, names))
    return "methods:\n" + "\n".join(f"  {name:<{width}}  {METHODS[name].summary}" for name in names)


def check_methods(parser: argparse.ArgumentParser, command: str, methods: list[str]) -> None:
    """A one-line parser error (exit 2) for a method ``command`` does not run, naming the
    successor of a renamed one."""
    valid = names_for(command)
    for method in methods:
        if method in RENAMED and RENAMED[method] in valid:
            parser.error(f"--methods: {method!r} is now called {RENAMED[method]!r}")
    unknown = [m for m in methods if m not in valid]
    if unknown:
        parser.error(f"--methods: unknown method(s) {unknown} for {command}; choose from {', '.join(valid)}")
