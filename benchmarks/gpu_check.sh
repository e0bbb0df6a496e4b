#!/usr/bin/env bash
# One prepared check for a machine with a single NVIDIA GPU (under 11 minutes):
# the Triton kernels bit for bit against the references on CUDA tensors (Signum's fused
# momentum step and pack too), kernel throughput vs memcpy (Triton and the torch fallback;
# pack/unpack GB/s against HBM; Signum's fused pass and its two-pass form against pack), a vote through the
# collective on CUDA, Newton–Schulz: signs flipped against float64 and time per call in float32
# (SignMuon's default) and bfloat16, per size and momentum rank; SignMuon's pre-vote work by
# path (what a fused momentum step for the non-matrix rest could save); single-GPU charlm
# throughput (step time) of SignMuon against AdamW, small and medium (the 14M GPT: how long a
# step's compute takes on a GPU, against the 0.69 s its fp32 all-reduce needs at 1 Gbit/s on 4
# ranks, the ratio the CPU time-to-target runs cannot show); and the FSDP2 vote on CUDA
# (register_fsdp_vote, one rank, bf16 mixed precision, Triton kernels); one DiLoCo round per
# pseudo-gradient rule (fp32 mean, sign vote, error-feedback scaled signs, error-feedback votes
# with 8-bit block scales) on CUDA against CPU.
# Writes its report to benchmarks/results/<date>-gpu-check.md (or $OUT if set).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
report="$out/$(date +%F)-gpu-check.md"
{
  echo "# $(date +%F) — GPU check"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo '```'
  echo
  echo "## Triton kernels on CUDA tensors against the references"
  echo '```'
  timeout 120 "$python" - <<'PY'
import torch
from signmuon.comm_hooks import majority_vote, VoteConfig
from signmuon.comm_hooks.kernels import cuda, reference
from signmuon.comm_hooks.kernels.layout import words_for
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
from signmuon.comm_hooks.vote.zero_codes import plane_from_runs, zero_runs
rows = torch.randn(3000, 96)
rows[:700], rows[900::31] = 0.0, 0.0  # an embedding's absent rows: zeros sent as runs
_, nonzero, _, _ = cuda.pack(rows.view(-1).cuda(), words_for(rows.numel()))
starts, lengths = zero_runs(nonzero)
assert torch.equal(plane_from_runs(starts, lengths, nonzero.numel()), nonzero)
assert torch.equal(torch.stack([starts, lengths]).cpu(), torch.stack(zero_runs(nonzero.cpu())))
print("triton kernels: bit-exact on CUDA for fp32/bf16/fp16/fp64 (pack, unpack, fused momentum_pack); majority_vote "
      "and zero runs on CUDA ok")
PY
  echo '```'
  echo
  echo "## Kernels on CUDA (ratios to a memcpy of the fp32 gradient; GB/s moved)"
  echo '```'
  timeout 120 "$python" -m signmuon.benchmarks.kernels --device cuda --sizes 1M 16M 64M 256M --world-size 8
  timeout 90 "$python" -m signmuon.benchmarks.kernels --device cuda --sizes 16M 256M --world-size 8 --kernels torch
  echo '```'
  echo
  echo "## Newton–Schulz: flipped signs against float64 and cost, float32 (default) vs bf16"
  echo '```'
  timeout 150 "$python" -m signmuon.benchmarks.ns_precision --device cuda --sizes 256 1024 4096 --ranks 8 32 0 \
    --precisions float32 bfloat16 --seeds 2 --repeats 5
  timeout 90 "$python" -m signmuon.benchmarks.ns_time --device cuda --dtype float32 --sizes 1024 4096 8192
  echo '```'
  echo
  echo "## SignMuon's pre-vote work by path on CUDA: the non-matrix rest's launches against fwd+bwd"
  echo '```'
  for size in small medium; do
    timeout 60 "$python" -m signmuon.benchmarks.direction_time --device cuda --task charlm --size "$size" --batch-size 32
  done
  echo '```'
  echo
  echo "## charlm on the GPU, one rank: SignMuon vs AdamW step time and perplexity"
  echo '```'
  timeout 150 "$python" -m signmuon.benchmarks.train --task charlm --device cuda --world-size 1 --steps 300 \
    --eval-every 300 --no-progress --methods adamw signmuon
  timeout 150 "$python" -m signmuon.benchmarks.train --task charlm --size medium --device cuda --world-size 1 \
    --steps 100 --eval-every 100 --no-progress --methods adamw signmuon
  echo '```'
  echo
  echo "## FSDP2 on CUDA: SignMuon through register_fsdp_vote, bf16 compute, one rank"
  echo '```'
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 timeout 120 "$python" - <<'PY'
import time, torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from signmuon.optim import SignMuon, node_mesh, register_fsdp_vote
dist.init_process_group("nccl")
torch.cuda.set_device(0)
mesh = node_mesh()
net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in net:
    fully_shard(layer, mesh=mesh["local"], mp_policy=policy)
fully_shard(net, mesh=mesh["local"], mp_policy=policy)
opt = SignMuon(net.parameters(), lr=1e-3)
register_fsdp_vote(net, opt, mesh)
x = torch.randn(64, 2048, device="cuda")
times = []
for step in range(12):
    torch.cuda.synchronize(); start = time.perf_counter()
    opt.zero_grad(); net(x).square().mean().backward(); opt.step()
    torch.cuda.synchronize(); times.append(time.perf_counter() - start)
dtypes = {v.dtype for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0}
assert dtypes == {torch.float32}, dtypes
print(f"fsdp signmuon on cuda: median step {1e3 * sorted(times[2:])[5]:.1f} ms, state {dtypes}")
dist.destroy_process_group()
PY
  echo '```'
  echo
  echo "## Rounds on CUDA: one DiLoCo round per pseudo-gradient rule, CUDA against CPU, one rank"
  echo '```'
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29534 RANK=0 WORLD_SIZE=1 timeout 120 "$python" - <<'PY'
import dataclasses, torch, torch.distributed as dist
from signmuon.optim import DPPFAverager, OuterStep
dist.init_process_group("nccl")
torch.cuda.set_device(0)
eight_bit = dataclasses.replace(OuterStep.diloco(pseudo_gradient="sign_vote_ef"), scale_block=64, scale_bits=8)
for rule, outer in [(r, OuterStep.diloco(pseudo_gradient=r)) for r in ("mean", "sign_vote", "scaled_sign")] + [
        ("sign_vote_ef, 8-bit scales per 64", eight_bit)]:
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 10)).to(device)
        averager = DPPFAverager(period=1, pull=1.0, outer=outer, module=net)
        with torch.no_grad():
            for p in net.parameters():
                p.grad = torch.zeros_like(p)
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(device))
        averager.average_parameters(net.parameters())
        results.append(torch.cat([p.detach().reshape(-1).cpu() for p in net.parameters()]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    print(f"round {rule}: CUDA equals CPU (max diff {float((results[1] - results[0]).abs().max()):.2e})")
dist.destroy_process_group()
PY
  echo '```'
} | tee "$report"
echo "report: $report"
