"""The Hugging Face Trainer: our optimizer built from the training arguments, the vote registered.

The Trainer replaces an optimizer it cannot place (``optimizers=(SignMuon(...), None)`` under
DeepSpeed becomes AdamW), refuses our names in a DeepSpeed config (it calls
``deepspeed.initialize`` itself), and under DeepSpeed keeps the engine's fp32 gradient all-reduce
on top of any vote. :class:`SignTrainer` (or :class:`SignTrainerMixin` for your own Trainer
subclass) handles all three::

    from signmuon.integrations.transformers import SignTrainer

    trainer = SignTrainer(
        model=model, args=TrainingArguments(..., learning_rate=2e-3),
        train_dataset=dataset,
        sign_optimizer={"type": "SignMuon", "params": {"momentum": 0.95}},   # the default type
    )
    trainer.train()

Under DDP (``torchrun``) the optimizer's hook is registered on the Trainer's DDP model; under
DeepSpeed (``args.deepspeed``, a config without an ``"optimizer"`` section, ZeRO stage 0, fp32)
the engine's all-reduce is switched off and the vote runs bucket by bucket in backward
(:class:`~signmuon.comm_hooks.BackwardReducer`). The Trainer's gradient clipping
(``max_grad_norm``, 1.0 by default) rescales the vote, whose sign our optimizers take: it changes
nothing.

Each rank's momentum is its own, and the Trainer saves the optimizer from rank 0 alone
(``optimizer.pt``), which every rank would load at ``resume_from_checkpoint``: every rank also
writes its own state (:data:`RANK_STATE_FILE`, in the checkpoint's folder) and resumes from it.
Needs ``pip install 'signmuon[transformers]'``.
"""

from __future__ import annotations

import glob
import os
from typing import Any

try:
    import transformers
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "signmuon.integrations.transformers needs transformers: pip install 'signmuon[transformers]'"
    ) from error

import torch
from torch.nn.parallel import DistributedDataParallel

from signmuon.optim import SignVoteOptimizer, muon_param_groups, sign_optimizer_from_spec
from signmuon.optim.checkpoint import refuse_load

__all__ = ["RANK_STATE_FILE", "SignTrainer", "SignTrainerMixin"]

RANK_STATE_FILE = "signmuon_optimizer_rank{rank:05d}.pt"
"""Each rank's optimizer state in a checkpoint's folder (the name the DeepSpeed integration uses)."""

_MISSING = "the checkpoint holds other ranks' optimizer state but not this rank's (on storage every rank sees?)"

# Set here, from the Trainer's arguments or its distributed setup.
_RESERVED = ("process_group", "vote_in_step", "checkpoint_all_ranks")


def _innermost(optimizer: Any) -> Any:
    """The user's optimizer inside the Trainer's wrappers (Accelerate's, DeepSpeed's)."""
    for _ in range(4):
        if isinstance(optimizer, SignVoteOptimizer) or getattr(optimizer, "optimizer", None) is None:
            break
        optimizer = optimizer.optimizer
    return optimizer


