# Part 1 of benchmarks/gpu_check.sh: the Triton kernels on CUDA tensors against the references.
# Sourced inside its report, from the repository root; uses its section, $python and $work.
echo
echo "## Triton kernels on CUDA tensors against the references"
echo '```'
section triton 90 "$python" - <<'PY'
import torch
from signmuon.comm_hooks import majority_vote, VoteConfig
from signmuon.comm_hooks.kernels import cuda, reference
from signmuon.comm_hooks.kernels.bits import words_for
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for n in (1, 63, 64, 65, 1000, 100_003):
        x = torch.randn(n).to(dtype)
        x[torch.rand(n) < 0.2] = 0.0
        x[::17] = -0.0
        words = words_for(n) + 1
        ref = reference.pack(x, words) if n < 5000 else None
        got = cuda.pack(x.cuda(), words)
        if ref is not None:
            assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1]), (dtype, n)
            assert int(got[2]) == ref[2] and bool(got[3]) == ref[3], (dtype, n)
        out = torch.empty(n, dtype=dtype, device="cuda")
        cuda.unpack(got[0], got[1], out)
        assert torch.equal(out.cpu(), torch.sign(x).to(dtype)), (dtype, n)
for dtype, grad_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                          (torch.float16, torch.float16), (torch.float64, torch.float64)):
    for n in (65, 100_003):
        for weight, skip in ((0.1, False), (0.9, False), (0.1, True)):
            m, g = torch.randn(n).to(dtype), (3 * torch.randn(n)).to(grad_dtype)
            m[::7] = 0.0
            words = words_for(n) + 1
            ref_m = m.clone()
            ref = reference.momentum_pack(ref_m, g, weight, torch.tensor(skip), words) if n < 5000 else None
            if ref is None:  # large: torch's lerp_ on the CPU, then the Triton pack of it
                ref_m = m.clone().lerp_(g.to(dtype), weight) if not skip else m.clone()
            got_m = m.cuda()
            got = cuda.momentum_pack(got_m, g.cuda(), weight, torch.tensor(skip, device="cuda"), words)
            assert torch.equal(got_m.cpu(), ref_m), ("momentum", dtype, grad_dtype, n, weight, skip)
            if ref is not None:
                assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1]), (dtype, n, weight)
for offset in (1, 3):  # the node-aware vote's slice of a node mean: a gradient view off its storage's alignment
    m, g = torch.randn(4099), 3 * torch.randn(4099 + offset)
    ref_m = m.clone()
    ref = reference.momentum_pack(ref_m, g[offset:], 0.1, torch.tensor(False), words_for(4099) + 1)
    got_m = m.cuda()
    got = cuda.momentum_pack(got_m, g.cuda()[offset:], 0.1, torch.tensor(False, device="cuda"), words_for(4099) + 1)
    assert torch.equal(got_m.cpu(), ref_m) and torch.equal(got[0].cpu(), ref[0]), ("unaligned slice", offset)
x = torch.randn(1 << 20, device="cuda")
assert torch.equal(majority_vote(x, config=VoteConfig()), torch.sign(x))
from signmuon.comm_hooks.vote.encodings.zero_codes import plane_from_runs, zero_runs
rows = torch.randn(3000, 96)
rows[:700], rows[900::31] = 0.0, 0.0  # an embedding's absent rows: zeros sent as runs
_, nonzero, _, _ = cuda.pack(rows.view(-1).cuda(), words_for(rows.numel()))
starts, lengths = zero_runs(nonzero)
assert torch.equal(plane_from_runs(starts, lengths, nonzero.numel()), nonzero)
assert torch.equal(torch.stack([starts, lengths]).cpu(), torch.stack(zero_runs(nonzero.cpu())))
# The vote of M = 8 voters with zeros and ties (even M) against the reference.
gen = torch.Generator().manual_seed(0)
signs = torch.randint(-1, 2, (8, 4000), generator=gen).float()
planes = [reference.pack(s, words_for(4000)) for s in signs]
positive, nonzero = torch.stack([p[0] for p in planes]), torch.stack([p[1] for p in planes])
tie = torch.randint(-2**62, 2**62, (words_for(4000),), generator=gen)
for tie_bits in (None, tie):
    want = reference.vote(positive, nonzero, tie_bits)
    got = cuda.vote(positive.cuda(), nonzero.cuda(), [False] * 8, None if tie_bits is None else tie_bits.cuda())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), "M = 8 vote"
# Past 2^31 entries: launches of 2^30 entries; the last words against the same entries packed alone.
n = (1 << 31) + 4099
x = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
x[-3000::7] = 0.0
got = cuda.pack(x, words_for(n))
tail_start = n - 64 * 200 - 3  # a word boundary: n - tail_start entries in the last 201 words
tail_start -= tail_start % 64
alone = cuda.pack(x[tail_start:], words_for(n - tail_start))
assert torch.equal(got[0][tail_start // 64 :], alone[0]) and torch.equal(got[1][tail_start // 64 :], alone[1]), "past 2^31"
out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
cuda.unpack(got[0], got[1], out)
assert torch.equal(out[-5000:], torch.sign(x[-5000:])) and torch.equal(out[:5000], torch.sign(x[:5000])), "unpack past 2^31"
del x, out, got
print("triton kernels: bit-exact on CUDA for fp32/bf16/fp16/fp64 (pack, unpack, fused momentum_pack); M = 8 vote with "
      "zeros and ties; pack/unpack past 2^31 entries; majority_vote and zero runs on CUDA ok")
PY
echo '```'
