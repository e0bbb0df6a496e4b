"""Every VoteConfig field is honoured by every entry point that takes one, or refused there with
an error that says where it works. The hook states and optimizers are exercised field by field
in their own tests (node-aware runs in test_hierarchy.py, ties and seeds in test_sign_vote_hook.py,
faults in test_reliability.py); here: the collective and the DeepSpeed backend."""

import pytest
import torch

from signmuon.comm_hooks import ByzantineFault, CommStats, VoteConfig, VoteWork, majority_vote
from signmuon.integrations.deepspeed import SignCompressedBackend
from tests.harness import run_distributed

HIERARCHICAL = VoteConfig(hierarchical=True, ranks_per_node=2)
# One setting changed from the default per entry (nonfinite has its own cases below).
VARIANTS = {
    "default": VoteConfig(),
    "exact": VoteConfig(tie="exact"),
    "seed": VoteConfig(seed=5),
    "two_phase": VoteConfig(algorithm="two_phase"),
    "torch_kernels": VoteConfig(kernels="torch"),
    "fault": VoteConfig(fault=ByzantineFault(ranks=(1,))),
}


@pytest.mark.parametrize("entry", [majority_vote, VoteWork], ids=lambda f: f.__name__)
def test_the_collective_refuses_the_node_aware_vote_and_says_where_it_works(entry):
    with pytest.raises(ValueError, match="SignVoteState.*SignMuon.*DeepSpeed"):
        entry(torch.ones(8), None, HIERARCHICAL)


def test_the_backend_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="hooks or a sign-vote optimizer"):
        SignCompressedBackend(vote=HIERARCHICAL)
    for config in (
        VoteConfig(algorithm="all_gather"),
        VoteConfig(fault=ByzantineFault(ranks=(0,))),
        VoteConfig(zeros="coin"),
    ):
        backend = SignCompressedBackend(vote=config)
        with pytest.raises(ValueError, match="two phases, has no fault injection and no zero rule"):
            backend.compressed_allreduce(torch.ones(16), torch.zeros(16), torch.zeros(16))
    with pytest.raises(TypeError, match="vote must be a VoteConfig"):
        SignCompressedBackend(vote={"tie": "fast"})


def test_the_backend_refuses_an_encoding_other_than_its_own(monkeypatch):
    from signmuon.comm_hooks.vote.encodings import VOTE_ENCODINGS

    monkeypatch.setitem(VOTE_ENCODINGS, "other", VOTE_ENCODINGS["sign"])
    backend = SignCompressedBackend(vote=VoteConfig(encoding="other"))
    with pytest.raises(ValueError, match="scaled signs, not VoteConfig.encoding='other'"):
        backend.compressed_allreduce(torch.ones(16), torch.zeros(16), torch.zeros(16))


def _fields_worker(rank, world_size):
    # Two ranks with opposite signs everywhere: every entry is a tie.
    x = torch.full((256,), 1.0 if rank == 0 else -1.0)
    results = {}
    for name, config in VARIANTS.items():
        stats = CommStats()
        results[name] = (majority_vote(x, config=config, step=3, stats=stats), stats.bytes_sent)
    nan = x.clone()
    nan[0] = float("nan") if rank == 1 else 1.0
    stats = CommStats()
    results["skip"] = (majority_vote(nan, stats=stats), stats.skipped)
    try:
        majority_vote(nan, config=VoteConfig(nonfinite="raise"))
        results["raise"] = None
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        results["raise"] = type(error).__name__
    return results


def test_each_field_of_the_collective_changes_what_it_should():
    results = run_distributed(_fields_worker, 2)
    r0, r1 = results
    default, default_bytes = r0["default"]
    assert torch.equal(default, r1["default"][0])  # the same coins on both ranks
    assert set(default.unique().tolist()) == {-1.0, 1.0}  # tie="fast": coins, one bit
    assert torch.equal(r0["exact"][0], torch.zeros(256))  # tie="exact": ties vote 0
    assert not torch.equal(r0["seed"][0], default)  # another seed, other coins
    assert r0["two_phase"][1] != default_bytes  # two ranks: "auto" gathers, "two_phase" does not
    assert torch.equal(r0["two_phase"][0], default)  # the same coins whatever the schedule
    assert torch.equal(r0["torch_kernels"][0], default)  # other kernels, the same bits
    assert torch.equal(r0["fault"][0], torch.ones(256))  # rank 1 flips: both vote +1
    assert torch.equal(r0["skip"][0], torch.zeros(256)) and r0["skip"][1] == 1
    assert r0["raise"] == r1["raise"] == "NonFiniteError"


