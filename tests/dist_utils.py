"""Run a function on M real processes joined by gloo, rendezvous through a temporary file.

No fixed ports: every call gets its own file store, so tests can run in parallel and never
collide with something else on the machine. A rank that raises fails the test with its
traceback; a rank that hangs fails it after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, init_file: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "rendezvous")
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, init_file, out_dir, args), nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
