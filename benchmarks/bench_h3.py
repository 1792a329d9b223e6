"""MiniMax-H3 sampler: time per step and peak memory for sdpa vs flash_varlen vs RainFusion (0.8).

Random weights, no downloads. Time per step = the fastest forward+Euler step after a warm-up one. Each
(config, backend) runs in a fresh process so the peak memory is its own.
On CPU the peak is the process RSS high-water mark; on CUDA, torch.cuda.max_memory_allocated.

    python benchmarks/bench_h3.py                 # tiny + mid (CPU-sized)
    python benchmarks/bench_h3.py --configs large # GPU: 10 blocks, 768x1344-like grid
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource

from step_timer import StepTimer  # benchmarks/ (this script's folder)

CONFIGS = {
    # name: (transformer overrides, width, height, frames)
    "tiny": (dict(), 96, 64, 124),
    "mid": (
        dict(
            num_attention_heads=4,
            attention_head_dim=64,
            hidden_size=256,
            num_layers=2,
            ffn_dim=512,
            time_embed_hidden_dim=64,
            time_embed_dim=32,
            rope_freq_dim=8,
        ),
        512,
        512,
        124,
    ),
    "large": (
        dict(
            num_attention_heads=16,
            attention_head_dim=128,
            hidden_size=2048,
            num_layers=10,
            ffn_dim=5632,
            time_embed_hidden_dim=256,
            time_embed_dim=128,
            rope_freq_dim=16,
        ),
        1344,
        768,
        124,
    ),
}
BACKENDS = {
    "sdpa": dict(backend="sdpa"),
    "flash_varlen": dict(backend="flash_varlen"),
    "rainfusion(0.8)": dict(backend="rainfusion", sparsity=0.8),
}


def run_one(config_name: str, backend: str, steps: int, threads: int) -> tuple[float, float, str, str]:
    import sys
    from pathlib import Path

    import torch

    if threads > 0:  # on a shared CPU, OpenMP threads that spin-wait for busy cores make tiny ops ~100x slower
        torch.set_num_threads(threads)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.h3_tiny import TRANSFORMER, make_models  # the tiny VAEs are enough: the benchmark stops at latents

    from omnivideo import compat
    from omnivideo.attention.config import AttentionConfig
    from omnivideo.backends import PLATFORM
    from omnivideo.models.h3.loader import geometry_of, latent_norm_of
    from omnivideo.models.handles import H3Conditioning, H3Model
    from omnivideo.pipelines.h3 import sample

    overrides, width, height, frames = CONFIGS[config_name]
    transformer, vae, audio_vae = make_models(seed=0, **overrides)
    device = PLATFORM.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformer.to(device, dtype)
    for name, p in transformer.named_parameters():  # the fp32 islands, as the loader keeps them
        if any(k in name.split(".") for k in transformer._keep_in_fp32_modules):
            p.data = p.data.float()
    model = H3Model(
        patcher=compat.manage(transformer, "diffusion", device),
        dtype=dtype,
        attention=AttentionConfig(**BACKENDS[backend]),
        geometry=geometry_of(transformer, vae, audio_vae),
        latent_norm=latent_norm_of(vae, audio_vae),
    )
    emb = torch.randn(1, 64, TRANSFORMER["text_dim"])
    cond = H3Conditioning(text=emb, text_token_tags=torch.ones(64, dtype=torch.long))
    timer = StepTimer(device)

    import logging
    import re

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("omnivideo").addHandler(handler)
    logging.getLogger("omnivideo").setLevel(logging.INFO)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer.start()
    sample(model, cond, seed=0, frames=frames, steps=steps, width=width, height=height, progress=timer)
    times = timer.durations()
    # first forward excluded (warm-up, compiles); min of the rest: robust to other processes on a shared CPU
    per_step = min(times[1:]) if len(times) > 1 else times[0]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from omnivideo.models.h3.geometry import resolve_shape

    shape = resolve_shape(frames, width, height, model.geometry)
    seq = (
        64
        + 2 * shape.num_audio_latents
        + shape.num_latent_frames * (shape.latent_height // 2) * (shape.latent_width // 2)
    )
    realized = next((m.group(1) for r in records if (m := re.search(r"realized ([0-9.]+|n/a)", r))), "-")
    return per_step, peak, f"{device.type}, seq {seq}", realized


def _child(args, queue):
    try:
        queue.put(run_one(*args))
    except Exception as exc:  # report, keep benchmarking the others
        queue.put(exc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--steps", type=int, default=6, help="sigma points (steps-1 forwards; the first is warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for cfg in args.configs.split(","):
        rows = {}
        for backend in BACKENDS:
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=((cfg, backend, args.steps, args.threads), q))
            p.start()
            res = q.get()
            p.join()
            if isinstance(res, Exception):
                print(f"{cfg:5s} {backend:16s} failed: {res}")
                continue
            rows[backend] = res
        if "sdpa" not in rows:
            continue
        base_t, base_m, where, _ = rows["sdpa"]
        print(f"\n{cfg} ({where}, {args.threads or 'default'} thread(s)); ratios vs sdpa")
        print(f"{'backend':16s} {'s/step':>9s} {'x time':>7s} {'peak MB':>9s} {'x mem':>6s} {'realized sparsity':>18s}")
        for backend, (t, m, _, realized) in rows.items():
            print(f"{backend:16s} {t:9.3f} {t / base_t:7.2f} {m:9.0f} {m / base_m:6.2f} {realized:>18s}")


if __name__ == "__main__":
    main()
