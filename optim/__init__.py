"""Optimisation math: Newton–Schulz, SignMuon, the Muon baseline, the DPPF averager."""

from .newton_schulz import MUON_COEFFICIENTS, as_matrix, newton_schulz
from .dppf import DPPFAverager, local_sgd, register_local_sgd_hook
from .muon_baseline import MuonWithAdamW
from .routing import HEAD_NAMES, muon_param_groups
from .sign_muon import (
    LR_SCALINGS,
    MUON_LR_RATIO,
    MUON_UPDATE_RMS,
    NS_DTYPES,
    SignMuon,
    lr_from_muon,
    parameter_path,
    step_size,
)
from .sign_vote_optim import SIGN_OPTIMIZERS, SignSGDMV, SignumMV, sign_optimizer_from_spec
from .valley import ValleyResult, inverse_mean_valley

__all__ = [
    "DPPFAverager",
    "HEAD_NAMES",
    "LR_SCALINGS",
    "MUON_LR_RATIO",
    "MUON_UPDATE_RMS",
    "NS_DTYPES",
    "MUON_COEFFICIENTS",
    "MuonWithAdamW",
    "SIGN_OPTIMIZERS",
    "SignMuon",
    "SignSGDMV",
    "SignumMV",
    "ValleyResult",
    "as_matrix",
    "inverse_mean_valley",
    "local_sgd",
    "lr_from_muon",
    "muon_param_groups",
    "register_local_sgd_hook",
    "newton_schulz",
    "parameter_path",
    "sign_optimizer_from_spec",
    "step_size",
]