# --- the hook states and the optimizers: each field reaches the vote they run -----------------


def _train(rank, entry, config):
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from signmuon.comm_hooks import SignVoteState, sign_vote_hook
    from signmuon.optim import SignMuon, SignumMV
    from tests.harness import batch, tiny_net

    net = tiny_net()
    if entry == "sign_vote_hook":
        model = DDP(net)
        state = SignVoteState(momentum=0.9, start_iter=1, vote=config)
        model.register_comm_hook(state, sign_vote_hook)
        opt, stats = torch.optim.SGD(net.parameters(), lr=0.01), state.stats
    elif entry == "SignMuon hook":
        model = DDP(net)
        opt = SignMuon(net.parameters(), lr=0.01, vote=config)
        stats = opt.register_comm_hook(model).stats
    else:  # SignumMV voting in step()
        model = net
        opt = SignumMV(net.parameters(), lr=0.01, vote=config, vote_in_step=True)
        stats = opt.stats
    for step in range(3):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()], stats.bytes_sent


def _entries_worker(rank, world_size):
    return {
        (entry, name): _train(rank, entry, config)
        for entry in ("sign_vote_hook", "SignMuon hook", "SignumMV in step")
        for name, config in VARIANTS.items()
    }


def test_each_field_reaches_the_vote_of_every_hook_and_optimizer():
    results = run_distributed(_entries_worker, 2)[0]
    for entry in ("sign_vote_hook", "SignMuon hook", "SignumMV in step"):
        params, sent = results[(entry, "default")]

        def same(name):
            return all(torch.equal(a, b) for a, b in zip(params, results[(entry, name)][0]))

        assert not same("exact") and not same("seed") and not same("fault"), entry  # ties and faults change the vote
        assert same("two_phase") and results[(entry, "two_phase")][1] != sent, entry  # same vote, other schedule
        assert same("torch_kernels") and results[(entry, "torch_kernels")][1] == sent, entry  # same bits, same bytes


def _triton_hook_worker(rank, world_size):
    import os

    os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are first imported here
    return {
        name: _train(rank, "sign_vote_hook", config)
        for name, config in (("numba", VoteConfig()), ("triton", VoteConfig(kernels="triton")))
    }


def test_the_signum_hook_on_the_triton_kernels_trains_the_same_bits():
    # The hook's momentum step runs inside Triton's fused momentum_pack (interpreted on CPU here).
    for r in run_distributed(_triton_hook_worker, 2):
        (numba_params, numba_sent), (triton_params, triton_sent) = r["numba"], r["triton"]
        assert all(torch.equal(a, b) for a, b in zip(numba_params, triton_params)) and numba_sent == triton_sent


def _triton_node_worker(rank, world_size):
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    return {
        name: _train(rank, "sign_vote_hook", VoteConfig(hierarchical=True, ranks_per_node=2, **kernels))
        for name, kernels in (("numba", {}), ("triton", {"kernels": "triton"}))
    }


def test_the_node_aware_signum_hook_on_the_triton_kernels_trains_the_same_bits():
    # Each rank's momentum slice advances inside Triton's momentum_pack, its gradient a view
    # into the node mean at the slice's offset (interpreted on CPU here).
    for r in run_distributed(_triton_node_worker, 4):
        (numba_params, numba_sent), (triton_params, triton_sent) = r["numba"], r["triton"]
        assert all(torch.equal(a, b) for a, b in zip(numba_params, triton_params)) and numba_sent == triton_sent


def test_the_docs_list_every_field_in_order():
    # docs/design.md's settings section names all of them; the user guide all a user sets.
    import dataclasses
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    fields = [f.name for f in dataclasses.fields(VoteConfig)]
    design = re.search(r"`VoteConfig\(([^)]*)\)` is\s", (root / "docs" / "design.md").read_text()).group(1)
    guide = re.search(r"one object, `VoteConfig\(([^)]*)\)`", (root / "docs" / "usage.md").read_text()).group(1)
    assert design.split(", ") == fields
    assert re.split(r",\s+", guide) == [f for f in fields if f != "fault"]  # fault: testing only
