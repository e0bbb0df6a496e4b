"""Optimisation math: Newton–Schulz, SignMuon, the Muon baseline, the DPPF averager."""

from .newton_schulz import MUON_COEFFICIENTS, as_matrix, newton_schulz
from .muon_baseline import MuonWithAdamW
from .sign_muon import SignMuon, parameter_path

__all__ = ["MUON_COEFFICIENTS", "MuonWithAdamW", "SignMuon", "as_matrix", "newton_schulz", "parameter_path"]
