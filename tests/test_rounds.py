"""Rounds with an outer step (DiLoCo, DPPF around the consensus), one-bit rounds and node-aware
rounds, on real gloo processes against single-process references, and DiLoCo against torchft's."""

import functools
import math
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import capture, compressed_allreduce_reference, run_distributed, vote_reference
from signmuon.comm_hooks import VoteConfig, VoteMismatchError, node_layout
from signmuon.optim import DPPFAverager, OuterStep, local_sgd

H = 3  # local steps per round
STEPS = 7


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same start on every rank, as DDP makes it
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _batch(worker: int, step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * worker + step))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x[:, :2].sin()).pow(2).mean()


def _inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# --- the single-process reference: DiLoCo (and DPPF around its consensus) as published ----------


def _sign_vote_combine(deltas, sizes):
    """Majority vote of the deltas' signs, each tensor scaled by the workers' mean of its mean |delta|."""
    voted = vote_reference(torch.stack([d.sign() for d in deltas]))
    out, start = [], 0
    for size in sizes:
        scale = sum(float(d[start : start + size].abs().mean()) for d in deltas) / len(deltas)
        out.append(voted[start : start + size] * scale)
        start += size
    return torch.cat(out)


def _reference(workers, steps, period, outer_lr=0.7, momentum=0.9, pull=1.0, push=0.0, combine="mean", block=0):
    """Each worker's flat parameters after every step (``block``: entries per scale of the vote)."""
    models = [_model() for _ in range(workers)]
    inners = [_inner(m) for m in models]
    consensus = _flat(models[0]).clone()
    outer = torch.optim.SGD([consensus], lr=outer_lr, momentum=momentum, nesterov=True)
    sizes = [p.numel() for p in models[0].parameters()]
    if block:  # each tensor's runs of `block` entries scale on their own
        sizes = [min(block, size - at) for size in sizes for at in range(0, size, block)]
    errors = None
    history = []
    for step in range(steps):
        for w, (m, opt) in enumerate(zip(models, inners)):
            opt.zero_grad()
            _loss(m, _batch(w, step)).backward()
            opt.step()
        if (step + 1) % period == 0:
            deltas = [consensus - _flat(m) for m in models]
            if combine == "mean":
                consensus.grad = sum(deltas) / workers
            elif combine == "sign_vote":
                consensus.grad = _sign_vote_combine(deltas, sizes)
            elif combine == "sign_vote_ef":
                errors = errors or [torch.zeros_like(consensus) for _ in range(workers)]
                fed = [d + e for d, e in zip(deltas, errors)]
                for w, c in enumerate(fed):  # each worker keeps what its own scaled signs leave out
                    pieces = c.split(sizes)
                    errors[w] = torch.cat([p - p.sign() * p.abs().mean() for p in pieces])
                consensus.grad = _sign_vote_combine(fed, sizes)
            else:
                n = consensus.numel()
                padded = -(-n // (8 * workers)) * 8 * workers
                if errors is None:
                    errors = ([torch.zeros(padded) for _ in range(workers)], [torch.zeros(padded // workers) for _ in range(workers)])
                consensus.grad, *errors = compressed_allreduce_reference(deltas, *errors)
            outer.step()
            for m in models:
                x = _flat(m)
                d = x - consensus
                new = x - pull * d + push * d / max(float(d.norm()), 1e-8)
                torch.nn.utils.vector_to_parameters(new, m.parameters())
        history.append([_flat(m) for m in models])
    return history


def _rounds_worker(rank, world_size, pull, push, combine, steps, grouped=False, block=0):
    model = _model()
    params = list(model.parameters())  # grouped: out of module order, as Muon's groups are
    given = [{"params": params[::2]}, {"params": params[1::2][::-1]}] if grouped else params
    inner = _inner(model)
    outer = OuterStep(
        optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True), pseudo_gradient=combine,
        vote=VoteConfig(tie="exact"), scale_block=block,
    )  # fmt: skip
    averager = DPPFAverager(period=H, pull=pull, push=push, outer=outer, module=model)
    history = []
    for step in range(steps):
        inner.zero_grad()
        _loss(model, _batch(rank, step)).backward()
        inner.step()
        averager.average_parameters(given)
        history.append(_flat(model).clone())
    consensus = _flat_of(averager.consensus_state_dict(model), model)
    return history, averager.rounds, averager.stats.bytes_sent, consensus


def _flat_of(state, model):
    names = [name for name, _ in model.named_parameters()]
    return torch.cat([state[n].reshape(-1) for n in names])


@pytest.mark.parametrize("pull, push", [(1.0, 0.0), (0.6, 0.02)])
def test_outer_step_rounds_equal_the_reference(pull, push):
    """pull=1, push=0 is DiLoCo; otherwise DPPF's pull and push act around the new consensus."""
    workers = 3
    results = run_distributed(_rounds_worker, workers, pull, push, "mean", STEPS)
    expected = _reference(workers, STEPS, H, pull=pull, push=push)
    for rank, (history, rounds, _, consensus) in enumerate(results):
        assert rounds == STEPS // H
        for step, got in enumerate(history):
            torch.testing.assert_close(got, expected[step][rank], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")
    if pull == 1.0:  # right after the last round (after step 5 of 0..6) every worker is the consensus
        assert torch.equal(results[0][0][5], results[1][0][5])
        for history, _, _, consensus in results:  # and the model to evaluate is that consensus
            assert torch.equal(consensus, history[5])


def test_the_parameters_may_come_in_another_order_and_grouping():
    # MuLoCo: Muon's parameter groups list the matrices first; the consensus keeps the module's order.
    results = run_distributed(_rounds_worker, 2, 1.0, 0.0, "mean", STEPS, True)
    expected = _reference(2, STEPS, H)
    for rank, (history, rounds, _, _) in enumerate(results):
        assert rounds == STEPS // H
        torch.testing.assert_close(history[-1], expected[-1][rank], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combine, block", [("sign_vote", 0), ("sign_vote_ef", 0), ("scaled_sign", 0), ("sign_vote_ef", 5)])
def test_one_bit_rounds_equal_the_reference(combine, block):
    workers = 3
    results = run_distributed(_rounds_worker, workers, 1.0, 0.0, combine, STEPS, False, block)
    expected = _reference(workers, STEPS, H, combine=combine, block=block)
    for rank, (history, _, _, _) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(got, expected[step][rank], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")


def _bytes_worker(rank, world_size, cases):
    return {case: _round_bytes(rank, *case) for case in cases}


def _round_bytes(rank, combine, tie):
    torch.manual_seed(0)
    model = nn.Linear(512, 512)
    outer = OuterStep(optimizer=functools.partial(torch.optim.SGD, lr=1.0), pseudo_gradient=combine, vote=VoteConfig(tie=tie))
    averager = DPPFAverager(period=1, outer=outer, module=model, track_distances=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))
    averager.average_parameters(model.parameters())
    before = averager.stats.bytes_sent
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank + 10)))
    averager.average_parameters(model.parameters())  # a second round: without the first round's checks
    return averager.stats.bytes_sent - before


COMBINES = ("mean", "sign_vote", "sign_vote_ef", "scaled_sign")
BYTE_CASES = {4: [(c, "fast") for c in COMBINES] + [("sign_vote", "exact")], 2: [(c, "exact") for c in COMBINES]}


@functools.cache
def _bytes_on(workers):
    """Rank 0's bytes of a second round, per (combine, tie): one set of processes per world size."""
    return run_distributed(_bytes_worker, workers, BYTE_CASES[workers])[0]


@pytest.mark.parametrize("workers, tie", [(4, "fast"), (2, "exact")])
def test_one_bit_rounds_send_a_32nd_of_the_fp32_round(workers, tie):
    fp32, *one_bits = (_bytes_on(workers)[(c, tie)] for c in COMBINES)
    assert fp32 >= 2 * (workers - 1) / workers * (512 * 513) * 4  # the ring's bytes of the fp32 pseudo-gradient
    for one_bit in one_bits:
        assert fp32 / 40 < one_bit < fp32 / 25, (fp32, one_bit)


def test_exact_ties_among_more_than_two_workers_cost_at_most_a_second_bit():
    fp32, exact = _bytes_on(4)[("mean", "fast")], _bytes_on(4)[("sign_vote", "exact")]  # the fp32 round has no ties
    assert fp32 / 40 < exact < fp32 / 12, (fp32, exact)


# --- checkpoints --------------------------------------------------------------------------------


def _resume_worker(rank, world_size, combine, path):
    """Run STEPS steps straight, and again with a save after step 4 and a load into fresh objects."""

    def build():
        model = _model()
        averager = DPPFAverager(period=H, pull=0.7, push=0.01, outer=OuterStep.diloco(pseudo_gradient=combine), module=model)
        return model, _inner(model), averager

    def run(model, inner, averager, steps):
        for step in steps:
            inner.zero_grad()
            _loss(model, _batch(rank, step)).backward()
            inner.step()
            averager.average_parameters(model.parameters())

    straight = build()
    run(*straight, range(STEPS + 3))
    first = build()
    run(*first, range(5))
    torch.save({"model": first[0].state_dict(), "inner": first[1].state_dict(), "averager": first[2].state_dict()},
               f"{path}.{rank}")  # fmt: skip
    resumed = build()
    saved = torch.load(f"{path}.{rank}", weights_only=True)
    resumed[0].load_state_dict(saved["model"])
    resumed[1].load_state_dict(saved["inner"])
    resumed[2].load_state_dict(saved["averager"])
    run(*resumed, range(5, STEPS + 3))
    return _flat(straight[0]), _flat(resumed[0]), straight[2].consensus.state_dict(), resumed[2].consensus.state_dict()


@pytest.mark.parametrize("combine", ["mean", "sign_vote_ef", "scaled_sign"])
def test_resume_is_bit_identical(combine):
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_resume_worker, 2, combine, os.path.join(tmp, "ckpt"))
    for straight, resumed, consensus_a, consensus_b in results:
        assert torch.equal(straight, resumed)
        assert all(torch.equal(a, b) for a, b in zip(consensus_a["tensors"], consensus_b["tensors"]))
        momentum = [s["momentum_buffer"] for s in consensus_a["optimizer"]["state"].values()]
        assert momentum and all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
                                for a, b in zip(consensus_a["optimizer"]["state"].values(), consensus_b["optimizer"]["state"].values()))  # fmt: skip
        if combine != "mean":
            assert consensus_a["errors"] and any(bool(e.any()) for buffers in consensus_a["errors"] for e in buffers)
            assert all(torch.equal(a, b) for pa, pb in zip(consensus_a["errors"], consensus_b["errors"]) for a, b in zip(pa, pb))


