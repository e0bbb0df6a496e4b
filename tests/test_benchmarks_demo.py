"""The README's main job, ``signmuon-bench demo``: its refusals, its verdict and the plan's
projection on synthetic runs, and a real run on a shaped link and on loopback."""

import pytest


def test_demo_refuses_what_it_cannot_run(capsys):
    from signmuon.benchmarks.__main__ import main

    for bad in (["--link"], ["--steps", "10"], ["--eval-every", "5"], ["--task", "cifar10"]):
        with pytest.raises(SystemExit):
            main(["demo", *bad])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --eval-every 5" in err and "at least 25" in err


def test_demo_help_is_its_own(capsys):
    from signmuon.benchmarks.__main__ import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: signmuon-bench demo") and "demo_curves.png" in out and "--task digits" in out


def _first_lines(argv, why):
    """The demo's first three lines for ``argv``, from its real parser's defaults."""
    from signmuon.benchmarks.commands import demo

    args, _ = demo.parser().parse_known_args(argv)
    return demo.intro_lines(args.task, args.steps, args.link, why, demo.model_parameters(args.task))


def test_the_demos_first_three_lines_name_the_model_the_methods_and_the_link():
    from signmuon.benchmarks.reports.demo import LABELS, METHODS
    from signmuon.benchmarks.workloads.tasks import CHARLM_SIZES, TinyGPT

    parameters = sum(p.numel() for p in TinyGPT(**CHARLM_SIZES["small"]).parameters())
    model, methods, link = _first_lines([], None)
    assert "character-level GPT" in model and f"{parameters:,} parameters" in model
    assert "standard library" in model and "300 steps" in model  # the data, and how much of it
    assert all(LABELS[m] in methods for m in METHODS)
    assert "100mbit between the 2 nodes" in link and "about 2 min" in link
    _, _, slower = _first_lines(["--link", "50mbit", "--steps", "600"], None)
    assert "50mbit" in slower and "about 4 min" in slower
    _, _, loopback = _first_lines(["--loopback"], "--loopback")
    assert "links cannot be shaped here (--loopback)" in loopback and "projection of the runs to 100mbit" in loopback
    cnn, digits, none = _first_lines(["--task", "digits"], None)
    assert "CNN" in cnn and "digits" in cnn and "signmuon" in digits and "loopback" in none


def test_the_demo_says_what_it_trains_before_it_trains(monkeypatch, capsys):
    from signmuon.benchmarks.commands import demo

    def no_training(command):
        raise RuntimeError(f"would train now ({command})")

    monkeypatch.setattr(demo, "load", no_training)
    with pytest.raises(RuntimeError, match="would train now"):
        demo.main(["--loopback"])
    assert capsys.readouterr().out.splitlines() == _first_lines(["--loopback"], "--loopback")


def _runs(final_losses, times, crossed):
    """Synthetic train results: each method's log reaches its final loss at its time."""
    runs = {}
    for (method, loss), seconds, sent in zip(final_losses.items(), times, crossed):
        log = [
            {"step": 25, "time_s": seconds / 2, "test_loss": 3.0, "bytes_between_nodes": sent / 2},
            {"step": 50, "time_s": seconds, "test_loss": loss, "bytes_between_nodes": sent},
        ]
        runs[method] = {"log": log, "bytes_between_nodes_per_rank": sent}
    return runs


def test_the_demos_verdict_says_who_reached_the_baselines_loss_first():
    from signmuon.benchmarks.reports.demo import summarize, verdict

    runs = _runs({"adamw": 2.0, "signmuon_node": 1.9, "diloco_vote_ef_8": 2.1}, (30.0, 15.0, 10.0), (2e8, 4e6, 1e6))
    rows = summarize(runs, {"adamw": 2.6e8, "signmuon_node": 7e6, "diloco_vote_ef_8": 2e6})
    assert [r["seconds_to_target"] for r in rows] == [30.0, 15.0, None]  # DiLoCo ends above the target
    assert rows[1]["bytes_between_nodes"] == 7e6  # the interfaces' count, not the statistics'
    line = verdict(rows, "100mbit")
    assert line.startswith("On a 100mbit link between 2 nodes, node-aware SignMuon reached DDP+AdamW's final loss")
    assert "2.0x sooner (15 s against 30 s)" in line and "1/37 of its bytes" in line
    slow = summarize(_runs({"adamw": 2.0, "signmuon_node": 1.9}, (10.0, 20.0), (2e8, 4e6)), None)
    assert "2.0x later" in verdict(slow, "loopback") and slow[1]["bytes_between_nodes"] == 4e6
    none = summarize(_runs({"adamw": 2.0, "signmuon_node": 2.2}, (10.0, 5.0), (2e8, 4e6)), None)
    assert "no one-bit method reached DDP+AdamW's final loss (2.000)" in verdict(none, "loopback")


