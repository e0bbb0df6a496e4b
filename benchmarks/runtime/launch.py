"""Run a function on M ranks: spawned local gloo processes, or the ranks torchrun started.

Local runs rendezvous through a temporary file, never a fixed port, so runs can go on side
by side and never collide with something else on the machine. A rank that raises fails the
run with its traceback; a rank that hangs fails it after ``timeout`` seconds. The tests launch
through this module too (``tests/harness.py``), reading their ranks' results as they like.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, call: bytes, world_size: int, init_file: str, out_dir: str, threads: int, environ: dict) -> None:
    # The caller's environment first, then its function: a forkserver's child starts with the
    # server's environment, and unpickling ``fn`` imports modules that read theirs.
    os.environ.clear()
    os.environ.update(environ)
    fn, args = pickle.loads(call)
    torch.set_num_threads(threads)
    # What torchrun sets, for frameworks that read it (DeepSpeed requires LOCAL_RANK).
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # Free DDP reducers (held in reference cycles) while their process group still exists,
        # and let every rank finish its collectives before the group goes away.
        del result
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's worker threads outlive the group on torch
    # 2.13, and one that frees a collective's tensors during that teardown aborts the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def median_seconds(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` in this process after one untimed call (the
    first allocates and, on a GPU, compiles), CUDA work waited for."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_calls(fn, iters: int, device: torch.device | None = None) -> list[float]:
    """Seconds of ``iters`` calls of ``fn``, each the max over the ranks (a collective step is as
    slow as its slowest rank); ranks start each call together, CUDA work is waited for."""
    cuda = device is not None and device.type == "cuda"
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device if cuda else None)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return times


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_torchrun(fn, *args, backend: str | None = None):
    """Call ``fn(rank, world_size, *args)`` in a process torchrun started; return its result.

    Uses the process group if one is up (see :func:`torchrun_group`), else makes one for the call.
    """
    with torchrun_group(backend):
        result = fn(dist.get_rank(), dist.get_world_size(), *args)
        gc.collect()
        dist.barrier()
        return result


@contextlib.contextmanager
def torchrun_group(backend: str | None = None):
    """The torchrun process group for the duration, made once: creating it again on the same
    MASTER_PORT after destroying it can hang the rendezvous, so several runs share one."""
    if dist.is_initialized():
        yield
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _destroyed_backends.append(backend)


_destroyed_backends: list[str] = []  # the torchrun groups this process made and destroyed


def end_torchrun_process() -> None:
    """End a benchmark process whose gloo torchrun group :func:`torchrun_group` destroyed: flush
    and leave with ``os._exit(0)``, as the local ranks do (gloo's worker threads outlive the group
    on torch 2.13 and can abort the interpreter's teardown after the results are out). Returns
    in any other process."""
    if "gloo" in _destroyed_backends:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0, threads: int = 1) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` local gloo processes.

    Returns each rank's result, rank 0 first: plain data (dicts, lists, numbers, strings,
    tensors), read back with ``weights_only=True``. ``threads`` is each process's torch thread
    count (1 keeps M ranks from fighting over a few cores).
    """
    return run_ranks(fn, world_size, args, timeout=timeout, threads=threads, load=load_result)


def run_ranks(fn, world_size: int, args: tuple, *, timeout: float, threads: int, load, start_method="spawn") -> list:
    """:func:`run_distributed` with the reader of each rank's result file, ``load(path)``; a rank
    that exited cleanly without a result (a test's deliberately dead rank) gives None.

    ``start_method="forkserver"`` forks the ranks from a server that has imported what
    :func:`multiprocessing.set_forkserver_preload` names (torch, once), instead of starting
    each in a fresh interpreter; the ranks still get this process's environment, path and
    working directory."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method={start_method!r}: use 'spawn' or 'forkserver' (a forked rank inherits threads)")
    call = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "rendezvous")
        ctx = mp.start_processes(
            _entry,
            args=(call, world_size, init_file, out_dir, threads, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s")
        paths = [os.path.join(out_dir, f"rank{r}.pt") for r in range(world_size)]
        return [load(p) if os.path.exists(p) else None for p in paths]


def load_result(path: str):
    """A rank's result file, refused (pickle.UnpicklingError naming it) unless it is plain data:
    the benchmarks return plain data, and reading anything else would run code."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(
            f"{path}: a rank returned more than plain data (dicts, lists, numbers, strings, tensors), which "
            "the launcher does not unpickle (torch's reason above): return plain data from the rank function"
        ) from error
