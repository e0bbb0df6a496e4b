"""``initialize``: ``deepspeed.initialize`` with SignMuon / SignumMV / SignSGDMV as config optimizers."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from signmuon.comm_hooks import VoteConfig
from signmuon.comm_hooks.dist import all_reduce, barrier
from signmuon.optim import SIGN_OPTIMIZERS, sign_optimizer_from_spec
from signmuon.optim.checkpoint import refuse_load

from .checkpoints import RANK_STATE_FILE, read_rank_file
from .zero_engine import initialize_zero

__all__ = ["OPTIMIZER_TYPES", "RANK_STATE_FILE", "check_supported", "initialize", "read_rank_file"]

OPTIMIZER_TYPES = SIGN_OPTIMIZERS
# Set by the integration itself, so not settable from the config: why, and what to do instead.
_RESERVED = {
    "process_group": "the vote runs over DeepSpeed's data-parallel group (engine.data_parallel_group); to vote "
    "over other ranks, give deepspeed's mpu (initialize(..., mpu=...)), whose get_data_parallel_group() it uses",
    "vote_in_step": "initialize(..., overlap_backward=False) votes in step()",
    "checkpoint_all_ranks": "engine.save_checkpoint already keeps every rank's momentum, in a file per rank",
    "vote": 'the vote is set by the config\'s top-level "vote" section',
    "master_weights": 'they follow "bf16": {"enabled": true}',
}


def _refuse_reserved(spec: dict[str, Any], name: str) -> None:
    """The same ValueError on every rank (the config is every rank's) before any collective."""
    params = spec.get("params", {})
    given = [key for key in _RESERVED if isinstance(params, dict) and key in params]
    if given:
        why = "; ".join(f"{key}: {_RESERVED[key]}" for key in given)
        raise ValueError(
            f"{given} in the DeepSpeed config's optimizer params for {name}: the integration sets them itself. "
            f"Remove them from the config ({why})"
        )


def _deepspeed():
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(
            "signmuon.integrations.deepspeed needs DeepSpeed: pip install 'signmuon[deepspeed]'"
        ) from error
    return deepspeed


def _load_config(config: str | os.PathLike | dict | None) -> dict[str, Any]:
    if config is None:
        raise ValueError("config is required: a DeepSpeed config dict or the path of its JSON file")
    if isinstance(config, dict):
        return copy.deepcopy(config)
    with open(config) as f:
        return json.load(f)


_MONITORS = ("csv_monitor", "tensorboard", "wandb", "comet")


def _check_monitor_names(config: dict[str, Any]) -> None:
    """A monitor's ``job_name`` becomes a directory under its ``output_path``: keep it there."""
    for section in _MONITORS:
        job = config.get(section, {}).get("job_name") if isinstance(config.get(section), dict) else None
        if job is None:
            continue
        job = str(job)
        if not job or os.path.isabs(job) or "/" in job or "\\" in job or job in (".", ".."):
            raise ValueError(
                f"{section}.job_name={job!r} must be a plain directory name: DeepSpeed joins it to "
                "output_path, so a path there writes outside the configured directory"
            )


def check_supported(config: dict[str, Any], name: str, *, bf16: bool = True) -> None:
    """Raise ValueError if DeepSpeed ``config`` cannot run optimizer ``name`` (ZeRO >= 1, fp16,
    bf16 with settings other than ``enabled``, or any bf16 where the caller does not build the
    engine itself: ``bf16=False``)."""
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage:
        raise ValueError(
            f"optimizer {name} with ZeRO stage {stage}: ZeRO partitions the optimizer state across all ranks, but each "
            "worker's momentum must stay whole (it is that worker's vote), and ZeRO reduces full-precision gradients, "
            'which is the communication the vote replaces. Use "zero_optimization": {"stage": 0}, or shard the '
            "model inside each node with FSDP2 and vote between nodes: signmuon.optim.register_fsdp_vote"
        )
    if config.get("fp16", {}).get("enabled", False):
        raise ValueError(
            f"optimizer {name} with fp16: DeepSpeed's fp16 optimizer adds loss scaling (which a sign vote "
            'does not need) and flattens the parameters; use "bf16": {"enabled": true} or fp32 with '
            "torch.autocast for half-precision compute in the forward pass"
        )
    section = config.get("bf16", {})
    if section.get("enabled", False) and not bf16:
        raise ValueError(
            f"optimizer {name} with bf16 in a DeepSpeed engine built elsewhere: DeepSpeed's bf16 optimizer flattens "
            "the parameters, losing the matrix shapes Newton–Schulz needs. Build the engine with "
            "signmuon.integrations.deepspeed.initialize (bf16 there keeps float32 master weights in our optimizer), "
            "or train in fp32 with torch.autocast(dtype=torch.bfloat16)"
        )
    if section.get("enabled", False) and set(section) - {"enabled"}:
        raise ValueError(
            f"optimizer {name} with bf16 settings {sorted(set(section) - {'enabled'})}: with our optimizers bf16 means bf16 "
            "parameters and gradients with float32 master weights and momentum in the optimizer; give only "
            '"bf16": {"enabled": true}'
        )


def initialize(
    *,
    model: torch.nn.Module,
    config: str | os.PathLike | dict,
    model_parameters=None,
    optimizer=None,
    overlap_backward: bool = True,
    **kwargs: Any,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` that also understands our optimizer types.

    If ``config["optimizer"]["type"]`` is ``SignMuon``, ``SignumMV`` or ``SignSGDMV`` (any
    case), the optimizer is built from its ``"params"`` (unknown keys are rejected with the
    valid list), DeepSpeed's own gradient all-reduce is switched off, and the workers'
    directions are majority-voted across the data-parallel ranks with the same hook and
    collective as under DDP: bucket by bucket as ``engine.backward`` produces the gradients
    (:class:`~signmuon.comm_hooks.BackwardReducer`), only at gradient-accumulation boundaries,
    so the vote overlaps the backward pass; ``engine.step()`` applies it. With
    ``overlap_backward=False`` the optimizer's ``step()`` votes instead (after backward; it
    also handles parameters that only some ranks use without voting zeros for them). A top-level ``"vote"`` section sets the vote (the fields of ``VoteConfig``:
    ``tie``, ``seed``, ``algorithm``, ``nonfinite``, ``kernels``; unknown keys are refused). Every other key goes to DeepSpeed unchanged; a config with none of our types
    is handed to ``deepspeed.initialize`` exactly as given.

    DeepSpeed clips gradients at norm 1.0 unless the config sets ``"gradient_clipping"``. With
    the overlapped vote it clips the voted ±1 tensor, whose sign ``step()`` takes, so it changes
    nothing; with ``overlap_backward=False`` it clips each worker's local gradient at that
    worker's own norm before its momentum, as ``clip_grad_norm_`` before a ``vote_in_step``
    step does (DeepSpeed's own clipping would use the ranks' mean norm): set it to 0 there for
    the exact math of the DDP hook.

    Refused for any config: a monitor ``job_name`` (``csv_monitor``, ``tensorboard``, ``wandb``,
    ``comet``) that is a path rather than a name, since DeepSpeed would write outside its
    ``output_path``.

    ``engine.load_checkpoint`` unpickles DeepSpeed's own files (``torch.load(weights_only=False)``):
    load only checkpoints you wrote. Our per-rank optimizer files in it are read with
    ``weights_only=True``, and one holding any other object is refused (docs/reliability.md).

    Supported with our types: ZeRO stage 0, in fp32 or with ``"bf16": {"enabled": true}``. In
    bf16 the model is cast to bfloat16 (as DeepSpeed casts it; feed bf16 inputs), the vote runs
    on the bf16 gradients, and the optimizer keeps float32 master weights and momentum
    (``master_weights=True``): DeepSpeed's own bf16 optimizer, which flattens the parameters and
    would lose the matrix shapes Newton–Schulz needs, is not used. fp16 is refused with the
    reason. Checkpoints (``engine.save_checkpoint`` / ``load_checkpoint``) keep every rank's
    local momentum, which DeepSpeed's rank-0 file would otherwise lose.

    ZeRO stage 1 and 2 (SignumMV, SignSGDMV; fp32 or bf16): ZeRO inside each node, the vote
    between nodes on each rank's partition (:mod:`signmuon.integrations.deepspeed.zero`, where the
    seam and every difference from plain DeepSpeed are described; docs/frameworks.md). ZeRO-3,
    offload, ZeRO++, MoE, model/sequence/pipeline parallelism and SignMuon there are refused.

    Returns:
        DeepSpeed's ``(engine, optimizer, training_dataloader, lr_scheduler)``.
    """
    loaded = _load_config(config)
    _check_monitor_names(loaded)
    deepspeed = _deepspeed()
    spec = loaded.get("optimizer")
    name = str(spec.get("type", "")) if isinstance(spec, dict) else ""
    if name.lower() not in OPTIMIZER_TYPES:
        return deepspeed.initialize(
            model=model, config=config, model_parameters=model_parameters, optimizer=optimizer, **kwargs
        )
    if optimizer is not None:
        raise ValueError(f"the config names optimizer {name!r} and an optimizer was passed too; give one")
    _refuse_reserved(spec, name)
    if loaded.get("zero_optimization", {}).get("stage", 0):
        check_supported({**loaded, "zero_optimization": {}}, name)  # fp16 and bf16 settings
        return initialize_zero(
            deepspeed,
            model=model,
            config=loaded,
            name=name,
            reserved=_RESERVED,
            kwargs=kwargs,
            model_parameters=model_parameters,
        )
    check_supported(loaded, name)
    vote = VoteConfig.from_dict(loaded.get("vote", {}))
    bf16 = bool(loaded.get("bf16", {}).get("enabled", False))
    if bf16:
        model.to(torch.bfloat16)  # what DeepSpeed's bf16 does to the module; master weights stay float32 below
    trainable = model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    opt = sign_optimizer_from_spec(
        {"type": name, "params": spec.get("params", {})},
        trainable,
        reserved=_RESERVED,
        vote=vote,
        vote_in_step=not overlap_backward,
        checkpoint_all_ranks=False,
        master_weights=bf16,
    )
    config_rest = {k: v for k, v in loaded.items() if k not in ("optimizer", "vote", "bf16")}
    engine, ds_optimizer, loader, scheduler = deepspeed.initialize(
        model=model, config=config_rest, optimizer=opt, **kwargs
    )
    engine.enable_backward_allreduce = False  # the vote in opt.step() is the gradient reduction
    opt.process_group = engine.data_parallel_group  # vote among data-parallel replicas only
    _checkpoint_per_rank(engine, opt)
    if overlap_backward:
        opt.register_backward_reducer(sync=engine.is_gradient_accumulation_boundary)
    else:
        engine.clip_fp32_gradients = functools.partial(_clip_own_norm, engine)
    return engine, ds_optimizer, loader, scheduler


def _clip_own_norm(engine) -> None:
    """DeepSpeed's clipping with this worker's own norm. Its ``clip_grad_norm_`` averages the norm
    over the data-parallel ranks (meant for gradients already averaged): on gradients not yet
    voted that clips every worker at the others' mean norm. Under an mpu the norm is summed over
    the model-parallel group, each replicated tensor counted once, as DeepSpeed does."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    mpu = engine.mpu
    params = [p for p in engine.module.parameters() if p.grad is not None]
    counted = [
        p.grad.float()
        for p in params
        if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)
    ]
    norm = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=engine.device)
    if mpu is not None:  # every rank of the group, with a gradient or not
        squares = norm.square()
        all_reduce(squares, mpu.get_model_parallel_group())
        norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, engine.gradient_clipping(), norm)


def _checkpoint_per_rank(engine, opt) -> None:
    """Make the engine's ``save_checkpoint`` / ``load_checkpoint`` keep each rank's optimizer
    state in a file of its own (:data:`RANK_STATE_FILE`, in the tag's folder).

    DeepSpeed writes the optimizer state from data-parallel rank 0 only, but the momentum is
    each worker's own. Gathering every rank's state into rank 0's file (``checkpoint_all_ranks``)
    put M copies of the momentum on every GPU at every save; here no rank holds another's.
    DeepSpeed's own optimizer entry (rank 0's state) is left unread on load.
    """
    save, load = engine.save_checkpoint, engine.load_checkpoint
    save_signature, load_signature = inspect.signature(save), inspect.signature(load)

    def rank_file(folder: str) -> str:
        return os.path.join(folder, RANK_STATE_FILE.format(rank=dist.get_rank() if dist.is_initialized() else 0))

    @functools.wraps(save)
    def save_checkpoint(*args, **kwargs):
        bound = save_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["tag"] is None:  # DeepSpeed's default tag, fixed before it saves
            bound.arguments["tag"] = f"global_step{engine.global_steps}"
        result = save(*bound.args, **bound.kwargs)
        folder = os.path.join(bound.arguments["save_dir"], str(bound.arguments["tag"]))
        os.makedirs(folder, exist_ok=True)
        torch.save(opt.state_dict(), rank_file(folder))
        barrier()  # every rank's file is written before any rank goes on
        return result

    @functools.wraps(load)
    def load_checkpoint(*args, **kwargs):
        bound = load_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        with_optimizer = bound.arguments["load_optimizer_states"] and not bound.arguments["load_module_only"]
        bound.arguments["load_optimizer_states"] = False
        path, client_state = load(*bound.args, **bound.kwargs)
        if path is not None and with_optimizer:
            own = rank_file(os.path.dirname(path))
            try:
                if not os.path.exists(own):
                    raise FileNotFoundError(
                        f"{own} is missing: the checkpoint holds no optimizer state of this rank (each rank writes "
                        "its own; was it saved by every rank, and onto storage every rank sees?)"
                    )
                saved = read_rank_file(own)
            except (FileNotFoundError, pickle.UnpicklingError) as error:
                refuse_load(opt, error)  # the other ranks wait in load_state_dict's check: all raise
            opt.load_state_dict(saved)
        return path, client_state

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
