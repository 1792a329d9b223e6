"""MiniMax-H3 sampler: time per step and peak memory for sdpa vs flash_varlen vs RainFusion (0.8).

Random weights, no downloads. Time per step = the fastest forward+Euler step after a warm-up one. Each
(config, backend) runs in a fresh process so the peak memory is its own.
On CPU the peak is the process RSS high-water mark; on CUDA, torch.cuda.max_memory_allocated.

With COMFYUI_PATH (+ COMFYUI_PYTHON, its interpreter) naming a ComfyUI with a native MiniMax-H3 (0.33+), the same
run also times core's own model (the same weights in core's format, core's sampler, `--native` configs):
unpatched (the attention core picked on this device) vs OmniVideo Patch Model Attention with sdpa and with
RainFusion (0.8), each in a fresh process of that interpreter.

    python benchmarks/bench_h3.py                 # tiny + mid (CPU-sized); native: mid
    python benchmarks/bench_h3.py --configs large --native large # GPU: 10 blocks, 768x1344-like grid
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
from pathlib import Path

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
NATIVE = ("core", "sdpa", "rainfusion(0.8)")  # core's own attention, then patched (BACKENDS' settings)
ROOT = Path(__file__).resolve().parents[1]


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


def native_one(config_name: str, variant: str, steps: int, threads: int) -> dict:
    """Core's native MiniMax-H3 MODEL (in COMFYUI_PYTHON): seconds per step of core's sampler, unpatched or patched."""
    sys.path[:0] = [os.environ["COMFYUI_PATH"], str(ROOT / "tests")]
    import torch
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    if threads > 0:
        torch.set_num_threads(threads)
    import comfy.ldm.modules.attention
    import comfy.model_management
    import comfy.sample
    import comfy.sd
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
    from support.h3_core_files import core_keys
    from support.h3_tiny import TRANSFORMER, make_models

    from omnivideo.attention.config import AttentionConfig
    from omnivideo.nodes.attention import OmniVideoPatchModelAttention

    overrides, width, height, frames = CONFIGS[config_name]
    transformer, _, _ = make_models(seed=0, **overrides)
    model = comfy.sd.load_diffusion_model_state_dict(
        {"model.diffusion_model." + k: v for k, v in core_keys(transformer).items()}
    )
    del transformer
    if variant != "core":
        model = OmniVideoPatchModelAttention.execute(model, AttentionConfig(**BACKENDS[variant])).args[0]
    latent = EmptyMiniMaxH3LatentAV.execute(width=width, height=height, length=frames).args[0]["samples"]
    cond = [[torch.randn(1, 64, TRANSFORMER["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    timer = StepTimer(comfy.model_management.get_torch_device())
    timer.start()
    comfy.sample.sample(
        model,
        comfy.sample.prepare_noise(latent, 0),
        steps - 1,  # as many forwards as ours: `steps` sigma points
        1.0,
        "euler",
        "simple",
        cond,
        cond,
        latent,
        callback=lambda *_: timer.update(),
        disable_pbar=True,
        seed=0,
    )
    times = timer.durations()
    opts = model.model_options.get("transformer_options", {})
    patch = getattr(opts.get("optimized_attention_override"), "__self__", None)
    realized = patch.stats.realized_sparsity if patch is not None else None
    video, audio = latent.unbind()
    seq = 64 + 2 * audio.shape[-1] + video.shape[2] * (video.shape[3] // 2) * (video.shape[4] // 2)
    return {
        "per_step": min(times[1:]) if len(times) > 1 else times[0],  # the first forward warms up / compiles
        "where": f"{comfy.model_management.get_torch_device().type}, seq {seq}, core's attention: "
        f"{comfy.ldm.modules.attention.optimized_attention.__name__}",
        "realized": "-" if realized is None else f"{realized:.3f}",
    }


def native(configs: list[str], steps: int, threads: int) -> None:
    """Print core's native model's time per step, unpatched vs patched (each variant in a fresh process)."""
    comfy, python = os.environ.get("COMFYUI_PATH"), os.environ.get("COMFYUI_PYTHON", sys.executable)
    if not comfy or not os.path.isfile(os.path.join(comfy, "comfy", "ldm", "minimax", "model.py")):
        print("\nnative: skipped (set COMFYUI_PATH / COMFYUI_PYTHON to a ComfyUI with comfy/ldm/minimax, 0.33+)")
        return
    for cfg in configs:
        rows = {}
        for variant in NATIVE:
            cmd = [python, __file__, "--native-child", cfg, variant, str(steps), str(threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"native {cfg} {variant} failed:\n{proc.stderr[-2000:]}")
                continue
            rows[variant] = json.loads(line[len("RESULT ") :])
        if "core" not in rows:
            continue
        base = rows["core"]["per_step"]
        print(
            f"\n{cfg}, core's native MiniMax-H3 ({rows['core']['where']}, {threads or 'default'} thread(s)); "
            "ratio vs core's own attention"
        )
        print(f"{'variant':24s} {'s/step':>9s} {'x time':>7s} {'realized sparsity':>18s}")
        for variant, row in rows.items():
            name = "core (unpatched)" if variant == "core" else f"patched {variant}"
            t = row["per_step"]
            print(f"{name:24s} {t:9.3f} {t / base:7.2f} {row['realized']:>18s}")


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
    ap.add_argument("--native", default="mid", help="configs run on core's native model too ('' = none)")
    ap.add_argument("--native-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.native_child:
        cfg, variant, steps, threads = args.native_child
        print("RESULT " + json.dumps(native_one(cfg, variant, int(steps), int(threads))))
        return
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
    native([c for c in args.native.split(",") if c], args.steps, args.threads)


if __name__ == "__main__":
    main()
