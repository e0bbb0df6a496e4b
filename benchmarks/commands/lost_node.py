"""DiLoCo rounds that survive a lost replica group, under torchft's Manager.

Two replica groups (one process each) train the task with AdamW inside and DiLoCo's outer step
every --period steps, through signmuon.integrations.torchft.FaultTolerantRounds and a torchft
lighthouse on this machine. In the second run of each seed replica 1 dies (os._exit, as a
crashed node) at --kill-at; it is started again --down seconds later and heals from the
survivor at the quorum after the survivor's next round. The first run has no failure: the same
seed, for comparison.

It prints, per run: the final test loss of each replica, the rounds committed and rolled back,
the step replica 1 rejoined at, the steps of work it lost (its local steps since its last
committed round, plus the steps the survivor ran while it was away), the steps the survivor
redid, and how long the failed round held the survivor up.

    signmuon-bench lost-node --task charlm --steps 320 --kill-at 100 --seeds 0 1 2"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import tempfile
import time
from datetime import timedelta

import torch

from signmuon.benchmarks.methods.tuned import tuned_lr_scale
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runtime.cli import command_parser, non_negative_float, positive_int
from signmuon.benchmarks.workloads.tasks import TASKS, evaluate, loss_fn

NAME = "lost-node"
SUMMARY = "DiLoCo rounds under torchft's Manager: a replica group killed, then healed"


__all__ = ["LostNodeConfig", "lost_node_run", "main"]

DEAD = 17  # replica 1's exit code when it dies on purpose


@dataclasses.dataclass(frozen=True)
class LostNodeConfig:
    """One run of two replica groups."""

    task: str = "charlm"
    """A ``train`` task, built from its config (nothing downloaded)."""
    steps: int = 300
    """Local steps of each replica."""
    period: int = 8
    """Local steps between rounds."""
    batch_size: int = 32
    """Each replica's batch."""
    kill_at: int | None = 100
    """The step at which replica 1 dies (None: no failure)."""
    down_seconds: float = 1.0
    """How long replica 1 stays dead before it is started again."""
    seed: int = 0
    """Seeds the model (the same on both replicas) and each replica's batches."""
    timeout_seconds: float = 5.0
    """The process group's timeout: how long a round waits on a dead peer at most."""


def _replica(replica: int, lighthouse: str, config: LostNodeConfig, out_dir: str, life: str, dies: bool, ready) -> None:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    from signmuon.integrations.torchft import FaultTolerantRounds
    from signmuon.optim import LocalStepAverager, OuterStep

    logging.getLogger("torchft").setLevel(logging.ERROR)  # it logs every quorum and commit
    torch.set_num_threads(1)
    task = TASKS[config.task](config.seed)
    torch.manual_seed(config.seed)
    model = task.make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=2e-3 * (tuned_lr_scale(config.task, "adamw") or 1.0))
    pg = ProcessGroupGloo(timeout=timedelta(seconds=config.timeout_seconds))
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        replica_id=str(replica),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=0,
        timeout=timedelta(seconds=30),
        use_async_quorum=False,
        init_sync=False,
    )
    averager = LocalStepAverager(
        config.period, outer=OuterStep.diloco(lr=0.7, momentum=0.5), pull=1.0, module=model, process_group=pg
    )
    if ready is not None:
        ready.wait()  # both replicas heartbeat before the first quorum: it holds both
    rounds = FaultTolerantRounds(manager, averager, inner)
    joined_at, events, iterations = rounds.steps_done, [], 0
    path = os.path.join(out_dir, f"replica{replica}-{life}.json")
    start = time.perf_counter()
    while rounds.steps_done < config.steps:
        iterations += 1
        step = rounds.steps_done
        if dies and step == config.kill_at:
            with open(path, "w") as f:  # the record of its rounds, then a crash: no shutdown, no goodbye
                json.dump({"replica": replica, "joined_at": joined_at, "events": events, "died_at": step}, f)
            os._exit(DEAD)
        gen = torch.Generator().manual_seed(config.seed * 7919 + replica * 100_003 + step)
        x, y = task.batch(torch.randint(0, task.num_examples, (config.batch_size,), generator=gen))
        inner.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        inner.step()
        round_start = time.perf_counter()
        committed = rounds.step()
        if committed is not None:
            events.append(
                {
                    "step": step + 1,
                    "committed": committed,
                    "replicas": manager.num_participants(),
                    "seconds": time.perf_counter() - round_start,
                }
            )
    result = {
        "replica": replica,
        "joined_at": joined_at,
        "heals": rounds.heals,
        "events": events,
        "iterations": iterations,
        "rounds_committed": rounds.rounds_committed,
        "rounds_failed": rounds.rounds_failed,
        "seconds": time.perf_counter() - start,
        **evaluate(model, task),
    }
    manager.shutdown(wait=False)
    with open(path, "w") as f:
        json.dump(result, f)


