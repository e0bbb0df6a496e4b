"""The README's main job: what the library is for, measured on this machine.

A small GPT (charlm ``small``) on 4 ranks as 2 nodes of 2, the link between the nodes shaped
with tc (``netem``; needs root and iproute2), trained 300 steps each by DDP+AdamW, node-aware
SignMuon (one bit per entry between nodes, every step) and DiLoCo with one-bit rounds (every 8
steps). It first says what it trains (the model, the data, the methods, the link, about how
long), then prints each method's final loss, its time to DDP+AdamW's final loss and the bytes
that left each node (the interfaces' counters), a verdict in one line, and draws test loss
against wall time and against those bytes. Where links cannot be shaped it says why, trains on
loopback and adds the plan's projection of those runs to the link (``cost.predict()``), labelled
as one. ``--task digits`` is the fast demo of before (a minute, loopback). ``--json`` writes the
summary and the runs (the README's copy of the output is made from such a report).

    signmuon-bench demo                   # 100 Mbit/s between the nodes
    signmuon-bench demo --link 50mbit
    signmuon-bench demo --task digits
"""

from __future__ import annotations

import os
import shutil

from signmuon.benchmarks.commands import load
from signmuon.benchmarks.reports.demo import LABELS, METHODS, plan_projection, projection_text, summarize, summary_text
from signmuon.benchmarks.reports.writer import write_report
from signmuon.benchmarks.runtime.cli import command_parser
from signmuon.benchmarks.workloads.tasks import CHARLM_SIZES, TinyGPT, digits_cnn

NAME = "demo"
SUMMARY = "the main job: DDP+AdamW against node-aware SignMuon and one-bit DiLoCo rounds on a shaped link"

RANKS, PER_NODE = 4, 2
TRAIN = [
    "--task",
    "charlm",
    "--world-size",
    str(RANKS),
    "--ranks-per-node",
    str(PER_NODE),
    "--eval-every",
    "25",
    # The rounds' outer step as tuned for one-bit rounds (benchmarks/results/2026-12-03-local-steps*).
    "--outer-lr",
    "1.0",
    "--outer-momentum",
    "0",
    "--outer-scale-block",
    "64",
]
DIGITS_METHODS, DIGITS_STEPS = ("adamw", "signum_mv", "signmuon"), 300
DIGITS = ["--world-size", "4", "--steps", str(DIGITS_STEPS), "--eval-every", "25", "--methods", *DIGITS_METHODS]

# How long it takes, from the README's runs on a 2-core machine (start-up and evaluation included):
SECONDS_PER_STEP = 130 / 300  # charlm, the three methods at 100mbit (2026-12-05-demo-100mbit)
DIGITS_SECONDS = 60


def model_parameters(task: str) -> int:
    """The parameter count of the model ``task`` trains (built here: a few milliseconds)."""
    model = digits_cnn() if task == "digits" else TinyGPT(**CHARLM_SIZES["small"])
    return sum(p.numel() for p in model.parameters())


def about(seconds: float) -> str:
    """A duration the way a person guesses one: tens of seconds, else whole minutes."""
    if seconds < 90:
        return f"about {max(10, round(seconds, -1)):.0f} s"
    return f"about {round(seconds / 60):.0f} min"


def intro_lines(task: str, steps: int, link: str, why: str | None, parameters: int) -> list[str]:
    """The three lines the demo prints before it trains: the model and data, the methods, and
    the link with about how long it will take; ``why`` is why links cannot be shaped (None: they can)."""
    if task == "digits":
        return [
            f"demo --task digits: a small CNN ({parameters:,} parameters) on scikit-learn's 8x8 digits, "
            f"4 local ranks, {steps} steps per method",
            f"methods compared: {DIGITS_METHODS[0]} (the baseline), {', '.join(DIGITS_METHODS[1:])}",
            f"link: loopback, none emulated; {about(DIGITS_SECONDS)} on 2 CPU cores",
        ]
    link_line = (
        f"link: {link} between the 2 nodes, emulated with tc (netem)"
        if why is None
        else f"link: none emulated, links cannot be shaped here ({why}): training on loopback, where sending "
        f"fewer bytes saves nothing, then the plan's projection of the runs to {link}"
    )
    return [
        f"demo: a character-level GPT (charlm small, {parameters:,} parameters) learning the next byte of the "
        f"Python standard library's source, on {RANKS} ranks as 2 nodes x {PER_NODE}, {steps} steps per method",
        f"methods compared: {LABELS[METHODS[0]]} (the baseline), {', '.join(LABELS[m] for m in METHODS[1:])}",
        f"{link_line}; {about(SECONDS_PER_STEP * steps)} on 2 CPU cores",
    ]


