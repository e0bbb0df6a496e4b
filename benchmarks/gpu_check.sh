#!/usr/bin/env bash
# One prepared check for a machine with a single NVIDIA GPU (under 8 minutes):
# kernel throughput vs memcpy on CUDA, Newton–Schulz time per size in bf16, and
# single-GPU charlm throughput (step time) of SignMuon against AdamW.
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
  echo "## Kernels on CUDA (ratios to a memcpy of the fp32 gradient)"
  echo '```'
  timeout 150 "$python" -m signmuon.benchmarks.kernels --device cuda --sizes 1M 16M 64M 256M --world-size 8
  echo '```'
  echo
  echo "## Newton–Schulz, bf16, 5 steps"
  echo '```'
  timeout 120 "$python" -m signmuon.benchmarks.ns_time --device cuda --sizes 512 1024 2048 4096 8192
  echo '```'
  echo
  echo "## charlm on the GPU, one rank: SignMuon vs AdamW step time and perplexity"
  echo '```'
  timeout 150 "$python" -m signmuon.benchmarks.train --task charlm --device cuda --world-size 1 --steps 300 \
    --eval-every 300 --no-progress --methods adamw signmuon
  echo '```'
} | tee "$report"
echo "report: $report"
