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

pytest -q -p no:cacheprovider tests/test_wan_vae_kernels.py tests/test_wan_vae_decode.py \
    tests/test_attention_rainfusion.py tests/test_attention_varlen.py tests/test_omnidreams_static_step.py 2>&1 \
    | tee "$out/gpu_tests.txt"
python benchmarks/bench_attention.py --dtype bf16 2>&1 | tee "$out/attention_gpu.txt"

# Memory owned by ComfyUI (needs a ComfyUI checkout): partial loading and fp8 on the GPU, H3 and OmniDreams at the
# mid size with a weight budget of a third of the model, vs the full load.
for c in "${COMFYUI_PATH:-}" ../shared/comfyui shared/comfyui; do
    if [ -f "$c/main.py" ]; then export COMFYUI_PATH=$(cd "$c" && pwd); break; fi
done
if [ -f "${COMFYUI_PATH:-}/main.py" ]; then
    # core VAE Decode vs ours in fresh GPU servers of this ComfyUI (and of ../shared/comfyui-0.33 as the baseline's
    # successor when both are here: COMFYUI_PYTHON / BASELINE_COMFYUI_PYTHON name their interpreters)
    COMFYUI_PYTHON=${COMFYUI_PYTHON:-python} python benchmarks/bench_wan_vae_decode.py --gpu --sizes 832x480x81 \
        --runs 3 2>&1 | tee "$out/wan_vae_decode_gpu.txt"
    # the install check on the device: every workflow, the decode at every level and every kernel on CUDA
    ${COMFYUI_PYTHON:-python} -m omnivideo.selftest --comfyui "$COMFYUI_PATH" 2>&1 | tee "$out/selftest_gpu.txt"
    python benchmarks/bench_model_memory.py --config mid 2>&1 | tee "$out/model_memory_gpu.txt"
    pytest -q -p no:cacheprovider tests/test_model_management.py 2>&1 | tee "$out/model_management_gpu.txt"
else
    echo "no ComfyUI checkout (COMFYUI_PATH): model-memory checks skipped" | tee "$out/model_memory_gpu.txt"
fi

# MiniMax-H3 on the GPU: our sampler's attention backends, and core 0.33's native model unpatched vs OmniVideo Patch
# Model Attention (sdpa, RainFusion 0.8) where a ComfyUI 0.33 is here (COMFYUI33_PYTHON: its interpreter)
native=""
for c in ../shared/comfyui-0.33 shared/comfyui-0.33; do
    if [ -f "$c/main.py" ]; then native=$(cd "$c" && pwd); break; fi
done
COMFYUI_PATH=$native COMFYUI_PYTHON=${COMFYUI33_PYTHON:-python} python benchmarks/bench_h3.py --configs large \
    --native large 2>&1 | tee "$out/h3_gpu.txt"

# OmniDreams at frame rate, the released 2B shape at 704x1280 in bf16, random weights (DiT only, no decode): ms per
# chunk (fps = 8 / s per chunk) and the KV window for eager / compiled / graphed x kv_finalize context_noise / skip x
# kv_dtype auto / fp8, as ratios in one run (goal on one H200 with the decode: >= 46 fps)
python benchmarks/bench_omnidreams.py --config 2b --height 704 --width 1280 --dtype bf16 --no-baseline --runs 1 \
    --chunks 6 --step eager --step compiled --step graphed --kv-finalize context_noise --kv-finalize skip \
    --kv-dtype auto --kv-dtype fp8_e4m3fn 2>&1 | tee "$out/omnidreams_frame_rate_gpu.txt"

# Streaming OmniDreams on the GPU: the 2B-shaped random DiT at 704x1280 in bf16 with the full-size Wan 2.1 VAE,
# streamed vs batch (peak, first frame, throughput) and the compiled blocks vs eager, ms per chunk.
if [ -f "${COMFYUI_PATH:-}/main.py" ]; then
    BENCH_FULL_VAE=1 python benchmarks/bench_omnidreams_stream.py --config 2b --chunks 4 10 --compile-chunks 10 \
        2>&1 | tee "$out/omnidreams_stream_gpu.txt"
    # OmniDreams Live at the same size: ms per chunk live (a websocket viewer, JPEGs) vs the plain stream (ratio),
    # control latency (a prompt POSTed at a random moment -> the first frame that reflects it: chunks, ms to write,
    # JPEG, websocket client) and frames-to-client, through the real aiohttp routes on 127.0.0.1 (needs aiohttp)
    BENCH_FULL_VAE=1 python benchmarks/bench_omnidreams_live.py --config 2b --chunks 6 --rounds 3 --reps 4 \
        2>&1 | tee "$out/omnidreams_live_gpu.txt"
fi

# OmniDreams context parallel across GPUs (one rank per GPU, NCCL): s/chunk, rank 0's peak and the bytes per chunk
# at world sizes 1, 2, 4 up to the GPU count (the mid config has 4 heads), 704x1280 in bf16. Needs more than one GPU.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -gt 1 ]; then
    sizes=""
    for n in 1 2 4; do [ "$n" -le "$gpus" ] && sizes="$sizes $n"; done
    # shellcheck disable=SC2086
    python benchmarks/bench_parallel.py --device cuda --world-sizes $sizes --config mid --latent 88x160 --chunks 6 \
        2>&1 | tee "$out/parallel_gpu.txt"
    # the pool on CUDA (NCCL's bootstrap bound to loopback like gloo): every socket of rank 0 and its workers on
    # loopback, strangers get nothing (the pool test starts 3 ranks: one per GPU)
    [ "$gpus" -gt 2 ] && pytest -q -p no:cacheprovider tests/test_parallel_pool.py 2>&1 \
        | tee "$out/parallel_pool_gpu.txt"
else
    echo "$gpus GPU(s): the multi-GPU context-parallel benchmark (bench_parallel.py --device cuda) skipped" \
        | tee "$out/parallel_gpu.txt"
fi

# ComfyUI's own models split by OmniVideo Sequence Parallel (ranks = threads, core's per-device copies): time per
# step and peak per GPU at 1 / 2 / 4 GPUs, full width with 4 blocks: MiniMax-H3 at 1344x768x124 (goal: >= 1.8x at 2,
# >= 3.2x at 4) and Wan 14B at 1280x704x81. Needs ComfyUI 0.33 (native H3, deepclone_multigpu) and several GPUs.
if [ "$gpus" -gt 1 ] && [ -n "$native" ]; then
    worlds=""
    for n in 1 2 4; do [ "$n" -le "$gpus" ] && worlds="$worlds $n"; done
    # shellcheck disable=SC2086
    COMFYUI_PATH=$native ${COMFYUI33_PYTHON:-python} -P benchmarks/bench_core_parallel.py --device cuda --config full \
        --layers 4 --model h3 --size 1344x768x124 --worlds $worlds 2>&1 | tee "$out/core_parallel_h3_gpu.txt"
    # shellcheck disable=SC2086
    COMFYUI_PATH=$native ${COMFYUI33_PYTHON:-python} -P benchmarks/bench_core_parallel.py --device cuda --config full \
        --layers 4 --model wan --size 1280x704x81 --worlds $worlds 2>&1 | tee "$out/core_parallel_wan_gpu.txt"
else
    echo "$gpus GPU(s) / ComfyUI 0.33 '${native}': the core-model sequence-parallel benchmark skipped" \
        | tee "$out/core_parallel_gpu.txt"
fi
