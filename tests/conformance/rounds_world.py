"""The world of the rounds' cells (test_rounds_cells.py, test_streaming_cells.py): what every rank
of a spawn runs (:func:`train`, one :class:`Run` per cell) and the single-process simulation each
cell's result must equal.

The simulation (:func:`simulate`) is local SGD as published, written with torch alone: workers in a
loop, the warm-up's gradient mean, DiLoCo's outer Nesterov step on the mean pseudo-gradient, DPPF's
pull and push, node-aware rounds as nodes whose gradient is their ranks' mean."""

from __future__ import annotations

import io
import math
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from signmuon.comm_hooks import node_layout
from signmuon.optim import LocalStepAverager, OuterStep, local_sgd
from signmuon.optim.rounds.streaming import split_by_bytes

from .cells import Cell

PERIOD = 3
LR, MOMENTUM = 0.1, 0.9
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # OuterStep.diloco()
VOCAB, WIDTH = 12, 6
ATOL = 1e-5  # gloo's sums and lerp's rounding against the simulation's; the bugs move entries by ~1e-2


class TiedNet(nn.Module):
    """A language model whose head is its embedding (one Parameter, two names) and an extra head
    some ranks leave out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.extra = nn.Linear(WIDTH, 2)

    def forward(self, tokens: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.body(self.embed(tokens[:, :-1])))
        loss = F.cross_entropy(self.head(h).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return loss + self.extra(h).pow(2).mean() if use_extra else loss


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight


def _model(kind: str) -> nn.Module:
    return _gpt2() if kind == "gpt2" else TiedNet()


def _tokens(kind: str, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return (
        torch.randint(0, 50, (2, 8), generator=gen)
        if kind == "gpt2"
        else torch.randint(0, VOCAB, (4, 6), generator=gen)
    )


def _loss(kind: str, net: nn.Module, tokens: torch.Tensor, use_extra: bool) -> torch.Tensor:
    return net(input_ids=tokens, labels=tokens).loss if kind == "gpt2" else net(tokens, use_extra)


def _inner(model: nn.Module, grouped: bool) -> torch.optim.Optimizer:
    params = list(model.parameters())  # a tied weight once
    given = [{"params": params[1::2]}, {"params": params[::2]}] if grouped else params
    return torch.optim.SGD(given, lr=LR, momentum=MOMENTUM)


@dataclass(frozen=True)
class Run:
    """One way of running rounds.

    Attributes:
        outer: DiLoCo's outer step (else plain rounds, torch's schedule).
        pull, push: DPPF's, around the average or the consensus.
        warmup: warm-up steps (gradients all-reduced; needs ``ddp``).
        steps: optimizer steps per rank.
        unused_on: ranks on which the extra head gets no gradient.
        per_node: node-aware rounds over nodes of this many ranks (0: flat).
        ddp: DDP and ``local_sgd`` (else a plain loop calling ``average_parameters``).
        resume_after: save after this step and go on from the save in fresh objects.
        torch_state: resume through torch's ``PostLocalSGDOptimizer`` state (the step alone).
        grouped: the averager gets the optimizer's groups, out of module order.
        model: "tied" (:class:`TiedNet`) or "gpt2".
        ahead: ranks that take one step more before ``consensus_state_dict``.
        fragments, delay, alpha, period: streaming rounds (F, τ, α; ``period`` each fragment's).
        dcp: resume through a DCP checkpoint (``get_state_dict``, ``dcp.save``, ``dcp.load``), into
            ``"fresh"`` objects or ``"running"`` ones; ``"direct"``: ``dcp.save`` of the model's,
            the optimizer's and the averager's ``state_dict()``, loaded the same way into fresh objects.
        pairs: ranks 0, 1 and ranks 2, 3 each run their rounds over a process group of their own
            (DDP, where ``ddp``, over the same group).
        interleaved: with ``pairs``, the groups are ranks 0, 2 and ranks 1, 3.
        pseudo_gradient: the outer step's rule (``"sign_vote"``: the vote of the workers' signs,
            each tensor scaled by their mean of its mean magnitude; ties vote 0).
    """

    outer: bool = True
    pull: float = 1.0
    push: float = 0.0
    warmup: int = 0
    steps: int = 7
    unused_on: tuple[int, ...] = ()
    per_node: int = 0
    ddp: bool = False
    resume_after: int | None = None
    torch_state: bool = False
    grouped: bool = False
    model: str = "tied"
    ahead: tuple[int, ...] = ()
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    period: int = PERIOD
    pairs: bool = False
    dcp: str = ""
    interleaved: bool = False
    pseudo_gradient: str = "mean"

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each process group of ``pairs`` (else one of all four)."""
        if not self.pairs:
            return ((0, 1, 2, 3),)
        return ((0, 2), (1, 3)) if self.interleaved else ((0, 1), (2, 3))


