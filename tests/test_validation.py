"""The validation sweep: every public constructor and entry point rejects bad values with a
ValueError or TypeError whose message names the argument (single process, no process group)."""

import pytest
import torch
from torch import nn

from signmuon.comm_hooks import (
    ByzantineFault,
    SignMuonHookState,
    SignVoteState,
    VoteConfig,
    majority_vote,
    pack_signs,
    unpack_signs,
)
from signmuon.comm_hooks.kernels.torch_ops import vote_packed
from signmuon.integrations.deepspeed import SignCompressedBackend, initialize
from signmuon.optim import (
    LocalStepAverager,
    SignMuon,
    SignSGDMV,
    SignumMV,
    inverse_mean_valley,
    lr_from_muon,
    newton_schulz,
)
from tests.harness import run_distributed


def _params():
    torch.manual_seed(0)
    return list(nn.Linear(3, 2).parameters())


_x = torch.ones(4)
_batches = [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))]
_net = nn.Linear(3, 2)
_loss = nn.functional.cross_entropy

CASES = [
    # (what, call, exception, words the message must contain)
    ("pack_signs tensor", lambda: pack_signs([1.0]), TypeError, "tensor"),
    ("lr_from_muon zero", lambda: lr_from_muon(0.0), ValueError, "muon_lr"),
    ("lr_from_muon nan", lambda: lr_from_muon(float("nan")), ValueError, "finite"),
    ("pack_signs dtype", lambda: pack_signs(torch.ones(3, dtype=torch.int32)), ValueError, "dtype"),
    ("unpack_signs packed dtype", lambda: unpack_signs(torch.zeros(1, dtype=torch.int8), 8), ValueError, "positive"),
    ("unpack_signs numel", lambda: unpack_signs(torch.zeros(1, dtype=torch.uint8), 9), ValueError, "numel"),
    (
        "unpack_signs out",
        lambda: unpack_signs(torch.zeros(1, dtype=torch.uint8), 8, out=torch.ones(3)),
        ValueError,
        "out",
    ),
    ("vote_packed shape", lambda: vote_packed(torch.zeros(4, dtype=torch.int64)), ValueError, "positive"),
    ("majority_vote tensor", lambda: majority_vote("x"), TypeError, "tensor"),
    ("majority_vote dtype", lambda: majority_vote(torch.ones(3, dtype=torch.int64)), ValueError, "dtype"),
    ("majority_vote sparse", lambda: majority_vote(torch.eye(2).to_sparse()), ValueError, "sparse"),
    ("majority_vote tie", lambda: VoteConfig(tie="coin"), ValueError, "tie"),
    ("majority_vote algorithm", lambda: VoteConfig(algorithm="ring"), ValueError, "algorithm"),
    ("majority_vote nonfinite", lambda: VoteConfig(nonfinite="ignore"), ValueError, "nonfinite"),
    ("majority_vote out", lambda: majority_vote(_x, out=torch.ones(5)), ValueError, "out"),
    ("SignVoteState momentum", lambda: SignVoteState(momentum=1.5), ValueError, "momentum"),
    ("VoteConfig seed", lambda: VoteConfig(seed=-1), ValueError, "seed"),
    ("VoteConfig kernels", lambda: VoteConfig(kernels="cuda"), ValueError, "kernels"),
    ("VoteConfig encoding", lambda: VoteConfig(encoding="two_bits"), ValueError, "encoding"),
    ("VoteConfig fault", lambda: VoteConfig(fault=(0,)), TypeError, "fault"),
    ("VoteConfig.from_dict keys", lambda: VoteConfig.from_dict({"ties": "fast"}), ValueError, "ties"),
    ("majority_vote config", lambda: majority_vote(_x, config={"tie": "fast"}), TypeError, "config"),
    ("majority_vote step", lambda: majority_vote(_x, step=-1), ValueError, "step"),
    ("SignVoteState vote", lambda: SignVoteState(vote="fast"), TypeError, "vote"),
    ("SignVoteState start_iter", lambda: SignVoteState(start_iter=-2), ValueError, "start_iter"),
    (
        "SignVoteState check_replicas_every",
        lambda: SignVoteState(check_replicas_every=-1),
        ValueError,
        "check_replicas_every",
    ),
    ("SignMuonHookState optimizer", lambda: SignMuonHookState(torch.optim.SGD(_params(), lr=1)), TypeError, "SignMuon"),
    ("ByzantineFault mode", lambda: ByzantineFault(ranks=(0,), mode="x"), ValueError, "mode"),
    ("newton_schulz steps", lambda: newton_schulz(torch.ones(2, 2), steps=0), ValueError, "steps"),
    ("newton_schulz shape", lambda: newton_schulz(torch.ones(2)), ValueError, "dimensions"),
    ("SignMuon lr", lambda: SignMuon(_params(), lr=-1), ValueError, "lr"),
    ("SignMuon momentum", lambda: SignMuon(_params(), momentum=1.0), ValueError, "momentum"),
    ("SignMuon ns_steps", lambda: SignMuon(_params(), ns_steps=0), ValueError, "ns_steps"),
    ("SignMuon weight_decay", lambda: SignMuon(_params(), weight_decay=-1), ValueError, "weight_decay"),
    (
        "SignMuon coupled_weight_decay",
        lambda: SignMuon(_params(), coupled_weight_decay=-1),
        ValueError,
        "coupled_weight_decay",
    ),
    ("SignMuon non_matrix", lambda: SignMuon(_params(), non_matrix="sgd"), ValueError, "non_matrix"),
    ("SignMuon adamw_lr", lambda: SignMuon(_params(), adamw_lr=-1), ValueError, "adamw_lr"),
    ("SignMuon adamw_betas", lambda: SignMuon(_params(), adamw_betas=(1.0, 0.9)), ValueError, "adamw_betas"),
    ("SignMuon adamw_eps", lambda: SignMuon(_params(), adamw_eps=0), ValueError, "adamw_eps"),
    ("SignMuon vote", lambda: SignMuon(_params(), vote="fast"), TypeError, "vote"),
    ("SignMuon use_muon", lambda: SignMuon([{"params": _params(), "use_muon": "yes"}]), ValueError, "use_muon"),
    (
        "SignMuon use_muon on a vector",
        lambda: SignMuon([{"params": _params()[1:], "use_muon": True}]),
        ValueError,
        "matrix path",
    ),
    ("SignumMV matrix path", lambda: SignumMV([{"params": _params(), "use_muon": True}]), ValueError, "SignMuon"),
    ("SignSGDMV lr", lambda: SignSGDMV(_params(), lr=-0.1), ValueError, "lr"),
    (
        "inverse_mean_valley directions",
        lambda: inverse_mean_valley(_net, _loss, _batches, directions=0),
        ValueError,
        "directions",
    ),
    ("inverse_mean_valley delta", lambda: inverse_mean_valley(_net, _loss, _batches, delta=0), ValueError, "delta"),
    (
        "inverse_mean_valley max_distance",
        lambda: inverse_mean_valley(_net, _loss, _batches, max_distance=-1),
        ValueError,
        "max_distance",
    ),
    (
        "inverse_mean_valley initial_distance",
        lambda: inverse_mean_valley(_net, _loss, _batches, initial_distance=99),
        ValueError,
        "initial_distance",
    ),
    ("inverse_mean_valley batches", lambda: inverse_mean_valley(_net, _loss, []), ValueError, "batches"),
    ("LocalStepAverager period", lambda: LocalStepAverager(period=0), ValueError, "period"),
    (
        "LocalStepAverager warmup_steps",
        lambda: LocalStepAverager(period=1, warmup_steps=-1),
        ValueError,
        "warmup_steps",
    ),
    ("LocalStepAverager pull", lambda: LocalStepAverager(period=1, pull=1.5), ValueError, "pull"),
    ("LocalStepAverager push", lambda: LocalStepAverager(period=1, push=-1), ValueError, "push"),
    ("LocalStepAverager eps", lambda: LocalStepAverager(period=1, eps=0), ValueError, "eps"),
    ("LocalStepAverager distance", lambda: LocalStepAverager(period=1, distance="layer"), ValueError, "distance"),
    (
        "SignCompressedBackend worker_error",
        lambda: SignCompressedBackend().compressed_allreduce(_x, torch.zeros(4), torch.zeros(4)),
        ValueError,
        "worker_error",
    ),
    ("deepspeed initialize config", lambda: initialize(model=_net, config=None), ValueError, "config"),
    ("run_distributed world_size", lambda: run_distributed(print, 0), ValueError, "world_size"),
]


@pytest.mark.parametrize("what, call, error, words", CASES, ids=[c[0] for c in CASES])
def test_rejects_bad_value(what, call, error, words):
    with pytest.raises(error) as caught:
        call()
    assert words in str(caught.value), f"{what}: {caught.value}"
