# Part 5 of benchmarks/gpu_check.sh: FSDP2 and a DiLoCo round on CUDA.
# Sourced inside its report, from the repository root; uses its section, $python and $work.
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
