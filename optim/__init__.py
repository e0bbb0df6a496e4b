"""Optimisation math: the pure functions (``functional``), Newton–Schulz, the sign-vote
optimizers (SignMuon, Signum-MV, signSGD-MV), the Muon baseline and local-step rounds."""

from .fsdp import check_checkpoint_layout, node_mesh, register_fsdp_vote
from .functional import (
    MUON_LR_RATIO,
    MUON_UPDATE_RMS,
    adamw_update,
    lr_from_muon,
    muon_direction,
    orthogonalize,
    polar_direction,
    signum_direction,
    step_size,
)
from .muon_baseline import MuonWithAdamW
from .newton_schulz import MUON_COEFFICIENTS, as_matrix, newton_schulz
from .rounds import DPPFAverager, LocalStepAverager, OuterStep, local_sgd, register_local_sgd_hook
from .routing import HEAD_NAMES, muon_param_groups
from .sign_muon import SignMuon
from .sign_vote import SignVoteOptimizer
from .signum import SignSGDMV, SignumMV
from .spec import SIGN_OPTIMIZERS, sign_optimizer_from_spec
from .valley import ValleyResult, inverse_mean_valley

__all__ = [
    "DPPFAverager",
    "HEAD_NAMES",
    "LocalStepAverager",
    "MUON_COEFFICIENTS",
    "MUON_LR_RATIO",
    "MUON_UPDATE_RMS",
    "MuonWithAdamW",
    "OuterStep",
    "SIGN_OPTIMIZERS",
    "SignMuon",
    "SignSGDMV",
    "SignVoteOptimizer",
    "SignumMV",
    "ValleyResult",
    "adamw_update",
    "as_matrix",
    "check_checkpoint_layout",
    "inverse_mean_valley",
    "local_sgd",
    "lr_from_muon",
    "muon_direction",
    "muon_param_groups",
    "newton_schulz",
    "node_mesh",
    "orthogonalize",
    "polar_direction",
    "register_fsdp_vote",
    "register_local_sgd_hook",
    "sign_optimizer_from_spec",
    "signum_direction",
    "step_size",
]
