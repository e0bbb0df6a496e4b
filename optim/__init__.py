"""Optimisation math: Newton–Schulz, SignMuon, the Muon baseline, the DPPF averager."""

from .newton_schulz import MUON_COEFFICIENTS, as_matrix, newton_schulz
from .dppf import DPPFAverager, local_sgd, register_local_sgd_hook
from .muon_baseline import MuonWithAdamW
from .sign_muon import SignMuon, parameter_path
from .sign_vote_optim import SIGN_OPTIMIZERS, SignSGDMV, SignumMV, sign_optimizer_from_spec
from .valley import ValleyResult, inverse_mean_valley

__all__ = [
    "DPPFAverager",
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
    "register_local_sgd_hook",
    "newton_schulz",
    "parameter_path",
    "sign_optimizer_from_spec",
]