def test_the_demos_projection_is_the_plans_model_fed_with_the_loopback_runs():
    from signmuon.benchmarks.cost.model import Cluster, Workload, predict
    from signmuon.benchmarks.reports.demo import plan_projection, projection_text, summarize

    runs = _runs({"adamw": 2.0, "signmuon_node": 1.9, "diloco_vote_ef_8": 2.1}, (3.0, 4.0, 2.0), (2e8, 4e6, 1e6))
    for run, ms in zip(runs.values(), (40.0, 45.0, 30.0)):
        run.update(world_size=4, step_ms=ms)
    rows = summarize(runs, None)
    inputs = Workload(2_000_000, 0.0, ((512, 512),) * 4, kernel_bytes_per_s=5e9, ns_flops_per_s=2e10)
    at_loopback = plan_projection(runs, rows, inputs, 1e-4, "10gbit")
    # The compute comes from the baseline's loopback step: projected to loopback's own rate, its step is that step.
    assert at_loopback[0]["step_s"] == pytest.approx(0.040)
    slow = plan_projection(runs, rows, inputs, 1e-4, "100mbit")
    # AdamW's fp32 bytes between the nodes on 100 Mbit/s add to its step, less what backward hides.
    wire = 8 * predict("allreduce", Cluster(2, 2, 100e6, 1, 1e-4, 10e9, 1e-4), inputs)["between_bytes_per_node"] / 100e6
    assert wire > 0.1 and slow[0]["step_s"] >= 0.040 + wire - 2 / 3 * 0.040
    assert slow[0]["seconds_to_target"] == pytest.approx(50 * slow[0]["step_s"])  # steps to target x step
    assert (
        slow[1]["seconds_to_target"] == pytest.approx(50 * slow[1]["step_s"]) and slow[2]["seconds_to_target"] is None
    )
    assert slow[1]["step_s"] < slow[0]["step_s"]  # 1 bit between nodes against fp32 on 100 Mbit/s
    text = projection_text(slow, "100mbit")
    assert "a projection, not a measurement" in text and "node-aware SignMuon would reach the target" in text


def test_the_demo_on_a_shaped_link_and_on_loopback(tmp_path, capsys):
    from signmuon.benchmarks.commands.demo import main
    from signmuon.benchmarks.reports.pages import regenerate

    rows = main(["--steps", "50", "--plot", str(tmp_path / "shaped.png"), "--json", str(tmp_path / "demo.json")])
    out = capsys.readouterr().out
    # What the README shows is made from the JSON: the same lines as printed.
    shown = regenerate(f"<!-- report demo {tmp_path / 'demo.json'} -->\n<!-- /report -->", "/")
    assert shown.split("```\n")[1].rstrip("`\n") in out
    assert "[3/3] DiLoCo, one-bit rounds every 8 steps, 50 steps, 100mbit between the nodes" in out
    assert out.splitlines()[:3] == _first_lines(["--steps", "50"], None)
    assert "the interfaces' counters" in out and ("reached DDP+AdamW's final loss" in out)
    by = {r["method"]: r for r in rows}
    assert by["adamw"]["seconds_to_target"] is not None  # the baseline reaches its own final loss
    assert by["signmuon_node"]["bytes_between_nodes"] < by["adamw"]["bytes_between_nodes"] / 10
    assert (tmp_path / "shaped.png").read_bytes()[:4] == b"\x89PNG"
    rows = main(["--loopback", "--steps", "25", "--plot", str(tmp_path / "loopback.png")])
    out = capsys.readouterr().out
    assert "links cannot be shaped here (--loopback)" in out and "a projection, not a measurement" in out
    assert "the plan's projection to a 100mbit link between the nodes" in out
    assert "On loopback (no slow link)" in out and (tmp_path / "loopback.png").exists()
