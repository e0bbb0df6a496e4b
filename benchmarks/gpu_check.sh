#!/usr/bin/env bash
# The first run on a lent GPU, as one prepared script under 10 minutes (a budget of 570 s:
# each section gets at most what is left, and one that runs out is reported, not fatal):
# 1. the Triton kernels bit for bit against the references on CUDA tensors (Signum's fused
#    momentum step and pack too), the multi-voter vote at M = 8 with zeros and ties, pack and
#    unpack past 2^31 entries (launches of 2^30 entries);
# 2. a sync audit under torch.cuda.set_sync_debug_mode("warn"): synchronisations per bucket of
#    the DDP hooks, per step of vote_in_step, the FSDP voter and a round, on 2 ranks sharing the
#    GPU through gloo with CUDA tensors;
# 3. 2 ranks on the GPU through gloo: DPPF and DiLoCo rounds, the train benchmark;
# 4. kernel throughput against memcpy; Newton–Schulz flips against float64 and time for
#    float32, TF32 and bf16; SignMuon's pre-vote work by path; charlm step time;
# 5. FSDP2 on CUDA (one rank, bf16 mixed precision): step time and peak memory against the
#    matrices' bytes; a DiLoCo round per pseudo-gradient rule, CUDA against CPU;
# 6. with two GPUs or more: torchrun with NCCL (flat and node-aware DDP hooks, rounds) against
#    the same run with gloo on the CPU, bit for bit.
# Writes its report to benchmarks/results/<date>-gpu-check.md (or $OUT if set).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
report="$out/$(date +%F)-gpu-check.md"
budget=570
work="$(mktemp -d)"  # scripts that spawn ranks must be files
# section NAME SECONDS COMMAND...: run COMMAND under the smaller of SECONDS and what is left.
section() {
  local name=$1 cap=$2 left=$((budget - SECONDS))
  shift 2
  if ((left < 20)); then echo "$name: skipped, out of time"; return 0; fi
  timeout $((cap < left ? cap : left)) "$@" || echo "$name: FAILED or timed out (exit $?)"
}
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
  echo
  echo "## Sync audit: host synchronisations on 2 ranks sharing the GPU through gloo (CUDA tensors)"
  echo '```'
  cat > "$work/audit.py" <<'PY'
import os, tempfile, warnings
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn

def count_syncs(fn):
    """Synchronisations torch flags (set_sync_debug_mode) plus explicit stream waits."""
    waits = [0]
    real = torch.cuda.Stream.synchronize
    def wait(stream):
        waits[0] += 1
        return real(stream)
    torch.cuda.synchronize()
    torch.cuda.Stream.synchronize = wait
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.Stream.synchronize = real
    return sum("synchroniz" in str(w.message) for w in caught) + waits[0]

