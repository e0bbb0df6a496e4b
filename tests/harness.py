"""What the tests share, shipped with them and not with the library: ``run_distributed`` (the
benchmarks' launcher of local gloo ranks, any result read back), the tiny model, batches and error capture, and the slow,
obviously-correct references the fast paths are held to."""

import math

import torch
import torch.multiprocessing as mp
from torch import nn

from signmuon.benchmarks.runtime.launch import run_ranks
from signmuon.comm_hooks.kernels import reference
from signmuon.comm_hooks.vote.packing import as_bytes, as_words
from signmuon.optim import polar_direction
from signmuon.optim.newton_schulz import as_matrix, newton_schulz

# --- running a function on M local ranks -----------------------------------------------------


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0, threads: int = 1) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` local gloo processes.

    Returns each rank's result (``torch.save``-able), rank 0 first. ``threads`` is each
    process's torch thread count (1 keeps M ranks from fighting over a few cores).
    """
    return run_ranks(
        fn, world_size, args, timeout=timeout, threads=threads, load=_load_scratch, start_method="forkserver"
    )


# The suite starts a few hundred process groups: forked from a server that imported torch once,
# a rank starts in a fraction of a second instead of importing torch afresh each time.
mp.set_forkserver_preload(["torch", "torch.distributed"])


def _load_scratch(path: str):
    # The tests' ranks return any torch.save-able object, into the run's own temporary folder:
    # unlike the library's files, these may unpickle.
    return torch.load(path, weights_only=False)


# --- the tiny model ----------------------------------------------------------------------------


def tiny_net() -> nn.Module:
    """6 -> 12 -> 3 MLP, the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent inputs and labels for ``tiny_net``."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)


# --- the rounds' toy: a model, its batches, loss and inner optimizer ------------------------------


def rounds_model() -> nn.Module:
    torch.manual_seed(0)  # the same start on every rank, as DDP makes it
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def rounds_batch(worker: int, step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * worker + step))


def rounds_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x[:, :2].sin()).pow(2).mean()


def rounds_inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# --- the node-level reference: node means, momentum, Newton-Schulz, a vote of the nodes --------


def rank_grads(params, rank, step, dtype=torch.float32):
    """This rank's gradient at ``params`` (a fresh net loaded with them, in ``dtype``), as float32."""
    net = tiny_net().to(dtype)
    with torch.no_grad():
        for p, v in zip(net.parameters(), params):
            p.copy_(v)
    x, y = batch(rank, step)
    nn.functional.cross_entropy(net(x.to(dtype)), y).backward()
    return [p.grad.float() for p in net.parameters()]


def node_means(params, step, nodes, per_node, dtype=torch.float32):
    """Each node's mean gradient, summed in rank order then divided, as the node all-reduce does."""
    grads = [rank_grads(params, r, step, dtype) for r in range(nodes * per_node)]
    members = [grads[n * per_node : (n + 1) * per_node] for n in range(nodes)]
    return [[sum(g[i] for g in node) / per_node for i in range(len(node[0]))] for node in members]


def vote_nodes(directions):
    """sign(sum over nodes of sign(direction)), per tensor (exact ties: 0)."""
    return [torch.sign(sum(torch.sign(d[i]) for d in directions)) for i in range(len(directions[0]))]


def node_reference_step(kind, params, step, nodes, per_node, momenta, lr, beta, polar=False, dtype=torch.float32):
    """One step of the node-level algorithm from ``params``; updates ``momenta`` (one list per node).
    ``kind``: "signsgd", "signum" (the hook's mul-add momentum), "signum_mv" (the optimizers' lerp),
    "signmuon"; ``polar``: SignMuon's post-vote polar step on matrices; ``dtype``: the gradients'
    (computed at ``params`` rounded to it; the math stays float32)."""
    torch.set_num_threads(1)  # the workers' thread count: the same float results
    means = node_means(params, step, nodes, per_node, dtype)
    if kind == "signsgd":
        directions = means
    else:
        for n in range(nodes):
            momenta[n] = [
                m.lerp(g, 1 - beta) if kind != "signum" else beta * m + (1 - beta) * g
                for m, g in zip(momenta[n], means[n])
            ]
        if kind in ("signum", "signum_mv"):
            directions = momenta
        else:  # SignMuon: Nesterov look-ahead, Newton–Schulz on matrices
            directions = []
            for n in range(nodes):
                looks = [g.lerp(m, beta) for g, m in zip(means[n], momenta[n])]
                directions.append([newton_schulz(as_matrix(d), 5).view_as(d) if d.dim() >= 2 else d for d in looks])
    voted = vote_nodes(directions)
    if polar:
        voted = [polar_direction(v) if v.dim() >= 2 else v for v in voted]
    return [p - lr * v for p, v in zip(params, voted)]


def capture(fn) -> str | None:
    """None if ``fn()`` returns, else ``"ErrorType: message"`` (what the tests compare across ranks)."""
    try:
        fn()
        return None
    except Exception as error:  # noqa: BLE001 - the tests inspect type and message
        return f"{type(error).__name__}: {error}"


# --- references ----------------------------------------------------------------------------


def vote_reference(signs: torch.Tensor) -> torch.Tensor:
    """``sign(sum_i sign(v_i))`` over dim 0 of float [M, n], ties 0: the definition."""
    return torch.sign(torch.sign(signs.double()).sum(dim=0)).float()


def pack_signs_reference(x: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`pack_signs`: a Python loop over the entries."""
    return as_bytes(reference.pack(x)[0], x.numel())


def pack_nonzero_reference(x: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`pack_nonzero`."""
    return as_bytes(reference.pack(x)[1], x.numel())


def unpack_signs_reference(positive: torch.Tensor, numel: int, nonzero: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`unpack_signs`, returning float32 on CPU."""
    nz = None if nonzero is None else as_words(nonzero.cpu(), numel)
    return reference.unpack(as_words(positive.cpu(), numel), nz, numel).float()


def compressed_allreduce_reference(buffers, worker_errors, server_errors):
    """1-bit Adam's error-feedback scaled-sign all-reduce, in floats, for all ranks at once."""
    M = len(buffers)
    n = worker_errors[0].numel()
    chunk = n // M

    def compress(x):
        scale = x.norm() / (x.numel() ** 0.5)
        sign = torch.where(x >= 0, 1.0, -1.0)
        return scale, sign, x - scale * sign

    compressed = []
    for r in range(M):
        x = torch.zeros(n)
        x[: buffers[r].numel()] = buffers[r].reshape(-1)
        scale, sign, worker_errors[r] = compress(x + worker_errors[r])
        compressed.append(scale * sign)
    pieces = []
    for r in range(M):
        server = sum(c[r * chunk : (r + 1) * chunk] for c in compressed) / M
        scale, sign, server_errors[r] = compress(server + server_errors[r])
        pieces.append(scale * sign)
    result = torch.cat(pieces)[: buffers[0].numel()].view_as(buffers[0])
    return result, worker_errors, server_errors


# --- the rounds' one-bit combination of pseudo-gradients, as published --------------------------


def shared_scales(deltas, sizes, scale_bits):
    """The workers' mean of each tensor's mean |delta|, each worker's scales sent in ``scale_bits``:
    float32; bfloat16 (rounded, divided by the workers, summed in bfloat16); or 8-bit codes
    round(8·log2(largest/scale)) below the worker's largest scale (255: zero)."""
    own = [[float(p.abs().mean()) for p in d.split(sizes)] for d in deltas]
    if scale_bits == 16:
        return [float(sum(torch.tensor(s[i]).to(torch.bfloat16) / len(own) for s in own)) for i in range(len(sizes))]
    if scale_bits == 8:
        codes = [[round(8 * math.log2(max(s) / x)) if x > 0 else 255 for x in s] for s in own]
        own = [[0.0 if c >= 255 else max(s) * 2 ** (-c / 8) for c in cs] for s, cs in zip(own, codes)]
    return [sum(s[i] for s in own) / len(own) for i in range(len(sizes))]


def coin_vote(deltas, round_index):
    """The vote with ``tie="fast"``: a tie among the voters takes the coin of the definition,
    ``tie_bit(call_key(seed 0, round), segment 0, entry)``, entries counted from the start of what
    the workers vote together."""
    from signmuon.comm_hooks.kernels import reference
    from signmuon.comm_hooks.vote.encodings.sign import call_key

    signs = torch.stack([d.sign() for d in deltas]).double()
    total, present = signs.sum(0), (signs != 0).sum(0)
    voted = torch.sign(total).float()
    key = call_key(0, round_index)
    for i in ((total == 0) & (present > 0)).nonzero().view(-1).tolist():
        voted[i] = 2.0 * reference.tie_bit(key, 0, i) - 1
    return voted


def sign_vote_combine(deltas, sizes, scale_bits=32, coin_round=None):
    """Majority vote of the deltas' signs (exact ties; fast ones with ``coin_round``, the round's
    index), each tensor scaled by :func:`shared_scales`."""
    if coin_round is None:
        voted = vote_reference(torch.stack([d.sign() for d in deltas]))
    else:
        voted = coin_vote(deltas, coin_round)
    scales = shared_scales(deltas, sizes, scale_bits)
    return torch.cat([piece * scale for piece, scale in zip(voted.split(sizes), scales)])