# --- node-aware rounds ------------------------------------------------------------------------


def _node_worker(rank, world_size, combine):
    from torch.nn.parallel import DistributedDataParallel as DDP

    layout = node_layout(None, 2)
    model = DDP(_model())
    averager = DPPFAverager(period=H, pull=1.0, outer=OuterStep.diloco(pseudo_gradient=combine), module=model.module, layout=layout)
    opt = local_sgd(model, _inner(model), averager)
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, _batch(rank, step)).backward()
        opt.step()
        history.append(_flat(model.module).clone())
    return history, averager.stats.bytes_sent_between_nodes, averager.consensus.tensors[0].numel()


def _node_reference(nodes, per_node, steps):
    """DiLoCo over `nodes` workers whose gradient is the mean of their ranks' gradients."""
    models = [_model() for _ in range(nodes)]
    inners = [_inner(m) for m in models]
    consensus = _flat(models[0]).clone()
    outer = torch.optim.SGD([consensus], lr=0.7, momentum=0.9, nesterov=True)
    history = []
    for step in range(steps):
        for node, (m, opt) in enumerate(zip(models, inners)):
            opt.zero_grad()
            sum(_loss(m, _batch(node * per_node + i, step)) for i in range(per_node)).div(per_node).backward()
            opt.step()
        if (step + 1) % H == 0:
            consensus.grad = sum(consensus - _flat(m) for m in models) / nodes
            outer.step()
            for m in models:
                torch.nn.utils.vector_to_parameters(consensus.clone(), m.parameters())
        history.append([_flat(m) for m in models])
    return history


