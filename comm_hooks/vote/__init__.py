"""The vote: its settings, the sign encoding, the transport that moves encoded shards, the
majority-vote collective and its node-aware schedule. Imports ``kernels`` and ``dist`` only."""

from .collective import VoteWork, majority_vote, majority_vote_async, vote_bytes_per_rank, vote_in_place
from .compressed_allreduce import scaled_sign_allreduce, scaled_sign_allreduce_start
from .config import ALGORITHMS, KERNELS, NONFINITE_ACTIONS, TIE_MODES, ZERO_RULES, VoteConfig
from .encodings import ByzantineFault, MomentumStep, error_buffer_sizes
from .node_vote import (
    NodeVoteWork,
    OwnedVoteWork,
    gather_in_node,
    mean_in_node,
    mean_node_aware,
    merge_in_node,
    node_slice,
)
from .packing import pack_nonzero, pack_planes, pack_planes_checked, pack_signs, packed_size, unpack_signs
from .topology import NodeLayout, node_layout

__all__ = [
    "ALGORITHMS",
    "ByzantineFault",
    "KERNELS",
    "MomentumStep",
    "NONFINITE_ACTIONS",
    "NodeLayout",
    "NodeVoteWork",
    "OwnedVoteWork",
    "TIE_MODES",
    "VoteConfig",
    "VoteWork",
    "ZERO_RULES",
    "error_buffer_sizes",
    "gather_in_node",
    "majority_vote",
    "majority_vote_async",
    "merge_in_node",
    "node_layout",
    "mean_in_node",
    "node_slice",
    "pack_nonzero",
    "pack_planes",
    "pack_planes_checked",
    "pack_signs",
    "packed_size",
    "scaled_sign_allreduce",
    "scaled_sign_allreduce_start",
    "unpack_signs",
    "vote_bytes_per_rank",
    "vote_in_place",
    "mean_node_aware",
]
