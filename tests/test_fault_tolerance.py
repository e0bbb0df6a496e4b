"""Rounds under torchft's Manager: a replica group lost inside a round, the survivors going
on, the group started again and healed; on real processes with torchft's lighthouse, held to a
single-process reference of that history."""

import functools
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from signmuon.optim import LocalStepAverager, OuterStep
from tests.harness import capture, flat_params, rounds_batch, rounds_inner, rounds_loss, rounds_model, run_distributed

H = 3  # local steps per round


KILL_AT, FT_STEPS = 2 * H, 24  # replica 1 dies inside its round after step KILL_AT (its second)


class _OuterThatMayDie(torch.optim.SGD):
    """DiLoCo's outer SGD; in the replica that is to die, its second round's step kills the
    process: after the pseudo-gradients were exchanged, before the round ends, so the survivor
    has stepped its consensus and parameters when the round fails and must roll them back."""

    dies = False

    def step(self, closure=None):
        self.taken = getattr(self, "taken", 0) + 1
        if self.dies and self.taken == KILL_AT // H:
            os._exit(17)  # a crash: no shutdown
        return super().step(closure)


def _fault_tolerant_replica(replica, local_rank, per_node, lighthouse, out_dir, life, ready, rejoiner_up):
    """One rank of a replica group of ``per_node`` ranks (FSDP2 over the group when more than one)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    from signmuon.integrations.torchft import FaultTolerantRounds

    torch.set_num_threads(1)
    model = rounds_model()
    if per_node > 1:  # the group's own process group, its FSDP2, and the Manager's store shared in it
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo", init_method=f"file://{out_dir}/group{replica}-{life}", rank=local_rank, world_size=per_node
        )
        fully_shard(model, mesh=init_device_mesh("cpu", (per_node,)))
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if local_rank == 0 else None
    port = torch.tensor([store.port if store is not None else 0])
    if per_node > 1:
        dist.broadcast(port, 0)
        store = store or TCPStore("localhost", int(port), is_master=False)
    inner = rounds_inner(model)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        replica_id=str(replica),
        store_addr="localhost",
        store_port=int(port),
        rank=local_rank,
        world_size=per_node,
        lighthouse_addr=lighthouse,
        port=0,
        timeout=timedelta(seconds=30),
        use_async_quorum=False,
        init_sync=False,
    )
    _OuterThatMayDie.dies = replica == 1 and life == "first"
    outer = OuterStep(optimizer=functools.partial(_OuterThatMayDie, lr=0.7, momentum=0.9, nesterov=True))
    averager = LocalStepAverager(period=H, pull=1.0, outer=outer, module=model, process_group=pg)
    if life == "rejoined":
        rejoiner_up.set()
    else:
        ready.wait()  # both heartbeat before the first quorum
    rounds = FaultTolerantRounds(manager, averager, inner)
    whole = lambda: (
        torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
        if per_node > 1
        else flat_params(model).clone()
    )  # noqa: E731
    record = {"joined_at": rounds.steps_done, "at_join": whole(), "rounds": []}
    path = os.path.join(out_dir, f"{replica}.{local_rank}-{life}.pt")
    while rounds.steps_done < FT_STEPS:
        step = rounds.steps_done
        if replica == 0 and rounds.rounds_failed and manager.num_participants() < 2:
            assert rejoiner_up.wait(120)
            time.sleep(0.3)  # while group 1 is away: time for it to ask for the quorum after our next round
        inner.zero_grad()
        rounds_loss(model, rounds_batch(replica * per_node + local_rank, step)).backward()
        inner.step()
        committed = rounds.step()
        if committed is not None:
            record["rounds"].append((step + 1, committed, manager.num_participants(), whole()))
            torch.save(record, path)  # the dying replica's record stands as of its last round
    record.update(heals=rounds.heals, failed=rounds.rounds_failed, error=repr(rounds.last_error))
    manager.shutdown(wait=False)
    torch.save(record, path)


def _run_lost_replica(per_node):
    """Two replica groups of ``per_node`` ranks; every rank of group 1 dies in its second round
    and is started again. Returns each rank's record by "group.local_rank-life"."""
    import multiprocessing

    from torchft.coordination import LighthouseServer

    os.environ.setdefault("RUST_LOG", "error")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    ctx = multiprocessing.get_context("spawn")
    ready, rejoiner_up = ctx.Barrier(2 * per_node), ctx.Event()
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            start = lambda group, life: [  # noqa: E731
                ctx.Process(
                    target=_fault_tolerant_replica,
                    args=(group, r, per_node, lighthouse.address(), out_dir, life, ready, rejoiner_up),
                )
                for r in range(per_node)
            ]
            survivors, dying = start(0, "first"), start(1, "first")
            for p in survivors + dying:
                p.start()
            for p in dying:
                p.join(timeout=180)
            assert [p.exitcode for p in dying] == [17] * per_node
            back = start(1, "rejoined")
            for p in back:
                p.start()
            for p in survivors + back:
                p.join(timeout=180)
            assert [p.exitcode for p in survivors + back] == [0] * (2 * per_node)
            return {
                name[:-3]: torch.load(os.path.join(out_dir, name))
                for name in os.listdir(out_dir)
                if name.endswith(".pt")
            }
    finally:
        lighthouse.shutdown()