# --- on every rank of the spawn -------------------------------------------------------------------


def _build(run: Run, where: dict):
    model = _model(run.model)
    net = (
        DDP(model, process_group=where.get("process_group")) if run.ddp else model
    )  # DDP first: its constructor copies rank 0's parameters
    averager = LocalStepAverager(
        period=run.period,
        warmup_steps=run.warmup,
        pull=run.pull,
        push=run.push,
        outer=OuterStep.diloco(pseudo_gradient=run.pseudo_gradient) if run.outer else None,
        module=model,
        **where,
        fragments=run.fragments,
        sync_delay=run.delay,
        update_alpha=run.alpha,
    )
    inner = _inner(model, run.grouped)
    opt = local_sgd(net, inner, averager) if run.ddp else inner
    return model, net, averager, opt


def _step(built, run: Run, rank: int, step: int) -> None:
    model, net, averager, opt = built
    opt.zero_grad()
    _loss(run.model, net, _tokens(run.model, rank, step), rank not in run.unused_on).backward()
    opt.step()
    if not run.ddp:
        averager.average_parameters(opt.param_groups)


def _resumed(built, run: Run, where: dict):
    """A save (each rank's model and optimizer, as a training script writes them; in a plain loop
    the averager's too) loaded into fresh objects."""
    model, _, averager, opt = built
    buffer = io.BytesIO()
    mine = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(mine if run.ddp else {**mine, "averager": averager.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    fresh = _build(run, where)
    fresh[0].load_state_dict(saved["model"])
    if not run.ddp:
        fresh[2].load_state_dict(saved["averager"])
    if run.torch_state:
        from torch.distributed.optim import PostLocalSGDOptimizer

        saved["optimizer"].pop("averager")
        PostLocalSGDOptimizer(fresh[3].optim, fresh[2]).load_state_dict(saved["optimizer"])
    else:
        fresh[3].load_state_dict(saved["optimizer"])
    return fresh


def _dcp_resumed(built, run: Run, where: dict):
    """A DCP checkpoint (one folder for every rank) of ``get_state_dict`` (the DDP model and
    local_sgd's optimizer), loaded with ``set_state_dict`` into fresh objects (``run.dcp ==
    "fresh"``) or into the running ones; or (``"direct"``) of each object's ``state_dict()``,
    loaded with each one's ``load_state_dict`` into fresh objects."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    made = [tempfile.mkdtemp(prefix="signmuon-rounds-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, 0)
    try:
        if run.dcp == "direct":
            objects = dict(zip(("model", "optim", "averager"), (built[0], built[3], built[2])))
            dcp.save({name: o.state_dict() for name, o in objects.items()}, checkpoint_id=made[0])
            fresh = _build(run, where)
            state = {name: o.state_dict() for name, o in zip(objects, (fresh[0], fresh[3], fresh[2]))}
            dcp.load(state, checkpoint_id=made[0])
            for name, o in zip(objects, (fresh[0], fresh[3], fresh[2])):
                o.load_state_dict(state[name])
            return fresh
        model_state, optim_state = get_state_dict(built[1], built[3])
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=made[0])
        fresh = _build(run, where) if run.dcp == "fresh" else built
        model_state, optim_state = get_state_dict(fresh[1], fresh[3])
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=made[0])
        set_state_dict(fresh[1], fresh[3], model_state_dict=state["model"], optim_state_dict=state["optim"])
        return fresh
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(made[0], ignore_errors=True)


def _named(module: nn.Module, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=remove_duplicate)}


def train(rank: int, world_size: int, run: Run) -> dict:
    """This rank's parameters, the consensus state dict and a fresh model loaded with it."""
    where = {"layout": node_layout(None, run.per_node) if run.per_node else None}
    if run.pairs:  # every rank makes every group, in the same order
        made = [dist.new_group(list(ranks)) for ranks in run.groups]
        where["process_group"] = next(g for g, ranks in zip(made, run.groups) if rank in ranks)
    built = _build(run, where)
    for step in range(run.steps + (rank in run.ahead)):
        _step(built, run, rank, step)
        if step == run.resume_after:
            built = (_dcp_resumed if run.dcp else _resumed)(built, run, where)
    model, _, averager, _ = built
    state = averager.consensus_state_dict(model)
    loaded = _model(run.model)
    loaded.load_state_dict(state)
    return {"params": _named(model), "consensus": dict(state), "loaded": _named(loaded, remove_duplicate=False)}


def shared_data(rank: int, world_size: int) -> None:
    """Weights tied by sharing .data: two Parameters over one memory."""
    model = TiedNet()
    model.head.weight = nn.Parameter(model.embed.weight.data)
    averager = LocalStepAverager(period=1, pull=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    averager.average_parameters(model.parameters())


def node_pairs_as_group(rank: int, world_size: int) -> None:
    """Node-aware rounds given a process group of one node's ranks."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    LocalStepAverager(period=PERIOD, module=TiedNet(), layout=node_layout(None, 2), process_group=pairs[rank // 2])


# --- the single-process simulation --------------------------------------------------------------


def _is_round(run: Run, step: int) -> bool:
    if step < run.warmup:
        return False
    if run.outer:  # DiLoCo's: after every `period` local steps
        return (step - run.warmup + 1) % run.period == 0
    return (step - run.warmup) % run.period == 0  # torch's: right after the warm-up, then every period


@torch.no_grad()
def _pull_push(params: list[torch.Tensor], targets: list[torch.Tensor], pull: float, push: float) -> None:
    d = [p - t for p, t in zip(params, targets)]
    r = math.sqrt(sum(float(x.double().pow(2).sum()) for x in d))
    for p, x in zip(params, d):
        p.copy_(p - pull * x + push * x / max(r, 1e-8))


def _simulate(run: Run, ranks: tuple[int, ...]) -> list[dict]:
    """The ranks of one process group, its workers (each ``per_node`` consecutive ones a node)."""
    per = run.per_node or 1
    workers = len(ranks) // per
    models = [_model(run.model) for _ in range(workers)]
    inners = [_inner(m, run.grouped) for m in models]
    params = [list(m.parameters()) for m in models]  # torch lists a tied weight once
    consensus = [p.detach().clone() for p in params[0]]
    # streaming DiLoCo as published: fragments of consecutive tensors, each its own outer step
    runs = split_by_bytes([c.numel() * c.element_size() for c in consensus], run.fragments)
    outers = [torch.optim.SGD(consensus[a:b], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for a, b in runs]
    every = run.period // run.fragments
    for step in range(run.steps):
        for w, (m, inner) in enumerate(zip(models, inners)):
            inner.zero_grad()
            for rank in ranks[w * per : (w + 1) * per]:  # a node's gradient: its ranks' mean
                _loss(run.model, m, _tokens(run.model, rank, step), rank not in run.unused_on).backward()
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.div_(per)
        if step < run.warmup:  # DDP's mean over every worker
            for i in range(len(consensus)):
                mean = sum(ps[i].grad for ps in params) / workers
                for ps in params:
                    ps[i].grad = mean.clone()
        for inner in inners:
            inner.step()
        with torch.no_grad():
            if run.outer and step == run.warmup - 1:  # the workers are equal at the end of the warm-up
                for c, p in zip(consensus, params[0]):
                    c.copy_(p)
            k = step - run.warmup + 1  # local steps since the warm-up
            if run.outer and k > 0 and (k + run.delay) % every == 0:  # taken τ steps before it lands
                a, b = runs[((k + run.delay) // every - 1) % run.fragments]
                total = sum(c.numel() for c in consensus[a:b])
                chunk = -(-total // run.per_node) if run.per_node else total  # each rail's slice of the fragment
                start = 0
                for i in range(a, b):
                    deltas = [consensus[i] - ps[i] for ps in params]
                    consensus[i].grad = sum(deltas) / workers
                    if run.pseudo_gradient == "sign_vote":  # one scale per tensor, per piece where a slice cuts it
                        grad = torch.sign(sum(torch.sign(d) for d in deltas)).reshape(-1)
                        end = start + grad.numel()
                        cuts = sorted({start, end} | set(range(chunk * (start // chunk + 1), end, chunk)))
                        for lo, hi in zip(cuts, cuts[1:]):
                            grad[lo - start : hi - start] *= (
                                sum(d.reshape(-1)[lo - start : hi - start].abs().mean() for d in deltas) / workers
                            )
                        consensus[i].grad = grad.view_as(deltas[0])
                    start += consensus[i].numel()
            if not _is_round(run, step) if not run.outer else not (k > 0 and k % every == 0):
                continue
            if run.outer:
                f = (k // every - 1) % run.fragments
                a, b = runs[f]
                outers[f].step()
                for ps in params:
                    _pull_push(ps[a:b], consensus[a:b], run.pull * (1 - run.alpha), run.push)
                continue
            targets = [sum(ps[i] for ps in params) / workers for i in range(len(consensus))]
            for ps in params:
                _pull_push(ps, targets, run.pull, run.push)
    return [_expected(run, models, consensus, i // per) for i in range(len(ranks))]


def _expected(run: Run, models: list[nn.Module], consensus: list[torch.Tensor], worker: int) -> dict:
    """What rank ``worker``'s train() returns: every name of a parameter carries its consensus
    (with an outer step) or the workers' mean."""
    index = {id(p): i for i, p in enumerate(models[0].parameters())}
    by_name = dict(models[0].named_parameters(remove_duplicate=False))
    means = [sum(ps) / len(models) for ps in zip(*(list(m.parameters()) for m in models))]
    value = {n: (consensus if run.outer else means)[index[id(p)]].detach().clone() for n, p in by_name.items()}
    return {
        "params": _named(models[worker]),
        "consensus": {n: value[n] for n in models[0].state_dict()},
        "loaded": value,
    }


def simulate(run: Run, world_size: int) -> list[dict]:
    """Every rank's expected result, the workers simulated one after another in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: the same float results
    try:
        groups = run.groups if run.pairs else (tuple(range(world_size)),)
        by_rank = {}
        for ranks in groups:  # each group a world of its own
            by_rank.update(zip(ranks, _simulate(run, ranks)))
        return [by_rank[r] for r in range(world_size)]
    finally:
        torch.set_num_threads(threads)


def rounds_cell(entry: str, klass: str, case: str, run: Run, refusal: str | None = None) -> Cell:
    """A cell of ``run``: equal to :func:`simulate` rank by rank, or refused with ``refusal``."""
    if refusal is not None:
        return Cell(entry, klass, case, partial(train, run=run), refusal=refusal)
    return Cell(entry, klass, case, partial(train, run=run), partial(simulate, run), atol=ATOL, per_rank=True)


AVERAGER, CONSENSUS = "LocalStepAverager", "consensus_state_dict"
DCP_DIRECT = "so every rank would resume with one rank's. Save a file per rank with torch.save"
"""What every rank raises for a DCP checkpoint of the rounds' state_dict()s: one rank's copy."""
HOLDS, GRADIENT, STATE, STEP = (
    "what the optimizer holds",
    "who has a gradient",
    "whose state comes back",
    "ranks out of step",
)
