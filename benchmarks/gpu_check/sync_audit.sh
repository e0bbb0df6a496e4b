# Part 2 of benchmarks/gpu_check.sh: the sync audit (its ranks are spawned, so the script is a file).
# Sourced inside its report, from the repository root; uses its section, $python and $work.
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