def _lost_replica_reference(failed_at, joined_at, per_node=1):
    """Each replica's flat parameters after every round: DiLoCo on both until replica 1 dies in
    the round after step KILL_AT; that round rolled back (the survivor keeps its local steps);
    rounds of the survivor alone; at ``joined_at`` replica 1 takes the survivor's whole state.
    A replica's gradient is the mean of its ``per_node`` ranks' gradients."""
    import copy

    models = [rounds_model(), rounds_model()]
    inners = [rounds_inner(m) for m in models]
    consensus = flat_params(models[0]).clone()
    outer = torch.optim.SGD([consensus], lr=0.7, momentum=0.9, nesterov=True)
    after = {0: {}, 1: {}}
    for step in range(FT_STEPS):
        if step == joined_at:
            models[1] = copy.deepcopy(models[0])
            inners[1] = rounds_inner(models[1])
            inners[1].load_state_dict(copy.deepcopy(inners[0].state_dict()))
        alive = [0, 1] if step < KILL_AT or step >= joined_at else [0]
        for w in alive:
            inners[w].zero_grad()
            sum(rounds_loss(models[w], rounds_batch(w * per_node + i, step)) for i in range(per_node)).div(
                per_node
            ).backward()
            inners[w].step()
        if step + 1 == failed_at:  # rolled back: the survivor's own parameters stand
            after[0][step + 1] = flat_params(models[0]).clone()
        if (step + 1) % H or step + 1 == failed_at:
            continue
        consensus.grad = sum(consensus - flat_params(models[w]) for w in alive) / len(alive)
        outer.step()
        for w in alive:
            torch.nn.utils.vector_to_parameters(consensus.clone(), models[w].parameters())
            after[w][step + 1] = consensus.clone()
    return after


@pytest.mark.parametrize("per_node", [1, 2])
def test_rounds_go_on_without_a_lost_replica_and_heal_it_when_it_returns(per_node):
    """per_node=2: each replica group shards the model with FSDP2 over its two ranks, the
    rounds run on each rank's shard over torchft's group of that shard, and the whole group dies."""
    runs = _run_lost_replica(per_node)
    for local_rank in range(per_node):
        survivor, died, back = (
            runs[f"{g}.{local_rank}-{life}"] for g, life in ((0, "first"), (1, "first"), (1, "rejoined"))
        )
        failed = [r for r in survivor["rounds"] if not r[1]]
        assert survivor["failed"] == 1 and len(failed) == 1, survivor["rounds"]
        failed_at = failed[0][0]
        assert failed_at == KILL_AT, failed_at  # the round it died in
        assert back["heals"] == 1 and back["joined_at"] % H == 0 and back["joined_at"] > failed_at, back["joined_at"]
        reference = _lost_replica_reference(failed_at, back["joined_at"], per_node)
        for record, replica in ((survivor, 0), (died, 1), (back, 1)):
            for step, committed, participants, params in record["rounds"]:
                next_quorum = 1 if failed_at <= step < back["joined_at"] else 2  # the quorum begun after this round
                assert participants == next_quorum, (replica, step, participants)
                torch.testing.assert_close(
                    params,
                    reference[replica][step],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=f"replica {replica}.{local_rank} step {step}",
                )
        # The rejoiner starts from the survivor's consensus, at the survivor's step.
        torch.testing.assert_close(back["at_join"], reference[0][back["joined_at"]], rtol=1e-5, atol=1e-6)
        assert [r[0] for r in back["rounds"]] == [s for s, *_ in survivor["rounds"] if s > back["joined_at"]]


def _refused_rounds_worker(rank, world_size):
    from signmuon.integrations.torchft import FaultTolerantRounds

    model = rounds_model()
    inner = rounds_inner(model)
    good = LocalStepAverager(period=H, pull=1.0, outer=OuterStep.diloco(), module=model)
    return (
        capture(lambda: FaultTolerantRounds(None, LocalStepAverager(period=H, module=model), inner)),
        capture(
            lambda: FaultTolerantRounds(
                None,
                LocalStepAverager(period=H, outer=OuterStep.diloco(pseudo_gradient="scaled_sign"), module=model),
                inner,
            )
        ),
        capture(lambda: FaultTolerantRounds(object(), good, inner)),
        capture(
            lambda: FaultTolerantRounds(
                None, LocalStepAverager(period=H, outer=OuterStep.diloco(), module=model, fragments=3), inner
            )
        ),
        capture(
            lambda: FaultTolerantRounds(
                None, LocalStepAverager(period=H, outer=OuterStep.diloco(), module=model, sync_delay=1), inner
            )
        ),
    )


def test_fault_tolerant_rounds_refuse_what_cannot_survive_a_loss():
    no_outer, scaled_sign, not_a_manager, streaming, delayed = run_distributed(_refused_rounds_worker, 1)[0]
    assert "with an outer step" in no_outer
    assert "scaled_sign" in scaled_sign and "sized by the number of replicas" in scaled_sign
    assert "TypeError" in not_a_manager and "torchft.Manager" in not_a_manager
    for refusal in (streaming, delayed):  # each says what to run instead
        assert "streaming rounds" in refusal and "fragments=1 and sync_delay=0" in refusal
        assert "torchft.local_sgd.DiLoCo" in refusal
