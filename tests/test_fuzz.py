"""Property tests (hypothesis) of pack / unpack / vote / collective against the slow references,
over random shapes, dtypes and values including ±0.0, subnormals, NaN, ±Inf, and sizes around
every padding boundary (bytes, 64-bit words, shards of M ranks)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from signmuon.comm_hooks import VoteConfig, majority_vote, unpack_signs
from signmuon.comm_hooks.kernels.torch_ops import vote_packed
from signmuon.comm_hooks.vote.packing import pack_planes
from tests.harness import (
    pack_nonzero_reference,
    pack_signs_reference,
    run_distributed,
    unpack_signs_reference,
    vote_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 1e-310, 5e-8, -5e-8]
# Sizes at and around byte (8), word (64) and 5-rank shard (320) boundaries.
BOUNDARY_SIZES = sorted({b + d for b in (8, 64, 128, 320, 640, 4096) for d in (-1, 0, 1)} | {1, 2, 3})


@st.composite
def tensors(draw, max_size=700):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.one_of(st.sampled_from(BOUNDARY_SIZES), st.integers(1, max_size)))
    values = draw(st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(-1e3, 1e3, width=32)), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float64).to(dtype)


@settings(max_examples=150, deadline=None)
@given(tensors())
def test_pack_and_unpack_match_references(x):
    positive, nonzero = pack_planes(x)
    assert torch.equal(positive, pack_signs_reference(x))
    assert torch.equal(nonzero, pack_nonzero_reference(x))
    n = x.numel()
    assert torch.equal(unpack_signs(positive, n, nonzero=nonzero), unpack_signs_reference(positive, n, nonzero))
    assert torch.equal(unpack_signs(positive, n), unpack_signs_reference(positive, n))


def _words(packed):
    return torch.cat([packed, packed.new_zeros((-packed.numel()) % 8)]).view(torch.int64)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_packed_vote_matches_reference(voters, n, seed):
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(-1, 2, (voters, n), generator=gen).float()
    pos = torch.stack([_words(pack_planes(s)[0]) for s in signs])
    nz = torch.stack([_words(pack_planes(s)[1]) for s in signs])
    out_pos, out_nz = vote_packed(pos, nz)
    as_bytes = lambda w: w.view(torch.uint8)  # noqa: E731
    assert torch.equal(unpack_signs(as_bytes(out_pos), n, nonzero=as_bytes(out_nz)), vote_reference(signs))


@settings(max_examples=100, deadline=None)
@given(tensors())
def test_single_rank_collective_is_the_sign(x):
    # NaN or Inf anywhere: the call is skipped (all zeros); otherwise the sign.
    expected = torch.zeros_like(x) if not torch.isfinite(x).all() else torch.sign(x.double()).to(x.dtype)
    assert torch.equal(majority_vote(x), expected)


def _fuzz_worker(rank, world_size, seeds):
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        n = int(rng.choice(BOUNDARY_SIZES + [int(rng.integers(1, 5000))]))
        x = _fuzz_input(seed, rank, n)
        out.append(majority_vote(x, config=VoteConfig(tie="exact")).to(torch.int8))
    return out


def _fuzz_input(seed, rank, n):
    rng = np.random.default_rng([seed, rank])
    values = rng.standard_normal(n).astype(np.float32)
    special = rng.random(n) < 0.2
    values[special] = rng.choice(np.array([0.0, -0.0, 1e-45, -1e-45], dtype=np.float32), special.sum())
    if seed % 10 == 9 and rank == seed % 3:  # now and then one rank holds an Inf or NaN
        values[int(rng.integers(0, n))] = [np.inf, -np.inf, np.nan][seed % 3]
    return torch.from_numpy(values)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_collective_fuzz(world_size):
    seeds = list(range(40))
    results = run_distributed(_fuzz_worker, world_size, seeds)
    for i, seed in enumerate(seeds):
        n = results[0][i].numel()
        inputs = torch.stack([_fuzz_input(seed, r, n) for r in range(world_size)])
        expected = vote_reference(inputs) if torch.isfinite(inputs).all() else torch.zeros(n)
        for r in range(world_size):
            assert torch.equal(results[r][i].float(), expected), (seed, r)
