"""The cost model behind ``signmuon-bench plan``: its byte counts are the formulas the
collectives are tested against, its crossover is where the step times meet, and the CLI refuses
bad input."""

import dataclasses

import pytest
import torch


def test_plan_bytes_are_the_collectives_formulas():
    from signmuon.benchmarks.cost.model import Cluster, Workload, predict
    from signmuon.comm_hooks import vote_bytes_per_rank
    from signmuon.comm_hooks.dist import ring_bytes

    n = 1 << 20
    flat = Cluster(4, 1, 1e9)  # one rank per node: everything a rank sends leaves its node
    work = Workload(n, 0.01)
    assert predict("allreduce", flat, work)["between_bytes_per_node"] == ring_bytes(4 * n, 4)
    assert predict("bf16_allreduce", flat, work)["between_bytes_per_node"] == ring_bytes(2 * n, 4)
    dense = predict("signsgd_mv", flat, work)["between_bytes_per_node"]
    assert dense == pytest.approx(vote_bytes_per_rank(n, 4, agree_sizes=False), rel=1e-3)  # words and headers aside
    nodes = Cluster(2, 2, 1e9)
    node_vote = predict("signsgd_mv_node", nodes, work)
    per_rail = vote_bytes_per_rank(n // 2, 2, agree_sizes=False)
    assert node_vote["between_bytes_per_node"] == pytest.approx(2 * per_rail, rel=1e-3)  # the node's two rails
    assert predict("signsgd_mv", flat, Workload(n, 0.01, zero_bits=1.0))["between_bytes_per_node"] == pytest.approx(
        2 * dense
    )
    # Rounds every H steps: the fp32 round's ring over the nodes (each rail a 1/L slice), spread over H.
    rounds = predict("diloco_node", nodes, Workload(n, 0.01, period=8))["between_bytes_per_node"]
    assert rounds == pytest.approx(2 * ring_bytes(4 * n // 2, 2) / 8)
    assert predict("diloco_vote_node", nodes, Workload(n, 0.01, period=8))["between_bytes_per_node"] == pytest.approx(
        rounds / 32
    )


def test_plan_zeros_follow_each_of_the_votes_rounds_with_one_more():
    # Where zeros travel (zero_bits > 0), their lists go in a round of their own after each of the
    # vote's rounds (the first announced their sizes): twice the α term, between nodes and inside.
    from signmuon.benchmarks.cost.model import Cluster, Workload, predict

    n, alpha = 1 << 20, 1e-3

    def rounds(method, cluster, zero_bits):
        work = Workload(n, 0.0, ((1024, 1024),), zero_bits=zero_bits, overlap=False)
        slow = predict(method, Cluster(**{**cluster.__dict__, "latency_s": alpha, "intra_latency_s": alpha}), work)
        fast = predict(method, Cluster(**{**cluster.__dict__, "latency_s": 0.0, "intra_latency_s": 0.0}), work)
        return round((slow["comm_s"] - fast["comm_s"]) / alpha, 6)

    flat, nodes = Cluster(4, 1, 1e9), Cluster(2, 2, 1e9)
    for method, cluster, dense, zeros in (
        ("signsgd_mv", flat, 6, 12),  # two-phase over 4 ranks: 2(M-1), each followed by the zeros'
        ("signum_mv", Cluster(1, 4, 1e9), 6, 12),  # one node: the same rounds inside it
        ("signsgd_mv_node", nodes, 2 + 2 + 1, 4 + 2 + 1),  # the rail vote's; the node all-reduce and gather keep theirs
        ("fsdp_signum_mv", nodes, 2 + 3, 4 + 3),  # the rail vote's; FSDP2's own collectives keep theirs
    ):
        assert (rounds(method, cluster, 0.0), rounds(method, cluster, 0.25)) == (dense, zeros), method
    assert rounds("allreduce", flat, 0.25) == rounds("allreduce", flat, 0.0) == 6  # no vote, no zeros' lists


def test_plan_crossover_is_where_the_step_times_meet():
    import math

    from signmuon.benchmarks.cost.model import Cluster, Workload, crossover, predict

    cluster, work = Cluster(8, 8, 1e9), Workload(100_000_000, 0.05, ((4096, 4096),) * 4)
    rate = crossover("signmuon_node", cluster, work)
    assert rate is not None and math.isfinite(rate)

    def gap(bps):
        c = Cluster(8, 8, bps)
        return predict("signmuon_node", c, work)["step_s"] - predict("allreduce", c, work)["step_s"]

    assert gap(rate * 0.9) < 0 < gap(rate * 1.1)  # the vote pays below the crossover, not above
    assert crossover("allreduce", cluster, work) is None  # never faster than itself
    # Newton–Schulz split over a node's ranks: less added time than on every rank alone.
    assert predict("signmuon_node", cluster, work)["extra_s"] < predict("signmuon", cluster, work)["extra_s"]


def test_plan_cli_tables_projection_and_errors(tmp_path, capsys):
    from signmuon.benchmarks.commands import plan
    from signmuon.benchmarks.cost.model import parse_rate

    rows = plan.main(["--model", "gpt-125m", "--nodes", "4", "--ranks-per-node", "8", "--link", "25gbit"])
    by = {r["method"]: r for r in rows}
    assert by["signsgd_mv_node"]["speedup"] > 1 > by["signmuon"]["speedup"] / by["signsgd_mv"]["speedup"]
    params, matrices = plan.model_shapes("gpt-1.3b")
    assert 1.25e9 < params < 1.4e9 and len(matrices) == 4 * 24
    projection = plan.main(["--projection", "--plot", str(tmp_path / "p.png")])
    grid = [r for r in projection if "link_gbit" in r]
    # 4 models x 3 links x 5 node counts x 4 DDP methods, and the sharded column: 2 models x 2 FSDP methods.
    assert len(grid) == 4 * 3 * 5 * 4 + 2 * 3 * 5 * 2 and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert len([r for r in projection if r.get("table") == "crossover"]) == 4 * 4
    projection = grid
    # The baseline is the faster fp32 schedule: the two-level one wherever it wins, never slower than itself.
    two_level = [r for r in projection if r["method"] == "allreduce_node"]
    assert all(r["speedup"] <= 1 + 1e-12 for r in two_level) and any(r["speedup"] == 1.0 for r in two_level)
    assert all(r["step_s"] * r["speedup"] == pytest.approx(r["baseline_step_s"]) for r in projection)
    assert "projection, not a measurement" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan.main(["--nodes", "2"])  # neither --model nor --params
    with pytest.raises(ValueError, match="kbit, mbit, gbit"):
        parse_rate("fast")


def test_plan_takes_the_rounds_period_and_bits_from_the_command_line(capsys):
    from signmuon.benchmarks.commands import plan

    common = [
        "--params",
        "1e8",
        "--compute-ms",
        "50",
        "--nodes",
        "4",
        "--ranks-per-node",
        "2",
        "--link",
        "1gbit",
        "--methods",
        "allreduce_node",
        "diloco_node",
        "diloco_vote_node",
    ]
    default = {r["method"]: r for r in plan.main(common)}
    assert "a round every 32 steps" in capsys.readouterr().out
    chosen = {r["method"]: r for r in plan.main(common + ["--period", "8", "--round-bits", "1.17"])}
    out = capsys.readouterr().out
    assert "a round every 8 steps" in out and "at 1.17 bits per entry" in out
    # A round every H steps: the node's share of the fp32 ring every step, over H; one-bit rounds a 32nd of that, times their bits.
    every_step = default["allreduce_node"]["between_bytes_per_node"]
    assert default["diloco_node"]["between_bytes_per_node"] == pytest.approx(every_step / 32)
    assert chosen["diloco_node"]["between_bytes_per_node"] == pytest.approx(every_step / 8)
    assert chosen["diloco_vote_node"]["between_bytes_per_node"] == pytest.approx(every_step / 8 / 32 * 1.17)
    assert chosen["diloco_vote_node"]["step_s"] > default["diloco_vote_node"]["step_s"]
    for bad in (["--period", "0"], ["--round-bits", "0.5"], ["--round-bits", "nan"]):
        with pytest.raises(SystemExit):
            plan.main(common + bad)
    with pytest.raises(SystemExit):  # the projection has its own H: not silently ignored
        plan.main(["--projection", "--period", "8"])
    assert "describe a cluster you plan" in capsys.readouterr().err


def test_validation_passes_combine_into_medians_per_point():
    from signmuon.benchmarks.commands.plan import main
    from signmuon.benchmarks.cost.validation import median_rows

    def point(rate, predicted, measured):
        return {
            "layout": "4x1",
            "world_size": 4,
            "method": "signsgd_mv",
            "rate": rate,
            "predicted_s": predicted,
            "measured_s": measured,
        }

    passes = [
        [point("30mbit", 0.05, 0.04), point("1gbit", 0.03, 0.02)],
        [point("30mbit", 0.06, 0.05), point("1gbit", 0.03, 0.04)],
        [point("30mbit", 0.07, 0.03), point("1gbit", 0.03, 0.03)],
    ]
    slow, fast = median_rows(passes)
    assert (slow["predicted_s"], slow["measured_s"]) == (0.06, 0.04) and slow["ratio"] == pytest.approx(1.5)
    assert fast["ratio"] == pytest.approx(1.0) and fast["pass_ratios"] == pytest.approx([1.5, 0.75, 1.0])
    with pytest.raises(ValueError, match="different orders"):
        median_rows([passes[0], passes[1][::-1]])
    with pytest.raises(SystemExit):
        main(["--model", "gpt-125m", "--repeats", "3"])  # without --validate


def test_the_validation_table_shows_each_votes_inputs_from_the_unshaped_run():
    from signmuon.benchmarks.cost.validation import median_rows
    from signmuon.benchmarks.reports.tables import validation_table

    def point(method, rate, measured, vote, zero_bits=0.0, kernel_s=3e-4):
        return {
            "layout": "2x1",
            "world_size": 2,
            "method": method,
            "rate": rate,
            "predicted_s": 0.010,
            "measured_s": measured,
            "vote_inputs_from_run": vote,
            "zero_bits": zero_bits,
            "kernel_s": kernel_s,
        }

    one_pass = [
        point("allreduce", "30mbit", 0.011, False),
        point("allreduce", "1gbit", 0.009, False),
        point("signsgd_mv", "30mbit", 0.014, True, 0.51, 2.9e-3),
        point("signsgd_mv", "1gbit", 0.012, True, 0.51, 2.9e-3),
    ]
    rows = median_rows([one_pass, one_pass])
    assert [r["vote_inputs_from_run"] for r in rows] == [False, False, True, True]
    table = validation_table([{"rows": rows}])
    assert table.splitlines()[:4] == [
        "| layout | method | 30mbit | 1gbit | zero bits / entry | vote kernels ms / step |",
        "|---|---|---|---|---|---|",
        "| 2x1 | allreduce | 0.91 | 1.11 | - | - |",  # an all-reduce's kernels are not the model's
        "| 2x1 | signsgd_mv | 0.71 | 0.83 | 0.51 | 2.9 |",
    ]
    assert table.endswith("Predicted / measured within 20%: 2x1: 3 of 4.")
    older = [{k: v for k, v in r.items() if k != "vote_inputs_from_run"} for r in rows]  # reports before the inputs
    assert validation_table([{"rows": older}]).splitlines()[0] == "| layout | method | 30mbit | 1gbit |"


def test_backward_hides_bucketed_communication_as_a_pipeline_of_buckets():
    # B buckets, backward T_b, collectives C one after another: the last ends
    # max(C - T_b(1 - 1/B), C/B) after backward. Hand-computed for both regimes.
    from signmuon.benchmarks.cost.model import Cluster, Workload, predict

    n = 10 * (25 * 2**20) // 4  # ten buckets of 25 MB of fp32 gradient (bucket_cap_mb=25 given to DDP)
    cluster = Cluster(4, 1, 1e9)
    for compute in (0.3, 3.0):  # backward 0.2 s (the link is slower) and 2 s (backward hides all but a bucket)
        overlapped = Workload(n, compute, first_bucket_bytes=25 * 2**20)
        upper = dataclasses.replace(overlapped, overlap=False)
        assert overlapped.buckets == 10
        for method in ("allreduce", "signsgd_mv", "signsgd_mv_node", "powersgd_r4"):
            full, got = predict(method, cluster, upper), predict(method, cluster, overlapped)
            C, T_b = full["comm_s"], 2 / 3 * compute
            assert got["comm_s"] == full["comm_s"] and full["exposed_comm_s"] == full["comm_s"]
            assert got["exposed_comm_s"] == pytest.approx(max(C - T_b * 0.9, C / 10))
            assert got["step_s"] == pytest.approx(compute + got["exposed_comm_s"] + got["extra_s"])
            assert full["step_s"] == pytest.approx(compute + C + full["extra_s"])
    ring = predict("allreduce", cluster, Workload(n, 0.3, first_bucket_bytes=25 * 2**20))
    assert ring["exposed_comm_s"] == pytest.approx(ring["comm_s"] - 0.2 * 0.9)  # 3.1 s of ring: longer than backward
    one_bucket = Workload(1000, 1.0)
    assert (
        one_bucket.buckets == 1
        and predict("allreduce", cluster, one_bucket)["exposed_comm_s"]
        == predict("allreduce", cluster, one_bucket)["comm_s"]
    )  # nothing to overlap with


def test_the_compute_of_a_measured_step_inverts_the_model():
    # Backward hides part of the communication, more as compute grows: the compute a measured step
    # implies is the one at which the model predicts that step, not the step less the communication.
    from signmuon.benchmarks.cost.model import Cluster, Workload, compute_for, predict

    cluster = Cluster(2, 1, 10e9)
    for params, buckets in ((530_442, 2), (1000, 1), (50_000_000, 9)):
        work = Workload(params, 0.0, kernel_bytes_per_s=5e9)
        assert work.buckets == buckets
        for method in ("allreduce", "signsgd_mv"):
            alone = predict(method, cluster, work)["step_s"]
            for measured in (1.5 * alone, 10 * alone):  # backward shorter, and longer, than the communication
                compute = compute_for(method, cluster, work, measured)
                got = predict(method, cluster, dataclasses.replace(work, compute_s=compute))["step_s"]
                assert compute > 0 and got == pytest.approx(measured, rel=1e-9), (params, method, measured)
    two = Workload(530_442, 0.0)
    alone = predict("allreduce", cluster, two)["step_s"]  # no compute, nothing hidden
    assert compute_for("allreduce", cluster, two, 0.006) > 0.006 - alone  # two buckets: some of it hidden
    assert compute_for("allreduce", cluster, two, alone / 2) == 0.0  # faster than the model can be


def test_the_models_buckets_are_ddps_a_first_of_one_mib_then_25(tmp_path):
    # DDP's default bucket_cap_mb puts the last layers' gradients in a first bucket of 1 MiB: a
    # model of 2 MB has two buckets, one half hidden behind backward, not one bucket and nothing.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from signmuon.benchmarks.cost.model import Workload
    from signmuon.benchmarks.workloads.models import mlp

    assert [Workload(n, 1.0).buckets for n in (1000, 2**18, 2**18 + 1, 2**18 + 25 * 2**18 + 1)] == [1, 1, 2, 3]
    assert Workload(2**20, 1.0, bucket_bytes=4 * 2**20, first_bucket_bytes=4 * 2**20).buckets == 1
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        # 1, 2, 3 and 4 buckets. DDP never splits a parameter: where they are large against the caps
        # (1728 x 4: 11 MiB each) buckets are fewer (2, the model says 3), so these are fine-grained.
        for width, depth in ((64, 2), (512, 2), (512, 30), (512, 60)):
            model = DistributedDataParallel(mlp(width, depth))
            calls = []

            def count(state, bucket):
                calls.append(bucket.index())
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut

            model.register_comm_hook(None, count)
            for _ in range(2):  # DDP re-buckets after the first backward
                calls.clear()
                model(torch.randn(2, 512)).sum().backward()
            params = sum(p.numel() for p in model.parameters())
            assert len(calls) == Workload(params, 1.0).buckets, (width, depth, calls)
    finally:
        dist.destroy_process_group()


def test_what_backward_cannot_hide_adds_whole():
    from signmuon.benchmarks.cost.model import Cluster, Workload, predict

    n = 10 * (25 * 2**20) // 4
    cluster = Cluster(2, 4, 1e9)
    work = Workload(n, 3.0, ((4096, 4096),) * 8, first_bucket_bytes=25 * 2**20)  # ten equal buckets
    # The node-aware votes hide their node all-reduce and rail vote, not their blocking gather of voted slices.
    gather_s = 8 * (3 / 4 * n) / cluster.intra_bps + 3 * cluster.intra_latency_s
    for method in ("signsgd_mv_node", "signmuon_node"):
        vote = predict(method, cluster, work)
        C = vote["comm_s"] - gather_s
        assert vote["exposed_comm_s"] == pytest.approx(max(C - 2.0 * 0.9, C / 10) + gather_s)
    # A round runs after the step: only the node's every-step all-reduce hides behind backward.
    for method in ("diloco_node", "diloco_vote_node"):
        got = predict(method, cluster, Workload(n, 3.0, period=4))
        every_step = predict(method, cluster, Workload(n, 3.0, period=10**9))  # the round spread to nothing
        round_s = got["comm_s"] - every_step["comm_s"]
        assert round_s > 0 and got["exposed_comm_s"] == pytest.approx(every_step["exposed_comm_s"] + round_s)
    with pytest.raises(ValueError, match="backward_share"):
        Workload(n, 1.0, backward_share=1.5)
    with pytest.raises(ValueError, match="bucket_bytes"):
        Workload(n, 1.0, bucket_bytes=0)
    with pytest.raises(ValueError, match="first_bucket_bytes"):
        Workload(n, 1.0, first_bucket_bytes=-1)


def test_plan_cli_overlap_flags(capsys):
    from signmuon.benchmarks.commands import plan

    common = ["--model", "gpt-1.3b", "--nodes", "8", "--ranks-per-node", "8", "--link", "100gbit"]
    overlapped = {r["method"]: r for r in plan.main(common)}
    assert "exposed: the communication backward (0.67 of the compute) does not hide" in capsys.readouterr().out
    upper = {r["method"]: r for r in plan.main(common + ["--no-overlap"])}
    assert "exposed:" not in capsys.readouterr().out
    for method, row in overlapped.items():
        assert row["step_s"] <= upper[method]["step_s"]
    assert overlapped["allreduce"]["step_s"] < upper["allreduce"]["step_s"]
    # The ring hides behind backward, so the vote's speed-up shrinks (it cannot hide the kernels).
    assert overlapped["signsgd_mv_node"]["speedup"] < upper["signsgd_mv_node"]["speedup"]
    fewer = {r["method"]: r for r in plan.main(common + ["--bucket-mb", "1000", "--backward-share", "0.5"])}
    assert fewer["allreduce"]["exposed_comm_s"] > overlapped["allreduce"]["exposed_comm_s"]
    capsys.readouterr()
    for bad in (["--backward-share", "1.5"], ["--bucket-mb", "0"], ["--bucket-mb", "nan"]):
        with pytest.raises(SystemExit):
            plan.main(common + bad)
    for bad in (["--validate", "--no-overlap"], ["--projection", "--bucket-mb", "10"]):
        with pytest.raises(SystemExit):
            plan.main(bad)


def test_fsdp_in_the_plan_hsdp_against_the_vote_with_and_without_overlap():
    from signmuon.benchmarks.commands import plan
    from signmuon.benchmarks.cost.model import Cluster, Workload, crossover, predict
    from signmuon.benchmarks.cost.projection import crossovers

    params, matrices = plan.model_shapes("gpt-7b")
    work = Workload(params, 0.8, matrices, 1e12, 2e14)
    cluster = Cluster(8, 8, 25e9)
    hsdp, two_level = predict("hsdp_allreduce", cluster, work), predict("allreduce_node", cluster, work)
    assert hsdp["between_bytes_per_node"] == pytest.approx(two_level["between_bytes_per_node"])  # fp32 across
    vote, in_step = predict("fsdp_signum_mv", cluster, work), predict("fsdp_signum_mv_in_step", cluster, work)
    assert vote["between_bytes_per_node"] == pytest.approx(hsdp["between_bytes_per_node"] / 32)  # one bit of 32
    assert vote["comm_s"] == pytest.approx(in_step["comm_s"])  # the same traffic...
    assert vote["exposed_comm_s"] < in_step["exposed_comm_s"]  # ...of which backward hides a part
    assert predict("fsdp_signmuon", cluster, work)["extra_s"] > vote["extra_s"]  # Newton–Schulz at the owners
    rate = crossover("fsdp_signmuon", cluster, work, "hsdp_allreduce")
    for bps, faster in ((rate * 0.9, True), (rate * 1.1, False)):
        c = Cluster(8, 8, bps)
        gap = predict("fsdp_signmuon", c, work)["step_s"] - predict("hsdp_allreduce", c, work)["step_s"]
        assert (gap < 0) == faster
    table = {(r["model"], r["method"]): r for r in crossovers()}
    assert table["gpt-7b", "fsdp_signmuon"]["baseline"] == "hsdp_allreduce"
    assert table["gpt-7b", "signmuon_node"]["baseline"] == "allreduce_node"
    rows = {r["method"]: r for r in plan.main(["--model", "gpt-7b", "--nodes", "8", "--link", "25gbit"])}
    assert rows["fsdp_signmuon"]["baseline"] == "hsdp_allreduce" and rows["signmuon_node"]["baseline"] == "allreduce"
    assert rows["fsdp_signum_mv"]["speedup"] == pytest.approx(
        rows["hsdp_allreduce"]["step_s"] / rows["fsdp_signum_mv"]["step_s"]
    )


def test_plan_choice_predicts_every_method_a_user_could_pick(tmp_path):
    import json

    from signmuon.benchmarks.commands import plan
    from signmuon.benchmarks.cost.projection import CHOICE, SHARDED_MODELS

    rows = plan.main(["--choice", "--json", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text())["rows"] == rows
    models = {r["model"] for r in rows}
    for model in models:
        methods = CHOICE["sharded" if model in SHARDED_MODELS else "replicated"]
        for gbit in CHOICE["links_gbit"]:
            at = [r for r in rows if r["model"] == model and r["link_gbit"] == gbit]
            assert [r["method"] for r in at] == list(methods)
    # Each row is the model's prediction, not a copy of another row: the fp32 step falls with the link.
    fp32 = [r["step_s"] for r in rows if r["model"] == "gpt-1.3b" and r["method"] == "allreduce"]
    assert fp32 == sorted(fp32, reverse=True) and fp32[0] > 2 * fp32[-1]
    # The vote's step hardly depends on the link at 32 nodes; SignMuon's adds Newton–Schulz to it.
    at = {(r["method"], r["link_gbit"]): r["step_s"] for r in rows if r["model"] == "gpt-125m"}
    assert at[("signmuon_node", 10)] > at[("signsgd_mv_node", 10)]
    assert at[("signsgd_mv_node", 10)] < 1.1 * at[("signsgd_mv_node", 400)]
    assert all(r["nodes"] == CHOICE["nodes"] for r in rows)
    for bad in (["--choice", "--projection"], ["--choice", "--plot", "x.png"], ["--choice", "--bucket-mb", "10"]):
        with pytest.raises(SystemExit):
            plan.main(bad)


def test_plan_predicts_the_share_of_a_streaming_round_hidden_behind_tau_steps():
    """A fragment's round (1/F of a whole round, every H/F steps) hides min(1, τ·compute / its
    wire time); the step loses exactly that share of the round's per-step seconds."""
    from signmuon.benchmarks.cost.model import Cluster, Workload, predict

    cluster = Cluster(2, 2, 10e6)  # 10 Mbit/s between 2 nodes x 2
    base = Workload(params=3_000_000, compute_s=0.05, period=32)

    def at(**kw):
        return predict("diloco_vote_node", cluster, dataclasses.replace(base, **kw))

    no_round = at(period=10**9)["exposed_comm_s"]
    whole = at()
    assert whole["round_hidden_share"] == 0.0  # τ = 0: the round after the step
    round_s = whole["exposed_comm_s"] - no_round  # a round's seconds per step
    for fragments, delay in ((1, 1), (4, 1), (4, 2), (8, 3)):
        streamed = at(fragments=fragments, sync_delay=delay)
        share = min(1.0, delay * base.compute_s / (round_s * base.period / fragments))
        assert streamed["round_hidden_share"] == pytest.approx(share)
        assert whole["exposed_comm_s"] - streamed["exposed_comm_s"] == pytest.approx(share * round_s)
    assert 0.0 < at(fragments=1, sync_delay=1)["round_hidden_share"] < 1.0  # a partial share, checked above
    assert at(fragments=8, sync_delay=3)["round_hidden_share"] == 1.0
