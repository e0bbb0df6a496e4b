"""The benchmarks across emulated links (network namespaces shaped by ``tc``; root and iproute2,
which .ci/run installs): the links hold their rate, the harness cleans up, bytes between nodes are
the interfaces' counts, and the cost model's validation runs its points."""

import os

import pytest

TWO_NODES = ["--world-size", "4", "--ranks-per-node", "2", "--rate", "1gbit", "--"]
"""netem's arguments for 2 emulated nodes of 2 ranks, 1 Gbit/s between them."""


def _counters_hold_the_count(report: dict) -> None:
    """Each node's interface sent about the bytes the methods counted between nodes."""
    for sent in report["tx_bytes_per_node"]:
        assert 0.95 * report["algorithmic_bytes_per_node"] <= sent <= 1.25 * report["algorithmic_bytes_per_node"]


def test_emulated_network_harness_two_ranks_and_cleanup():
    # Two ranks in their own network namespaces over a rate-limited bridge (needs root and
    # iproute2, which .ci/run installs): the vote must send far fewer real bytes.
    import subprocess

    from signmuon.benchmarks.commands import netem

    common = [
        "--world-size",
        "2",
        "--rate",
        "1gbit",
        "--",
        "bandwidth",
        "--sizes",
        "256K",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--methods",
    ]
    fp32 = netem.main(common + ["allreduce"])
    vote = netem.main(common + ["signsgd_mv_exact"])
    for report in (fp32, vote):
        assert all(sent >= 0.9 * report["algorithmic_bytes_per_rank"] for sent in report["tx_bytes_per_rank"])
    assert max(vote["tx_bytes_per_rank"]) < max(fp32["tx_bytes_per_rank"]) / 5
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    prefix = f"sm{os.getpid() % 100000}"  # EmulatedNetwork's names in this process
    assert not any(line.startswith(prefix) for line in leftovers.splitlines()), "namespaces left behind"


def test_a_shaped_link_holds_a_small_message_to_its_rate():
    # After an idle pause (a step's compute) 96 KB must still cross 10 Mbit/s at the rate (77 ms),
    # not ride a token bucket that refilled meanwhile at loopback speed (which favours the vote).
    import subprocess
    import sys
    import time

    from signmuon.benchmarks.netem.network import EmulatedNetwork

    size, port = 96_000, 29611
    server = (
        "import socket; s = socket.create_server(('0.0.0.0', %d)); c, _ = s.accept(); n = 0\n"
        "while n < %d: n += len(c.recv(65536))\n"
        "c.sendall(b'k')" % (port, size)
    )
    client = (
        "import socket, time; c = socket.create_connection(('%s', %d)); c.sendall(b'x'); time.sleep(0.3)\n"
        "start = time.perf_counter(); c.sendall(bytes(%d)); c.recv(1); print(time.perf_counter() - start)"
    )
    with EmulatedNetwork(2, "10mbit", "") as net:
        run_in = ["ip", "netns", "exec"]
        listening = subprocess.Popen([*run_in, net.namespaces[1], sys.executable, "-c", server])
        try:
            for _ in range(50):  # until the server listens
                done = subprocess.run(
                    [*run_in, net.namespaces[0], sys.executable, "-c", client % (net.address(1), port, size - 1)],
                    capture_output=True,
                    text=True,
                )
                if done.returncode == 0:
                    break
                time.sleep(0.1)
            assert done.returncode == 0, done.stderr
        finally:
            listening.kill()
    assert float(done.stdout) >= 0.8 * 8 * size / 10e6


def test_rate_sweep_trains_under_each_rate_and_reports_time_to_target(tmp_path, capsys):
    # Two rates, two methods, a few steps, in namespaces (root and iproute2, as above): one
    # training run per rate, a time-to-target row per method and a panel per rate.
    from signmuon.benchmarks.commands import netem

    out = netem.main(
        [
            "--world-size",
            "2",
            "--rates",
            "100mbit",
            "1gbit",
            "--plot",
            str(tmp_path / "rates.png"),
            "--",
            "train",
            "--steps",
            "6",
            "--eval-every",
            "3",
            "--methods",
            "adamw",
            "signsgd_mv",
        ]
    )
    reports = out["reports"]
    assert [r["rate"] for r in reports] == ["100mbit", "1gbit"]
    for report in reports:
        runs = report["train"]["runs"]
        assert [r["method"] for r in runs] == ["adamw", "signsgd_mv"] and all(r["world_size"] == 2 for r in runs)
        assert report["train"]["summary"]["adamw"]["reached"] == 1, "adamw reaches its own final loss"
        assert max(report["tx_bytes_per_rank"]) > 0
    assert (tmp_path / "rates.png").read_bytes()[:4] == b"\x89PNG"
    lines = capsys.readouterr().out.splitlines()
    adamw_row = next(line for line in lines if line.strip().startswith("adamw ") and "(1/1)" in line)
    assert adamw_row.count("(1/1) 1.00x") == 2, "adamw's time to target is the 1.00x reference at each rate"


