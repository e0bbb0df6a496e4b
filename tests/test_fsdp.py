"""The vote on FSDP2 shards (register_fsdp_vote), on gloo ranks grouped into nodes of 2:
equal to the node-level reference (node means -> momentum -> Newton-Schulz -> sign -> vote of
the nodes) and to the node-aware unsharded paths; bytes; state per rank; bf16; gradient
accumulation; DCP checkpoints; refusals."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import VoteConfig, vote_bytes_per_rank
from signmuon.optim import SignMuon, SignSGDMV, SignumMV, check_checkpoint_layout, node_mesh, register_fsdp_vote
from tests.harness import batch, capture, node_reference_step, run_distributed, tiny_net

LR, BETA, STEPS = 0.01, 0.9, 3
KINDS = ("signsgd", "signum_mv", "signmuon", "signmuon_polar")


def _optimizer(kind, params, vote, **options):
    if kind == "signsgd":
        return SignSGDMV(params, lr=LR, vote=vote, **options)
    if kind == "signum_mv":
        return SignumMV(params, lr=LR, momentum=BETA, vote=vote, **options)
    return SignMuon(params, lr=LR, momentum=BETA, polar_after_vote=kind == "signmuon_polar", vote=vote, **options)


def _sharded_net(mesh, nested=True, **fsdp_options):
    net = tiny_net()
    for layer in (net[0], net[2]) if nested else ():  # nested units, as per-block wrapping does
        fully_shard(layer, mesh=mesh["local"], **fsdp_options)
    fully_shard(net, mesh=mesh["local"], **fsdp_options)
    return net


def _whole(net):
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def _train(net, opt, rank, steps=STEPS, model=None):
    model = model or net
    trajectory = [
        _whole(net)
        if hasattr(next(net.parameters()), "full_tensor")
        else [p.detach().clone() for p in net.parameters()]
    ]
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        params = list(net.parameters())
        trajectory.append(_whole(net) if hasattr(params[0], "full_tensor") else [p.detach().clone() for p in params])
    return trajectory


def _reference_worker(rank, world_size, per_node):
    mesh = node_mesh(per_node)
    out = {}
    for kind in KINDS:
        net = _sharded_net(mesh)
        opt = _optimizer(kind, net.parameters(), VoteConfig(tie="exact"))
        register_fsdp_vote(net, opt, mesh)
        out[kind] = _train(net, opt, rank)
    # The node-aware unsharded paths on the same data: vote_in_step with the same tie coins,
    # and the DDP hook (its coins are keyed by bucket order, so exact ties there).
    for name, config in (("fast", VoteConfig()), ("exact", VoteConfig(tie="exact"))):
        net = _sharded_net(mesh)
        opt = _optimizer("signmuon", net.parameters(), config)
        register_fsdp_vote(net, opt, mesh)
        out[f"fsdp_{name}"] = _train(net, opt, rank)
    net = tiny_net()
    opt = _optimizer(
        "signmuon", net.parameters(), VoteConfig(hierarchical=True, ranks_per_node=per_node), vote_in_step=True
    )
    out["in_step_fast"] = _train(net, opt, rank)
    # Row-sharded matrices with fast ties (Signum-MV, signSGD-MV): each shard must draw the coins
    # of its entries in the whole matrix (its first entry is its first row times the row's size).
    for kind in ("signsgd", "signum_mv"):
        net = _sharded_net(mesh)
        opt = _optimizer(kind, net.parameters(), VoteConfig())
        register_fsdp_vote(net, opt, mesh)
        out[f"fsdp_fast_{kind}"] = _train(net, opt, rank)
        net = tiny_net()
        config = VoteConfig(hierarchical=True, ranks_per_node=per_node)
        out[f"in_step_fast_{kind}"] = _train(net, _optimizer(kind, net.parameters(), config, vote_in_step=True), rank)
    # Non-matrix parameters on AdamW over the full-precision mean, as in DDP.
    net = _sharded_net(mesh)
    opt = _optimizer("signmuon", net.parameters(), VoteConfig(), non_matrix="adamw")
    register_fsdp_vote(net, opt, mesh)
    out["fsdp_adamw"] = _train(net, opt, rank)
    net = tiny_net()
    config = VoteConfig(hierarchical=True, ranks_per_node=per_node)
    opt = _optimizer("signmuon", net.parameters(), config, vote_in_step=True, non_matrix="adamw")
    out["in_step_adamw"] = _train(net, opt, rank)
    net = tiny_net()
    model = DDP(net, bucket_cap_mb=0.0005)
    opt = _optimizer("signmuon", net.parameters(), VoteConfig(tie="exact", hierarchical=True, ranks_per_node=per_node))
    opt.register_comm_hook(model)
    out["ddp_exact"] = _train(net, opt, rank, model=model)
    return out


# 3 and 4 ranks per node: tiny_net's last layer has 3 rows, so with 4 ranks one holds no shard of it.
@pytest.mark.parametrize("world_size, per_node", [(4, 2), (6, 2), (6, 3), (8, 4)])
def test_fsdp_vote_equals_the_node_level_reference_and_the_node_aware_ddp_path(world_size, per_node):
    nodes = world_size // per_node
    results = run_distributed(_reference_worker, world_size, per_node, timeout=400)
    for result in results[1:]:
        for key in results[0]:
            assert all(torch.equal(a, b) for a, b in zip(results[0][key][-1], result[key][-1])), (
                f"{key}: replicas differ"
            )
    out = results[0]
    for kind in KINDS:
        trajectory = out[kind]
        momenta = [[torch.zeros_like(p) for p in trajectory[0]] for _ in range(nodes)]
        base = "signmuon" if kind.startswith("signmuon") else kind
        for step in range(STEPS):
            expected = node_reference_step(
                base,
                trajectory[step],
                step,
                nodes,
                per_node,
                momenta,
                LR,
                BETA if kind != "signsgd" else 0.0,
                polar=kind == "signmuon_polar",
            )
            for a, b in zip(trajectory[step + 1], expected):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{kind} step {step}")
        assert all(not torch.equal(a, b) for a, b in zip(trajectory[-1], trajectory[0])), kind
    for fsdp, unsharded in (
        ("fsdp_fast", "in_step_fast"),
        ("fsdp_exact", "ddp_exact"),
        ("fsdp_adamw", "in_step_adamw"),
        ("fsdp_fast_signsgd", "in_step_fast_signsgd"),
        ("fsdp_fast_signum_mv", "in_step_fast_signum_mv"),
    ):
        for step, (a_params, b_params) in enumerate(zip(out[fsdp], out[unsharded])):
            for a, b in zip(a_params, b_params):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{fsdp} vs {unsharded}, step {step}")


def _bytes_worker(rank, world_size, per_node, kind, during_backward):
    mesh = node_mesh(per_node)
    net = _sharded_net(mesh)
    opt = _optimizer(kind, net.parameters(), VoteConfig())
    sharded = register_fsdp_vote(net, opt, mesh, during_backward=during_backward)
    _train(net, opt, rank, steps=1)
    local = rank % per_node

    def entries(params):  # what this rank votes of ``params``: its rows, and whole matrices it owns
        voted = 0
        for p in params:
            spec = sharded.specs[p]
            if spec.owner is None:
                lo, hi = spec.rows(per_node, local)
                voted += (hi - lo) * spec.row_numel
            elif spec.owner == local:
                voted += p.numel()
        return voted

    calls = [u for u in sharded.units.units if u] if during_backward else [list(sharded.specs)]  # per unit, or one
    state = sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return opt.stats.bytes_sent_between_nodes, [entries(params) for params in calls], state


@pytest.mark.parametrize("kind", ["signum_mv", "signmuon"])
@pytest.mark.parametrize("during_backward", [True, False])
def test_between_node_bytes_follow_the_formula_and_state_is_one_shard(kind, during_backward):
    world_size, per_node = 4, 2
    results = run_distributed(_bytes_worker, world_size, per_node, kind, during_backward)
    ddp_state = sum(p.numel() for p in tiny_net().parameters())  # one momentum per parameter
    for between, calls, state in results:
        assert len(calls) == (2 if during_backward else 1)  # tiny_net's two units with parameters (the root has none)
        assert between == sum(vote_bytes_per_rank(voted, world_size // per_node, agree_sizes=False) for voted in calls)
        assert state <= ddp_state / per_node + 2 * 12  # the momentum of this rank's rows (uneven splits: a row more)
    assert sum(r[2] for r in results[:per_node]) == ddp_state  # the node holds each momentum entry once


def _precision_worker(rank, world_size, reduce_dtype, accumulate):
    mesh = node_mesh(2)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    net = _sharded_net(mesh, mp_policy=policy)
    opt = SignMuon(net.parameters(), lr=LR, momentum=BETA)
    register_fsdp_vote(net, opt, mesh)
    before = _whole(net)
    for step in range(2):
        opt.zero_grad()
        micro = [batch(rank, 10 * step + m) for m in range(2)] if accumulate else [batch(rank, step)]
        for m, (x, y) in enumerate(micro):
            net.set_requires_gradient_sync(m == len(micro) - 1)
            nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    dtypes = sorted(
        {str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0}
    )
    return before, _whole(net), dtypes, opt.stats.calls


@pytest.mark.parametrize("reduce_dtype, accumulate", [(torch.float32, False), (torch.bfloat16, True)])
def test_bf16_mixed_precision_and_gradient_accumulation(reduce_dtype, accumulate):
    results = run_distributed(_precision_worker, 4, reduce_dtype, accumulate)
    before, after, dtypes, _ = results[0]
    assert dtypes == ["torch.float32"]  # momentum in float32 under bf16 compute
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(after, other[1]))
    for a, b in zip(before, after):
        # Every entry moves by lr per step (a sign step), so each differs from the start.
        assert (a - b).abs().max() <= 2 * LR + 1e-6 and not torch.equal(a, b)


def _nonfinite_worker(rank, world_size, action, during_backward):
    from signmuon.comm_hooks import NonFiniteError

    mesh = node_mesh(2)
    net = _sharded_net(mesh)
    opt = SignMuon(net.parameters(), lr=LR, vote=VoteConfig(nonfinite=action))
    register_fsdp_vote(net, opt, mesh, during_backward=during_backward)
    _train(net, opt, rank, steps=1)
    before = _whole(net)
    if rank == 3:  # one rank of node 1: a NaN in the gradient reaching the first unit only (the last voted)

        def poison(grad):
            grad = grad.clone()
            grad[0, 0] = float("nan")
            return grad

        def on_forward(module, args, out):
            out.register_hook(poison)

        net[1].register_forward_hook(on_forward)
    x, y = batch(rank, 1)
    opt.zero_grad()
    try:
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        error = None
    except NonFiniteError as caught:
        error = str(caught)
    return before, _whole(net), opt.stats.skipped, error


@pytest.mark.parametrize("action", ["skip", "raise"])
@pytest.mark.parametrize("during_backward", [True, False])
def test_a_nonfinite_gradient_on_one_rank_skips_or_raises_on_every_rank(action, during_backward):
    results = run_distributed(_nonfinite_worker, 4, action, during_backward)
    for before, after, skipped, error in results:
        # The last unit was voted cleanly during backward; the step still moves nothing.
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "no parameter moves"
        if action == "skip":
            assert skipped == 1 and error is None
        else:
            assert error is not None and "NaN or Inf" in error


def _refusal_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = node_mesh(2)
    errors = {}
    net = _sharded_net(mesh)
    opt = SignMuon(net.parameters(), lr=LR)
    nn.functional.cross_entropy(net(batch(rank, 0)[0]), batch(rank, 0)[1]).backward()
    errors["no_entry_point"] = capture(opt.step)
    errors["ddp_hook"] = capture(lambda: opt.comm_state)
    errors["one_d_mesh"] = capture(lambda: register_fsdp_vote(net, opt, mesh["local"]))
    registered = _sharded_net(mesh)
    late = SignumMV(list(registered.parameters())[:2], lr=LR)
    late.add_param_group({"params": list(registered.parameters())[2:]})
    register_fsdp_vote(registered, late, mesh)
    errors["late_group"] = capture(lambda: late.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}))
    errors["groups_after_late"] = len(late.param_groups)
    errors["hook_after_fsdp"] = capture(lambda: late.comm_state)
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = tiny_net()
    fully_shard(hsdp, mesh=hsdp_mesh)
    errors["hsdp"] = capture(lambda: register_fsdp_vote(hsdp, SignumMV(hsdp.parameters(), lr=LR), mesh))
    partial = _sharded_net(mesh)
    errors["missing"] = capture(
        lambda: register_fsdp_vote(partial, SignumMV(list(partial.parameters())[:2], lr=LR), mesh)
    )
    plain = tiny_net()
    errors["unsharded"] = capture(lambda: register_fsdp_vote(plain, SignumMV(plain.parameters(), lr=LR), mesh))
    twice = _sharded_net(mesh)
    opt = SignumMV(twice.parameters(), lr=LR)
    errors["flag"] = capture(lambda: register_fsdp_vote(twice, opt, mesh, during_backward="yes"))
    register_fsdp_vote(twice, opt, mesh)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(twice(x), y).backward()
    errors["second_backward"] = capture(lambda: nn.functional.cross_entropy(twice(x), y).backward())
    return errors


def test_refusals_name_what_to_do():
    results = run_distributed(_refusal_worker, 4)
    errors = results[0]
    assert all(r == errors for r in results[1:]), "every rank raises the same"
    assert "register_fsdp_vote" in errors["no_entry_point"] and "node_mesh" in errors["no_entry_point"]
    assert "register_fsdp_vote" in errors["ddp_hook"]
    assert "(node, local) mesh" in errors["one_d_mesh"] and "1-D" in errors["one_d_mesh"]
    assert "HSDP" in errors["hsdp"] and "mesh['local']" in errors["hsdp"]
    assert "not in the optimizer" in errors["missing"]
    assert "not sharded" in errors["unsharded"]
    assert "before register_fsdp_vote" in errors["late_group"]
    assert errors["groups_after_late"] == 2, "the refused group is not added"
    assert "already votes through ShardedExchange" in errors["hook_after_fsdp"]
    assert "during_backward must be True or False" in errors["flag"]
    assert (
        "second backward" in errors["second_backward"]
        and "set_requires_gradient_sync(False)" in errors["second_backward"]
    )


def _checkpoint_worker(rank, world_size, path, per_node, phase):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = node_mesh(per_node)
    net = _sharded_net(mesh)
    opt = SignMuon(net.parameters(), lr=LR, momentum=BETA)
    register_fsdp_vote(net, opt, mesh)

    def run(start, steps):
        for step in range(start, start + steps):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        return _whole(net)

    def momenta():  # every node's momentum, (N, *shape) per parameter
        return {k: v["momentum_buffer"].full_tensor() for k, v in get_state_dict(net, opt)[1]["state"].items()}

    if phase == "save":
        run(0, 2)
        model_state, optim_state = get_state_dict(net, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        torch.save(opt.state_dict(), f"{path}.rank{rank}.pt")  # a file per rank, beside
        return run(2, 2), momenta()
    error = capture(lambda: check_checkpoint_layout(path, opt))
    if error is not None:
        return error
    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    error = capture(lambda: dcp.load(state, checkpoint_id=path))
    if error is None:
        error = capture(
            lambda: set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        )
    if error is not None:
        return error
    assert opt.steps_taken == 2
    loaded = momenta()
    # Its own rank's file of another layout: the mark shows another place, refused (DCP reshards).
    own_file = capture(lambda: opt.load_state_dict(torch.load(f"{path}.rank{rank}.pt", weights_only=False)))
    return run(2, 2), loaded, own_file


def test_dcp_resume_is_bit_identical_and_a_different_node_count_is_refused(tmp_path):
    path = str(tmp_path / "checkpoint")
    continued = run_distributed(_checkpoint_worker, 4, path, 2, "save")
    resumed = run_distributed(_checkpoint_worker, 4, path, 2, "load")
    for (a, _), (b, _, own_file) in zip(continued, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "resume on the same layout"
        assert own_file is None, own_file  # its own file on the layout it was saved on loads
    loaded = resumed[0][1]  # every node's momentum as loaded on 2 nodes x 2
    one_rank_nodes = run_distributed(_checkpoint_worker, 2, path, 1, "load")  # 2 nodes of 1 rank: DCP reshards the rows
    assert not isinstance(one_rank_nodes[0], str), one_rank_nodes[0]
    for _, _, own_file in one_rank_nodes:
        assert own_file is not None and "another layout of ranks per node" in own_file, own_file
    for key, value in loaded.items():
        assert value.shape[0] == 2 and torch.equal(one_rank_nodes[0][1][key], value), key
        assert not torch.equal(value[0], value[1]), "each node keeps its own momentum"
    assert set(loaded) == set(continued[0][1])
    other = run_distributed(_checkpoint_worker, 4, path, 1, "load")  # 4 nodes of 1
    assert all(isinstance(e, str) for e in other), "every rank refuses"
    assert "2 node(s) x 2 rank(s)" in other[0] and "4 node(s) x 1 rank(s)" in other[0], other[0]


def _modes_worker(rank, world_size, per_node):
    """Each setting trained twice, voting unit by unit during backward and all in step()."""
    mesh = node_mesh(per_node)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    settings = {
        **{kind: ({}, {}, 1) for kind in KINDS},
        "signmuon_fast": ({"vote": VoteConfig()}, {}, 1),
        "signum_mv_fast": ({"vote": VoteConfig(), "kind": "signum_mv"}, {}, 1),
        "signmuon_adamw": ({"non_matrix": "adamw", "vote": VoteConfig()}, {}, 1),
        "signmuon_bf16_accumulate": ({"vote": VoteConfig()}, {"mp_policy": policy}, 3),
        "signmuon_root_unit_only": ({}, {"nested": False}, 1),  # reduced in FSDP2's final callback
        "signmuon_adamw_bf16_accumulate": ({"non_matrix": "adamw"}, {"mp_policy": policy}, 2),
    }
    out = {}
    for name, (options, fsdp_options, micro_batches) in settings.items():
        options = dict(options)
        kind = options.pop("kind", name.split("_fast")[0] if name in KINDS or "fast" in name else "signmuon")
        vote = options.pop("vote", VoteConfig(tie="exact"))
        for during_backward in (True, False):
            net = _sharded_net(mesh, **fsdp_options)
            opt = _optimizer(kind, net.parameters(), vote, **options)
            register_fsdp_vote(net, opt, mesh, during_backward=during_backward)
            trajectory, in_backward, in_step, early = [], 0, 0, 0
            for step in range(STEPS):
                opt.zero_grad()
                for m in range(micro_batches):
                    net.set_requires_gradient_sync(m == micro_batches - 1)
                    x, y = batch(rank, 10 * step + m)
                    sent = opt.stats.bytes_sent_between_nodes
                    nn.functional.cross_entropy(net(x), y).backward()
                    if m < micro_batches - 1:
                        early += opt.stats.bytes_sent_between_nodes - sent
                    else:
                        in_backward += opt.stats.bytes_sent_between_nodes - sent
                sent = opt.stats.bytes_sent_between_nodes
                opt.step()
                in_step += opt.stats.bytes_sent_between_nodes - sent
                trajectory.append(_whole(net))
            momenta = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
            out[name, during_backward] = trajectory, momenta, (early, in_backward, in_step)
    return out


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


# 2 x 2 and 3 x 2: the vote of each unit during backward is the vote of the whole step, bit for bit.
@pytest.mark.parametrize("world_size, per_node", [(4, 2), (6, 2)])
def test_the_vote_during_backward_equals_the_vote_in_step_bit_for_bit(world_size, per_node):
    results = run_distributed(_modes_worker, world_size, per_node, timeout=600)
    for out in results:
        names = {name for name, _ in out}
        for name in names:
            (a_steps, a_momenta, a_bytes), (b_steps, b_momenta, b_bytes) = out[name, True], out[name, False]
            # AdamW's mean gradient is an all-reduce on the rail: with 3 nodes its summation order
            # follows the message size (a unit, or the whole step), so it agrees to rounding there.
            same = torch.equal if "adamw" not in name or world_size // per_node == 2 else _close
            for step, (a, b) in enumerate(zip(a_steps, b_steps)):
                assert all(same(x, y) for x, y in zip(a, b)), f"{name}: step {step} differs"
            assert all(same(x, y) for x, y in zip(a_momenta, b_momenta)), f"{name}: momenta differ"
            assert not torch.equal(a_steps[0][0], a_steps[-1][0]), name
            # Nothing crosses nodes on micro-batches without sync; during backward everything crosses
            # before step(), which sends nothing; in step mode the other way round.
            assert a_bytes[0] == b_bytes[0] == 0, name
            assert a_bytes[1] > 0 and a_bytes[2] == 0, (name, a_bytes)
            assert b_bytes[1] == 0 and b_bytes[2] > 0, (name, b_bytes)
