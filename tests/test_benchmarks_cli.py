"""The benchmarks' command line (dispatch, one-line errors, help, the method registry) and the sweeps'
aggregation over seeds and settings."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch


def test_cli_dispatches_commands_and_rejects_unknown_ones(capsys):
    import pytest

    from signmuon.benchmarks.__main__ import main
    from signmuon.benchmarks.commands import COMMANDS

    main(["ns-time", "--sizes", "32", "--repeats", "1"])
    assert "size" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown command"):
        main(["trian"])
    assert set(COMMANDS) >= {"train", "bandwidth", "netem", "kernels", "ddp-step", "deepspeed-step"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--methods", "adamw", "lion"], "unknown method(s) ['lion']"),
        (["train", "--world-size", "0"], "--world-size: 0 must be at least 1"),
        (["train", "--task", "cifar10"], "--task cifar10 needs --data-dir"),
        (["train", "--device", "cuda"] if not torch.cuda.is_available() else ["train", "--device", "tpu"], "--device"),
        (["train", "--world-size", "4", "--ranks-per-node", "3"], "must be >= 1 and divide --world-size 4"),
        (["bandwidth", "--sizes", "1Q"], "'1Q' is not a size"),
        (["kernels", "--sizes", "0"], "must be at least one entry"),
        (["ddp-step", "--world-size", "-2"], "-2 must be at least 1"),
        (["sweep", "--methods", "adamw", "lion"], "unknown method(s) ['lion']"),
        (["bandwidth", "--methods", "vote_fast"], "'vote_fast' is now called 'signsgd_mv'"),
        (["ddp-step", "--methods", "sign_vote"], "'sign_vote' is now called 'signsgd_mv'"),
        (["ddp-step", "--methods", "adamw"], "unknown method(s) ['adamw'] for ddp-step"),
        (["netem", "--rates", "1gbit", "fast", "--", "train"], "give it in tc's units"),
        (["netem", "--plot", "x.png", "--", "bandwidth"], "--plot draws training curves"),
        (["train", "--size", "medium"], "--size medium is charlm's option"),
        (["train", "--seeds", "1", "1"], "each seed once"),
        (["sweep", "--lr-scales", "1", "-2"], "each must be a positive number"),
        (["ns-precision", "--ranks", "-1"], "each must be >= 0"),
        (["dppf-sweep", "--pulls", "1.5"], "each must lie in [0, 1]"),
        (["dppf-sweep", "--pushes", "-0.1"], "each must be finite and >= 0"),
        (["dppf-sweep", "--periods", "16"], "invalid choice: 16"),
        (["train", "--outer-scale-bits", "4"], "--outer-scale-bits: invalid choice: 4"),
        (["lost-node", "--down", "-1"], "--down: -1 must be a finite number >= 0"),
        (["lost-node", "--down", "soon"], "'soon' is not a number"),
    ],
)
def test_cli_errors_are_one_line_with_status_2_before_anything_runs(argv, message, capsys):
    from signmuon.benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "error:" in err[-1] and not any("Traceback" in line for line in err)


def test_sweep_aggregates_seeds_and_picks_the_lowest_mean():
    from signmuon.benchmarks.commands.sweep import aggregate

    grid = [
        {"method": "a", "lr_scale": 1.0, "seed": 0, "test_loss": 2.0},
        {"method": "a", "lr_scale": 1.0, "seed": 1, "test_loss": 4.0},
        {"method": "a", "lr_scale": 2.0, "seed": 0, "test_loss": 2.9},
        {"method": "a", "lr_scale": 2.0, "seed": 1, "test_loss": 2.9},
        {"method": "b", "lr_scale": 0.5, "seed": 0, "test_loss": float("nan")},
        {"method": "b", "lr_scale": 1.0, "seed": 0, "test_loss": 1.0},
    ]
    summary = aggregate(grid)
    assert summary["a"]["scales"][1.0]["mean"] == 3.0
    assert summary["a"]["scales"][1.0]["std"] == pytest.approx(2**0.5)  # sample std of (2, 4)
    assert summary["a"]["tuned_scale"] == 2.0 and summary["a"]["tuned"]["mean"] == pytest.approx(2.9)
    assert summary["b"]["tuned_scale"] == 1.0, "a diverged (NaN) factor is never the tuned one"


def test_sweep_runs_each_scale_and_seed(tmp_path):
    from signmuon.benchmarks.commands import sweep

    out = tmp_path / "sweep.json"
    # One method keeps it short: every method's builder takes the factor from the same config.
    report = sweep.main(
        [
            "--methods",
            "adamw",
            "--lr-scales",
            "0.5",
            "2",
            "--seeds",
            "0",
            "1",
            "--world-size",
            "2",
            "--steps",
            "3",
            "--json",
            str(out),
        ]
    )
    assert len(report["grid"]) == 2 * 2
    assert json.loads(out.read_text())["command"].startswith("signmuon-bench sweep --methods adamw")
    losses = {(r["method"], r["lr_scale"], r["seed"]): r["test_loss"] for r in report["grid"]}
    assert losses[("adamw", 0.5, 0)] != losses[("adamw", 2.0, 0)], "the factor reaches the optimizer"
    assert losses[("adamw", 0.5, 0)] != losses[("adamw", 0.5, 1)], "the seed reaches the run"


@pytest.mark.parametrize(
    "command",
    [
        "train",
        "bandwidth",
        "kernels",
        "ddp-step",
        "deepspeed-step",
        "netem",
        "ns-time",
        "direction-time",
        "ns-precision",
        "sweep",
        "dppf-sweep",
        "zero-structure",
        "lost-node",
        "round-time",
    ],
)
def test_help_names_the_command_shows_defaults_and_no_rst(command, capsys):
    from signmuon.benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: signmuon-bench {command} ")
    assert "``" not in out and ":class:" not in out
    assert "(default: " in out
    from signmuon.benchmarks.methods.registry import names_for

    methods = names_for("train" if command == "sweep" else command)
    assert all(f"  {name} " in out for name in methods)  # the registry's list, for commands with --methods


def test_every_method_is_defined_once_with_a_builder_per_command_that_runs_it():
    import inspect

    from signmuon.benchmarks.methods.registry import METHODS, RENAMED, builder, names_for

    commands = {"bandwidth", "ddp-step", "deepspeed-step", "train", "train:fsdp", "plan"}
    assert all(method.builders and set(method.builders) <= commands for method in METHODS.values())
    assert not set(RENAMED) & set(METHODS) and set(RENAMED.values()) <= set(METHODS)
    assert set(names_for("train:fsdp")) <= set(names_for("train")), "a sharded form of a method train runs"
    tuned = [m.tuned_as for m in METHODS.values() if m.tuned_as]
    assert tuned and set(tuned) <= set(names_for("train"))
    with pytest.raises(ValueError, match="ddp-step has no method 'signum_mv_optim'; it runs allreduce"):
        builder("signum_mv_optim", "ddp-step")
    # No command dispatches on method names any more: each asks the registry for its builder.
    for module in ("bandwidth", "ddp_step", "deepspeed_step", "train", "plan"):
        source = inspect.getsource(__import__(f"signmuon.benchmarks.commands.{module}", fromlist=["x"]))
        assert 'method == "' not in source and "method.startswith(" not in source, module


def test_dppf_sweep_compares_each_setting_with_local_sgd_of_its_period():
    from signmuon.benchmarks.commands.dppf_sweep import aggregate

    def row(period, pull, push, seed, loss, acc):
        return {
            "period": period,
            "pull": pull,
            "push": push,
            "seed": seed,
            "test_loss": loss,
            "test_acc": acc,
            "worker_acc": acc,
            "mean_distance": push,
        }

    rows = [
        row(8, 1.0, 0.0, 0, 1.00, 0.90),
        row(8, 1.0, 0.0, 1, 1.10, 0.92),  # local SGD: loss 1.05 ± 0.07
        row(8, 0.5, 0.2, 0, 0.80, 0.95),
        row(8, 0.5, 0.2, 1, 0.82, 0.96),  # better beyond the spread
        row(8, 0.5, 0.0, 0, 1.00, 0.91),
        row(8, 0.5, 0.0, 1, 1.20, 0.93),  # overlaps
        row(32, 1.0, 0.0, 0, 0.50, 0.99),
        row(32, 0.5, 0.2, 0, 0.90, float("nan")),  # worse; NaN acc is worse
    ]
    by_key = {(e["period"], e["pull"], e["push"]): e for e in aggregate(rows)}
    assert by_key[(8, 1.0, 0.0)]["test_loss"] == (pytest.approx(1.05), pytest.approx(0.1 / 2**0.5))
    assert by_key[(8, 1.0, 0.0)]["loss_beyond_spread"] is None, "local SGD is the reference"
    assert (by_key[(8, 0.5, 0.2)]["loss_beyond_spread"], by_key[(8, 0.5, 0.2)]["acc_beyond_spread"]) == (1, 1)
    assert (by_key[(8, 0.5, 0.0)]["loss_beyond_spread"], by_key[(8, 0.5, 0.0)]["acc_beyond_spread"]) == (0, 0)
    assert (by_key[(32, 0.5, 0.2)]["loss_beyond_spread"], by_key[(32, 0.5, 0.2)]["acc_beyond_spread"]) == (-1, -1)


def test_dppf_sweep_trains_local_sgd_and_each_pull_push(tmp_path):
    from signmuon.benchmarks.commands import dppf_sweep

    report = dppf_sweep.main(
        [
            "--periods",
            "8",
            "--pulls",
            "1",
            "--pushes",
            "0",
            "0.5",
            "--seeds",
            "0",
            "--world-size",
            "2",
            "--steps",
            "9",
            "--json",
            str(tmp_path / "d.json"),
        ]
    )
    runs = {(r["pull"], r["push"]): r for r in report["runs"]}
    assert set(runs) == {(1.0, 0.0), (1.0, 0.5)} and all(r["rounds"] >= 1 for r in runs.values())
    assert runs[(1.0, 0.0)]["test_loss"] != runs[(1.0, 0.5)]["test_loss"], "the push reaches the averager"
    assert json.loads((tmp_path / "d.json").read_text())["summary"][0]["period"] == 8


END_AFTER_GROUP = """
import atexit
import torch.distributed as dist
from signmuon.benchmarks.runtime.launch import end_torchrun_process, torchrun_group
atexit.register(print, " teardown")
if {make_group}:
    with torchrun_group("gloo"):
        print("ranks", dist.get_world_size(), end="")  # no newline: stays in the pipe's buffer
