"""Packed-domain vote against sign(sum(sign)) computed on floats."""

import pytest
import torch

from signmuon.comm_hooks import pack_signs, unpack_signs
from signmuon.comm_hooks.kernels.torch_ops import vote_packed
from signmuon.comm_hooks.vote.packing import pack_nonzero
from tests.harness import vote_reference


def _words(packed: torch.Tensor) -> torch.Tensor:
    pad = (-packed.numel()) % 8
    return torch.cat([packed, packed.new_zeros(pad)]).view(torch.int64)


def _vote(signs: torch.Tensor, dense: bool, tie_break=None) -> torch.Tensor:
    m, n = signs.shape
    pos = torch.stack([_words(pack_signs(s)) for s in signs])
    nz = None if dense else torch.stack([_words(pack_nonzero(s)) for s in signs])
    out_pos, out_nz = vote_packed(pos, nz, tie_break=tie_break)
    as_bytes = lambda w: w.view(torch.uint8)  # noqa: E731
    return unpack_signs(as_bytes(out_pos), n, nonzero=as_bytes(out_nz))


@pytest.mark.parametrize("voters", range(1, 10))
def test_dense_vote_matches_reference(voters):
    gen = torch.Generator().manual_seed(voters)
    signs = torch.randn(voters, 4099, generator=gen)
    assert torch.equal(_vote(signs, dense=True), vote_reference(signs))


@pytest.mark.parametrize("voters", [1, 2, 3, 4, 5, 8, 17])
def test_vote_with_zeros_matches_reference(voters):
    gen = torch.Generator().manual_seed(100 + voters)
    signs = torch.randint(-1, 2, (voters, 3001), generator=gen).float()
    signs[:, :64] = 0.0  # a whole word of entries that no voter moves
    result = _vote(signs, dense=False)
    assert torch.equal(result, vote_reference(signs))
    assert (result[:64] == 0).all()


@pytest.mark.parametrize("voters", [2, 4, 6])
def test_tie_break_bits_only_touch_ties(voters):
    gen = torch.Generator().manual_seed(voters)
    signs = torch.randint(-1, 2, (voters, 2048), generator=gen).float()
    signs[:, :100] = 0.0
    tie_break = torch.randint(0, 256, (2048 // 8,), dtype=torch.uint8, generator=gen).view(torch.int64)
    result = _vote(signs, dense=False, tie_break=tie_break)
    reference = vote_reference(signs)
    all_zero = (signs == 0).all(dim=0)
    tie = (reference == 0) & ~all_zero
    assert tie.sum() > 100, "the test needs ties"
    assert torch.equal(result[~tie], reference[~tie])
    bits = unpack_signs(tie_break.view(torch.uint8), 2048)
    assert torch.equal(result[tie], bits[tie])
    assert (result[all_zero] == 0).all()
    # Dense path: every entry nonzero, so ties are exactly where the counts balance.
    dense_signs = torch.where(signs == 0, 1.0, signs)
    dense_result = _vote(dense_signs, dense=True, tie_break=tie_break)
    dense_tie = vote_reference(dense_signs) == 0
    assert torch.equal(dense_result[dense_tie], bits[dense_tie])
    assert torch.equal(dense_result[~dense_tie], vote_reference(dense_signs)[~dense_tie])


def test_bad_shapes():
    with pytest.raises(ValueError, match="int64"):
        vote_packed(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="nonzero"):
        vote_packed(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64))