def test_node_aware_rounds_equal_the_node_level_reference():
    results = run_distributed(_node_worker, 4, "mean")  # 2 nodes x 2 ranks
    expected = _node_reference(2, 2, STEPS)
    numel = expected[0][0].numel()
    for rank, (history, between, slice_numel) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(got, expected[step][rank // 2], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")
        chunk = math.ceil(numel / 2)
        assert slice_numel == min(chunk, numel - (rank % 2) * chunk)  # the consensus and its momentum: 1/L per rank
        # Between nodes: each round's ring over the 2 nodes' rail carries this rank's half.
        rail_ring = 2 * (2 - 1) * slice_numel * 4 // 2
        assert between >= (STEPS // H) * rail_ring
        assert between < (STEPS // H) * rail_ring + 4096  # plus the small agreement rounds
    for a, b in zip(results[0][0], results[1][0]):  # the ranks of a node hold the same parameters
        assert torch.equal(a, b)


# --- refusals ---------------------------------------------------------------------------------


def _bad_outer_worker(rank, world_size):
    model = _model()
    averager = DPPFAverager(period=2, outer=OuterStep.diloco(), module=model)
    other_rule = DPPFAverager(period=2, outer=OuterStep.diloco(pseudo_gradient="scaled_sign"), module=model)
    return (
        capture(lambda: DPPFAverager(period=2, outer=OuterStep(optimizer=lambda params: params), module=model)),
        capture(lambda: averager.average_parameters(list(model.parameters())[:2])),
        capture(lambda: other_rule.load_state_dict(averager.state_dict())),
    )


def test_bad_outer_settings():
    with pytest.raises(ValueError, match="pseudo_gradient"):
        OuterStep(optimizer=torch.optim.SGD, pseudo_gradient="int8")
    with pytest.raises(ValueError, match="must build an optimizer"):
        OuterStep(optimizer=torch.optim.SGD([torch.zeros(1)], lr=1.0))
    with pytest.raises(ValueError, match="module="):
        DPPFAverager(period=2, outer=OuterStep.diloco())
    with pytest.raises(ValueError, match="OuterStep"):
        DPPFAverager(period=2, outer=torch.optim.SGD, module=_model())
    not_an_optimizer, other_params, other_rule = run_distributed(_bad_outer_worker, 1)[0]
    assert "not a torch.optim.Optimizer" in not_an_optimizer
    assert "same parameters" in other_params
    assert "another pseudo_gradient rule than 'scaled_sign'" in other_rule


def _unequal_start_worker(rank, world_size):
    torch.manual_seed(rank)  # no DDP: every rank starts elsewhere
    model = nn.Linear(3, 2)
    averager = DPPFAverager(period=1, outer=OuterStep.diloco(), module=model)
    return capture(lambda: averager.average_parameters(model.parameters()))


def test_an_unequal_start_raises_on_every_rank():
    for error in run_distributed(_unequal_start_worker, 2):
        assert error is not None and "build DPPFAverager after DDP" in error and VoteMismatchError.__name__ in error


def _outer_settings_worker(rank, world_size):
    model = _model()
    same = DPPFAverager(period=1, outer=OuterStep(optimizer=lambda params: torch.optim.SGD(params, lr=1.0)), module=model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    same.average_parameters(model.parameters())  # a lambda is described alike on every rank
    differing = DPPFAverager(period=1, outer=OuterStep.diloco(lr=0.7 if rank == 0 else 0.5), module=model)
    return capture(lambda: differing.average_parameters(model.parameters()))


def test_ranks_with_different_outer_steps_raise_on_every_rank():
    for error in run_distributed(_outer_settings_worker, 2):
        assert error is not None and "SettingsMismatchError" in error and "outer" in error


def _one_node_worker(rank, world_size):
    return capture(lambda: DPPFAverager(period=2, layout=node_layout(None, 2)))


def test_node_aware_rounds_need_two_nodes():
    for error in run_distributed(_one_node_worker, 2):
        assert error is not None and "at least two nodes" in error


# --- DiLoCo against torchft's ---------------------------------------------------------------------


def _torchft_replica(replica, lighthouse, out_dir):
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    model = _model()
    inner = _inner(model)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=2, load_state_dict=model.load_state_dict, state_dict=model.state_dict,
        replica_id=str(replica), store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, port=0, timeout=timedelta(seconds=60), use_async_quorum=False, init_sync=False,
    )  # fmt: skip
    history = []
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=H):
            for step in range(STEPS):
                inner.zero_grad()
                _loss(model, _batch(replica, step)).backward()
                inner.step()
                history.append(_flat(model).clone())
    finally:
        manager.shutdown(wait=False)
    torch.save(history, os.path.join(out_dir, f"replica{replica}.pt"))


def _run_torchft(replicas):
    import multiprocessing

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas)
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            ctx = multiprocessing.get_context("spawn")
            procs = [ctx.Process(target=_torchft_replica, args=(r, lighthouse.address(), out_dir)) for r in range(replicas)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=180)
            assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
            return [torch.load(os.path.join(out_dir, f"replica{r}.pt")) for r in range(replicas)]
    finally:
        lighthouse.shutdown()


def test_diloco_equals_torchft_step_for_step():
    theirs = _run_torchft(2)
    ours = run_distributed(_rounds_worker, 2, 1.0, 0.0, "mean", STEPS)
    for replica in range(2):
        for step in range(STEPS):
            torch.testing.assert_close(
                ours[replica][0][step], theirs[replica][step], rtol=1e-6, atol=1e-7, msg=f"replica {replica} step {step}"
            )
    assert not torch.equal(theirs[0][1], theirs[1][1])  # the replicas do train apart between rounds
    assert torch.equal(theirs[0][H - 1], theirs[1][H - 1])  # and meet at each round


# --- rounds under torchft's Manager: a replica group lost, then healed ---------------------------

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
    model = _model()
    if per_node > 1:  # the group's own process group, its FSDP2, and the Manager's store shared in it
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"file://{out_dir}/group{replica}-{life}", rank=local_rank, world_size=per_node)
        fully_shard(model, mesh=init_device_mesh("cpu", (per_node,)))
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if local_rank == 0 else None
    port = torch.tensor([store.port if store is not None else 0])
    if per_node > 1:
        dist.broadcast(port, 0)
        store = store or TCPStore("localhost", int(port), is_master=False)
    inner = _inner(model)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=None, state_dict=None, replica_id=str(replica), store_addr="localhost",
        store_port=int(port), rank=local_rank, world_size=per_node, lighthouse_addr=lighthouse, port=0,
        timeout=timedelta(seconds=30), use_async_quorum=False, init_sync=False,
    )  # fmt: skip
    _OuterThatMayDie.dies = replica == 1 and life == "first"
    outer = OuterStep(optimizer=functools.partial(_OuterThatMayDie, lr=0.7, momentum=0.9, nesterov=True))
    averager = DPPFAverager(period=H, pull=1.0, outer=outer, module=model, process_group=pg)
    if life == "rejoined":
        rejoiner_up.set()
    else:
        ready.wait()  # both heartbeat before the first quorum
    rounds = FaultTolerantRounds(manager, averager, inner)
    whole = lambda: torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]) if per_node > 1 else _flat(model).clone()  # noqa: E731
    record = {"joined_at": rounds.steps_done, "at_join": whole(), "rounds": []}
    path = os.path.join(out_dir, f"{replica}.{local_rank}-{life}.pt")
    waited = False
    while rounds.steps_done < FT_STEPS:
        step = rounds.steps_done
        if replica == 0 and rounds.rounds_failed and not waited:  # let the rejoiner ask for the next quorum
            assert rejoiner_up.wait(120)
            time.sleep(0.5)
            waited = True
        inner.zero_grad()
        _loss(model, _batch(replica * per_node + local_rank, step)).backward()
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
                ctx.Process(target=_fault_tolerant_replica,
                            args=(group, r, per_node, lighthouse.address(), out_dir, life, ready, rejoiner_up))
                for r in range(per_node)
            ]  # fmt: skip
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
            return {name[:-3]: torch.load(os.path.join(out_dir, name)) for name in os.listdir(out_dir) if name.endswith(".pt")}
    finally:
        lighthouse.shutdown()


