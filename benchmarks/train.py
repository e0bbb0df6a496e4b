"""Data-parallel training benchmark: accuracy, bytes sent per rank and step time per method.

Tasks (see ``tasks.py``): ``digits`` (scikit-learn's digits, a small CNN), ``charlm`` (a
small GPT on the standard library's source), ``cifar10`` (ResNet-18, from ``--data-dir``).
Each step every rank draws its own slice of the global batch.

    python -m signmuon.benchmarks.train --world-size 4 --methods adamw signsgd_mv signum_mv
    torchrun --nproc-per-node 4 -m signmuon.benchmarks.train
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.benchmarks.cli import check_device, command_parser, network_label, parse_methods, positive_int
from signmuon.benchmarks.curves import seed_summary
from signmuon.benchmarks.launch import (
    end_torchrun_process,
    run_distributed,
    run_torchrun,
    torchrun_group,
    under_torchrun,
)
from signmuon.benchmarks.methods import FSDP_METHODS, METHODS, STRATEGIES, Setup, TrainConfig
from signmuon.benchmarks.tasks import CHARLM_SIZES, TASKS, evaluate, loss_fn, make_task
from signmuon.benchmarks.train_report import (
    by_method,
    print_projection,
    print_summary,
    print_table,
    print_time_split,
    write_curves,
)
from signmuon.benchmarks.tuned import SWEEPS, borrowed_lr_scale, tuned_lr_scale
from signmuon.comm_hooks.dist import group_device, mean_all_reduce
from signmuon.comm_hooks.kernels import warm_up
from signmuon.comm_hooks.vote import ZERO_RULES
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
    methods = FSDP_METHODS if config.strategy == "fsdp" else METHODS
    setup = methods[method](task.make_model().to(device), dataclasses.replace(config, lr_scale=lr_scale))
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
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
        if under_torchrun():
            results.append(run_torchrun(train_worker, method, config))
        else:
            results.append(run_distributed(train_worker, world_size, method, config)[0])
        if valley:
            results[-1]["inv_mv"] = valley_of(results[-1]["final_state"], config)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("train", __doc__, methods="train")
    parser.add_argument("--world-size", type=positive_int, default=4, help="local gloo ranks (ignored under torchrun)")
    parser.add_argument("--task", default="digits", choices=sorted(TASKS))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    parser.add_argument("--arch", default="resnet18", choices=["resnet18", "resnet50"], help="cifar10's model")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--data-dir", help="where cifar10 lives (torchvision's cifar-10-batches-py folder's parent)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[TrainConfig.seed],
        help="one run per seed; several give mean ± std and bands (default: %(default)s)",
    )
    parser.add_argument("--size", default="small", choices=sorted(CHARLM_SIZES), help="charlm's model size")
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="report time and steps to this test loss (default: adamw's final loss, if run)",
    )
    parser.add_argument("--byzantine", type=int, default=0, help="ranks 0..k-1 send flipped signs")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="L for the *_node methods and --strategy fsdp (default: torchrun's LOCAL_WORLD_SIZE)",
    )
    parser.add_argument(
        "--vote-zeros",
        default="abstain",
        choices=ZERO_RULES,
        help="the vote's zero rule (VoteConfig.zeros): abstain, or a keyed coin (one bit per entry)",
    )
    parser.add_argument(
        "--strategy",
        default="ddp",
        choices=STRATEGIES,
        help="ddp (replicas) or fsdp (FSDP2 per block: adamw over every rank; "
        f"{', '.join(m for m in FSDP_METHODS if m != 'adamw' and not m.startswith('diloco'))} over each node, "
        f"voting between nodes; {', '.join(m for m in FSDP_METHODS if m.startswith('diloco'))} over each node, "
        "rounds between nodes)",
    )
    parser.add_argument(
        "--outer-lr",
        type=float,
        default=TrainConfig.outer_lr,
        help="the DiLoCo methods' outer learning rate (default: %(default)s, DiLoCo's)",
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=TrainConfig.outer_momentum,
        help="the DiLoCo methods' outer Nesterov momentum (default: %(default)s, DiLoCo's)",
    )
    parser.add_argument(
        "--outer-scale-block",
        type=int,
        default=0,
        help="entries per scale of the one-bit rounds' voted signs (0: one scale per tensor)",
    )
    parser.add_argument(
        "--outer-scale-bits",
        type=int,
        choices=[32, 16, 8],
        default=TrainConfig.outer_scale_bits,
        help="bits those scales travel in: 32 (float32), 16 (bfloat16), 8 (a log-grid code)",
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        help="clip_grad_norm_(max_norm) before each step, as nanoGPT does (default: off)",
    )
    parser.add_argument(
        "--lr-scale",
        type=float,
        default=1.0,
        help="multiply every method's learning rates (default: %(default)s; see the sweep command)",
    )
    parser.add_argument(
        "--untuned",
        dest="tuned_lr",
        action="store_false",
        help="each method's default learning rate instead of the sweep's tuned one (benchmarks/tuned.py)",
    )
    parser.add_argument("--valley", action="store_true", help="measure each final model's Inverse Mean Valley")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--csv", help="write every evaluation (step, time, bytes, losses, accuracy) as CSV")
    parser.add_argument("--plot", help="write test loss vs step / bytes / time as a PNG")
    args = parse_methods(parser, argv)  # before anything trains: a typo must not cost the runs before it
    check_device(parser, args.device)
    if args.task == "cifar10" and not args.data_dir:
        parser.error("--task cifar10 needs --data-dir (the folder holding torchvision's cifar-10-batches-py)")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        parser.error(f"--clip-grad-norm {args.clip_grad_norm} must be > 0")
    if not args.outer_lr > 0 or not 0 <= args.outer_momentum < 1 or args.outer_scale_block < 0:
        parser.error(
            f"--outer-lr {args.outer_lr} must be > 0, --outer-momentum {args.outer_momentum} in [0, 1) "
            f"and --outer-scale-block {args.outer_scale_block} >= 0"
        )
    if not args.lr_scale > 0:
        parser.error(f"--lr-scale {args.lr_scale} must be > 0")
    if args.size != "small" and args.task != "charlm":
        parser.error(f"--size {args.size} is charlm's option; --task {args.task} has one model size")
    if args.target_loss is not None and not math.isfinite(args.target_loss):
        parser.error(f"--target-loss {args.target_loss} must be a finite loss")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed once")
    if args.strategy == "fsdp" and set(args.methods) - set(FSDP_METHODS):
        parser.error(
            f"--strategy fsdp trains {sorted(FSDP_METHODS)}; not {sorted(set(args.methods) - set(FSDP_METHODS))}"
        )
    if args.strategy == "fsdp" and args.ranks_per_node is None and not under_torchrun():
        parser.error("--strategy fsdp shards over each node: pass --ranks-per-node L")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or args.world_size % args.ranks_per_node):
        parser.error(f"--ranks-per-node {args.ranks_per_node} must be >= 1 and divide --world-size {args.world_size}")
    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        byzantine=args.byzantine,
        size=args.size,
        eval_every=args.eval_every,
        task=args.task,
        data_dir=args.data_dir,
        device=args.device,
        arch=args.arch,
        progress=args.progress,
        ranks_per_node=args.ranks_per_node,
        clip_grad_norm=args.clip_grad_norm,
        lr_scale=args.lr_scale,
        tuned_lr=args.tuned_lr,
        strategy=args.strategy,
        vote_zeros=args.vote_zeros,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        outer_scale_block=args.outer_scale_block,
        outer_scale_bits=args.outer_scale_bits,
    )
    # Under torchrun one process group serves every run (making it again can hang the rendezvous).
    with torchrun_group() if under_torchrun() else contextlib.nullcontext():
        results = [
            r
            for seed in args.seeds
            for r in run(args.methods, args.world_size, dataclasses.replace(config, seed=seed), valley=args.valley)
        ]
    runs_by_method = by_method(results)
    target = args.target_loss
    if target is None and "adamw" in runs_by_method:  # the quality the full-precision baseline reaches
        target = statistics.fmean(r["log"][-1]["test_loss"] for r in runs_by_method["adamw"])
    summaries = {m: seed_summary(runs, target) for m, runs in runs_by_method.items()}
    if not under_torchrun() or os.environ.get("RANK") == "0":
        if len(args.seeds) == 1:
            print_table(results, target)
            if target is not None and network_label() == "loopback":
                print_projection(results, target)
        else:
            print_summary(summaries, results, target)
        print_time_split(results)
        print(
            "lr x: factor on the method's default learning rate; * = tuned by the learning-rate sweep "
            f"(benchmarks/results/{SWEEPS.get(results[0]['task'].split('-')[0], 'none')}); ~ = its factor for the "
            "same optimizer"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "command": "signmuon-bench train " + " ".join(sys.argv[1:] if argv is None else argv),
                        "target_loss": target,
                        "summary": summaries,
                        "runs": [{k: v for k, v in r.items() if k != "final_state"} for r in results],
                    },
                    f,
                    indent=1,
                )
        write_curves(results, args.csv, args.plot)
    return results


if __name__ == "__main__":
    main()
    end_torchrun_process()