def shaping_unavailable() -> str | None:
    """Why links cannot be shaped here (None: they can)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    if os.geteuid() != 0:
        return "it needs root (network namespaces and tc)"
    return None


def plot(runs: dict[str, dict], node_bytes: dict[str, float] | None, path: str, title: str) -> None:
    """Test loss against wall time and against bytes between nodes (each method's own count
    along its run, scaled to the interfaces' total where there is one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    target = runs[METHODS[0]]["log"][-1]["test_loss"]
    for method, run in runs.items():
        log = run["log"]
        counted = [e["bytes_between_nodes"] for e in log]
        scale = node_bytes[method] / counted[-1] if node_bytes and counted[-1] else 1.0
        losses = [e["test_loss"] for e in log]
        by_time.plot([e["time_s"] for e in log], losses, marker=".", label=LABELS[method])
        sent = [(c * scale / 1e6, loss) for c, loss in zip(counted, losses) if c > 0]  # a log axis
        by_bytes.plot([x for x, _ in sent], [y for _, y in sent], marker=".", label=LABELS[method])
    for ax in (by_time, by_bytes):
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.grid(True, alpha=0.3)
    by_bytes.set_xscale("log")
    by_time.set_xlabel("wall time, s")
    by_bytes.set_xlabel("MB between nodes" + (" (per node)" if node_bytes else " (per rank, as counted)"))
    by_time.set_ylabel("test loss")
    by_time.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.abspath(path)}")


def _shaped(link: str, steps: int) -> tuple[dict[str, dict], dict[str, float]]:
    """Each method in its own emulated cluster, so each node's counters are its own."""
    netem = load("netem")
    runs, node_bytes = {}, {}
    for i, method in enumerate(METHODS, 1):
        print(f"[{i}/{len(METHODS)}] {LABELS[method]}, {steps} steps, {link} between the nodes", flush=True)
        report = netem.main(
            ["--world-size", str(RANKS), "--ranks-per-node", str(PER_NODE), "--rate", link, "--delay", ""]
            + ["--live", "--quiet", "--", "train", *TRAIN, "--steps", str(steps), "--methods", method]
        )
        runs[method] = report["train"]["runs"][0]
        sent = report["tx_bytes_per_node"]
        node_bytes[method] = sum(sent) / len(sent)
    return runs, node_bytes


def parser():
    """The demo's options (its defaults are the README's run)."""
    options = command_parser(NAME, __doc__)
    options.add_argument("--task", choices=["charlm", "digits"], default="charlm")
    options.add_argument(
        "--link", default="100mbit", help="the rate between the nodes, tc's units (default: %(default)s)"
    )
    options.add_argument("--loopback", action="store_true", help="do not shape: loopback, and the projection")
    options.add_argument("--steps", type=int, default=300)
    options.add_argument("--plot", default="demo_curves.png", help="the picture (default: %(default)s)")
    options.add_argument("--json", help="write the summary and the runs to this file")
    return options


def main(argv: list[str] | None = None):
    options = parser()
    args, rest = options.parse_known_args(argv)
    if args.task == "digits":  # the fast demo: 4 local ranks on loopback, train's own table
        print("\n".join(intro_lines("digits", DIGITS_STEPS, "loopback", None, model_parameters("digits"))), flush=True)
        return load("train").main(DIGITS + ["--plot", args.plot] + rest)
    if rest:
        options.error(f"unrecognized arguments: {' '.join(rest)} (train's options go to `signmuon-bench train`)")
    if args.steps < 25:
        options.error(f"--steps {args.steps}: at least 25 (one evaluation)")
    why = "--loopback" if args.loopback else shaping_unavailable()
    # Before anything is trained, so a user watching the terminal knows what they wait for.
    print("\n".join(intro_lines(args.task, args.steps, args.link, why, model_parameters(args.task))), flush=True)
    if why is None:
        runs, node_bytes = _shaped(args.link, args.steps)
        link, counted_by = args.link, "bytes that left each node, the interfaces' counters (mean of the 2 nodes)"
    else:
        results = load("train").main(TRAIN + ["--steps", str(args.steps), "--methods", *METHODS, "--no-progress"])
        runs, node_bytes = {r["method"]: r for r in results}, None
        link, counted_by = "loopback", "per rank, as each method's statistics count them"
    rows = summarize(runs, node_bytes)
    print()
    print(summary_text(rows, link, counted_by))
    projected = None
    if node_bytes is None:
        from signmuon.benchmarks.cost.kernels import measure_latency, measure_model  # numba: only here

        inputs = measure_model(TinyGPT(**CHARLM_SIZES["small"]))
        projected = plan_projection(runs, rows, inputs, measure_latency(), args.link)
        print(projection_text(projected, args.link))
    plot(runs, node_bytes, args.plot, f"charlm, {RANKS} ranks as 2 nodes x {PER_NODE}, {link} between the nodes")
    fields = {"link": link, "counted_by": counted_by, "rows": rows, "projection": projected, "runs": runs}
    write_report(NAME, argv, fields, args.json)
    return rows