def worker(rank, init):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.cuda.set_device(0)
    from signmuon.comm_hooks import CommStats, SignVoteState, VoteConfig, node_layout, sign_vote_hook
    from signmuon.comm_hooks.shard_vote import ShardSpec, ShardVoter
    from signmuon.optim import LocalStepAverager, OuterStep, SignMuon, SignumMV
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).cuda()
    x = torch.randn(64, 512, device="cuda") + rank
    report = []
    for name, momentum in (("signSGD-MV hook", 0.0), ("Signum-MV hook", 0.9)):
        model = torch.nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=1)
        state = SignVoteState(None, momentum=momentum, start_iter=1)
        calls = []

        def hook(state, bucket):  # DDP checks the hook's parameter names
            calls.append(1)
            return sign_vote_hook(state, bucket)

        model.register_comm_hook(state, hook)
        for step in range(4):
            calls.clear()
            syncs = count_syncs(lambda: model(x).square().mean().backward())
        report.append(f"{name}: {syncs} syncs in a backward of {len(calls)} buckets ({syncs / len(calls):.1f} per bucket)")
    for cls in (SignumMV, SignMuon):
        net = make()
        opt = cls(net.parameters(), lr=1e-3, vote_in_step=True)
        for step in range(3):
            net(x).square().mean().backward()
            syncs = count_syncs(opt.step)
            opt.zero_grad()
        report.append(f"{cls.__name__}(vote_in_step=True).step(): {syncs} syncs, {len(list(net.parameters()))} parameters")
    voter = ShardVoter(node_layout(None, 1), VoteConfig(), CommStats())
    specs = [ShardSpec((512, 512), key=0, owner=0), ShardSpec((512,), key=1)]
    shards = [torch.randn(512, 512, device="cuda"), torch.randn(512, device="cuda")]
    for step in range(3):
        syncs = count_syncs(lambda: voter.vote(shards, specs, lambda i, g: g, lambda i, t: t, None, step=step, label="audit"))
    report.append(f"FSDP voter step: {syncs} syncs")
    net = make()
    averager = LocalStepAverager(period=1, module=net, outer=OuterStep.diloco(pseudo_gradient="sign_vote"))
    for step in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        syncs = count_syncs(lambda: averager.average_parameters(net.parameters()))
    report.append(f"DiLoCo sign_vote round: {syncs} syncs")
    if rank == 0:
        print("\n".join(report))
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":  # spawned ranks import this file
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(worker, args=(os.path.join(folder, "init"),), nprocs=2, start_method="spawn")
PY
  section sync-audit 90 "$python" "$work/audit.py"
  echo '```'
  echo
  echo "## 2 ranks sharing the GPU through gloo: DPPF and DiLoCo on digits, CUDA tensors"
  echo '```'
  section gloo-train 60 "$python" -m signmuon.benchmarks train --task digits --device cuda --world-size 2 --steps 60 \
    --eval-every 30 --no-progress --methods dppf_8 diloco_8
  echo '```'
  echo
  echo "## Kernels on CUDA (ratios to a memcpy of the fp32 gradient; GB/s moved)"
  echo '```'
  section kernels 60 "$python" -m signmuon.benchmarks kernels --device cuda --sizes 1M 16M 64M 256M --world-size 8
  section kernels-torch 40 "$python" -m signmuon.benchmarks kernels --device cuda --sizes 16M 256M --world-size 8 --kernels torch
  echo '```'
  echo
  echo "## Newton–Schulz: flipped signs against float64 and cost, float32 (default), TF32, bf16"
  echo '```'
  section ns-precision 90 "$python" -m signmuon.benchmarks ns-precision --device cuda --sizes 256 1024 4096 \
    --ranks 8 32 0 --precisions float32 tfloat32 bfloat16 --seeds 2 --repeats 5
  for dtype in float32 tfloat32 bfloat16; do
    section "ns-time $dtype" 20 "$python" -m signmuon.benchmarks ns-time --device cuda --dtype "$dtype" --sizes 1024 4096 8192
  done
  echo '```'
  echo
  echo "## SignMuon's pre-vote work by path on CUDA: the non-matrix rest's launches against fwd+bwd"
  echo '```'
  for size in small medium; do
    section direction-time 30 "$python" -m signmuon.benchmarks direction-time --device cuda --task charlm --size "$size" \
      --batch-size 32
  done
  echo '```'
  echo
  echo "## charlm on the GPU, one rank: SignMuon vs AdamW step time and perplexity"
  echo '```'
  section charlm-medium 75 "$python" -m signmuon.benchmarks train --task charlm --size medium --device cuda --world-size 1 \
    --steps 100 --eval-every 100 --no-progress --methods adamw signmuon
  echo '```'
  echo
  echo "## FSDP2 on CUDA: SignMuon through register_fsdp_vote, bf16 compute, one rank: the vote during backward (worker stream) against the vote in step()"
  echo '```'
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 section fsdp 90 "$python" - <<'PY'
import time, torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from signmuon.optim import SignMuon, node_mesh, register_fsdp_vote
dist.init_process_group("nccl")
torch.cuda.set_device(0)
mesh = node_mesh()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
x = torch.randn(64, 2048, device="cuda")
finals = {}
for during_backward in (True, False):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    for layer in net:
        fully_shard(layer, mesh=mesh["local"], mp_policy=policy)
    fully_shard(net, mesh=mesh["local"], mp_policy=policy)
    opt = SignMuon(net.parameters(), lr=1e-3)
    register_fsdp_vote(net, opt, mesh, during_backward=during_backward)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(12):
        torch.cuda.synchronize(); start = time.perf_counter()
        opt.zero_grad(); net(x).square().mean().backward(); opt.step()
        torch.cuda.synchronize(); times.append(time.perf_counter() - start)
    dtypes = {v.dtype for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0}
    assert dtypes == {torch.float32}, dtypes
    matrix_bytes = sum(4 * p.numel() for p in net.parameters() if p.dim() == 2)
    peak = torch.cuda.max_memory_allocated()
    finals[during_backward] = [p.full_tensor().float().cpu() for p in net.parameters()]
    print(f"fsdp signmuon on cuda, during_backward={during_backward}: median step {1e3 * sorted(times[2:])[5]:.1f} ms, "
          f"state {dtypes}, peak memory {peak / 2**20:.0f} MiB = {peak / matrix_bytes:.2f}x the fp32 matrices")
