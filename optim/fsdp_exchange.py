"""The exchange of the FSDP vote (:class:`ShardedExchange`, made by
:func:`~signmuon.optim.fsdp.register_fsdp_vote`): each FSDP unit's gradient shards voted between
nodes, and the optimizer's state as DCP saves it (each node's momentum as a row of an (N, ...)
DTensor on the (node, local) mesh)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from signmuon.comm_hooks.dist import VoteMismatchError, group_size_rank
from signmuon.comm_hooks.shard_vote import ShardSpec, ShardVoter

from .checkpoint import load_rank_state
from .exchanges import Exchange, Exchanged
from .fsdp_units import UnitVotes
from .params import local_tensor
from .shards import vote_shards
from .sign_vote import SignVoteOptimizer

__all__ = ["ShardedExchange"]

_MARK_COLUMNS = 2520  # splits evenly over 1..10 ranks per node, leaves every rank a column up to 50
_USE_DCP = (
    "On FSDP shards, save with torch.distributed.checkpoint (get_state_dict(model, opt) and dcp.save on every rank; "
    "dcp.load and set_state_dict to resume, on any ranks per node), or save a file per rank "
    "(torch.save(opt.state_dict(), f'optimizer.rank{rank}.pt') on every rank, each loading its own): not one "
    "rank's optimizer file loaded on every rank"
)


@dataclass(eq=False)
class ShardedExchange(Exchange):
    """The exchange :func:`~signmuon.optim.fsdp.register_fsdp_vote` gives an optimizer: the mesh,
    the voter and each voted parameter's :class:`~signmuon.comm_hooks.shard_vote.ShardSpec`.
    ``finish_vote`` runs on the whole tensor at its owner, inside the exchange.

    With ``units`` (the default of ``register_fsdp_vote``), each FSDP unit is voted as
    backward reduces it; ``step()`` votes only what no unit voted (all of it without ``units``)."""

    mesh: DeviceMesh
    voter: ShardVoter
    specs: dict[torch.Tensor, ShardSpec]
    units: UnitVotes | None = None
    """The vote during backward, unit by unit; None: in ``step()``."""
    results: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    """Voted updates (or mean gradients) of the parameters voted since the last step."""
    skipped: bool = False
    """Whether a vote since the last step was skipped (a NaN or Inf): then ``step()`` skips all."""

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(nodes, ranks per node)."""
        return self.mesh.shape[0], self.mesh.shape[1]

    finishes_vote = True

    def vote(
        self,
        optimizer: SignVoteOptimizer,
        params: list[torch.Tensor],
        name: str,
        grads: list[torch.Tensor | None] | None = None,
        unit: int | None = None,
    ) -> None:
        """Vote ``params`` into :attr:`results` (voted ones: their shard of the update; averaged
        ones: their shard of the mean gradient) from ``grads`` (default: their ``.grad``; None: no
        gradient, as from a parameter that has none: every parameter takes part).

        ``unit``: the FSDP unit these are, voted during backward. Its number tags the exchange on
        the rail, so nodes whose units closed in different orders raise VoteMismatchError on
        every rank instead of voting one unit's gradients against another's of the same size."""
        if grads is None:
            grads = [None if p.grad is None else local_tensor(p.grad) for p in params]
        step, skipped = optimizer.steps_taken, self.voter.stats.skipped
        units = len(self.units.units) if self.units is not None else 0
        tag = step * (units + 1) + (0 if unit is None else unit + 1)
        label = f"{name} step {step}" + ("" if unit is None else f", FSDP unit {unit}")
        try:
            done = vote_shards(
                optimizer,
                self.voter,
                params,
                grads,
                self.specs,
                label=label,
                tag=tag,
                mean_tag=None if unit is None else tag,
            )
        except VoteMismatchError as error:
            if self.units is None:
                raise
            raise VoteMismatchError(f"{error}{self.hint}") from error
        self.skipped |= self.voter.stats.skipped != skipped
        self.results.update(zip([p for _, p, _ in done.voted + done.averaged], done.signs + done.means))

    @property
    def hint(self) -> str:
        """What a mismatch during backward says to do."""
        if self.units is None:
            return ""
        return (
            f". The vote during backward takes FSDP units in the order they close (tag: step x "
            f"{len(self.units.units) + 1} + unit + 1; + 0 for what no unit reduced, voted in step()), which must be "
            "the same on every node; where data-dependent control flow changes it, pass during_backward=False to "
            "register_fsdp_vote"
        )

    def exchange(self, optimizer: SignVoteOptimizer, params: list[torch.Tensor], name: str) -> Exchanged:
        """For ``optimizer.step()``: (voted, this rank's shard of each voted update, averaged,
        its shard of each mean gradient). A skipped vote of any unit skips the whole step, as the
        vote of the whole step would."""
        if self.units is not None:
            self.units.finish()
        left = [p for p in params if p not in self.results]
        if left:
            self.vote(optimizer, left, name)
        self.voter.settle(self.hint)  # a mismatch on one rail stops every rank here, not at the next collective
        voted, averaged = optimizer.split_by_path(params)
        signs = [self.results[p] for _, p, _ in voted]
        if self.skipped:
            signs = [torch.zeros_like(s) for s in signs]
        return Exchanged(voted, signs, averaged, [self.results[p] for _, p, _ in averaged])

    def stepped(self) -> None:
        self.results.clear()
        self.skipped = False
        if self.units is not None:
            self.units.stepped()

    def state_dict(self, optimizer: SignVoteOptimizer, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as DCP needs it: each node's momentum as a DTensor of shape (N, *shape), the
        state that every node shares (AdamW's moments) as DTensors like their parameter; the
        step count and the layout in every param group (the only entries DCP keeps besides state)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        nodes, per_node = self.mesh_shape
        out = {}
        for index, values in state["state"].items():
            p = params[index]
            out[index] = {
                key: self._as_dtensor(p, value, per_node_state=key == "momentum_buffer")
                if _is_shard(value, p)
                else value
                for key, value in values.items()
            }
        info = {"steps_taken": optimizer.steps_taken, "nodes": nodes, "ranks_per_node": per_node}
        groups = [{**g, "signmuon": info} for g in state["param_groups"]]
        if groups:  # one mark, in the first group (DCP keeps only state and param groups)
            groups[0]["signmuon"] = {**info, "mark": self._mark(group_size_rank(optimizer.process_group)[1])}
        return {"state": out, "param_groups": groups}

    def _mark_row(self) -> tuple[torch.Tensor, int]:
        """This rank's part of the mark (see :meth:`_mark`) without the saving rank, and N x C."""
        nodes, per_node = self.mesh_shape
        node, local = self.mesh.get_coordinate()
        chunks = torch.arange(_MARK_COLUMNS, dtype=torch.int64).chunk(per_node)
        columns = chunks[local] if local < len(chunks) else torch.zeros(0, dtype=torch.int64)
        return node * _MARK_COLUMNS + columns, nodes * _MARK_COLUMNS

    def _mark_misses(self) -> bool:
        """Whether some rank of a node holds no column of the mark (more ranks per node than its
        columns share out): a rank's check of it then proves nothing, so every rank's load is
        also checked by its momentum (as a state saved before the mark is)."""
        per_node = self.mesh_shape[1]
        return len(torch.arange(_MARK_COLUMNS).chunk(per_node)) < per_node

    def _mark(self, rank: int) -> DTensor:
        """Who saved which part of the state: entry (node, column) of an (N, C) DTensor laid out
        as the momentum is holds node x C + column + the saving rank x N x C. DCP hands every rank
        the entries of its own place, however it reshards the ranks of a node; a file of another
        rank's state_dict() hands it that rank's."""
        row, span = self._mark_row()
        value = (row + rank * span).unsqueeze(0).to(self.mesh.device_type)
        shape = torch.Size((self.mesh_shape[0], _MARK_COLUMNS))
        return DTensor.from_local(
            value, self.mesh, [Shard(0), Shard(1)], run_check=False, shape=shape, stride=(shape[1], 1)
        )

    def _saved_here(self, mark: Any, rank: int) -> tuple[int, str | None]:
        """(the rank whose state this is, a refusal) from the loaded mark; ``rank``: this one's."""
        if mark is None:
            return rank, None  # saved before the mark existed: checked by its momentum instead
        loaded = (mark.to_local() if isinstance(mark, DTensor) else mark).detach().cpu().flatten()
        row, span = self._mark_row()
        if loaded.shape == row.shape and torch.equal(loaded % span, row):
            return rank, None
        saver = int(loaded[0]) // span if loaded.numel() else rank
        if saver != rank:
            return saver, None
        return rank, (
            f"rank {rank} is loading its own state_dict() of another layout of ranks per node: a file per rank loads "
            f"on the layout it was saved on only. {_USE_DCP}"
        )

    def _as_dtensor(self, param: torch.Tensor, value: torch.Tensor, *, per_node_state: bool) -> DTensor:
        if not per_node_state:
            return DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        shape = (self.mesh_shape[0], *param.shape)
        return DTensor.from_local(
            value.unsqueeze(0),
            self.mesh,
            [Shard(0), Shard(1)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    def params_changed(self, optimizer: SignVoteOptimizer) -> None:
        raise ValueError("add param groups before register_fsdp_vote: it lays out the shards of the parameters it sees")

    def load_state_dict(self, optimizer: SignVoteOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`state_dict` for this rank, after checking the saved layout."""
        groups = state_dict.get("param_groups", [])
        info = groups[0].get("signmuon") if groups else None
        if info is None or "nodes" not in info:
            raise ValueError(
                "this state dict was not saved by a sign-vote optimizer on FSDP shards (no node layout in its param "
                "groups); save with get_state_dict(model, optimizer) after register_fsdp_vote"
            )
        nodes, per_node = self.mesh_shape
        if info["nodes"] != nodes:
            raise ValueError(
                f"the checkpoint was saved on {info['nodes']} node(s) x {info['ranks_per_node']} rank(s); this run has "
                f"{nodes} node(s) x {per_node} rank(s). Each node's momentum is its own: resume on {info['nodes']} "
                "node(s) (any ranks per node)"
            )
        state = {
            index: {key: _local_part(value) for key, value in values.items()}
            for index, values in state_dict.get("state", {}).items()
        }
        plain = [{k: v for k, v in g.items() if k != "signmuon"} for g in groups]
        saver, refusal = self._saved_here(info.get("mark"), group_size_rank(optimizer.process_group)[1])
        local = load_rank_state(
            optimizer,
            {"state": state, "param_groups": plain, "signmuon": {"steps_taken": info["steps_taken"], "rank": saver}},
            refusal=refusal,
            remedy=_USE_DCP,
            digest=_momentum_digest(state, self.voter.device)
            if info.get("mark") is None or self._mark_misses()
            else None,
        )
        local.pop("signmuon", None)
        return {**local, "signmuon": {"steps_taken": info["steps_taken"]}}


def _momentum_digest(state: dict, device: torch.device) -> torch.Tensor:
    """A state saved before the mark, summed (:func:`~signmuon.optim.checkpoint.agree_to_load`'s
    ``digest``): ranks' own momenta differ (each node's gradients, each rank's rows), so equal
    ones are one rank's file loaded on several. All-zero ones sum to 0, never compared (whose
    they are changes nothing); nodes that saw the same data have equal momenta of their own,
    whose files are refused too."""
    momenta = [v for _, values in sorted(state.items()) for k, v in values.items() if k == "momentum_buffer"]
    digest = torch.zeros(3, dtype=torch.float64, device=device)
    for i, t in enumerate(momenta):
        t = t.to(device, torch.float64)
        digest += torch.stack([t.new_tensor(float(t.numel())), t.sum(), t.square().sum()]) * (i + 1)
    return digest


def _is_shard(value: Any, param: torch.Tensor) -> bool:
    return (
        torch.is_tensor(value)
        and not isinstance(value, DTensor)
        and value.shape == local_tensor(param).shape
        and value.dim() > 0
    )


def _local_part(value: Any) -> Any:
    if not isinstance(value, DTensor):
        return value
    local = value.to_local()
    return local[0] if value.device_mesh.ndim == 2 else local  # (N, ...) per-node state: this node's row
