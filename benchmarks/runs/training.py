"""The training run every training command shares: one method on M ranks, evaluated as it goes
(:func:`train_worker`), and several methods in turn (:func:`run`)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.benchmarks.methods.registry import builder, names_for
from signmuon.benchmarks.methods.training import Setup, TrainConfig
from signmuon.benchmarks.methods.tuned import borrowed_lr_scale, tuned_lr_scale
from signmuon.benchmarks.runtime.launch import (
    run_distributed,
    run_torchrun,
    under_torchrun,
)
from signmuon.benchmarks.workloads.tasks import evaluate, loss_fn, make_task
from signmuon.comm_hooks.dist import group_device, mean_all_reduce
from signmuon.comm_hooks.kernels import warm_up
from signmuon.optim import inverse_mean_valley


def _progress(total: int, desc: str):
    if not sys.stderr.isatty():  # in a log (or under netem) every update would become a line
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra brings it; without it, no bar
        return None
    return tqdm(total=total, desc=desc, leave=False)


def _network(model: nn.Module) -> nn.Module:
    """The trained network: DDP's module, or the FSDP2-sharded network itself."""
    return model.module if isinstance(model, DDP) else model


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value gathered whole (a collective), else the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def mean_over_workers(value: float) -> float:
    """The workers' mean of ``value`` (one all-reduce on the default group's device)."""
    total = torch.tensor([value], dtype=torch.float64, device=group_device(None))
    return mean_all_reduce(total, None).item()


def _whole_consensus(setup, model: nn.Module) -> dict[str, torch.Tensor]:
    """The averager's consensus model, sharded values gathered whole (a collective)."""
    return {k: _whole(v) for k, v in setup.averager.consensus_state_dict(_network(model)).items()}