def _lost_replica_reference(failed_at, joined_at, per_node=1):
    """Each replica's flat parameters after every round: DiLoCo on both until replica 1 dies in
    the round after step KILL_AT; that round rolled back (the survivor keeps its local steps);
    rounds of the survivor alone; at ``joined_at`` replica 1 takes the survivor's whole state.
    A replica's gradient is the mean of its ``per_node`` ranks' gradients."""
    import copy

    models = [_model(), _model()]
    inners = [_inner(m) for m in models]
    consensus = _flat(models[0]).clone()
    outer = torch.optim.SGD([consensus], lr=0.7, momentum=0.9, nesterov=True)
    after = {0: {}, 1: {}}
    for step in range(FT_STEPS):
        if step == joined_at:
            models[1] = copy.deepcopy(models[0])
            inners[1] = _inner(models[1])
            inners[1].load_state_dict(copy.deepcopy(inners[0].state_dict()))
        alive = [0, 1] if step < KILL_AT or step >= joined_at else [0]
        for w in alive:
            inners[w].zero_grad()
            sum(_loss(models[w], _batch(w * per_node + i, step)) for i in range(per_node)).div(per_node).backward()
            inners[w].step()
        if step + 1 == failed_at:  # rolled back: the survivor's own parameters stand
            after[0][step + 1] = _flat(models[0]).clone()
        if (step + 1) % H or step + 1 == failed_at:
            continue
        consensus.grad = sum(consensus - _flat(models[w]) for w in alive) / len(alive)
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
        survivor, died, back = (runs[f"{g}.{local_rank}-{life}"] for g, life in ((0, "first"), (1, "first"), (1, "rejoined")))
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
                    params, reference[replica][step], rtol=1e-5, atol=1e-6, msg=f"replica {replica}.{local_rank} step {step}"
                )
        # The rejoiner starts from the survivor's consensus, at the survivor's step.
        torch.testing.assert_close(back["at_join"], reference[0][back["joined_at"]], rtol=1e-5, atol=1e-6)
        assert [r[0] for r in back["rounds"]] == [s for s, *_ in survivor["rounds"] if s > back["joined_at"]]


