"""Where a ReLU model's exact zeros lie, and what a row-and-column code of them would cost.

A rank abstains from the vote where its entry is exactly 0; the positions travel as a list,
as runs of consecutive zeros or as a second bit plane, whichever is cheapest
(``VoteConfig(zeros="abstain")``). Dead units zero whole rows of
the weight into them and whole columns of the weight out of them, so a code of zero rows and
columns costs rows + columns bits per matrix. This command trains one worker (its share of
the batch, SGD) and at chosen steps splits the zeros of each gradient and of Signum's momentum
into those in a zero row, those in a zero column, and the rest; it prints the bits per entry
of that code and of the best row-and-column code (residual zeros as a list or a plane,
whichever is cheaper), per tensor, summed over the model. Matrices are the weights' views as
(first dimension, the rest), as Newton–Schulz sees them.

Two more columns bound what any code could do that treats the zeros left outside zero rows
and columns as independent of each other (their zeroth-order entropy, an ideal arithmetic
coder's cost): with today's sign plane kept (every entry's bit, plus the zeros' positions),
and with signs sent for the nonzero entries only. Each takes per tensor the cheaper of the
plain entropy of the zero mask and the row and column masks plus the entropy of the rest.

    signmuon-bench zero-structure --task digits --batch-size 16 --steps 30
    signmuon-bench zero-structure --task mlp --batch-size 32 --steps 8
"""

from __future__ import annotations

import math

import torch

from signmuon.benchmarks.runtime.cli import command_parser, positive_int
from signmuon.benchmarks.workloads.models import mlp
from signmuon.benchmarks.workloads.tasks import TASKS, loss_fn

NAME = "zero-structure"
SUMMARY = "where a ReLU model's exact zeros lie, and what coding them by rows and columns costs"


__all__ = ["zero_structure", "main"]


def entropy_bits(count: int, n: int) -> float:
    """n times the binary entropy of count / n: an ideal code of which of n entries are marked."""
    if count in (0, n):
        return 0.0
    p = count / n
    return -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p))


def zero_structure(tensors: list[torch.Tensor]) -> dict[str, float]:
    """Fractions of all entries that are zero, in a zero row, in a zero column (not in a zero
    row) and neither; bits per entry of the vote's code (list, runs or plane), of a
    row-and-column code, and the entropy bounds with and without a sign bit for zeros."""
    keys = (
        "entries",
        "zeros",
        "rows",
        "columns",
        "residual",
        "bits_now",
        "bits_structured",
        "entropy_with_plane",
        "entropy_nonzero_signs",
    )
    totals = dict.fromkeys(keys, 0)
    for t in tensors:
        zero = (t == 0).reshape(t.shape[0], -1) if t.dim() > 1 else (t == 0).reshape(1, -1)
        rows, cols = zero.all(dim=1), zero.all(dim=0)
        covered = rows[:, None] | cols[None, :]
        n, k, residual = zero.numel(), int(zero.sum()), int((zero & ~covered).sum())
        flat = zero.reshape(-1)
        runs = int((flat[1:] & ~flat[:-1]).sum()) + int(flat[0])  # maximal runs of zeros
        plane = 64 * -(-n // 64)
        list_or_plane = lambda count: 0 if count == 0 else min(plane, 32 * count)  # noqa: E731
        totals["entries"] += n
        totals["zeros"] += k
        totals["rows"] += int(rows.sum()) * zero.shape[1]
        totals["columns"] += int((cols[None, :] & ~rows[:, None]).sum())
        totals["residual"] += residual
        totals["bits_now"] += n + (min(list_or_plane(k), 64 * runs) if k else 0)
        masks = sum(zero.shape) if k > residual else 0
        totals["bits_structured"] += n + (min(plane, masks + list_or_plane(residual)) if k else 0)
        uncovered = n - int(covered.sum())
        positions = min(entropy_bits(k, n), sum(zero.shape) + entropy_bits(residual, uncovered)) if k else 0.0
        totals["entropy_with_plane"] += n + positions
        totals["entropy_nonzero_signs"] += n - k + positions
    n = totals.pop("entries")
    return {key: value / n for key, value in totals.items()}


def _model_and_batches(task: str, batch_size: int, seed: int):
    torch.manual_seed(seed)
    if task == "mlp":  # ddp-step's 9.9M-parameter ReLU MLP and its four random batches
        gen = torch.Generator().manual_seed(seed)
        batches = [
            (torch.randn(batch_size, 512, generator=gen), torch.randint(0, 10, (batch_size,), generator=gen))
            for _ in range(4)
        ]
        return mlp(1728, 4), lambda step: batches[step % 4]
    made = TASKS[task](seed)
    gen = torch.Generator().manual_seed(seed)
    return made.make_model(), lambda step: made.batch(torch.randint(0, made.num_examples, (batch_size,), generator=gen))


def run(task: str, batch_size: int, steps: int, report: list[int], lr: float = 0.01, beta: float = 0.9, seed: int = 0):
    """[(step, "gradient" | "momentum", zero_structure)] of one worker trained with SGD."""
    model, batch = _model_and_batches(task, batch_size, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    momentum = [torch.zeros_like(p) for p in params]
    optimizer = torch.optim.SGD(params, lr=lr)
    rows = []
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        grads = [p.grad for p in params]
        for m, g in zip(momentum, grads):
            m.lerp_(g, 1 - beta)
        if step in report:
            rows += [(step, "gradient", zero_structure(grads)), (step, "momentum", zero_structure(momentum))]
        optimizer.step()
    return rows


def main(argv: list[str] | None = None) -> list:
    parser = command_parser("zero-structure", __doc__)
    parser.add_argument("--task", default="digits", choices=[*TASKS, "mlp"], help="a train task, or ddp-step's MLP")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="one worker's share of the batch")
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = sorted({0, args.steps // 2, args.steps - 1})
    rows = run(args.task, args.batch_size, args.steps, report, seed=args.seed)
    print(f"task={args.task} batch={args.batch_size} steps={args.steps} seed={args.seed} (fractions of all entries)")
    print(
        f"{'step':>5} {'tensor':>9} {'zeros':>7} {'in rows':>8} {'in cols':>8} {'residual':>9} "
        f"{'bits now':>9} {'bits rows+cols':>15} {'entropy':>8} {'entropy, signs of nonzeros':>27}"
    )
    for step, what, s in rows:
        print(
            f"{step:>5} {what:>9} {s['zeros']:>7.3f} {s['rows']:>8.3f} {s['columns']:>8.3f} {s['residual']:>9.4f} "
            f"{s['bits_now']:>9.2f} {s['bits_structured']:>15.2f} {s['entropy_with_plane']:>8.2f} "
            f"{s['entropy_nonzero_signs']:>27.2f}"
        )
    return rows
