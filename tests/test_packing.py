"""Fast pack/unpack against the slow references, bit for bit."""

import pytest
import torch

from signmuon.comm_hooks import pack_signs, unpack_signs
from signmuon.comm_hooks.vote.packing import bits_to_bytes, pack_nonzero, pack_planes, pack_planes_checked, packed_size
from tests.harness import pack_nonzero_reference, pack_signs_reference, unpack_signs_reference

_CHUNK = 1 << 15  # sizes around a large power of two: block boundaries of any kernel

SIZES = [1, 7, 8, 9, 63, 64, 65, 1000]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _ternary_input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen).to(dtype)
    x[torch.rand(n, generator=gen) < 0.2] = 0.0
    x[torch.rand(n, generator=gen) < 0.1] = -0.0
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_pack_matches_reference(n, dtype):
    x = _ternary_input(n, dtype, seed=n)
    assert pack_signs(x).shape == (packed_size(n),)
    assert torch.equal(pack_signs(x), pack_signs_reference(x))
    assert torch.equal(pack_nonzero(x), pack_nonzero_reference(x))
    positive, nonzero = pack_planes(x)
    assert torch.equal(positive, pack_signs_reference(x)) and torch.equal(nonzero, pack_nonzero_reference(x))


@pytest.mark.parametrize("n", SIZES)
def test_torch_bit_packer_matches_numpy(n):
    # The device-agnostic torch packer (the CUDA path) checked on CPU.
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    pad = (-n) % 8
    padded = torch.cat([bits, bits.new_zeros(pad)]) if pad else bits
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)
    torch_packed = (padded.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)
    assert torch.equal(bits_to_bytes(bits), torch_packed)
    assert torch.equal(torch_packed, pack_signs_reference(bits.float() - 0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_unpack_matches_reference_and_inverts_pack(n, dtype):
    x = _ternary_input(n, dtype, seed=100 + n)
    pos, nz = pack_signs(x), pack_nonzero(x)
    out = torch.full((n,), 7.0, dtype=dtype)
    result = unpack_signs(pos, n, nonzero=nz, out=out)
    assert result is out
    assert torch.equal(out.float(), unpack_signs_reference(pos, n, nz))
    assert torch.equal(out, torch.sign(x))
    assert not torch.signbit(out[out == 0]).any(), "zeros unpack as +0.0"
    dense = unpack_signs(pos, n, dtype=dtype)
    assert torch.equal(dense.float(), unpack_signs_reference(pos, n))
    assert torch.equal(dense, torch.where(x > 0, 1.0, -1.0).to(dtype))


def test_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, float("nan"), 3.0, -2.0])
    assert torch.equal(pack_signs(x), pack_signs_reference(x))
    assert torch.equal(pack_nonzero(x), pack_nonzero_reference(x))
    signs = unpack_signs(pack_signs(x), x.numel(), nonzero=pack_nonzero(x))
    # Subnormals keep their sign; NaN is "not positive, nonzero" = -1.
    assert signs.tolist() == [0.0, 0.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0]


def test_multidimensional_and_noncontiguous_inputs():
    x = torch.randn(6, 5).t()  # not contiguous
    assert torch.equal(pack_signs(x), pack_signs_reference(x.contiguous()))


def test_bad_input():
    with pytest.raises(ValueError, match="floating-point"):
        pack_signs(torch.arange(10))
    with pytest.raises(ValueError, match="sparse"):
        pack_signs(torch.eye(3).to_sparse())
    with pytest.raises(TypeError):
        pack_signs([1.0, -1.0])
    with pytest.raises(ValueError, match="uint8"):
        unpack_signs(torch.zeros(2, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="out must be"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 8, out=torch.empty(7))


@pytest.mark.parametrize("n", [_CHUNK - 1, _CHUNK, _CHUNK + 1, 2 * _CHUNK + 13])
def test_pack_across_chunk_boundaries(n):
    x = _ternary_input(n, torch.float32, seed=n)
    positive, nonzero = pack_planes(x)
    assert torch.equal(positive, pack_signs_reference(x))
    assert torch.equal(nonzero, pack_nonzero_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_checked_pack_flags_nonfinite(dtype, bad):
    x = _ternary_input(3 * _CHUNK + 5, dtype, seed=1)
    if bad is not None:
        x[2 * _CHUNK + 3] = bad
    positive, nonzero, nonfinite = pack_planes_checked(x)
    assert torch.equal(positive, pack_signs(x)) and torch.equal(nonzero, pack_nonzero(x))
    assert bool(nonfinite) == (bad is not None)


def test_checked_pack_large_finite_values_are_not_flagged():
    assert not bool(pack_planes_checked(torch.full((1000,), 3e38))[2])  # the float32 sum overflows
    assert not bool(pack_planes_checked(torch.full((1000,), 60000.0, dtype=torch.float16))[2])
