"""SignMuon's pre-vote work on one worker per step, by path, against the model's forward and
backward: the matrices (momentum, Nesterov look-ahead, Newton–Schulz) and the rest (biases
and norm gains: momentum and look-ahead, one small tensor after another). The rest's time is
all that fusing its momentum step into fewer passes or launches could save.

    signmuon-bench direction-time --task charlm --size medium
    signmuon-bench direction-time --task charlm --size medium --device cuda
"""

from __future__ import annotations

import torch

from signmuon.benchmarks.runtime.cli import check_device, command_parser, positive_int
from signmuon.benchmarks.runtime.launch import median_seconds
from signmuon.benchmarks.workloads.tasks import TASKS, loss_fn, make_task
from signmuon.optim import SignMuon

NAME = "direction-time"
SUMMARY = "SignMuon's pre-vote work per step by path (matrices, the rest) against fwd+bwd"


__all__ = ["direction_time", "main"]


def direction_time(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, repeats: int = 5) -> list[dict]:
    """Rows ``{"path", "params", "entries", "seconds"}`` for the forward and backward of one
    batch, then SignMuon's (default settings) ``local_direction`` over each path's parameters:
    medians of ``repeats`` timed runs after one warm-up."""
    device = next(model.parameters()).device
    opt = SignMuon(model.parameters())

    def forward_backward() -> None:
        model.zero_grad()
        loss_fn(model(inputs), targets).backward()

    params = [p for p in model.parameters() if p.requires_grad]
    rows = [
        {
            "path": "forward+backward",
            "params": len(params),
            "entries": sum(p.numel() for p in params),
            "seconds": median_seconds(forward_backward, repeats, device),
        }
    ]
    for whole, label in ((True, "matrices"), (False, "the rest")):
        chosen = [p for p in params if opt.votes(p) and (opt.route(p)[1] in opt.whole_paths) == whole]
        directions = lambda chosen=chosen: [opt.local_direction(p, p.grad) for p in chosen]  # noqa: E731
        rows.append(
            {
                "path": label,
                "params": len(chosen),
                "entries": sum(p.numel() for p in chosen),
                "seconds": median_seconds(directions, repeats, device) if chosen else 0.0,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("direction-time", __doc__)
    parser.add_argument("--task", default="charlm", choices=[t for t in TASKS if t != "cifar10"])
    parser.add_argument("--size", default="small", choices=["small", "medium"], help="charlm's model size")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="one worker's share of the batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    device = torch.device(args.device)
    torch.manual_seed(0)
    task = make_task(args.task, size=args.size)
    model = task.make_model().to(device)
    inputs, targets = (t.to(device) for t in task.batch(torch.arange(args.batch_size)))
    rows = direction_time(model, inputs, targets, args.repeats)
    base = rows[0]["seconds"]
    print(f"task={args.task} size={args.size} batch={args.batch_size} device={device} torch={torch.__version__}")
    print(f"{'':>17} {'params':>7} {'entries':>11} {'ms':>9} {'vs fwd+bwd':>11}")
    for row in rows:
        print(
            f"{row['path']:>17} {row['params']:>7} {row['entries']:>11} {row['seconds'] * 1e3:>9.3f} "
            f"{row['seconds'] / base:>11.3f}"
        )
    return rows
