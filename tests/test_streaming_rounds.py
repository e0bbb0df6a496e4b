"""Streaming rounds (fragments, sync_delay τ, update_alpha α) against torchft's streaming DiLoCo
through its own Manager, step for step, and one-bit streaming rounds against a single-process
reference; DiLoCo without fragments is the first of the configurations. Each side runs every
configuration in one spawn."""

import copy
import functools
import io
import os
import re
import tempfile
import time

import pytest
import torch
from torch import nn

from signmuon.comm_hooks import VoteConfig
from signmuon.comm_hooks.dist import VoteMismatchError
from signmuon.optim import LocalStepAverager, OuterStep
from signmuon.optim.rounds.streaming import fragment_due, split_by_bytes
from tests.harness import (
    compressed_allreduce_reference,
    flat_params,
    rounds_batch,
    rounds_inner,
    rounds_loss,
    rounds_model,
    run_distributed,
    sign_vote_combine,
)

H = 12  # local steps per fragment's round: a multiple of every F, and τ = 2 < H / 3
STEPS = 2 * H
# (H, steps, F, τ, α): streaming, then DiLoCo (H = 3, 7 steps). torchft picks the fragment by its
# Manager's step, which runs on across configurations: F = 3 first, then 2, then 1, so that
# each configuration starts at a multiple of its F (checked in the replica).
FP32 = [(H, STEPS, f, tau, alpha) for f in (3, 2, 1) for tau in (0, 1, 2) for alpha in (0.0, 0.5)] + [(3, 7, 1, 0, 0.0)]
# The fragments a count cuts rounds_model's [12, 3, 6, 2] entries into (balanced by bytes).
SPLITS = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]], 3: [[0], [1, 2], [3]]}
# (rule, scale_block, F, τ, α), held to the single-process reference.
ONE_BIT = [("sign_vote", 0, 2, 1, 0.5), ("sign_vote_ef", 4, 3, 2, 0.0), ("scaled_sign", 0, 2, 1, 0.0)]


# --- the single-process reference: streaming DiLoCo as published ---------------------------------


def _combine(rule, deltas, sizes, errors, block):
    """The workers' ``deltas`` combined by ``rule`` (``errors``: the rule's feedback, updated)."""
    if block:
        sizes = [min(block, size - at) for size in sizes for at in range(0, size, block)]
    if rule == "mean":
        return sum(deltas) / len(deltas)
    if rule == "sign_vote":
        return sign_vote_combine(deltas, sizes)
    if rule == "sign_vote_ef":
        fed = [d + e for d, e in zip(deltas, errors[0])]
        errors[0] = [torch.cat([p - p.sign() * p.abs().mean() for p in c.split(sizes)]) for c in fed]
        return sign_vote_combine(fed, sizes)
    return compressed_allreduce_reference(deltas, *errors)[0]  # updates the error lists in place


