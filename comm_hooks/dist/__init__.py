"""What every communicating layer shares: process-group basics, statistics, errors, the
mean all-reduce, flattening, and cross-rank consistency checks. Imports nothing above it."""

from .consistency import (
    ReplicaDivergenceError,
    SettingsMismatchError,
    check_replicas,
    check_same_settings,
    settings_digest,
    tensor_fingerprint,
)
from .groups import Agreement, NonFiniteError, VoteMismatchError, agree, barrier, gather_rows, group_device, group_size_rank
from .stats import CommStats
from .host import from_host, host_words
from .tensors import all_reduce, all_to_all, flatten, mean_all_reduce, nonfinite_flag, ring_bytes, split_like, unflatten_into

__all__ = [
    "CommStats",
    "NonFiniteError",
    "ReplicaDivergenceError",
    "SettingsMismatchError",
    "VoteMismatchError",
    "Agreement",
    "agree",
    "all_reduce",
    "all_to_all",
    "barrier",
    "check_replicas",
    "check_same_settings",
    "flatten",
    "from_host",
    "gather_rows",
    "group_device",
    "group_size_rank",
    "host_words",
    "mean_all_reduce",
    "nonfinite_flag",
    "ring_bytes",
    "settings_digest",
    "split_like",
    "tensor_fingerprint",
    "unflatten_into",
]