# --- rounds on FSDP2's shards: FSDP2 inside each node, rounds between nodes ---------------------


def _fsdp_rounds_worker(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from signmuon.optim import node_mesh

    mesh = node_mesh(2)  # 2 nodes x 2 ranks
    model = _model()
    fully_shard(model, mesh=mesh["local"])  # FSDP2 averages the node's gradients every step
    inner = _inner(model)
    refused = (
        capture(lambda: DPPFAverager(period=H, pull=1.0, outer=OuterStep.diloco(), module=model)),  # WORLD: 2 shards each
        capture(lambda: DPPFAverager(period=H, pull=0.5, push=0.05, module=model, process_group=mesh["node"].get_group())),
    )
    averager = DPPFAverager(period=H, pull=1.0, outer=OuterStep.diloco(), module=model, process_group=mesh["node"].get_group())
    history = []
    for step in range(STEPS):
        inner.zero_grad()
        _loss(model, _batch(rank, step)).backward()
        inner.step()
        averager.average_parameters(model.parameters())
        history.append(torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]))
    state = averager.consensus_state_dict(model)
    consensus = torch.cat([state[name].full_tensor().reshape(-1) for name, _ in model.named_parameters()])
    shard = sum(c.numel() for c in averager.consensus.tensors)
    return history, consensus, shard, refused, averager.stats.bytes_sent


