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
# Each numbered part is a file of benchmarks/gpu_check/, sourced below in this order.
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
  source benchmarks/gpu_check/triton.sh
  source benchmarks/gpu_check/sync_audit.sh
  source benchmarks/gpu_check/commands.sh
  source benchmarks/gpu_check/fsdp_rounds.sh
  source benchmarks/gpu_check/nccl.sh
} | tee "$report"
echo "report: $report"
