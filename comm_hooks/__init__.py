"""Communication: sign bit packing, the majority-vote collective, DDP hooks and their state."""

from .backward_reducer import BackwardReducer, ReadyBucket
from .collective import VoteWork, majority_vote, majority_vote_async, vote_bytes_per_rank
from .config import ALGORITHMS, KERNELS, NONFINITE_ACTIONS, TIE_MODES, VoteConfig
from .consistency import (
    ReplicaDivergenceError,
    SettingsMismatchError,
    check_replicas,
    check_same_settings,
    settings_digest,
    tensor_fingerprint,
)
from .encoding import SignEncoding
from .exchange import CommStats, ExchangeWork, NonFiniteError, VoteMismatchError, agree, gather_rows, group_size_rank
from .faults import ByzantineFault
from .hierarchy import NodeVoteWork, matrix_cost, node_mean, owners, vote_owned, world_mean
from .kernels import kernels_for
from .kernels.layout import SignSegments
from .packing import (
    bits_to_bytes,
    nonfinite_flag,
    pack_nonzero,
    pack_nonzero_reference,
    pack_planes,
    pack_planes_checked,
    pack_signs,
    pack_signs_reference,
    packed_size,
    unpack_signs,
    unpack_signs_reference,
)
from .sign_muon_hook import SignMuonHookState, WorkerDirections, sign_muon_hook
from .topology import NodeLayout, node_layout
from .sign_vote_hook import SignVoteState, VoteHookState, allreduce_hook, allreduce_mean, sign_vote_hook
from .vote import vote_packed, vote_reference

__all__ = [
    "agree",
    "ALGORITHMS",
    "allreduce_hook",
    "allreduce_mean",
    "BackwardReducer",
    "bits_to_bytes",
    "ByzantineFault",
    "check_replicas",
    "check_same_settings",
    "CommStats",
    "ExchangeWork",
    "gather_rows",
    "group_size_rank",
    "KERNELS",
    "kernels_for",
    "majority_vote",
    "majority_vote_async",
    "matrix_cost",
    "node_layout",
    "node_mean",
    "NodeLayout",
    "NodeVoteWork",
    "NONFINITE_ACTIONS",
    "nonfinite_flag",
    "NonFiniteError",
    "owners",
    "pack_nonzero",
    "pack_nonzero_reference",
    "pack_planes",
    "pack_planes_checked",
    "pack_signs",
    "pack_signs_reference",
    "packed_size",
    "ReadyBucket",
    "ReplicaDivergenceError",
    "settings_digest",
    "SettingsMismatchError",
    "sign_muon_hook",
    "sign_vote_hook",
    "SignEncoding",
    "SignMuonHookState",
    "SignSegments",
    "SignVoteState",
    "tensor_fingerprint",
    "TIE_MODES",
    "unpack_signs",
    "unpack_signs_reference",
    "vote_bytes_per_rank",
    "vote_owned",
    "vote_packed",
    "vote_reference",
    "VoteConfig",
    "VoteHookState",
    "VoteMismatchError",
    "VoteWork",
    "WorkerDirections",
    "world_mean",
]
