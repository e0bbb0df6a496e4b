"""A training script that survives a killed rank: per-rank checkpoints, resumed on relaunch.

Run it under a relaunch loop (torchrun's own ``--max-restarts`` does not re-form a gloo group
on torch 2.13 CPU; see docs/reliability.md)::

    for attempt in 1 2 3; do
        torchrun --standalone --nproc-per-node 2 docs/examples/resumable_train.py --dir ckpt --steps 12 && break
    done

Each rank writes its own file every ``--every`` steps (model, SignMuon state with the rank's
momentum, the step), atomically, keeps its last two, and on start all ranks load the newest
step they all hold, with ``weights_only=True``. Batches are
a function of (rank, step), so the steps replayed after a restart see the same data, and the
run ends bit-identical to one never interrupted. ``--die-at`` lets a test kill one rank with
SIGKILL once.
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.optim import SignMuon


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def save_atomically(state: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a rank killed mid-write leaves no half-written file under the name


def saved_steps(directory: str, rank: int) -> list[int]:
    """Steps this rank has checkpoints of, newest first (it keeps two)."""
    prefix = f"rank{rank}.step"
    names = [n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".pt")]
    return sorted((int(n[len(prefix) : -3]) for n in names), reverse=True)


def resume_step(directory: str, rank: int, world_size: int) -> int:
    """The newest step every rank has a checkpoint of (0: start afresh).

    A rank killed between two ranks' saves can be one checkpoint behind, so each rank keeps its
    last two and all ranks agree on the newest step they all hold (one tiny all-gather).
    """
    mine = (saved_steps(directory, rank) + [0, 0])[:2]
    rows = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(rows, torch.tensor(mine))
    common = set.intersection(*({int(s) for s in row} | {0} for row in rows))
    return max(common)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--die-at", type=int, default=-1, help="rank 1 kills itself at this step, once")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.dir, exist_ok=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = SignMuon(net.parameters(), lr=0.01)
    step = resume_step(args.dir, rank, world_size)
    if step:
        saved = torch.load(os.path.join(args.dir, f"rank{rank}.step{step}.pt"), weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])  # raises if saved on another world size
    model = DDP(net)
    opt.register_comm_hook(model)
    marker = os.path.join(args.dir, "died")
    while step < args.steps:
        if rank == 1 and step == args.die_at and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if step % args.every == 0 or step == args.steps:
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}
            save_atomically(state, os.path.join(args.dir, f"rank{rank}.step{step}.pt"))
            for old in saved_steps(args.dir, rank)[2:]:
                os.remove(os.path.join(args.dir, f"rank{rank}.step{old}.pt"))
    dist.barrier()  # a rank that tore the group down while a peer still reads its last send aborts it
    dist.destroy_process_group()
    # Everything is saved. Leave without the interpreter's teardown: on torch 2.13 gloo's worker
    # threads outlive destroy_process_group once an optimizer was built after init, and one that
    # frees a finished collective's tensors during that teardown aborts the process (SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
