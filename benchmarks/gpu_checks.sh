#!/usr/bin/env bash
# One prepared run for a lent GPU: CUDA bit-exactness of the Triton kernels and the fused decode,
# then the GPU benchmark ratios. Logs go to $OUT (device tool) or benchmarks/results/.
# Needs the pack's dependencies importable (diffusers, transformers, safetensors, triton).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

python -m pytest -q -p no:cacheprovider tests/test_wan_vae_kernels.py tests/test_wan_vae_decode.py \
    tests/test_attention_rainfusion.py tests/test_attention_varlen.py 2>&1 | tee "$out/gpu_tests.txt"
python benchmarks/bench_wan_vae_decode.py --frames 81 --height 480 --width 832 --dtype bf16 --runs 3 \
    2>&1 | tee "$out/wan_vae_decode_gpu.txt"
python benchmarks/bench_attention.py --dtype bf16 2>&1 | tee "$out/attention_gpu.txt"
