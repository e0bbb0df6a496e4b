"""What rounds refuse, on every rank: bad outer-step settings, parameters or rules that do not
match the averager's, workers that start apart or step differently, node-aware rounds on one node."""

import pytest
import torch
from torch import nn

from signmuon.comm_hooks import VoteMismatchError, node_layout
from signmuon.optim import LocalStepAverager, OuterStep
from tests.harness import capture, rounds_model, run_distributed


def _bad_outer_worker(rank, world_size):
    model = rounds_model()
    averager = LocalStepAverager(period=2, outer=OuterStep.diloco(), module=model)
    other_rule = LocalStepAverager(period=2, outer=OuterStep.diloco(pseudo_gradient="scaled_sign"), module=model)
    return (
        capture(lambda: LocalStepAverager(period=2, outer=OuterStep(optimizer=lambda params: params), module=model)),
        capture(lambda: averager.average_parameters(list(model.parameters())[:2])),
        capture(lambda: other_rule.load_state_dict(averager.state_dict())),
    )


def test_bad_outer_settings():
    with pytest.raises(ValueError, match="pseudo_gradient"):
        OuterStep(optimizer=torch.optim.SGD, pseudo_gradient="int8")
    with pytest.raises(ValueError, match="must build an optimizer"):
        OuterStep(optimizer=torch.optim.SGD([torch.zeros(1)], lr=1.0))
    for bad in (dict(scale_block=-1), dict(scale_block=True), dict(scale_bits=4), dict(scale_bits=True)):
        with pytest.raises(ValueError, match="scale_block=(-1|True)|scale_bits=(4|True)"):
            OuterStep(optimizer=torch.optim.SGD, pseudo_gradient="sign_vote_ef", **bad)
    for rule in ("mean", "scaled_sign"):  # they have no scales to set: refused, not ignored
        for setting in (dict(scale_block=64), dict(scale_bits=8)):
            with pytest.raises(ValueError, match=f"pseudo_gradient='{rule}' has none"):
                OuterStep(optimizer=torch.optim.SGD, pseudo_gradient=rule, **setting)
    with pytest.raises(ValueError, match="module="):
        LocalStepAverager(period=2, outer=OuterStep.diloco())
    with pytest.raises(ValueError, match="OuterStep"):
        LocalStepAverager(period=2, outer=torch.optim.SGD, module=rounds_model())
    not_an_optimizer, other_params, other_rule = run_distributed(_bad_outer_worker, 1)[0]
    assert "not a torch.optim.Optimizer" in not_an_optimizer
    assert "same parameters" in other_params
    assert "another pseudo_gradient rule than 'scaled_sign'" in other_rule


def _unequal_start_worker(rank, world_size):
    torch.manual_seed(rank)  # no DDP: every rank starts elsewhere
    model = nn.Linear(3, 2)
    averager = LocalStepAverager(period=1, outer=OuterStep.diloco(), module=model)
    return capture(lambda: averager.average_parameters(model.parameters()))


def test_an_unequal_start_raises_on_every_rank():
    for error in run_distributed(_unequal_start_worker, 2):
        assert (
            error is not None and "build LocalStepAverager after DDP" in error and VoteMismatchError.__name__ in error
        )


def _outer_settings_worker(rank, world_size):
    model = rounds_model()
    same = LocalStepAverager(
        period=1, outer=OuterStep(optimizer=lambda params: torch.optim.SGD(params, lr=1.0)), module=model
    )
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    same.average_parameters(model.parameters())  # a lambda is described alike on every rank
    differing = LocalStepAverager(period=1, outer=OuterStep.diloco(lr=0.7 if rank == 0 else 0.5), module=model)
    scale_bits = OuterStep(
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        pseudo_gradient="sign_vote_ef",
        scale_bits=8 if rank == 0 else 16,
    )
    other_bits = LocalStepAverager(period=1, outer=scale_bits, module=model)
    return capture(lambda: differing.average_parameters(model.parameters())), capture(
        lambda: other_bits.average_parameters(model.parameters())
    )


def test_ranks_with_different_outer_steps_raise_on_every_rank():
    for errors in run_distributed(_outer_settings_worker, 2):
        for error in errors:  # another learning rate, other scale bits
            assert error is not None and "SettingsMismatchError" in error and "outer" in error


def _one_node_worker(rank, world_size):
    return capture(lambda: LocalStepAverager(period=2, layout=node_layout(None, 2)))


def test_node_aware_rounds_need_two_nodes():
    for error in run_distributed(_one_node_worker, 2):
        assert error is not None and "at least two nodes" in error


def _blocks_one_by_one(sizes, lo, hi, block):
    """(start, stop) of every scale block of the slice [lo, hi), one at a time: the definition."""
    found, start = [], 0
    for size in sizes:
        step = block or size
        for at in range(start, start + size, max(step, 1)):
            a, b = max(at, lo), min(at + step, start + size, hi)
            if b > a:
                found.append((a - lo, b - lo))
        start += size
    return found


def test_scale_blocks_are_the_blocks_one_by_one_as_rows_of_a_few_runs():
    from signmuon.optim.rounds.pseudo_gradients import scale_blocks

    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        sizes = tuple(
            int(s) for s in torch.randint(0, 40, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
        )
        total = sum(sizes)
        lo = int(torch.randint(0, total + 1, (1,), generator=gen))
        hi = int(torch.randint(lo, total + 1, (1,), generator=gen))
        block = int(torch.randint(0, 9, (1,), generator=gen))
        runs = scale_blocks(sizes, lo, hi, block)
        rows = [(a + k * width, a + (k + 1) * width) for a, b, width in runs for k in range((b - a) // width)]
        assert all((b - a) % width == 0 for a, b, width in runs)
        assert rows == _blocks_one_by_one(sizes, lo, hi, block), (sizes, lo, hi, block)
        assert len(runs) <= 3 * len(sizes)
