"""The projection of ``plan --projection``: published GPU-cluster figures (GPT models of 125M to
70B parameters, 2 to 512 nodes of 8 GPUs, 25 to 400 Gbit/s per GPU) through the cost model. It
is a projection, not a measurement; its assumptions print with it."""

from __future__ import annotations

import math

from signmuon.benchmarks.cost.model import Cluster, Workload, crossover, predict

__all__ = [
    "ASSUMPTIONS",
    "CHOICE",
    "GPT_SIZES",
    "PROJECTION",
    "SHARDED_MODELS",
    "choice",
    "crossovers",
    "model_shapes",
    "plot_projection",
    "projection",
]


# GPT-style models: (layers, width, vocabulary); 12·layers·width² + vocabulary·width parameters.
GPT_SIZES = {
    "gpt-125m": (12, 768, 50257),
    "gpt-1.3b": (24, 2048, 50257),
    "gpt-7b": (32, 4096, 50257),
    "gpt-70b": (80, 8192, 50257),
}
PROJECTION = {
    "models": ("gpt-125m", "gpt-1.3b", "gpt-7b", "gpt-70b"),
    "nodes": (2, 8, 32, 128, 512),
    "links_gbit": (25, 100, 400),
    "ranks_per_node": 8,
    "tokens_per_rank": 8192,
    "tflops": 400.0,
    "kernel_gbps": 1000.0,
    "ns_tflops": 200.0,
}
ASSUMPTIONS = (
    "projection, not a measurement: 8 GPUs per node on NVLink (450 GB/s per GPU, 2 us), one NIC per GPU "
    "(10 us per round between nodes), 8192 tokens per GPU per step, forward+backward at 400 TFLOP/s "
    "(6·n·tokens flops), the vote's kernels at 1 TB/s of fp32 input, Newton–Schulz at 200 TFLOP/s, {overlap}, "
    "one bit per entry (dense); SignMuon's Newton–Schulz split over "
    "each node's 8 GPUs; one-bit rounds: the node's gradient all-reduce every step and a round every 32 steps, "
    "its cost spread over them (the time per step only: how many more steps rounds need is not modelled)"
)