def test_emulated_nodes_count_the_bytes_between_them():
    # Two namespaces of two ranks each: the node-aware vote's ranks talk over loopback inside a
    # node, so the shaped links carry only the between-node votes, about what the formula says.
    from signmuon.benchmarks.commands import netem

    report = netem.main(
        TWO_NODES
        + [
            "bandwidth",
            "--sizes",
            "1M",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--methods",
            "signsgd_mv_node",
        ]
    )
    assert len(report["tx_bytes_per_node"]) == 2
    _counters_hold_the_count(report)


def test_fsdp_rows_count_the_bytes_between_nodes_and_hold_a_shard_of_the_state():
    # ddp-step's FSDP rows on 2 emulated nodes of 2: the vote's bytes between nodes as the veth
    # counters see them, and optimizer state per rank half of the replicated optimizer's.
    from signmuon.benchmarks.commands import netem

    argv = TWO_NODES + [
        "ddp-step",
        "--width",
        "512",
        "--depth",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--methods",
        "fsdp_signmuon",
    ]
    report = netem.main(argv)  # (a DDP row would add DDP's initial broadcast of the parameters)
    (fsdp,) = report["rows"]
    assert fsdp["state_bytes"] * 2 == 4 * fsdp["params"]  # L = 2: half of one float32 momentum
    assert fsdp["nodes"] == "2x2" and fsdp["between_nodes_bytes_per_rank"] > 0
    _counters_hold_the_count(report)  # the votes, plus rendezvous, settings check and timing collectives


def test_a_small_validation_predicts_each_point_with_the_cost_model(capsys):
    # The cost model's check against emulated links, small: 2 ranks (one per core), base
    # 10 Gbit/s, one slow rate. Each prediction is cost.predict() fed with the model's size, the
    # compute, zeros' bits and vote kernel time from the unshaped run, NS throughput and the link.
    import dataclasses

    from signmuon.benchmarks.commands.plan import validate
    from signmuon.benchmarks.cost.model import Cluster, Workload, predict

    rows = validate(
        rates=("30mbit",), base="10gbit", width=256, steps=3, layouts=((2, 1, ("allreduce", "signsgd_mv")),)
    )
    ring, vote = rows
    assert [(r["layout"], r["world_size"], r["method"], r["rate"]) for r in rows] == [
        ("2x1", 2, "allreduce", "30mbit"),
        ("2x1", 2, "signsgd_mv", "30mbit"),
    ]
    params = 512 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    shapes = ((256, 512), (256, 256), (10, 256))
    for r in rows:
        workload = Workload(
            params, r["compute_s"], shapes, r["kernel_bytes_per_s"], r["ns_flops_per_s"], zero_bits=r["zero_bits"]
        )
        cluster = Cluster(2, 1, 30e6, nics_per_node=1, latency_s=r["latency_s"], intra_bps=10e9)
        model = predict(r["method"], dataclasses.replace(cluster, intra_latency_s=r["latency_s"]), workload)
        assert r["predicted_s"] == pytest.approx(model["step_s"])
        assert r["ratio"] == pytest.approx(r["predicted_s"] / r["measured_s"])
        assert r["compute_s"] > 0 and r["kernel_bytes_per_s"] > 0 and r["ns_flops_per_s"] > 0
        assert 0 < r["latency_s"] < 0.01
    assert ring["bytes_crossing"] == ring["measured_crossing"] == 4 * params  # a ring of 2 sends its gradient once
    # The model's dense bit per entry; ReLU's exact zeros cost up to one more: the zeros' bits the
    # unshaped run showed (as ddp-step prints them) are the model's, and its vote's kernel time.
    assert 0 < vote["zero_bits"] <= 1
    assert vote["bytes_crossing"] == pytest.approx(vote["measured_crossing"], rel=0.01)  # to the bits' two decimals
    assert ring["zero_bits"] == 0
    assert vote["kernel_s"] == pytest.approx(4 * params / vote["kernel_bytes_per_s"])
    assert vote["kernel_s"] != ring["kernel_s"]  # the run's own, not the microbenchmark's
    assert vote["bytes_crossing"] < ring["bytes_crossing"] / 10
    assert ring["measured_s"] > 0.6 * 8 * ring["bytes_crossing"] / 30e6  # the link did shape it
    assert vote["measured_s"] < ring["measured_s"] / 3
    assert "points on 2 ranks within 20% of cost.predict()" in capsys.readouterr().out