class _RegisterVote(transformers.TrainerCallback):
    """Registers the vote once the Trainer has wrapped the model (before the first batch)."""

    def __init__(self, trainer: SignTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.register_vote()


class SignTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it): ``class T(SignTrainerMixin, Trainer)``.

    Args:
        sign_optimizer: ``{"type": "SignMuon" | "SignumMV" | "SignSGDMV", "params": {...}}`` (the
            shape of a DeepSpeed optimizer section); ``lr`` defaults to ``args.learning_rate`` and
            ``weight_decay`` to ``args.weight_decay`` (not on biases and norms, as the Trainer
            does); embeddings and the output head take the non-matrix path
            (:func:`~signmuon.optim.muon_param_groups`). Default: SignMuon with those two.
            Unknown keys raise ``ValueError``.

    An optimizer passed as ``optimizers=(SignMuon(...), scheduler)`` is used as given (not under
    DeepSpeed, where the Trainer replaces it; use ``sign_optimizer``).
    """

    def __init__(self, *args: Any, sign_optimizer: dict[str, Any] | None = None, **kwargs: Any) -> None:
        spec = {"type": "SignMuon", "params": {}} if sign_optimizer is None else sign_optimizer
        self.sign_optimizer = spec
        super().__init__(*args, **kwargs)
        sign_optimizer_from_spec(spec, [torch.zeros(1, requires_grad=True)], reserved=_RESERVED)  # validate now
        self.add_callback(_RegisterVote(self))

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        given = dict(self.sign_optimizer.get("params", {}))
        lr = given.pop("lr", self.args.learning_rate)
        weight_decay = given.pop("weight_decay", self.args.weight_decay)
        decay = set(self.get_decay_parameter_names(model))
        groups = []
        # Embeddings and the output head off the matrix path (each tied tensor once), and weight
        # decay where the Trainer puts it (not on biases and norms).
        if str(self.sign_optimizer["type"]).lower() == "signmuon":
            routing = muon_param_groups(model)
        else:  # SignumMV / SignSGDMV: every parameter on the one Signum path
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            routing = [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
        for routed in routing:
            for decayed in (True, False):
                named = [(n, p) for n, p in zip(routed["param_names"], routed["params"]) if (n in decay) == decayed]
                if named:
                    group = {"params": [p for _, p in named], "param_names": [n for n, _ in named]}
                    group["weight_decay"] = weight_decay if decayed else 0.0
                    if "use_muon" in routed:
                        group["use_muon"] = routed["use_muon"]
                    groups.append(group)
        spec = {"type": self.sign_optimizer["type"], "params": given}
        self.optimizer = sign_optimizer_from_spec(spec, groups, reserved=_RESERVED, lr=lr)
        return self.optimizer

    def _saves_per_rank(self) -> bool:
        """Whether the optimizer's state is saved a file per rank (DeepSpeed and FSDP save their own way)."""
        voting = isinstance(_innermost(self.optimizer), SignVoteOptimizer)
        return voting and not (self.is_deepspeed_enabled or self.is_fsdp_enabled)

    def _rank_file(self, folder: str) -> str:
        return os.path.join(folder, RANK_STATE_FILE.format(rank=self.args.process_index))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Rank 0's optimizer.pt stays: a plain Trainer resuming from it is refused on every rank
        # (it holds rank 0's momentum) rather than silently starting from fresh momentum.
        super()._save_optimizer_and_scheduler(output_dir)
        if self._saves_per_rank():
            os.makedirs(output_dir, exist_ok=True)
            torch.save(self.optimizer.state_dict(), self._rank_file(output_dir))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._saves_per_rank():
            return super()._load_optimizer_and_scheduler(checkpoint)
        own = self._rank_file(checkpoint)
        if not os.path.isfile(own):
            others = glob.glob(os.path.join(checkpoint, RANK_STATE_FILE.replace("{rank:05d}", "*")))
            if others and not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
                # The other ranks load theirs and wait for this one in the optimizer's check.
                refuse_load(_innermost(self.optimizer), FileNotFoundError(f"{own} is missing: {_MISSING}"))
            # optimizer.pt alone (saved before per-rank files): refused on every rank but 0.
            return super()._load_optimizer_and_scheduler(checkpoint)
        device = self.args.device
        location = device if self.args.world_size > 1 and device.type != "cpu" else "cpu"
        self.optimizer.load_state_dict(torch.load(own, map_location=location, weights_only=True))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def register_vote(self) -> None:
        """Register the vote on the wrapped model (called at ``on_train_begin``)."""
        optimizer = _innermost(self.optimizer)
        if not isinstance(optimizer, SignVoteOptimizer):
            raise ValueError(
                f"{type(self).__name__} trains with signmuon's optimizers, but the Trainer's optimizer is "
                f"{type(optimizer).__name__}: pass sign_optimizer={{...}} instead of optimizers=(...)"
            )
        wrapped = self.model_wrapped
        if self.is_deepspeed_enabled:
            from signmuon.integrations.deepspeed import check_supported

            config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            check_supported(config, type(optimizer).__name__, bf16=False)  # the Trainer built the engine
            if not optimizer.has_comm_hook:
                wrapped.enable_backward_allreduce = False  # the vote is the gradient reduction
                optimizer.process_group = wrapped.data_parallel_group
                optimizer.register_backward_reducer(sync=wrapped.is_gradient_accumulation_boundary)
        elif isinstance(wrapped, DistributedDataParallel):
            if not optimizer.has_comm_hook:
                optimizer.register_comm_hook(wrapped)
                if self.accelerator.scaler is not None:  # fp16: the vote divides by the loss scale
                    optimizer.use_grad_scaler(self.accelerator.scaler)
        elif self.args.world_size > 1:
            raise ValueError(
                f"{type(optimizer).__name__} under the Trainer needs DDP or DeepSpeed on several processes; the "
                f"model is wrapped as {type(wrapped).__name__} (FSDP and tensor parallelism are not supported)"
            )


class SignTrainer(SignTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training with SignMuon / SignumMV / SignSGDMV (see the mixin)."""
