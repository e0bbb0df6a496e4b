"""Optimisation math: Newton-Schulz, SignMuon, sign-vote optimizers, the DPPF averager."""
