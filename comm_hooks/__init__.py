"""Communication: sign bit packing, the majority-vote collective, DDP hooks and their state."""

from .collective import (
    ALGORITHMS,
    NONFINITE_ACTIONS,
    TIE_MODES,
    CommStats,
    NonFiniteError,
    VoteWork,
    majority_vote,
    majority_vote_async,
    nonfinite_flag,
    vote_bytes_per_rank,
)
from .consistency import (
    ReplicaDivergenceError,
    SettingsMismatchError,
    check_replicas,
    check_same_settings,
    settings_digest,
)
from .faults import ByzantineFault
from .packing import (
    pack_planes,
    pack_planes_checked,
    pack_nonzero,
    pack_nonzero_reference,
    pack_signs,
    pack_signs_reference,
    packed_size,
    unpack_signs,
    unpack_signs_reference,
)
from .sign_muon_hook import SignMuonHookState, WorkerDirections, sign_muon_hook
from .sign_vote_hook import SignVoteState, VoteHookState, allreduce_hook, allreduce_mean, sign_vote_hook
from .vote import vote_packed, vote_reference

__all__ = [
    "ALGORITHMS",
    "ByzantineFault",
    "NONFINITE_ACTIONS",
    "NonFiniteError",
    "ReplicaDivergenceError",
    "SettingsMismatchError",
    "TIE_MODES",
    "CommStats",
    "SignMuonHookState",
    "SignVoteState",
    "VoteHookState",
    "WorkerDirections",
    "VoteWork",
    "allreduce_hook",
    "allreduce_mean",
    "check_replicas",
    "check_same_settings",
    "pack_planes",
    "pack_planes_checked",
    "majority_vote",
    "majority_vote_async",
    "nonfinite_flag",
    "pack_nonzero",
    "pack_nonzero_reference",
    "pack_signs",
    "pack_signs_reference",
    "packed_size",
    "sign_muon_hook",
    "settings_digest",
    "sign_vote_hook",
    "unpack_signs",
    "unpack_signs_reference",
    "vote_bytes_per_rank",
    "vote_packed",
    "vote_reference",
]