end_torchrun_process()
print(" returned", end="")
"""


def test_a_torchrun_benchmark_on_gloo_ends_without_the_interpreters_teardown():
    """After its gloo group is gone, a benchmark under torchrun leaves with os._exit(0): the
    teardown that can abort on torch 2.13 does not run, and what it printed is flushed first.
    A process that made no group returns from it and ends normally."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    outputs = {}
    for make_group in (True, False):
        done = subprocess.run(
            [sys.executable, "-c", END_AFTER_GROUP.format(make_group=make_group)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done
        outputs[make_group] = done.stdout
    assert outputs == {True: "ranks 1", False: " returned teardown\n"}


def test_ddp_step_counts_the_hook_momentum_and_the_node_aware_rows_hold_a_slice_of_it():
    from signmuon.benchmarks.commands import ddp_step

    rows = ddp_step.main(
        [
            "--world-size",
            "4",
            "--ranks-per-node",
            "2",
            "--width",
            "64",
            "--depth",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--methods",
            "signum_mv",
            "signum_mv_node",
            "signsgd_mv_node",
        ]
    )
    flat, node, no_momentum = (
        next(r for r in rows if r["method"] == m) for m in ("signum_mv", "signum_mv_node", "signsgd_mv_node")
    )
    assert flat["state_bytes"] == 4 * flat["params"]  # one float32 momentum, the whole model
    assert 2 * node["state_bytes"] <= flat["state_bytes"] + 2 * 4 * 8  # L = 2: about half (slices round up)
    assert node["state_bytes"] >= flat["state_bytes"] // 2
    assert no_momentum["state_bytes"] == 0
    for row in rows:  # the vote's own host seconds per step (the cost model's kernel time), inside the step
        assert 0 < row["vote_kernel_s"] < row["step_s"], row


def test_ddp_step_rounds_take_each_methods_median_and_keep_a_failure():
    from signmuon.benchmarks.commands.ddp_step import merge_rounds

    passes = [
        [{"method": "a", "step_s": t, "bytes_per_rank": 7}, {"method": "b", "step_s": 2 * t}] for t in (3.0, 1.0, 2.0)
    ]
    passes[1][1] = {"method": "b", "error": "boom"}
    a, b = merge_rounds(passes)
    assert a == {"method": "a", "step_s": 2.0, "bytes_per_rank": 7, "step_s_rounds": [3.0, 1.0, 2.0]}
    assert b == {"method": "b", "error": "boom"}
    assert merge_rounds(passes[:1]) == passes[0]
    with pytest.raises(ValueError, match="different orders"):
        merge_rounds([passes[0], passes[0][::-1]])


def test_direction_time_splits_signmuons_parameters_by_path():
    from torch import nn

    from signmuon.benchmarks.commands.direction_time import direction_time

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))
    rows = direction_time(model, torch.randn(4, 6), torch.randint(0, 3, (4,)), repeats=2)
    assert [r["path"] for r in rows] == ["forward+backward", "matrices", "the rest"]
    assert [(r["params"], r["entries"]) for r in rows] == [(5, 30 + 5 + 5 + 5 + 15), (2, 30 + 15), (3, 5 + 5 + 5)]
    assert all(r["seconds"] > 0 for r in rows)


