"""Communication: the majority-vote collective, the DDP hooks and their state.

Layers, each importing only those before it: ``kernels`` (pack, vote, unpack per device),
``dist`` (process-group basics, statistics, errors, the mean all-reduce), ``vote`` (settings,
encodings, the transport, the collective, the node-aware schedule), then the DDP adapters in
this folder (hook states, hooks, the backward reducer).
"""

from .allreduce import allreduce_hook, allreduce_mean, mean_all_reduce_future
from .backward_reducer import BackwardReducer
from .dist import (
    CommStats,
    NonFiniteError,
    ReplicaDivergenceError,
    SettingsMismatchError,
    VoteMismatchError,
    check_replicas,
)
from .hook_state import VoteHookState
from .kernels.bits import SignSegments
from .sign_muon_hook import SignMuonHookState, WorkerDirections, sign_muon_hook
from .sign_vote_hook import SignVoteState, sign_vote_hook
from .vote import (
    ByzantineFault,
    NodeLayout,
    VoteConfig,
    VoteWork,
    majority_vote,
    majority_vote_async,
    node_layout,
    pack_signs,
    unpack_signs,
    vote_bytes_per_rank,
)

__all__ = [
    "BackwardReducer",
    "ByzantineFault",
    "CommStats",
    "NodeLayout",
    "NonFiniteError",
    "ReplicaDivergenceError",
    "SettingsMismatchError",
    "SignMuonHookState",
    "SignSegments",
    "SignVoteState",
    "VoteConfig",
    "VoteHookState",
    "VoteMismatchError",
    "VoteWork",
    "WorkerDirections",
    "allreduce_hook",
    "allreduce_mean",
    "mean_all_reduce_future",
    "check_replicas",
    "majority_vote",
    "majority_vote_async",
    "node_layout",
    "pack_signs",
    "sign_muon_hook",
    "sign_vote_hook",
    "unpack_signs",
    "vote_bytes_per_rank",
]
