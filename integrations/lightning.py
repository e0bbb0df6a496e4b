"""Lightning: a DDP strategy that votes, on CPU and GPU alike.

Lightning's ``DDPStrategy`` registers communication hooks on CUDA devices only (on CPU a hook
passed to it is never called), and its model averaging accepts only torch's
``PeriodicModelAverager``. :class:`SignDDPStrategy` is the one object to pass instead::

    import lightning.pytorch as pl
    from signmuon.integrations.lightning import SignDDPStrategy

    class Net(pl.LightningModule):
        def configure_optimizers(self):
            return SignMuon(self.parameters(), lr=2e-3)   # its hook is registered for you

    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=SignDDPStrategy(),
                         gradient_clip_val=1.0)           # clipping cannot shrink a sign step
    trainer.fit(Net(), loader)

Each rank's momentum is its own, and Lightning writes a checkpoint from rank 0 alone, which every
rank loads at ``fit(..., ckpt_path=...)``: :class:`SignDDPStrategy` also writes each rank's own
training state beside it (``<checkpoint>.signmuon_rank00001.pt``: the optimizers', the bare hook's
momentum, the averager's with the worker's parameters) and resumes every rank from its own.

Needs ``pip install 'signmuon[lightning]'``.
"""

from __future__ import annotations

import os
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("signmuon.integrations.lightning needs Lightning: pip install 'signmuon[lightning]'") from error

from signmuon.comm_hooks import SignVoteState, sign_vote_hook
from signmuon.optim import LocalStepAverager, SignVoteOptimizer, register_local_sgd_hook

__all__ = ["RANK_STATE_SUFFIX", "SignDDPStrategy"]

RANK_STATE_SUFFIX = ".signmuon_rank{rank:05d}.pt"
"""Appended to a checkpoint's path: the file of each rank's own training state."""