same = all(torch.equal(a, b) for a, b in zip(finals[True], finals[False]))
print(f"during backward equals in step(), bit for bit: {same}")
assert same
dist.destroy_process_group()
PY
  echo '```'
  echo
  echo "## Rounds on CUDA: one DiLoCo round per pseudo-gradient rule, CUDA against CPU, one rank"
  echo '```'
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29534 RANK=0 WORLD_SIZE=1 section rounds-cuda 60 "$python" - <<'PY'
import dataclasses, torch, torch.distributed as dist
from signmuon.optim import LocalStepAverager, OuterStep
dist.init_process_group("nccl")
torch.cuda.set_device(0)
eight_bit = dataclasses.replace(OuterStep.diloco(pseudo_gradient="sign_vote_ef"), scale_block=64, scale_bits=8)
for rule, outer in [(r, OuterStep.diloco(pseudo_gradient=r)) for r in ("mean", "sign_vote", "scaled_sign")] + [
        ("sign_vote_ef, 8-bit scales per 64", eight_bit)]:
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 10)).to(device)
        averager = LocalStepAverager(period=1, pull=1.0, outer=outer, module=net)
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
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  echo "## NCCL against gloo on the CPU, bit for bit ($gpus GPUs)"
  echo '```'
  if ((gpus >= 2)); then
    check="$work"
    cat > "$check/votes.py" <<'PY'
"""Each rank's gradient set exactly (loss = sum of p * g), voted by the DDP hook flat and, with 4
ranks or more, node-aware (2 ranks per node), then a DiLoCo sign_vote round: the same bits under
NCCL on GPUs as under gloo on the CPU. Usage: votes.py BACKEND OUT (torchrun sets the ranks)."""
import os, sys
import torch, torch.distributed as dist
from torch import nn
from signmuon.comm_hooks import SignVoteState, VoteConfig, sign_vote_hook
from signmuon.optim import LocalStepAverager, OuterStep

backend, out = sys.argv[1], sys.argv[2]
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)
results = {}
configs = [("flat", VoteConfig())] + ([("node-aware", VoteConfig(hierarchical=True, ranks_per_node=2))] if world >= 4 else [])
for name, config in configs:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 10)).to(device)
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.1)
    model.register_comm_hook(SignVoteState(None, momentum=0.9, start_iter=1, vote=config), sign_vote_hook)
    for step in range(4):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        grads = [torch.randn(p.shape, generator=gen) for p in net.parameters()]
        for g in grads:
            g[torch.rand(g.shape, generator=gen) < 0.1] = 0.0  # zeros travel
        model.zero_grad()
        sum((p * g.to(device)).sum() for p, g in zip(model.module.parameters(), grads)).backward()
        results[f"{name} step {step}"] = [p.grad.detach().cpu().clone() for p in net.parameters()]
torch.manual_seed(0)
net = nn.Linear(300, 200).to(device)
averager = LocalStepAverager(period=1, module=net, outer=OuterStep.diloco(pseudo_gradient="sign_vote"), track_distances=False)
with torch.no_grad():
    for p in net.parameters():
        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)).to(device))
averager.average_parameters(net.parameters())
results["round"] = [p.detach().cpu().clone() for p in net.parameters()]
torch.save(results, f"{out}.rank{rank}")
dist.destroy_process_group()
PY
    section nccl 90 torchrun --standalone --nproc-per-node "$gpus" "$check/votes.py" nccl "$check/nccl"
    section gloo 90 env CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node "$gpus" "$check/votes.py" gloo "$check/gloo"
    section compare 30 "$python" -c "
import sys, torch
gpus, check = int(sys.argv[1]), sys.argv[2]
for rank in range(gpus):
    a, b = torch.load(f'{check}/nccl.rank{rank}'), torch.load(f'{check}/gloo.rank{rank}')
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for key in a:
        if key == 'round':  # the outer step's floats: close, the votes under it exact
            torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)
        else:
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), (rank, key)
print(f'NCCL on {gpus} GPUs equals gloo on the CPU: votes bit for bit ({len(a) - 1} hook steps), the round within 1e-6')
" "$gpus" "$check"
  else
    echo "one GPU: the NCCL comparison needs two or more (skipped)"
  fi
  echo '```'
} | tee "$report"
echo "report: $report"