def lost_node_run(config: LostNodeConfig) -> dict:
    """Both replicas' results (``first``: as started; ``rejoined``: replica 1's second life)."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's lighthouse and managers log every quorum otherwise
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    ctx = multiprocessing.get_context("spawn")
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            ready = ctx.Barrier(2)
            procs = [
                ctx.Process(
                    target=_replica,
                    args=(
                        r,
                        lighthouse.address(),
                        config,
                        out_dir,
                        "first",
                        r == 1 and config.kill_at is not None,
                        ready,
                    ),
                )
                for r in range(2)
            ]
            for p in procs:
                p.start()
            if config.kill_at is not None:
                procs[1].join()
                if procs[1].exitcode != DEAD:
                    raise RuntimeError(f"replica 1 ended with exit code {procs[1].exitcode} before it was to die")
                time.sleep(config.down_seconds)
                procs[1] = ctx.Process(
                    target=_replica, args=(1, lighthouse.address(), config, out_dir, "rejoined", False, None)
                )
                procs[1].start()
            for p in procs:
                p.join()
            if any(p.exitcode != 0 for p in procs):
                raise RuntimeError(f"a replica failed: exit codes {[p.exitcode for p in procs]}")
            return {name[:-5]: json.load(open(os.path.join(out_dir, name))) for name in sorted(os.listdir(out_dir))}
    finally:
        lighthouse.shutdown()


def summary(results: dict, config: LostNodeConfig) -> dict:
    """What the failure cost: the step replica 1 rejoined at and the steps of work it lost."""
    survivor, first = results["replica0-first"], results["replica1-first"]
    out = {
        "test_loss": [survivor["test_loss"]],
        "rounds_committed": survivor["rounds_committed"],
        "rounds_failed": survivor["rounds_failed"],
        "survivor_steps_redone": survivor["iterations"] - config.steps,
    }
    back = results.get("replica1-rejoined")
    if back is None:
        out["test_loss"].append(first["test_loss"])
        return out
    if first.get("died_at") != config.kill_at:
        raise RuntimeError(f"replica 1 was to die at step {config.kill_at}; its record says {first.get('died_at')}")
    # replica 1's work since its last committed round died with it; the survivors' steps until it rejoined it never did
    last_round = max((e["step"] for e in first["events"] if e["committed"]), default=0)
    if not back["heals"]:
        raise RuntimeError("replica 1 came back after the survivor had finished: run more --steps or kill it earlier")
    out.update(
        test_loss=[survivor["test_loss"], back["test_loss"]],
        rejoined_at=back["joined_at"],
        heals=back["heals"],
        lost_steps=back["joined_at"] - last_round,
        stall_seconds=max((e["seconds"] for e in survivor["events"] if not e["committed"]), default=0.0),
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = command_parser("lost-node", __doc__)
    parser.add_argument("--task", default="charlm", choices=list(TASKS))
    parser.add_argument(
        "--steps", type=positive_int, default=320, help="a multiple of --period: the run ends on a round"
    )
    parser.add_argument("--period", type=positive_int, default=8)
    parser.add_argument("--kill-at", type=positive_int, default=100)
    parser.add_argument("--down", type=non_negative_float, default=1.0, help="seconds replica 1 stays dead")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.kill_at >= args.steps:
        parser.error(f"--kill-at {args.kill_at} must come before the last step ({args.steps})")
    if args.steps % args.period:
        parser.error(f"--steps {args.steps} must be a multiple of --period {args.period}: the replicas end on a round")
    runs: dict[str, list[dict]] = {"no failure": [], "replica 1 lost": []}
    for seed in args.seeds:
        base = LostNodeConfig(
            task=args.task, steps=args.steps, period=args.period, kill_at=None, down_seconds=args.down, seed=seed
        )
        for name, config in (("no failure", base), ("replica 1 lost", dataclasses.replace(base, kill_at=args.kill_at))):
            runs[name].append({"seed": seed, **summary(lost_node_run(config), config)})
    print(
        f"task={args.task} steps={args.steps} period={args.period}: DiLoCo (AdamW inside, outer 0.7/0.5), "
        "2 replica groups under torchft's Manager"
    )
    print(
        f"{'run':<16} {'seed':>4} {'test loss r0 / r1':>18} {'rounds ok / rolled back':>24} {'rejoined at':>12} "
        f"{'steps lost (r1)':>16} {'redone (r0)':>12} {'stall s':>8}"
    )
    for name, rows in runs.items():
        for s in rows:
            losses = " / ".join(f"{v:.4f}" for v in s["test_loss"])
            print(
                f"{name:<16} {s['seed']:>4} {losses:>18} {s['rounds_committed']:>14} / {s['rounds_failed']:<7} "
                f"{s.get('rejoined_at', '-')!s:>12} {s.get('lost_steps', 0):>16} {s['survivor_steps_redone']:>12} "
                f"{s.get('stall_seconds', 0.0):>8.2f}"
            )
    for name, rows in runs.items():
        final = torch.tensor([s["test_loss"][0] for s in rows], dtype=torch.float64)
        spread = float(final.std()) if len(rows) > 1 else 0.0
        print(f"{name}: final test loss {float(final.mean()):.4f} ± {spread:.4f} over {len(rows)} seed(s)")
    write_report("lost-node", argv, {"config": vars(args), "runs": runs}, args.json)
    return runs