_FOREIGN = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class SignDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose gradient reduction is one of ours, registered on any device.

    Args:
        comm_state: a :class:`~signmuon.comm_hooks.SignVoteState`: the bare sign-vote hook
            (signSGD-MV or Signum-MV) with whatever optimizer ``configure_optimizers`` returns.
            That optimizer applies the vote as it finds it in ``.grad``, so Lightning's
            ``gradient_clip_val`` would shrink every step: refused together (use ``SignumMV``
            / ``SignSGDMV`` instead, whose steps take the sign and ignore clipping).
        averager: a :class:`~signmuon.optim.LocalStepAverager`: local SGD with pull and push. After
            its warm-up no gradient leaves a worker; every optimizer step ends with
            ``averager.average_parameters`` (a round every ``period`` steps).
        **kwargs: everything else ``DDPStrategy`` takes (``process_group_backend``, ``timeout``,
            DDP's own keyword arguments...). Lightning's ``ddp_comm_*`` and
            ``model_averaging_period`` are refused: the arguments above replace them.

    With neither, ``configure_optimizers`` must return a ``SignMuon`` / ``SignumMV`` /
    ``SignSGDMV``, whose own hook is registered (``opt.register_comm_hook(ddp_model)``).
    Hooks are registered once the DDP model and the optimizers exist, before the first batch;
    a hook that has still not run by the first optimizer step raises there.

    Checkpoints: every rank writes its own training state beside the checkpoint rank 0 writes
    (:data:`RANK_STATE_SUFFIX`, removed with it) and loads it at ``ckpt_path=...``; the files
    must be where every rank sees its own. A checkpoint without them is refused by our
    optimizers on every rank (it holds rank 0's momentum), and with ``comm_state`` or
    ``averager`` raises ``FileNotFoundError``.
    """

    def __init__(
        self, *, comm_state: SignVoteState | None = None, averager: LocalStepAverager | None = None, **kwargs: Any
    ) -> None:
        given = sorted(set(kwargs) & set(_FOREIGN))
        if given:
            raise ValueError(
                f"SignDDPStrategy sets the gradient reduction itself; {given} would compete with it: pass "
                "comm_state=SignVoteState(...), averager=LocalStepAverager(...), or a SignMuon from configure_optimizers"
            )
        if comm_state is not None and not isinstance(comm_state, SignVoteState):
            raise TypeError(f"comm_state must be a SignVoteState, got {type(comm_state).__name__}")
        if averager is not None and not isinstance(averager, LocalStepAverager):
            raise TypeError(f"averager must be a LocalStepAverager, got {type(averager).__name__}")
        if comm_state is not None and averager is not None:
            raise ValueError("comm_state and averager are two gradient reductions for one model; pass one")
        super().__init__(**kwargs)
        self.comm_state = comm_state
        self.averager = averager
        self._own_parameters: dict[str, Any] | None = None  # this rank's, loaded before DDP's broadcast

    def _rank_file(self, filepath: Any) -> str:
        return f"{filepath}{RANK_STATE_SUFFIX.format(rank=self.global_rank)}"

    def _rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What of a checkpoint is this rank's own: the optimizers' states (the momentum, before the
        vote), the bare hook's momentum and the averager's state (its slice of the rounds), with an
        averager the parameters too."""
        own = {"optimizer_states": checkpoint["optimizer_states"]}
        if self.comm_state is not None:
            own["comm_state"] = self.comm_state.state_dict()
        if self.averager is not None:  # between rounds each worker's parameters are its own too
            own["averager"] = self.averager.state_dict()
            own["state_dict"] = checkpoint["state_dict"]
        return own

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # rank 0's file
        if "optimizer_states" in checkpoint:  # not a weights-only checkpoint
            own = self._rank_state(checkpoint)
            self.checkpoint_io.save_checkpoint(own, self._rank_file(filepath), storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        self.checkpoint_io.remove_checkpoint(self._rank_file(filepath))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if "optimizer_states" not in checkpoint:
            return checkpoint
        path = self._own_file(checkpoint_path)
        if path is None:
            if self.comm_state is not None or self.averager is not None:
                raise FileNotFoundError(
                    f"{self._rank_file(checkpoint_path)} is missing: the checkpoint holds no training state of this "
                    "rank (the hook's momentum, the averager's state are each rank's own); resume from a checkpoint "
                    "SignDDPStrategy saved, on storage every rank sees"
                )
            return checkpoint  # our optimizers refuse rank 0's momentum on every other rank
        own = self.checkpoint_io.load_checkpoint(path, weights_only=True)
        checkpoint["optimizer_states"] = own["optimizer_states"]
        for name, target in (("comm_state", self.comm_state), ("averager", self.averager)):
            if target is not None:
                if name not in own:
                    raise ValueError(f"{path} holds no {name} state: it was saved by a SignDDPStrategy without {name}")
                target.load_state_dict(own[name])
        if self.averager is not None:
            if "state_dict" not in own:
                raise ValueError(
                    f"{path} holds no parameters of this rank (an older SignDDPStrategy's): between rounds "
                    "they are each rank's own; resume from a checkpoint this version saved"
                )
            checkpoint["state_dict"] = self._own_parameters = own["state_dict"]
        return checkpoint

    def _own_file(self, checkpoint_path: Any) -> str | None:
        """This rank's file of ``checkpoint_path`` (of its target, for ModelCheckpoint's ``last.ckpt`` link)."""
        candidates = [self._rank_file(checkpoint_path)]
        if os.path.islink(str(checkpoint_path)):
            candidates.append(self._rank_file(os.path.realpath(checkpoint_path)))
        return next((c for c in candidates if get_filesystem(c).exists(c)), None)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # wraps the model in DDP, then sets up the optimizers
        if self._own_parameters is not None:  # DDP's wrapping broadcast rank 0's over them
            self.lightning_module.load_state_dict(self._own_parameters)
            self._own_parameters = None
        if trainer.state.fn == TrainerFn.FITTING:
            self._register_reduction(trainer)

    def _register_reduction(self, trainer: pl.Trainer) -> None:
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        voting = [o for o in optimizers if isinstance(o, SignVoteOptimizer)]
        if (self.comm_state is not None or self.averager is not None) and voting:
            raise ValueError(
                f"configure_optimizers returned {type(voting[0]).__name__}, which registers its own hook, and "
                "SignDDPStrategy was given comm_state or averager too; use one of the two"
            )
        scaler = getattr(self.precision_plugin, "scaler", None)  # precision="16-mixed"
        if scaler is not None and self.comm_state is not None:
            raise ValueError(
                "precision='16-mixed' with the bare sign-vote hook: GradScaler divides the voted ±1 gradient by its "
                "scale and so every step of a plain optimizer. Return signmuon.optim.SignumMV, SignSGDMV or SignMuon "
                "from configure_optimizers, or train in precision='bf16-mixed'"
            )
        if self.comm_state is not None:
            if trainer.gradient_clip_val:
                raise ValueError(
                    f"gradient_clip_val={trainer.gradient_clip_val} with the bare sign-vote hook: clipping shrinks the "
                    "voted ±1 gradient and so every step of a plain optimizer. Return signmuon.optim.SignumMV or "
                    "SignSGDMV from configure_optimizers (no comm_state needed), or set gradient_clip_val=None"
                )
            self.model.register_comm_hook(self.comm_state, sign_vote_hook)
            for optimizer in optimizers:
                self.comm_state.check_called_by_first_step(
                    optimizer,
                    fix="Under Lightning, pass the state as SignDDPStrategy(comm_state=...) and train with it.",
                )
        elif self.averager is not None:
            register_local_sgd_hook(self.model, self.averager)
            self._model_averager = self.averager  # DDPStrategy.optimizer_step calls average_parameters
        elif len(voting) == 1:
            voting[0].register_comm_hook(self.model)
            if scaler is not None:
                voting[0].use_grad_scaler(scaler)  # the vote divides by the loss scale; overflows reach the scaler
        else:
            found = ", ".join(type(o).__name__ for o in optimizers) or "none"
            raise ValueError(
                "SignDDPStrategy needs one sign-voting optimizer (SignMuon, SignumMV or SignSGDMV) from "
                f"configure_optimizers, or comm_state / averager; got optimizers: {found}"
            )
