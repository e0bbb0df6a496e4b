# Parts 3 and 4 of benchmarks/gpu_check.sh: the benchmark commands on the GPU.
# Sourced inside its report, from the repository root; uses its section, $python and $work.
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
