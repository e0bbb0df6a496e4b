"""The docs' result tables and figures are made from the JSON reports in benchmarks/results:
every page agrees with its JSON now, a page that disagrees is found and rewritten, and every
image in the docs is drawn from JSON by ``signmuon-bench report``."""

import json
import re
import shutil
from pathlib import Path

import pytest

from signmuon.benchmarks.commands import load
from signmuon.benchmarks.reports.pages import TABLE_BLOCK, figure_specs, regenerate

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
report = load("report")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_generated_table_agrees_with_its_json(page):
    text = page.read_text()
    assert regenerate(text, str(ROOT)) == text, f"{page.name} disagrees with its JSON: run signmuon-bench report"


def test_the_result_pages_hold_generated_tables_only():
    # Tables of measurements live on these pages; each must be a generated one.
    for name in ("README.md", "docs/results.md", "docs/choosing.md", "docs/muon.md"):
        text = (ROOT / name).read_text()
        assert TABLE_BLOCK.search(text), name
        outside = re.sub(r"```.*?```", "", TABLE_BLOCK.sub("", text), flags=re.S)
        assert not [line for line in outside.splitlines() if line.startswith("|")], f"a hand-written table in {name}"


def _tree(tmp_path: Path) -> Path:
    """A copy of what the pages read: the README, docs/*.md and benchmarks/results/*.json."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for page in PAGES:
        shutil.copy(page, tmp_path / page.relative_to(ROOT))
    for json_file in (ROOT / "benchmarks" / "results").glob("*.json"):
        shutil.copy(json_file, tmp_path / "benchmarks" / "results" / json_file.name)
    return tmp_path


def test_a_page_that_disagrees_with_its_json_is_found_and_rewritten(tmp_path, capsys):
    root = _tree(tmp_path)
    page = root / "docs" / "results.md"
    original = page.read_text()
    drifted = original.replace("1.889 ± 0.010", "1.850 ± 0.010", 1)  # SignMuon's final loss, edited by hand
    assert drifted != original
    page.write_text(drifted)
    with pytest.raises(SystemExit, match="docs/results.md"):
        report.main(["--root", str(root), "--check"])
    assert page.read_text() == drifted  # --check writes nothing
    assert report.main(["--root", str(root), "--no-figures"]) == ["docs/results.md"]
    assert page.read_text() == original
    report.main(["--root", str(root), "--check"])
    assert "agrees" in capsys.readouterr().out


def test_a_table_whose_json_changed_is_found(tmp_path):
    root = _tree(tmp_path)
    source = root / "benchmarks" / "results" / "2026-12-05-projection.json"
    source.write_text(source.read_text().replace('"speedup": 2.6', '"speedup": 9.6'))
    with pytest.raises(SystemExit, match="README.md"):
        report.main(["--root", str(root), "--check"])


def test_an_unknown_table_or_missing_json_is_refused():
    with pytest.raises(ValueError, match="unknown report table 'nope'"):
        regenerate("<!-- report nope x.json -->\n<!-- /report -->", str(ROOT))
    with pytest.raises(ValueError, match=r"no option basline \(its options: \['baseline', 'methods'\]\)"):
        regenerate(
            "<!-- report time-to-target benchmarks/results/2026-12-03-rates-charlm.json basline=adamw -->\n"
            "<!-- /report -->",
            str(ROOT),
        )
    with pytest.raises(FileNotFoundError, match="missing.json"):
        regenerate("<!-- report train benchmarks/results/missing.json -->\n<!-- /report -->", str(ROOT))


def test_every_image_in_the_docs_is_drawn_from_json(tmp_path):
    root = _tree(tmp_path)
    for page in PAGES:
        text = page.read_text()
        images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
        drawn = {out for _, out, _ in figure_specs(text)}
        assert set(images) <= drawn, f"{page.name}: images with no JSON behind them: {set(images) - drawn}"
        for image in images:
            assert (page.parent / image).is_file(), f"{page.name}: {image} is not in the repository"
    (root / "docs" / "figures").mkdir()
    report.main(["--root", str(root)])
    for page in PAGES:
        for _, out, _ in figure_specs(page.read_text()):
            drawn = (root / page.relative_to(ROOT)).parent / out
            assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out


def _train(method: str, finals: list[list[float]], target: float | None = None) -> dict:
    """A train report of ``method`` whose seeds evaluated at steps 100, 200, 300 with these losses."""
    runs = [
        {
            "method": method,
            "strategy": "ddp",
            "log": [{"step": s, "time_s": s / 10, "test_loss": v} for s, v in zip((100, 200, 300), losses)],
        }
        for losses in finals
    ]
    return {"target_loss": target, "summary": {method: {}}, "runs": runs}


def test_choosing_weighs_the_step_by_the_measured_steps_to_the_target(tmp_path):
    # One model, two links: Signum-MV's step is the fastest at both, but it never reaches the
    # target; SignMuon reaches it in 2/3 of the steps: first at the slow link (1.5 s · 2/3 = 1.0 s
    # against fp32's 3.0 s), not at the fast one (1.8 s · 2/3 = 1.2 s against 1.0 s).
    plan = [
        {"model": "gpt-125m", "link_gbit": g, "nodes": 8, "method": m, "step_s": s}
        for g, steps in ((10, (3.0, 1.0, 1.5)), (400, (1.0, 0.9, 1.8)))
        for m, s in zip(("allreduce", "signsgd_mv_node", "signmuon_node"), steps)
    ]
    files = {
        "plan.json": {"command": "plan", "rows": plan},
        "adamw.json": _train("adamw", [[2.5, 2.2, 2.0]], target=2.0),
        "signum.json": _train("signum_mv", [[2.6, 2.4, 2.1], [2.6, 2.3, 2.05]]),
        "signmuon.json": _train("signmuon_node", [[2.3, 2.0, 1.9], [2.2, 1.95, 1.9]]),
    }
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    spec = "plan.json adamw.json signum.json signmuon.json"
    fastest = regenerate(f"<!-- report choice {spec} which=fastest_step -->\n<!-- /report -->", str(tmp_path))
    assert "| GPT 125M | Signum-MV 3.00× | Signum-MV 1.11× |" in fastest
    first = regenerate(f"<!-- report choice {spec} -->\n<!-- /report -->", str(tmp_path))
    assert "| GPT 125M | SignMuon 3.00× | fp32 all-reduce 1.00× |" in first
    steps = regenerate(f"<!-- report steps {spec} -->\n<!-- /report -->", str(tmp_path))
    assert "| Signum-MV | Signum-MV: the vote of each worker's momentum signs | never (0/2 seeds) |" in steps
    assert "| SignMuon | SignMuon, node-aware (Newton-Schulz split in the node) | 0.67 |" in steps


def test_the_step_table_names_each_runs_link_and_divides_by_the_vote_in_step(tmp_path):
    def rows(during, in_step):
        common = {"params": 2e6, "between_nodes_bytes_per_rank": 1e6}
        return [
            {**common, "method": "fsdp_signum_mv", "step_s": during, "between_nodes_in_backward_share": 1.0},
            {**common, "method": "fsdp_signum_mv_in_step", "step_s": in_step, "between_nodes_in_backward_share": 0.0},
        ]

    shaped = "signmuon-bench netem --world-size 4 --ranks-per-node 2 --rate 100mbit -- ddp-step --methods x"
    files = {
        "shaped.json": {"command": shaped, "rows": rows(0.6, 0.8)},
        "loopback.json": {"command": "signmuon-bench ddp-step --world-size 4", "rows": rows(0.5, 0.4)},
    }
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    table = regenerate("<!-- report step shaped.json loopback.json -->\n<!-- /report -->", str(tmp_path))
    assert "| 100mbit | 2.0M | 0.600 | 0.75× | 1.00 | 100% |" in table
    assert "| loopback | 2.0M | 0.500 | 1.25× | 1.00 | 100% |" in table
    assert "_in_step" not in table and table.count("| 2.0M |") == 2


def test_the_streaming_table_pools_seeds_and_divides_each_burst_by_the_unfragmented_rounds(tmp_path):
    def run(method, seed, loss, burst, hidden):
        log = [{"step": 25, "time_s": 10.0, "test_loss": 3.0}, {"step": 50, "time_s": 20.0, "test_loss": loss}]
        return {
            "method": method, "seed": seed, "log": log, "step_ms": 1.0, "bytes_per_rank": 4e6,
            "bytes_between_nodes_per_rank": 2e6, "largest_burst_between_nodes_per_rank": burst,
            "round_hidden_share": hidden,
        }  # fmt: skip

    seed0 = {"train": {"summary": {}, "runs": [run("whole", 0, 2.0, 8000, 0.0), run("streamed", 0, 2.2, 2000, 0.9)]}}
    seed1 = {"train": {"summary": {}, "runs": [run("whole", 1, 2.0, 8000, 0.0), run("streamed", 1, 1.8, 2400, 0.7)]}}
    for name, content in {"seed0.json": seed0, "seed1.json": seed1}.items():
        (tmp_path / name).write_text(json.dumps(content))
    spec = "<!-- report streaming seed0.json seed1.json baseline=whole target=2.1 -->\n<!-- /report -->"
    table = regenerate(spec, str(tmp_path))
    assert "| whole | 2 | 2.000 ± 0.000 | 2.00 | 8.0 | 1.00 | 0% | 20, 20 |" in table
    assert "| streamed | 2 | 2.000 ± 0.283 | 2.00 | 2.4 | 0.30 | 80% | never, 20 |" in table
