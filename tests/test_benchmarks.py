"""Smoke tests of the benchmark entry points: they run on 2 local ranks and report what they claim."""

import json

from signmuon.benchmarks import bandwidth


def test_bandwidth_sweep_writes_table_json_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "bw"
    rows = bandwidth.main(["--world-size", "2", "--sizes", "1K", "64K", "--iters", "2", "--warmup", "1",
                           "--json", f"{out}.json", "--csv", f"{out}.csv", "--plot", f"{out}.png", "--no-progress"])  # fmt: skip
    assert {r["method"] for r in rows} == set(bandwidth.METHODS)
    by = {(r["method"], r["numel"]): r for r in rows if "error" not in r}
    fp32, vote = by[("fp32_allreduce", 65536)], by[("vote_exact", 65536)]
    assert fp32["bytes_per_rank"] / vote["bytes_per_rank"] > 25  # ~32x fewer bytes, plus headers
    assert by[("int8_sum_allreduce", 65536)]["bytes_per_rank"] * 4 == fp32["bytes_per_rank"]
    for r in by.values():
        assert r["p10_s"] <= r["median_s"] <= r["p90_s"]
        assert r["busbw_GBps"] == r["algbw_GBps"]  # 2(M-1)/M = 1 at M = 2
    assert json.loads((tmp_path / "bw.json").read_text()) == rows
    assert (tmp_path / "bw.csv").read_text().count("\n") == len(rows) + 1
    assert (tmp_path / "bw.png").read_bytes()[:4] == b"\x89PNG"
    assert "vote_exact" in capsys.readouterr().out


def test_train_writes_curves_and_is_repeatable(tmp_path):
    from signmuon.benchmarks import train

    argv = ["--world-size", "2", "--steps", "40", "--eval-every", "20", "--methods", "adamw", "signum_mv",
            "--csv", str(tmp_path / "curves.csv"), "--plot", str(tmp_path / "curves.png")]  # fmt: skip
    first = train.main(argv)
    second = train.main(argv[:-4])
    for a, b in zip(first, second):
        assert [e["test_loss"] for e in a["log"]] == [e["test_loss"] for e in b["log"]], "seeded runs repeat"
    rows = (tmp_path / "curves.csv").read_text().splitlines()
    assert rows[0].startswith("method,step,time_s,bytes") and len(rows) == 1 + 2 * 2
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    adamw, signum = first
    assert signum["log"][-1]["bytes"] < adamw["log"][-1]["bytes"] / 5
