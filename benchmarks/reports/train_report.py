"""What ``train`` prints and writes: the tables (one seed, several seeds), where a step's time
goes, the projected time to target at link rates, and the curves as CSV and PNG."""

from __future__ import annotations

import csv
import math
import os
import statistics

from signmuon.benchmarks.reports.curves import seed_summary, time_to_target
from signmuon.benchmarks.runtime.cli import network_label


def print_time_split(results: list[dict]) -> None:
    """Per method, the mean over seeds of the step's time split (``train.time_split``)."""
    fields = ("step", "forward_backward_rest", "newton_schulz", "pack_vote_unpack", "network_wait")
    print("where a step's time goes, ms (mean per step; '-': not ours to time)")
    print(
        f"{'method':>16} {'step':>8} {'fwd+bwd+rest':>13} {'Newton-Schulz':>14} {'pack+vote+unpack':>17} {'network wait':>13}"
    )
    for method, runs in by_method(results).items():
        cells = []
        for field in fields:
            values = [r["time_split_ms"][field] for r in runs if r["time_split_ms"][field] is not None]
            cells.append(f"{statistics.fmean(values):.2f}" if values else "-")
        widths = (8, 13, 14, 17, 13)
        print(f"{method:>16} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print("largest burst: the most bytes a rank sent between nodes in one step; hidden: round wire time hidden")
    for method, runs in by_method(results).items():
        burst = max(r.get("largest_burst_between_nodes_per_rank", 0) for r in runs)
        shares = [r["round_hidden_share"] for r in runs if r.get("round_hidden_share") is not None]
        hidden = f", hidden {100 * statistics.fmean(shares):.0f}%" if shares else ""
        print(f"{method:>16} largest burst {burst / 1e3:.1f} KB{hidden}")


def write_curves(results: list[dict], csv_path: str | None = None, png_path: str | None = None) -> None:
    """Every evaluation of every run as CSV rows, and test loss vs step / bytes / time as PNG
    (one line per method: the mean over seeds, with a ±1 std band when there are several)."""
    if csv_path:
        fields = [
            "method",
            "seed",
            "step",
            "time_s",
            "bytes",
            "bytes_between_nodes",
            "train_loss",
            "test_loss",
            "test_acc",
            "worker_acc",
        ]
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            for r in results:
                for entry in r["log"]:
                    writer.writerow({"method": r["method"], "seed": r.get("seed", 0), **entry})
    if png_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogFormatterSciNotation, NullFormatter

        fig, axes = plt.subplots(1, 3, figsize=(13, 4.4), sharey=True)
        for method, runs in by_method(results).items():
            summary = seed_summary(runs)
            curve, log = summary["curve"], runs[0]["log"]
            mean, std = curve["mean"], curve["std"]
            xs = ([e["step"] for e in log], [max(e["bytes"], 1) / 1e6 for e in log], curve["time_s"])
            for ax, x in zip(axes, xs):
                line = ax.plot(x, mean, marker=".", label=method if ax is axes[0] else None)[0]
                if len(runs) > 1:
                    lower = [m - d for m, d in zip(mean, std)]
                    upper = [m + d for m, d in zip(mean, std)]
                    ax.fill_between(x, lower, upper, color=line.get_color(), alpha=0.2)
        for ax, label in zip(axes, ("step", "MB sent per rank", "wall time, s")):
            ax.set_xlabel(label)
            ax.grid(True, alpha=0.3)
        axes[1].set_xscale("log")
        # Label the decades only: minor labels on a log axis spanning a decade or two overlap.
        axes[1].xaxis.set_major_formatter(LogFormatterSciNotation())
        axes[1].xaxis.set_minor_formatter(NullFormatter())
        axes[0].set_ylabel("test loss")
        axes[0].legend(fontsize=8)
        if results:
            first = results[0]
            seeds = len({r.get("seed", 0) for r in results})
            band = f", mean ± std of {seeds} seeds" if seeds > 1 else ""
            fig.suptitle(
                f"{first['task']}: {first['world_size']} ranks, {network_label()}: test loss by step, bytes and time{band}"
            )
        fig.tight_layout()
        fig.savefig(png_path, dpi=110)
        plt.close(fig)
        print(f"wrote {os.path.abspath(png_path)}")


def by_method(results: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by method, in first-seen order."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["method"], []).append(r)
    return groups


def _target_cell(hit: tuple[float, int] | None) -> tuple[str, str]:
    return ("-", "-") if hit is None else (f"{hit[0]:.1f}", str(hit[1]))


def _lr_cell(result: dict) -> str:
    """The factor; '*' marks one the sweep tuned, '~' one it tuned for the same optimizer."""
    mark = "*" if result.get("lr_tuned") else "~" if result.get("lr_borrowed") else ""
    return f"{result.get('lr_scale', 1.0):g}{mark}"


def print_table(results: list[dict], target: float | None = None) -> None:
    """One seed: a row per method; with ``target``, the wall time and steps to reach it."""
    base = next((r["bytes_per_rank"] for r in results if r["method"] == "adamw"), None)
    ppl = any("test_ppl" in r for r in results)
    if results:
        _print_header(results[0], f"seed={results[0].get('seed', 0)}", target)
    print(
        f"{'method':>16} {'lr x':>6} {'test acc':>9} {'worker acc':>10} "
        + (f"{'test ppl':>9} " if ppl else "")
        + f"{'rounds':>7} {'MB sent/rank':>13} {'vs adamw':>9} {'step ms':>8} {'Inv.MV':>7}"
        + (f" {'s to target':>12} {'steps':>6}" if target is not None else "")
    )
    for r in results:
        ratio = f"{r['bytes_per_rank'] / base:.3f}" if base else "-"
        worker = f"{r['worker_acc']:.3f}" if "worker_acc" in r else "-"
        inv_mv = f"{r['inv_mv']:.3f}" if "inv_mv" in r else "-"
        perplexity = f"{r['test_ppl']:>9.3f} " if ppl else ""
        reach = ""
        if target is not None:
            seconds, steps = _target_cell(time_to_target(r["log"], target))
            reach = f" {seconds:>12} {steps:>6}"
        print(
            f"{r['method']:>16} {_lr_cell(r):>6} {r['test_acc']:>9.3f} {worker:>10} {perplexity}{r['rounds']:>7} "
            f"{r['bytes_per_rank'] / 1e6:>13.3f} {ratio:>9} {r['step_ms']:>8.2f} {inv_mv:>7}{reach}"
        )


PROJECTED_RATES = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9, "10 Gbit/s": 10e9}


def print_projection(results: list[dict], target: float) -> None:
    """Time to ``target`` if each rank had its own link at each of :data:`PROJECTED_RATES`: the
    measured time to target plus the bytes it sent until then at that rate. A projection."""
    print(
        "projected time to target, s, each rank on its own link (the measured time plus the bytes sent until the "
        "target at the link's rate; latency and overlap not modelled: a projection, not a measurement)"
    )
    print(f"{'method':>16} " + " ".join(f"{name:>11}" for name in PROJECTED_RATES))
    for r in results:
        entry = next((e for e in r["log"] if math.isfinite(e["test_loss"]) and e["test_loss"] <= target), None)
        cells = [
            "-" if entry is None else f"{entry['time_s'] + 8 * entry['bytes'] / bps:.1f}"
            for bps in PROJECTED_RATES.values()
        ]
        print(f"{r['method']:>16} " + " ".join(f"{c:>11}" for c in cells))


def print_summary(summaries: dict[str, dict], results: list[dict], target: float | None) -> None:
    """Several seeds: per method the mean ± std of the final test loss and step time, bytes,
    and how many seeds reach ``target`` in what time and steps (mean ± std of those that do)."""
    first = results[0]
    _print_header(first, f"seeds={summaries[first['method']]['seeds']}", target)
    print(
        f"{'method':>16} {'lr x':>6} {'test loss':>17} {'MB sent/rank':>13} {'step ms':>15}"
        + (f" {'reached':>8} {'s to target':>15} {'steps':>13}" if target is not None else "")
    )
    for method, s in summaries.items():
        lr = _lr_cell(next(r for r in results if r["method"] == method))
        row = (
            f"{method:>16} {lr:>6} {s['final'][0]:>8.4f} ± {s['final'][1]:<6.4f} {s['bytes_per_rank'][0] / 1e6:>13.3f} "
            f"{s['step_ms'][0]:>7.2f} ± {s['step_ms'][1]:<5.2f}"
        )
        if target is not None:
            t, n = s["time_to_target"], s["steps_to_target"]
            row += f" {s['reached']:>4}/{s['seeds']:<3}"
            row += f" {t[0]:>7.1f} ± {t[1]:<5.1f} {n[0]:>6.0f} ± {n[1]:<4.0f}" if t else f" {'-':>15} {'-':>13}"
        print(row)


def _print_header(first: dict, seeds: str, target: float | None) -> None:
    print(
        f"task={first['task']} world_size={first['world_size']} network={network_label()} "
        f"steps={first['log'][-1]['step']} {seeds}" + (f" target loss={target:.4f}" if target is not None else "")
    )
