"""Training at several link rates (``netem --rates ... -- train``): the time to target per method
and rate, and test loss against wall time, a panel per rate."""

from __future__ import annotations

__all__ = ["plot_rates", "print_time_to_target"]


def print_time_to_target(reports: list[dict]) -> None:
    """Train runs at several rates: per method and rate, the wall time (mean over seeds) to the
    target loss, the seeds that reached it and, where adamw ran, the ratio to adamw's time at the
    same rate; '-' where no seed reached it."""
    trains = [r for r in reports if "train" in r]
    if not trains:
        return
    methods = list(trains[0]["train"]["summary"])
    first = trains[0]["train"]["runs"][0]
    print(
        f"time to target, s (task={first['task']}, world_size={first['world_size']}; target: each rate's own, "
        "adamw's final loss unless --target-loss)"
    )
    print(f"{'method':>16} " + " ".join(f"{r['rate']:>23}" for r in trains))
    for method in methods:
        cells = []
        for r in trains:
            summary = r["train"]["summary"].get(method, {})
            t = summary.get("time_to_target")
            adamw = r["train"]["summary"].get("adamw", {}).get("time_to_target")
            ratio = f" {t[0] / adamw[0]:.2f}x" if t and adamw and adamw[0] > 0 else ""
            cells.append(f"{t[0]:.1f} ({summary['reached']}/{summary['seeds']}){ratio}" if t else "-")
        print(f"{method:>16} " + " ".join(f"{c:>23}" for c in cells))


def plot_rates(reports: list[dict], path: str) -> None:
    """Test loss against wall time, one panel per rate, one line (mean, ±1 std band) per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trains = [r for r in reports if "train" in r]
    fig, axes = plt.subplots(1, len(trains), figsize=(4.6 * len(trains), 4.2), sharey=True, squeeze=False)
    for ax, report in zip(axes[0], trains):
        for method, summary in report["train"]["summary"].items():
            curve = summary["curve"]
            line = ax.plot(curve["time_s"], curve["mean"], marker=".", label=method)[0]
            if summary["seeds"] > 1:
                lower = [m - d for m, d in zip(curve["mean"], curve["std"])]
                upper = [m + d for m, d in zip(curve["mean"], curve["std"])]
                ax.fill_between(curve["time_s"], lower, upper, color=line.get_color(), alpha=0.2)
        target = report["train"].get("target_loss")
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"{report['rate']}")
        ax.set_xlabel("wall time, s")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("test loss")
    axes[0][0].legend(fontsize=8)
    first = trains[0]["train"]["runs"][0]
    fig.suptitle(
        f"{first['task']}, {first['world_size']} ranks: test loss against wall time by link rate (dashed: target)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