def test_rounds_on_fsdp2_shards_equal_the_node_level_reference():
    results = run_distributed(_fsdp_rounds_worker, 4)
    expected = _node_reference(2, 2, STEPS)
    numel = expected[0][0].numel()
    for rank, (history, consensus, shard, refused, sent) in enumerate(results):
        for step, got in enumerate(history):
            torch.testing.assert_close(got, expected[step][rank // 2], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")
        torch.testing.assert_close(consensus, expected[STEPS - STEPS % H - 1][0], rtol=1e-5, atol=1e-6)
        assert 0 < shard < numel  # each rank keeps the consensus of its shard only
        assert "holds 2 shards" in refused[0] and "push" in refused[1], refused
        rounds_ring = (STEPS // H) * shard * 4  # two nodes: a round sends this rank's shard once
        assert rounds_ring <= sent < rounds_ring + 4096, (sent, rounds_ring)
    assert sum(r[2] for r in results[:2]) == numel  # a node's two shards make the whole model


def _refused_rounds_worker(rank, world_size):
    from signmuon.integrations.torchft import FaultTolerantRounds

    model = _model()
    inner = _inner(model)
    good = DPPFAverager(period=H, pull=1.0, outer=OuterStep.diloco(), module=model)
    return (
        capture(lambda: FaultTolerantRounds(None, DPPFAverager(period=H, module=model), inner)),
        capture(lambda: FaultTolerantRounds(None, DPPFAverager(period=H, outer=OuterStep.diloco(pseudo_gradient="scaled_sign"), module=model), inner)),
        capture(lambda: FaultTolerantRounds(object(), good, inner)),
    )


def test_fault_tolerant_rounds_refuse_what_cannot_survive_a_loss():
    no_outer, scaled_sign, not_a_manager = run_distributed(_refused_rounds_worker, 1)[0]
    assert "with an outer step" in no_outer
    assert "scaled_sign" in scaled_sign and "sized by the number of replicas" in scaled_sign
    assert "TypeError" in not_a_manager and "torchft.Manager" in not_a_manager