def test_round_time_compares_block_scales_with_tensor_scales():
    from signmuon.benchmarks.commands.round_time import main

    rows = main(["--entries", "20000", "--tensors", "3", "--block", "64", "--repeats", "1"])
    assert [r["rule"] for r in rows] == ["sign_vote", "sign_vote_ef"]
    for row in rows:
        assert row["per_tensor_s"] > 0 and row["block_s"] > 0 and row["ratio"] == row["block_s"] / row["per_tensor_s"]


def test_every_command_module_exports_its_name_summary_and_main():
    from signmuon.benchmarks.commands import COMMANDS, load

    modules = {
        p.stem for p in (pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "commands").glob("*.py")
    } - {"__init__"}
    assert set(COMMANDS.values()) == modules, "every command module is listed, and only those"
    for name in COMMANDS:
        module = load(name)
        assert module.NAME == name and module.SUMMARY and callable(module.main)


def test_every_report_is_written_by_one_writer_and_old_row_lists_still_read(tmp_path):
    import inspect

    from signmuon.benchmarks.commands import COMMANDS, load
    from signmuon.benchmarks.reports.writer import read_report, write_report

    written = write_report("plan", ["--nodes", "2"], {"rows": [{"method": "allreduce"}]}, str(tmp_path / "p.json"))
    assert read_report(str(tmp_path / "p.json")) == written
    assert written["command"] == "signmuon-bench plan --nodes 2"
    (tmp_path / "old.json").write_text(json.dumps([{"method": "allreduce"}]))
    assert read_report(str(tmp_path / "old.json")) == {"rows": [{"method": "allreduce"}]}
    for name in COMMANDS:  # no command writes its JSON report itself
        assert "json.dump(" not in inspect.getsource(load(name)) or name == "lost-node", name