def model_shapes(name: str) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(parameters, matrix shapes) of a GPT-style model of ``GPT_SIZES``."""
    layers, width, vocab = GPT_SIZES[name]
    per_layer = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]
    matrices = tuple(per_layer * layers)  # the hidden matrices; the embedding is not orthogonalised
    return sum(r * c for r, c in matrices) + vocab * width, matrices


SHARDED_MODELS = ("gpt-7b", "gpt-70b")
"""The models of the sharded column: FSDP2 inside nodes (the vote between them against HSDP)."""
CROSSOVER_METHODS = {  # method: the fp32 schedule it replaces
    "signsgd_mv_node": "allreduce_node",
    "signmuon_node": "allreduce_node",
    "fsdp_signum_mv": "hsdp_allreduce",
    "fsdp_signmuon": "hsdp_allreduce",
}


def _workload(name: str, overlap: bool) -> Workload:
    params, matrices = model_shapes(name)
    compute = 6 * params * PROJECTION["tokens_per_rank"] / (PROJECTION["tflops"] * 1e12)
    return Workload(
        params, compute, matrices, PROJECTION["kernel_gbps"] * 1e9, PROJECTION["ns_tflops"] * 1e12, overlap=overlap
    )


def crossovers(nodes: int = 8, overlap: bool = True) -> list[dict]:
    """Per model and method of ``CROSSOVER_METHODS``: the link rate per GPU below which it is
    faster than the fp32 schedule it replaces (two-level all-reduce for DDP, HSDP for FSDP2), on
    ``nodes`` nodes of 8 GPUs (None: at no rate; inf: at every rate)."""
    rows = []
    for name in PROJECTION["models"]:
        workload = _workload(name, overlap)
        cluster = Cluster(nodes, PROJECTION["ranks_per_node"], 100e9)
        for method, base in CROSSOVER_METHODS.items():
            bps = crossover(method, cluster, workload, base)
            rows.append({"model": name, "nodes": nodes, "method": method, "baseline": base, "crossover_bps": bps})
    return rows


OVERLAP_WORDS = {
    True: "backward (2/3 of the compute) hiding DDP's bucketed communication of 25 MB buckets (not the node-aware "
    "votes' blocking gather in the node, nor a round)",
    False: "no overlap of communication with backward (an upper bound)",
}


def projection(plot: str | None = None, overlap: bool = True) -> list[dict]:
    """The projection table: every model, node count and link of :data:`PROJECTION`."""
    rows = []
    for name in PROJECTION["models"]:
        workload = _workload(name, overlap)
        for gbit in PROJECTION["links_gbit"]:
            for nodes in PROJECTION["nodes"]:
                cluster = Cluster(nodes, PROJECTION["ranks_per_node"], gbit * 1e9)
                # The baseline a user has today: the faster fp32 schedule (a flat ring's 2(M-1) rounds
                # cost more than its bytes on hundreds of nodes).
                base = min(predict(m, cluster, workload)["step_s"] for m in ("allreduce", "allreduce_node"))
                columns = [(("allreduce_node", "signsgd_mv_node", "signmuon_node", "diloco_vote_node"), base)]
                if name in SHARDED_MODELS:  # the sharded column: FSDP2 inside nodes, against HSDP
                    hsdp = predict("hsdp_allreduce", cluster, workload)["step_s"]
                    columns.append((("fsdp_signum_mv", "fsdp_signmuon"), hsdp))
                for methods, baseline in columns:
                    for method in methods:
                        step = predict(method, cluster, workload)["step_s"]
                        rows.append(
                            {
                                "model": name,
                                "link_gbit": gbit,
                                "nodes": nodes,
                                "method": method,
                                "step_s": step,
                                "speedup": baseline / step,
                                "baseline_step_s": baseline,
                            }
                        )
    print(ASSUMPTIONS.format(overlap=OVERLAP_WORDS[overlap]))
    ddp, hsdp = (PROJECTION["models"], "the faster fp32 all-reduce"), (SHARDED_MODELS, "HSDP's fp32 between nodes")
    grids = (
        ("signsgd_mv_node", "signSGD-MV / Signum-MV, node-aware", *ddp),
        ("signmuon_node", "SignMuon, node-aware", *ddp),
        ("diloco_vote_node", "one-bit rounds every 32 steps, node-aware, time per step only", *ddp),
        ("fsdp_signum_mv", "sharded: FSDP2 inside nodes, Signum-MV voted between them during backward", *hsdp),
        ("fsdp_signmuon", "sharded: FSDP2 inside nodes, SignMuon voted between them during backward", *hsdp),
    )
    for method, label, models, over in grids:
        print(
            f"{'model':>9} {'link':>9} "
            + " ".join(f"{n:>6}" for n in PROJECTION["nodes"])
            + f"   (nodes; {label}; step speed-up over {over})"
        )
        for name in models:
            for gbit in PROJECTION["links_gbit"]:
                cells = [
                    r["speedup"]
                    for r in rows
                    if r["model"] == name and r["link_gbit"] == gbit and r["method"] == method
                ]
                print(f"{name:>9} {gbit:>5}Gbit " + " ".join(f"{c:>5.2f}x" for c in cells))
    table = crossovers(overlap=overlap)
    print(
        f"{'model':>9} "
        + " ".join(f"{m:>16}" for m in CROSSOVER_METHODS)
        + "   (8 nodes of 8 GPUs: the vote pays below this link rate per GPU; DDP against the two-level fp32 "
        "all-reduce, FSDP2 against HSDP)"
    )
    for name in PROJECTION["models"]:
        cells = [_rate(r["crossover_bps"]) for r in table if r["model"] == name]
        print(f"{name:>9} " + " ".join(f"{c:>16}" for c in cells))
    rows += [{**r, "table": "crossover"} for r in table]
    if plot:
        plot_projection(rows, plot)
    return rows


CHOICE = {
    "nodes": 32,
    "links_gbit": (10, 25, 50, 100, 200, 400),
    "replicated": ("allreduce", "allreduce_node", "signsgd_mv_node", "signmuon_node", "diloco_vote_node"),
    "sharded": ("hsdp_allreduce", "fsdp_signum_mv", "fsdp_signmuon"),
}
"""The grid of "Choosing a method": link rates per GPU against model size on one cluster size; a
model of :data:`SHARDED_MODELS` is trained sharded (FSDP2 inside nodes), the others replicated."""


def choice(overlap: bool = True) -> list[dict]:
    """Predicted step time of every method a user could pick, per model and link rate of
    :data:`CHOICE` (the rest of the projection's assumptions)."""
    rows = []
    for name in PROJECTION["models"]:
        workload = _workload(name, overlap)
        methods = CHOICE["sharded" if name in SHARDED_MODELS else "replicated"]
        for gbit in CHOICE["links_gbit"]:
            cluster = Cluster(CHOICE["nodes"], PROJECTION["ranks_per_node"], gbit * 1e9)
            for method in methods:
                step = predict(method, cluster, workload)["step_s"]
                rows.append(
                    {"model": name, "link_gbit": gbit, "nodes": CHOICE["nodes"], "method": method, "step_s": step}
                )
    print(ASSUMPTIONS.format(overlap=OVERLAP_WORDS[overlap]))
    for group in ("replicated", "sharded"):
        models = [m for m in PROJECTION["models"] if (m in SHARDED_MODELS) == (group == "sharded")]
        print(f"{'model':>9} {'link':>9} " + " ".join(f"{m:>16}" for m in CHOICE[group]) + f"   (step ms; {group})")
        for name in models:
            for gbit in CHOICE["links_gbit"]:
                cells = [r["step_s"] * 1e3 for r in rows if r["model"] == name and r["link_gbit"] == gbit]
                print(f"{name:>9} {gbit:>5}Gbit " + " ".join(f"{c:>16.1f}" for c in cells))
    return rows


def _rate(bps: float | None) -> str:
    if bps is None:
        return "never"
    if bps == math.inf:
        return "always"
    return f"{bps / 1e9:.3g} Gbit/s"


def plot_projection(rows: list[dict], path: str) -> None:
    """The node-aware votes' projected speed-up against nodes, a panel per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(PROJECTION["links_gbit"]), figsize=(5 * len(PROJECTION["links_gbit"]), 4), sharey=True
    )
    for ax, gbit in zip(axes, PROJECTION["links_gbit"]):
        for color, name in enumerate(PROJECTION["models"]):
            for method, style, label in (("signsgd_mv_node", "-", "Signum-MV"), ("signmuon_node", "--", "SignMuon")):
                cells = [r for r in rows if r["model"] == name and r.get("link_gbit") == gbit and r["method"] == method]
                ax.plot(
                    [r["nodes"] for r in cells],
                    [r["speedup"] for r in cells],
                    style,
                    marker="o",
                    color=f"C{color}",
                    label=f"{name}, {label}",
                )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{gbit} Gbit/s per GPU between nodes")
        ax.set_xlabel("nodes of 8 GPUs")
    axes[0].set_ylabel("step speed-up over the faster fp32 all-reduce")
    axes[0].legend(fontsize="small", ncol=2)
    fig.suptitle(
        "Node-aware Signum-MV (solid) and SignMuon (dashed), projected from an α–β model (assumptions: plan --projection)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
