"""Every fast kernel family against the slow references, bit for bit.

numba (CPU), torch (any device) and Triton (CUDA kernels, run on CPU tensors by Triton's
interpreter in a subprocess with TRITON_INTERPRET=1) all follow one contract; the reference
is a Python loop over Python floats and ints (``kernels.reference``).
"""

import os
import subprocess
import sys

import pytest
import torch

from signmuon.comm_hooks import SignSegments
from signmuon.comm_hooks.kernels import cpu, kernels_for, reference, torch_ops
from signmuon.comm_hooks.kernels.bits import words_for

FAMILIES = {"numba": cpu, "torch": torch_ops}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 63, 64, 65, 130, 1000, 4099]


def _input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen).to(dtype)
    x[torch.rand(n, generator=gen) < 0.2] = 0.0
    x[torch.rand(n, generator=gen) < 0.1] = -0.0
    if n > 10:
        x[3], x[5], x[7] = float("nan"), float("inf"), -float("inf")
        x[9] = torch.finfo(dtype).tiny / 4 if dtype != torch.bfloat16 else 1e-40  # a subnormal
    return x


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_pack_and_unpack_match_reference(family, dtype, n):
    kernels = FAMILIES[family]
    x = _input(n, dtype, seed=n)
    words = words_for(n) + 1  # one whole word of padding too
    ref = reference.pack(x, words)
    got = kernels.pack(x, words)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert int(got[2]) == ref[2] and bool(got[3]) == ref[3]
    for nonzero in (None, ref[1]):
        out = torch.full((n,), 7.0, dtype=dtype)
        kernels.unpack(ref[0], nonzero, out)
        assert torch.equal(out.double(), reference.unpack(ref[0], nonzero, n))
        assert not torch.signbit(out[out == 0]).any(), "a zero vote is +0.0"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, NaN payloads aside (every NaN is a NaN to both)."""
    nan = a.isnan()
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])


MOMENTUM_CASES = [  # (buffer dtype, gradient dtype): the hooks keep fp32 momentum for half gradients
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32),
]


def _momentum_pack_matches(kernels, dtype, grad_dtype, n: int, weight: float, skip: bool, offset: int = 0) -> bool:
    """``kernels.momentum_pack`` against the reference (torch's ``lerp_``, then the reference pack);
    ``offset``: the gradient is a view starting that many entries into its storage (the
    node-aware vote's slice of a node mean)."""
    buf = _input(n, dtype, seed=n)  # zeros, -0.0, and past 10 entries NaN, Inf and a subnormal
    grad = (torch.randn(n + offset, generator=torch.Generator().manual_seed(n + 1)).to(grad_dtype) * 3)[offset:]
    grad[::5] = 0.0
    words = words_for(n) + 1
    expected_buf = buf.clone()
    ref = reference.momentum_pack(expected_buf, grad, weight, torch.tensor(skip), words)
    got = kernels.momentum_pack(buf, grad, weight, torch.tensor(skip), words)
    same_planes = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    return same_planes and int(got[2]) == ref[2] and bool(got[3]) == ref[3] and _same_bits(buf, expected_buf)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,grad_dtype", MOMENTUM_CASES)
def test_momentum_pack_matches_reference(family, dtype, grad_dtype):
    # Both of lerp's branches (weight below and from 0.5), a skipped step, sizes around a word.
    for n in (1, 63, 65, 1000):
        for weight in (0.1, 0.5, 0.9):
            for skip in (False, True):
                assert _momentum_pack_matches(FAMILIES[family], dtype, grad_dtype, n, weight, skip), (n, weight, skip)
    assert _momentum_pack_matches(FAMILIES[family], dtype, grad_dtype, 1000, 0.1, False, offset=3), "an unaligned slice"
    buf = torch.ones(70, dtype=dtype)
    FAMILIES[family].momentum_pack(buf, torch.full((70,), float("nan"), dtype=grad_dtype), 0.1, torch.tensor(True), 2)
    assert torch.equal(buf, torch.ones(70, dtype=dtype)), "a skipped step leaves the momentum as it was"


def test_finite_input_has_no_flag_and_zero_count_is_exact():
    x = torch.randn(10_000)
    x[x == 0] = 1.0
    x[::97] = 0.0
    for kernels in FAMILIES.values():
        _, _, zeros, bad = kernels.pack(x, words_for(x.numel()))
        assert int(zeros) == len(range(0, 10_000, 97)) and not bool(bad)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("voters", [1, 2, 3, 4, 5, 8, 17])
def test_vote_matches_reference(family, voters):
    gen = torch.Generator().manual_seed(voters)
    words = 300  # more than one block of the numba kernel
    positive = torch.randint(-(2**62), 2**62, (voters, words), generator=gen)
    nonzero = torch.randint(-(2**62), 2**62, (voters, words), generator=gen) | positive
    dense = torch.tensor([v % 3 == 0 for v in range(voters)])
    effective = torch.where(dense.unsqueeze(1), torch.full_like(nonzero, -1), nonzero)
    tie = torch.randint(-(2**62), 2**62, (words,), generator=gen)
    for tie_bits in (None, tie):
        ref = reference.vote(positive, effective, tie_bits)
        got = FAMILIES[family].vote(positive, nonzero, dense, tie_bits)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    got = FAMILIES[family].vote(positive, None, None, None)  # all dense
    ref = reference.vote(positive, None, None)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    every = torch.ones(voters, dtype=torch.bool)  # all dense, with tie bits (numba's counting-only path)
    got = FAMILIES[family].vote(positive, nonzero, every, tie)
    ref = reference.vote(positive, torch.full_like(nonzero, -1), tie)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_tie_words_match_reference(family):
    segments = SignSegments((0, 5, 70, 200, 333), (3, 0, 17, 2**63 + 5))
    for first, words in [(0, 1), (0, 6), (64, 3), (128, 2), (320, 1)]:
        ref = reference.tie_words(segments, 12345, first, words)
        assert torch.equal(FAMILIES[family].tie_words(segments, 12345, first, words, None), ref)


def test_tie_bits_depend_on_segment_not_layout():
    # The same parameter (key 7) at another offset of another bucket draws the same coins.
    a = reference.tie_words(SignSegments((0, 100, 300), (3, 7)), 99, 0, 5)
    b = cpu.tie_words(SignSegments((0, 200, 264), (7, 4)), 99, 0, 5)
    bits_a = [(int(a[(100 + i) // 64]) >> ((100 + i) % 64)) & 1 for i in range(200)]
    bits_b = [(int(b[i // 64]) >> (i % 64)) & 1 for i in range(200)]
    assert bits_a == bits_b
    assert 0.35 < sum(bits_a) / 200 < 0.65


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shard_draws_the_coins_of_its_entries_in_the_whole_tensor(family):
    # FSDP votes shards: rows 70.. of a 300-entry tensor (key 7) after 50 entries of another.
    whole = reference.tie_words(SignSegments((0, 300), (7,)), 99, 0, 5)
    shard = FAMILIES[family].tie_words(SignSegments((0, 50, 280), (3, 7), (0, 70)), 99, 0, 5, None)
    bits_whole = [(int(whole[(70 + i) // 64]) >> ((70 + i) % 64)) & 1 for i in range(230)]
    bits_shard = [(int(shard[(50 + i) // 64]) >> ((50 + i) % 64)) & 1 for i in range(230)]
    assert bits_whole == bits_shard
    with pytest.raises(ValueError, match="offsets"):
        SignSegments((0, 50, 280), (3, 7), (0,))


def test_kernel_choice_is_explicit():
    assert kernels_for(torch.device("cpu")) is cpu
    assert kernels_for(torch.device("cpu"), "torch") is torch_ops
    with pytest.raises(ValueError, match="numba"):
        kernels_for(torch.device("meta"), "numba")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="triton"):
            kernels_for(torch.device("cpu"), "triton")


_TRITON_CHECK = """
import torch
from signmuon.comm_hooks.kernels import cuda, reference
from signmuon.comm_hooks.kernels.bits import words_for
from tests.test_kernels import _input, DTYPES
checked = 0
for dtype in DTYPES:
    for n in (1, 63, 64, 65, 1000, 2100):
        x = _input(n, dtype, seed=n)
        words = words_for(n) + 1
        ref = reference.pack(x, words)
        got = cuda.pack(x, words)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (dtype, n)
        assert int(got[2]) == ref[2] and bool(got[3]) == ref[3], (dtype, n)
        for nonzero in (None, ref[1]):
            out = torch.full((n,), 7.0, dtype=dtype)
            cuda.unpack(ref[0], nonzero, out)
            assert torch.equal(out.double(), reference.unpack(ref[0], nonzero, n)), (dtype, n)
        checked += 1
from tests.test_kernels import MOMENTUM_CASES, _momentum_pack_matches
fused = 0
for dtype, grad_dtype in MOMENTUM_CASES:
    for n in (1, 65, 2100):
        for weight in (0.1, 0.9):
            for skip in (False, True):
                assert _momentum_pack_matches(cuda, dtype, grad_dtype, n, weight, skip), (dtype, grad_dtype, n, weight, skip)
                fused += 1
# Tensors past 2^31 entries run as several launches (32-bit offsets inside a launch): the same
# bits from launches of 3 words each, with a short last one and padding words past the data.
cuda.CHUNK_WORDS = 3
chunked = 0
for dtype in DTYPES:
    for n in (65, 200, 2100):
        x = _input(n, dtype, seed=n)
        words = words_for(n) + 1
        ref = reference.pack(x, words)
        got = cuda.pack(x, words)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), ("chunked", dtype, n)
        assert int(got[2]) == ref[2] and bool(got[3]) == ref[3], ("chunked", dtype, n)
        out = torch.full((n,), 7.0, dtype=dtype)
        cuda.unpack(ref[0], ref[1], out)
        assert torch.equal(out.double(), reference.unpack(ref[0], ref[1], n)), ("chunked", dtype, n)
        chunked += 1
for dtype, grad_dtype in MOMENTUM_CASES:
    assert _momentum_pack_matches(cuda, dtype, grad_dtype, 2100, 0.1, False), ("chunked", dtype, grad_dtype)
    assert _momentum_pack_matches(cuda, dtype, grad_dtype, 1000, 0.1, False, offset=3), ("chunked", dtype, grad_dtype)
    chunked += 1
print("checked", checked, "fused", fused, "chunked", chunked)
"""


def test_triton_kernels_match_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"checked 24 fused 84 chunked {3 * len(DTYPES) + len(MOMENTUM_CASES)}" in done.stdout


def test_tie_words_on_random_segments_match_reference():
    # Unaligned segment starts, keys over the whole 64-bit range, ranges past the data: the word
    # path (two hashes shifted together) and the entry path (boundary words) must both agree.
    import random

    rng = random.Random(1)
    for case in range(12):
        n = rng.randint(2, 1500)
        cuts = sorted(rng.sample(range(1, n), min(5, n - 1)))
        keys = tuple(rng.randint(0, 2**64 - 1) for _ in range(len(cuts) + 1))
        offsets = tuple(rng.randint(0, 300) for _ in keys) if case % 2 else ()
        segments = SignSegments(tuple([0, *cuts, n]), keys, offsets)
        first, words, key = 64 * rng.randint(0, n // 64), rng.randint(1, 30), rng.randint(0, 2**64 - 1)
        ref = reference.tie_words(segments, key, first, words)
        for family in FAMILIES.values():
            assert torch.equal(family.tie_words(segments, key, first, words, None), ref), case


def test_warm_up_compiles_each_kernel_for_each_dtype_before_any_timed_call():
    # In a fresh process (nothing compiled yet): after warm_up every numba kernel the vote calls
    # has a compiled signature, pack one per dtype (its input type differs by width).
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from signmuon.comm_hooks.kernels import cpu, warm_up\n"
        "kernels = (cpu._pack_kernel, cpu._vote_kernel, cpu._unpack_kernel, cpu._tie_kernel)\n"
        "print([len(k.signatures) for k in kernels])\n"
        "warm_up('cpu', (torch.float32, torch.bfloat16))\n"
        "print([len(k.signatures) for k in kernels])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[0, 0, 0, 0]"
    packs, votes, unpacks, ties = eval(out[1])
    assert packs == 2 and votes >= 1 and unpacks == 2 and ties == 1


def test_popcount_numpy_path_equals_the_swar_definition():
    words = torch.randint(-(2**62), 2**62, (1000,), generator=torch.Generator().manual_seed(3))
    words[:4] = torch.tensor([0, -1, -(2**63), 2**63 - 1])
    expected = torch.tensor([bin(w & (2**64 - 1)).count("1") for w in words.tolist()])
    assert torch.equal(torch_ops.popcount64(words), expected)
    assert torch.equal(torch_ops._popcount_swar(words), expected)
    assert torch.equal(torch_ops.popcount64(words.view(2, 500)[:, ::2]), expected.view(2, 500)[:, ::2])