def test_deepspeed_step_offers_the_zero_rows_and_their_table(capsys):
    from signmuon.benchmarks.commands import deepspeed_step
    from signmuon.benchmarks.methods.registry import names_for
    from signmuon.benchmarks.reports.tables import zero_step_table

    zero_rows = {"zero2_adamw", "zero1_signum_mv", "zero2_signum_mv", "zero2_signmuon"}
    assert zero_rows <= set(names_for("deepspeed-step"))
    assert not zero_rows & set(deepspeed_step.DEFAULT_METHODS), "the ZeRO rows need nodes: not run by default"
    with pytest.raises(SystemExit):
        deepspeed_step.main(["--methods", "zero3_signum_mv"])
    assert "zero2_signmuon" in capsys.readouterr().err
    row = {"params": 10, "state_bytes_max_rank": 20.0, "interface_payload_bytes_per_node": [1000.0, 3000.0]}
    rows = [{"method": "zero2_adamw", "step_s": 0.4, **row}, {"method": "zero2_signum_mv", "step_s": 0.1, **row}]
    table = zero_step_table([{"reports": [{"rate": "100mbit", "rows": rows}]}]).splitlines()
    assert table[-1].endswith("| 100mbit | 100 | 0.250× | 2.0 | 0.500 |"), table[-1]


def test_train_reports_each_methods_largest_burst_and_hidden_share(capsys):
    from signmuon.benchmarks.methods.registry import METHODS
    from signmuon.benchmarks.reports.train_report import print_time_split

    streaming, whole = METHODS["diloco_vote_ef_8_stream4"], METHODS["diloco_vote_ef_8"]
    assert streaming.tuned_as == whole.tuned_as, "the streaming row is the one-bit rounds row with fragments"
    split = {"step": 2.0, "forward_backward_rest": 2.0, "newton_schulz": None, "pack_vote_unpack": None}
    results = [
        {"method": "whole", "time_split_ms": {**split, "network_wait": None}, "round_hidden_share": 0.0}
        | {"largest_burst_between_nodes_per_rank": 12_000},
        {"method": "streamed", "time_split_ms": {**split, "network_wait": None}, "round_hidden_share": 0.9}
        | {"largest_burst_between_nodes_per_rank": 3_000},
        {"method": "streamed", "time_split_ms": {**split, "network_wait": None}, "round_hidden_share": 0.7}
        | {"largest_burst_between_nodes_per_rank": 3_500},
        {"method": "ddp", "time_split_ms": {**split, "network_wait": None}, "round_hidden_share": None}
        | {"largest_burst_between_nodes_per_rank": 0},
    ]
    print_time_split(results)
    out = capsys.readouterr().out
    assert "whole largest burst 12.0 KB, hidden 0%" in out
    assert "streamed largest burst 3.5 KB, hidden 80%" in out  # the largest over seeds, the mean share
    assert "ddp largest burst 0.0 KB\n" in out
