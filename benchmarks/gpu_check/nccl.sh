# Part 6 of benchmarks/gpu_check.sh: NCCL against gloo on the CPU (two GPUs or more).
# Sourced inside its report, from the repository root; uses its section, $python and $work.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "## NCCL against gloo on the CPU, bit for bit ($gpus GPUs)"
echo '```'
if ((gpus >= 2)); then
  check="$work"
  cat > "$check/votes.py" <<'PY'
"""Each rank's gradient set exactly (loss = sum of p * g), voted by the DDP hook flat and, with 4
ranks or more, node-aware (2 ranks per node), then a DiLoCo sign_vote round and streaming one-bit
rounds (2 fragments, each in flight for a step): the same bits under
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
# Streaming one-bit rounds (2 fragments, each in flight for one step): the collectives issued
# asynchronously on the training stream's data, waited for a step later.
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 10)).to(device)
outer = OuterStep.diloco(pseudo_gradient="sign_vote_ef")
averager = LocalStepAverager(period=4, module=net, outer=outer, fragments=2, sync_delay=1, track_distances=False)
for step in range(8):
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + step)).to(device), alpha=0.01)
    averager.average_parameters(net.parameters())
results["streaming round"] = [p.detach().cpu().clone() for p in net.parameters()]
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
        if 'round' in key:  # the outer step's floats: close, the votes under it exact
            torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)
        else:
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), (rank, key)
print(f'NCCL on {gpus} GPUs equals gloo on the CPU: votes bit for bit ({len(a) - 2} hook steps), the rounds (one streamed) within 1e-6')
" "$gpus" "$check"
else
  echo "one GPU: the NCCL comparison needs two or more (skipped)"
fi
echo '```'