def _reference(steps, period, count, delay, alpha, rule="mean", block=0, workers=2):
    """Each worker's flat parameters after every step: fragment f's pseudo-gradient taken and
    combined at k + τ = j·S (j - 1 = f mod F), its outer step and lerp at k = j·S, S = period / F."""
    models = [rounds_model() for _ in range(workers)]
    inners = [rounds_inner(m) for m in models]
    every = period // count

    def fragment(m, f):
        return [list(m.parameters())[i] for i in SPLITS[count][f]]

    def flat(m, f):
        return torch.cat([p.detach().reshape(-1) for p in fragment(m, f)])

    consensus = [flat(models[0], f).clone() for f in range(count)]
    outers = [torch.optim.SGD([c], lr=0.7, momentum=0.9, nesterov=True) for c in consensus]
    errors = []
    for c in consensus:
        padded = -(-c.numel() // (8 * workers)) * 8 * workers
        errors.append(
            [[torch.zeros(c.numel())] * workers]
            if rule == "sign_vote_ef"
            else [[torch.zeros(padded)] * workers, [torch.zeros(padded // workers)] * workers]
        )
    pending = {}

    history = []
    for step in range(steps):
        for w, (m, opt) in enumerate(zip(models, inners)):
            opt.zero_grad()
            rounds_loss(m, rounds_batch(w, step)).backward()
            opt.step()
        k = step + 1
        if (k + delay) % every == 0:
            f = ((k + delay) // every - 1) % count
            deltas = [consensus[f] - flat(m, f) for m in models]
            sizes = [p.numel() for p in fragment(models[0], f)]
            pending[f] = _combine(rule, deltas, sizes, errors[f], block)
        if k % every == 0:
            f = (k // every - 1) % count
            consensus[f].grad = pending.pop(f)
            outers[f].step()
            for m in models:
                x = flat(m, f)
                torch.nn.utils.vector_to_parameters(
                    consensus[f].detach() + alpha * (x - consensus[f].detach()), fragment(m, f)
                )
        history.append([flat_params(m) for m in models])
    return history


# --- ours: every configuration in one spawn --------------------------------------------------------


def _averager(period, count, delay, alpha, rule="mean", block=0):
    model = rounds_model()
    outer = OuterStep(
        optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        pseudo_gradient=rule,
        vote=VoteConfig(tie="exact"),
        scale_block=block,
    )
    averager = LocalStepAverager(
        period=period, pull=1.0, outer=outer, module=model, fragments=count, sync_delay=delay, update_alpha=alpha
    )
    return model, rounds_inner(model), averager


def _run(rank, period, steps, count, delay, alpha, rule="mean", block=0, before_round=None):
    """Each step's flat parameters, and which fragments had a round in flight after each step."""
    model, inner, averager = _averager(period, count, delay, alpha, rule, block)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    assert [[index[id(p)] for p in part.params] for part in averager.fragments] == SPLITS[count]
    history, in_flight = [], []
    for step in range(steps):
        inner.zero_grad()
        rounds_loss(model, rounds_batch(rank, step)).backward()
        inner.step()
        if before_round is not None:
            before_round(step, averager)
        averager.average_parameters(model.parameters())
        history.append(flat_params(model).clone())
        in_flight.append([f for f, part in enumerate(averager.fragments) if part.in_flight is not None])
    return history, in_flight, averager.stats


def _overlapped(rank, out_dir):
    """A fragment's collective outlasts the next step: rank 1's combine starts only once rank 0
    has finished the step after taking the round (if rank 0 waited for it there, neither goes on)."""
    signal = os.path.join(out_dir, "rank0-stepped")

    def before_round(step, averager):
        part = averager.fragments[0]
        if rank == 1 and step == 0:
            combine = part.consensus.combine

            def late(*args):
                for _ in range(6000):  # a minute at most
                    if os.path.exists(signal):
                        return combine(*args)
                    time.sleep(0.01)
                raise TimeoutError("rank 0 did not get past the step after the round was taken")

            part.consensus.combine = late
        if rank == 0 and part.in_flight is not None:  # the inner step after the take is done
            open(signal, "w").close()

    history, in_flight, stats = _run(rank, H, H, 2, 1, 0.0, before_round=before_round)
    return in_flight, stats.round_seconds, stats.round_wait_seconds


RESUMED = (H, STEPS, 2, 1, 0.5)  # saved after step 5, its fragment 0's round in flight


def _resumed(rank):
    """RESUMED's run saved (model, inner optimizer, averager) with a round in flight, after
    consensus_state_dict there, and continued by a fresh model and averager loaded from it."""
    period, steps, count, delay, alpha = RESUMED
    model, inner, averager = _averager(period, count, delay, alpha)
    history = []
    for step in range(steps):
        if step == 5:
            assert averager.fragments[0].in_flight is not None
            consensus = averager.consensus_state_dict(model)
            saved = copy.deepcopy((model.state_dict(), inner.state_dict(), averager.state_dict()))
            if rank == 1:  # as saved before the landing was bytes: the list itself, loaded the same
                saved[2]["landing"] = torch.load(io.BytesIO(saved[2]["landing"]), weights_only=True)
            model, inner, averager = _averager(period, count, delay, alpha)
            model.load_state_dict(saved[0])
            inner.load_state_dict(saved[1])
            averager.load_state_dict(saved[2])
        inner.zero_grad()
        rounds_loss(model, rounds_batch(rank, step)).backward()
        inner.step()
        averager.average_parameters(model.parameters())
        history.append(flat_params(model).clone())
    return history, torch.cat([t.reshape(-1) for t in consensus.values()])


def _out_of_step(rank, rule):
    """Both ranks take fragment 0's round after step 5; rank 0, its round still in flight, asks
    for consensus_state_dict while rank 1 goes on to land it: raised on both, by name (rank 1
    at its next collective of the averager, which reads its landing's check, or, where its
    landing issues a second phase, before that), not a collective of mismatched sizes or a hang."""
    model, inner, averager = _averager(H, 2, 1, 0.0, rule)
    in_flight = None
    try:
        for step in range(6):
            if rank == 0 and step == 5:
                in_flight = averager.fragments[0].in_flight is not None
                averager.consensus_state_dict(model)
            inner.zero_grad()
            rounds_loss(model, rounds_batch(rank, step)).backward()
            inner.step()
            averager.average_parameters(model.parameters())
        averager.consensus_state_dict(model)
    except VoteMismatchError as error:
        return in_flight, str(error)
    return in_flight, None


def _ours_worker(rank, world_size, out_dir):
    runs = [_run(rank, *config) for config in FP32]
    one_bit = [
        _run(rank, H, STEPS, count, delay, alpha, rule, block)[0] for rule, block, count, delay, alpha in ONE_BIT
    ]
    waits = [(stats.round_seconds, stats.round_wait_seconds, stats.round_steps_hidden) for _, _, stats in runs]
    return (
        [history for history, _, _ in runs],
        one_bit,
        [in_flight for _, in_flight, _ in runs],
        waits,
        _overlapped(rank, out_dir),
        _resumed(rank),
        [_out_of_step(rank, rule) for rule in ("mean", "scaled_sign")],
    )


# --- torchft's streaming DiLoCo, through its Manager ---------------------------------------------


def _torchft_replica(replica, lighthouse, out_dir):
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    holder = {"model": rounds_model()}
    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=2,
        load_state_dict=lambda state: holder["model"].load_state_dict(state),
        state_dict=lambda: holder["model"].state_dict(),
        replica_id=str(replica),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=0,
        timeout=timedelta(seconds=60),
        use_async_quorum=False,
        init_sync=False,
    )
    histories = []
    try:
        for period, steps, count, delay, alpha in FP32:
            assert manager.current_step() % count == 0, (manager.current_step(), count)
            model = holder["model"] = rounds_model()
            inner = rounds_inner(model)
            params = list(model.parameters())
            fragments = []
            for members in SPLITS[count]:  # a module holding the fragment's own Parameters
                fragment = nn.Module()
                for i in members:
                    fragment.register_parameter(f"p{i}", params[i])
                fragments.append(fragment)
            outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
            history = []
            with DiLoCo(
                manager,
                fragments,
                inner,
                outers,
                sync_every=period,
                fragment_sync_delay=delay,
                fragment_update_alpha=alpha,
            ):
                for step in range(steps):
                    inner.zero_grad()
                    rounds_loss(model, rounds_batch(replica, step)).backward()
                    inner.step()
                    history.append(flat_params(model).clone())
            histories.append(history)
            for key in [k for k in manager._user_state_dicts if k.startswith("StreamingDiLoCoFragment_")]:
                del manager._user_state_dicts[key], manager._load_state_dict_fns[key]  # the next DiLoCo's
    finally:
        manager.shutdown(wait=False)
    torch.save(histories, os.path.join(out_dir, f"replica{replica}.pt"))


def _run_torchft(replicas):
    import multiprocessing

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas)
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            ctx = multiprocessing.get_context("spawn")
            procs = [
                ctx.Process(target=_torchft_replica, args=(r, lighthouse.address(), out_dir)) for r in range(replicas)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=300)
            assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
            return [torch.load(os.path.join(out_dir, f"replica{r}.pt")) for r in range(replicas)]
    finally:
        lighthouse.shutdown()


def test_streaming_rounds_equal_torchft_and_the_reference_step_for_step():
    theirs = _run_torchft(2)
    with tempfile.TemporaryDirectory() as out_dir:
        ours = run_distributed(_ours_worker, 2, out_dir, timeout=400)
    for c, (period, steps, count, delay, alpha) in enumerate(FP32):
        for replica in range(2):
            for step in range(steps):
                torch.testing.assert_close(
                    ours[replica][0][c][step],
                    theirs[replica][c][step],
                    rtol=1e-6,
                    atol=1e-7,
                    msg=f"H={period} F={count} τ={delay} α={alpha}: replica {replica} step {step}",
                )
        assert not torch.equal(theirs[0][c][1], theirs[1][c][1])  # the replicas do train apart between rounds
        if count == 1 and delay == 0 and alpha == 0.0:
            assert torch.equal(theirs[0][c][period - 1], theirs[1][c][period - 1])  # and meet at each round
    _streaming_checks(ours)
    for c, (rule, block, count, delay, alpha) in enumerate(ONE_BIT):
        expected = _reference(STEPS, H, count, delay, alpha, rule, block)
        for replica in range(2):
            for step in range(STEPS):
                torch.testing.assert_close(
                    ours[replica][1][c][step],
                    expected[step][replica],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=f"{rule} F={count} τ={delay} α={alpha}: replica {replica} step {step}",
                )


# --- the split and the schedule, and what streaming refuses ----------------------------------------


def _best_split(sizes, count):
    """The smallest largest-run over every split of ``sizes`` into ``count`` non-empty runs."""
    import itertools

    return min(
        max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
        for cuts in itertools.combinations(range(1, len(sizes)), count - 1)
    )


def test_a_count_cuts_the_parameters_into_runs_balanced_by_bytes():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        sizes = torch.randint(1, 50, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        count = int(torch.randint(1, len(sizes) + 1, (1,), generator=gen))
        runs = split_by_bytes(sizes, count)
        assert len(runs) == count and runs[0][0] == 0 and runs[-1][1] == len(sizes)
        assert all(a < b for a, b in runs) and all(b == a2 for (_, b), (a2, _) in zip(runs, runs[1:]))
        assert max(sum(sizes[a:b]) for a, b in runs) == _best_split(sizes, count), (sizes, count, runs)


def test_each_fragment_lands_every_period_at_its_offset_and_is_taken_tau_steps_before():
    period, count, delay = 12, 3, 2
    due = [fragment_due(k, period, count, delay) for k in range(1, 3 * period + 1)]
    lands = [(k, f) for k, (_, f) in enumerate(due, 1) if f is not None]
    taken = [(k, f) for k, (f, _) in enumerate(due, 1) if f is not None]
    assert lands == [(k, (k // 4 - 1) % 3) for k in range(4, 37, 4)]
    assert taken == [(k - delay, f) for k, f in lands]


def test_streaming_refuses_what_torchft_refuses_and_what_is_ambiguous():
    model = rounds_model()
    outer = OuterStep.diloco()
    cases = {
        "must be a multiple of fragments=3": dict(period=4, fragments=3),
        "sync_delay=2 must be < period/fragments=2": dict(period=4, fragments=2, sync_delay=2),
        "sync_delay=-1": dict(period=4, sync_delay=-1),
        "update_alpha=1.5": dict(period=4, update_alpha=1.5),
        "cannot cut 4 trained tensors into 5": dict(period=5, fragments=5),
        "push moves a worker": dict(period=4, fragments=2, push=0.1),
        "in fragments 0 and 1": dict(period=4, fragments=[model, model[2]]),
        "in no fragment": dict(period=4, fragments=[model[0]]),
        "must be a module or a list of modules": dict(period=4, fragments=[model[0], "head"]),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            LocalStepAverager(outer=outer, module=model, **kwargs)
    with pytest.raises(ValueError, match="need outer="):
        LocalStepAverager(period=4, fragments=2)


def _streaming_checks(ours):
    """What the spawn of ours saw besides the parameters: which fragment was in flight after each
    step, the rounds' seconds, and a collective that outlasted the step after it was issued."""
    for replica in range(2):
        _, _, in_flight, waits, (overlapped, seconds, waited), _, _ = ours[replica]
        for (period, steps, count, delay, _), flights, (total, exposed, hidden) in zip(FP32, in_flight, waits):
            every = period // count
            expected = [
                [((k + delay) // every - 1) % count] if delay and (k % every) >= every - delay else []
                for k in range(1, steps + 1)
            ]
            assert flights == expected, (period, count, delay)
            assert total > 0.0 and exposed >= 0.0
            assert hidden == delay * (steps // every)  # τ steps computed behind each round's combine
            if delay == 0:
                assert exposed == total  # a round that lands where it is taken waits for all of it
        assert overlapped[4] == [0] and overlapped[5] == []  # taken after step 5 of 6, landed after 6
        assert seconds > 0.0 and 0.0 <= waited
    # Saved and resumed with a round in flight: the same steps, bit for bit; the consensus
    # there is the last landed one, the same on both ranks.
    uninterrupted = ours[0][0][FP32.index(RESUMED)], ours[1][0][FP32.index(RESUMED)]
    for replica in range(2):
        history, consensus = ours[replica][5]
        assert all(torch.equal(a, b) for a, b in zip(history, uninterrupted[replica])), replica
        assert torch.equal(consensus, ours[0][5][1])
        for in_flight, raised in ours[replica][6]:  # fp32, then scaled_sign (two phases)
            assert raised is not None and "steps=5" in raised and "steps=6" in raised, raised
            assert "call=consensus_state_dict" in raised and "call=a local-step round" in raised, raised
            assert in_flight == (True if replica == 0 else None)