def train_worker(rank: int, world_size: int, method: str, config: TrainConfig) -> dict:
    """Train ``method`` on this rank; every rank returns the same final metrics."""
    if config.batch_size % world_size:
        raise ValueError(f"batch_size={config.batch_size} must divide by the world size {world_size}")
    task = make_task(config.task, config.seed, config.data_dir, arch=config.arch, size=config.size)
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        )  # ranks may share a GPU
        torch.cuda.set_device(device)
    torch.manual_seed(config.seed)
    swept_task = task.name if config.size == "small" else ""
    tuned = tuned_lr_scale(swept_task, method) if config.tuned_lr else None
    borrowed = borrowed_lr_scale(swept_task, method) if config.tuned_lr and tuned is None else None
    lr_scale = config.lr_scale * (tuned or borrowed or 1.0)
    build = builder(method, "train:fsdp" if config.strategy == "fsdp" else "train")
    setup = build(task.make_model().to(device), dataclasses.replace(config, lr_scale=lr_scale))
    model, opt = setup.model, setup.optimizer
    per_rank = config.batch_size // world_size
    data_gen = torch.Generator().manual_seed(config.seed + 1)  # same on every rank: disjoint slices
    log, step_times = [], []
    progress = _progress(config.steps, f"{task.name}/{method}") if rank == 0 and config.progress else None
    if setup.votes:  # the kernels' first compile is not training time
        warm_up(device, sorted({p.dtype for p in model.parameters()}, key=str))
    wall_start = time.perf_counter()
    eval_seconds = 0.0  # left out of time_s: the curves show training time, not evaluation time
    warmup = min(5, config.steps // 5)  # kernels compile and buckets form: left out of the time split
    at_warmup = _seconds(setup)
    burst = sent_before = 0  # the most bytes this rank sent between nodes in any one step
    for step in range(config.steps):
        batch = torch.randint(0, task.num_examples, (config.batch_size,), generator=data_gen)
        x, y = (t.to(device) for t in task.batch(batch[rank * per_rank : (rank + 1) * per_rank]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - start)
        sent_now = setup.stats.bytes_sent_between_nodes
        burst, sent_before = max(burst, sent_now - sent_before), sent_now
        if step + 1 == warmup:
            at_warmup = _seconds(setup)
        if progress is not None:
            progress.update()
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            eval_start = time.perf_counter()
            entry = {
                "step": step + 1,
                "time_s": eval_start - wall_start - eval_seconds,
                "bytes": setup.stats.bytes_sent,
                "bytes_between_nodes": setup.stats.bytes_sent_between_nodes,
                "train_loss": loss.item(),
                **evaluate(model, task),
            }
            if setup.averager is not None:
                # Workers differ between rounds: report the consensus and the mean worker.
                entry["worker_acc"] = mean_over_workers(entry["test_acc"])
                consensus = task.make_model().to(device)
                consensus.load_state_dict(_whole_consensus(setup, model))
                entry.update(evaluate(consensus, task))
            log.append(entry)
            eval_seconds += time.perf_counter() - eval_start
    if progress is not None:
        progress.close()
    result = {
        "method": method,
        "strategy": config.strategy,
        "vote_zeros": config.vote_zeros,
        "outer": [config.outer_lr, config.outer_momentum, config.outer_scale_block, config.outer_scale_bits],
        "task": task.name if config.size == "small" else f"{task.name}-{config.size}",
        "world_size": world_size,
        "seed": config.seed,
        "lr_scale": lr_scale,
        "lr_tuned": tuned is not None,
        "lr_borrowed": borrowed is not None,
        "test_acc": log[-1]["test_acc"],
        "bytes_per_rank": setup.stats.bytes_sent,
        "bytes_between_nodes_per_rank": setup.stats.bytes_sent_between_nodes,
        "largest_burst_between_nodes_per_rank": burst,
        "round_hidden_share": setup.stats.round_hidden_share if setup.stats.round_seconds > 0 else None,
        "round_seconds": setup.stats.round_seconds,
        "round_steps_hidden": setup.stats.round_steps_hidden,
        "step_ms": 1e3 * statistics.median(step_times),
        "time_split_ms": time_split(step_times[warmup:], _seconds(setup), at_warmup),
        "log": log,
    }
    if "test_ppl" in log[-1]:
        result["test_ppl"] = log[-1]["test_ppl"]
    if setup.averager is not None:
        result["worker_acc"] = log[-1]["worker_acc"]
        result["rounds"] = setup.averager.rounds
        result["mean_distance"] = setup.averager.mean_distance
        result["final_state"] = {k: v.cpu() for k, v in _whole_consensus(setup, model).items()}
    else:
        result["rounds"] = config.steps  # gradient communication every step
        result["final_state"] = {k: _whole(v).detach().cpu().clone() for k, v in _network(model).state_dict().items()}
    return result


def _seconds(setup: Setup) -> dict[str, float | None]:
    """The cumulative timers a time split is a difference of (None: not ours to time)."""
    stats = setup.stats
    packing = stats.pack_seconds + stats.vote_seconds + stats.unpack_seconds
    return {
        "newton_schulz": getattr(setup.optimizer, "ns_seconds", None),
        "pack_vote_unpack": packing if setup.votes else None,
        "network_wait": stats.wait_seconds if setup.votes else None,
    }


def time_split(step_times: list[float], end: dict, start: dict) -> dict[str, float | None]:
    """Where a step's time went, in ms per step (means over ``step_times``, this rank):
    Newton–Schulz, packing + voting + unpacking, blocked on the network, and the rest (forward,
    backward, the optimizer's arithmetic), from the timers at the start and end of those steps.
    None where the work is not ours to time (torch's Muon, DDP's own all-reduce, whose wait
    happens inside DDP's reducer)."""
    steps = max(len(step_times), 1)
    split: dict[str, float | None] = {"step": 1e3 * sum(step_times) / steps}
    for field in ("newton_schulz", "pack_vote_unpack", "network_wait"):
        split[field] = None if end[field] is None or start[field] is None else 1e3 * (end[field] - start[field]) / steps
    split["forward_backward_rest"] = split["step"] - sum(v for k, v in split.items() if k != "step" and v is not None)
    return split


def valley_of(state: dict[str, torch.Tensor], config: TrainConfig, directions: int = 10) -> float:
    """Inv. MV of a final (consensus) model on training batches (delta = 0.1 nats)."""
    task = make_task(config.task, config.seed, config.data_dir, arch=config.arch, size=config.size)
    net = task.make_model()
    net.load_state_dict(state)
    indices = torch.randperm(task.num_examples, generator=torch.Generator().manual_seed(config.seed))[:2048]
    batches = [task.batch(chunk) for chunk in indices.split(512)]
    result = inverse_mean_valley(
        net, loss_fn, batches, directions=directions, delta=0.1, max_distance=50.0, seed=config.seed
    )
    return result.inverse_mean_valley


def run(methods: list[str], world_size: int, config: TrainConfig, valley: bool = False) -> list[dict]:
    """Each method on ``world_size`` local gloo ranks (or the torchrun ranks); rank 0's results.

    ``valley`` adds each final (consensus) model's Inverse Mean Valley as ``inv_mv``.
    """
    results = []
    for method in methods:
        if method not in names_for("train"):
            raise ValueError(f"unknown method {method!r}; choose from {sorted(names_for('train'))}")
        if under_torchrun():
            results.append(run_torchrun(train_worker, method, config))
        else:
            results.append(run_distributed(train_worker, world_size, method, config)[0])
        if valley:
            results[-1]["inv_mv"] = valley_of(results[-1]["final_state"], config)
    return results
