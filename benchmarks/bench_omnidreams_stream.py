"""OmniDreams streamed (OmniDreams Stream: each chunk decoded and written to the mp4 as it finishes) vs batch (the
sampler's whole latent, then one decode, then the mp4), side by side: peak RSS after 10, 50 and 200 chunks, time to
the first decoded frame, throughput, and per chunk with the decode (the frame rate a viewer sees): eager vs the compiled
blocks vs the graphed step (`cuda_graph`: static buffers replayed as a CUDA graph; eager on a CPU).

Random weights, no downloads; needs COMFYUI_PATH (ComfyUI's Wan 2.1 VAE classes, a small random one here). Each
variant runs in a fresh process; its peak is the RSS high-water mark (VmHWM) of the rollout, decode and writing,
over the RSS once the models are built (with MALLOC_MMAP_THRESHOLD_=65536, so RSS follows live memory).

    python benchmarks/bench_omnidreams_stream.py                     # CPU: tiny, 10 / 50 / 200 chunks
    python benchmarks/bench_omnidreams_stream.py --config mid --chunks 10 50
    BENCH_FULL_VAE=1 python benchmarks/bench_omnidreams_stream.py --config 2b --chunks 10   # GPU: 704x1280, bf16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAE = dict(dim=8, z_dim=16)  # a small Wan 2.1 VAE (16 latent channels, as OmniDreams needs)


def rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    """Start VmHWM over from the current RSS (Linux: clear_refs 5), so the peak is the rollout's own."""
    Path("/proc/self/clear_refs").write_text("5")


def child(config: str, variant: str, chunks: int) -> dict:
    sys.path[:0] = [os.environ["COMFYUI_PATH"], str(ROOT / "tests"), str(ROOT / "benchmarks")]
    import torch
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    import comfy.ldm.wan.vae as wan21
    import comfy.sd
    import folder_paths
    from bench_omnidreams import CONFIGS
    from support.omnidreams_tiny import stored_state_dict
    from support.wan_vae_fixtures import COMFY_FULL, random_wan_state_dict

    from omnivideo import compat
    from omnivideo.integration.video_file import StreamingVideoWriter
    from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel
    from omnivideo.models.omnidreams.dit import OmniDreamsConfig
    from omnivideo.models.omnidreams.loader import build_dit
    from omnivideo.pipelines import omnidreams as pipe
    from omnivideo.pipelines.omnidreams.stream import stream
    from omnivideo.pipelines.wan_decode import decode

    folder_paths.set_output_directory(tempfile.mkdtemp())
    kwargs, height, width = CONFIGS[config]
    cfg = OmniDreamsConfig(**kwargs)
    device = compat.comfy_torch_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dit = build_dit(stored_state_dict(cfg), dtype)
    model = OmniDreamsModel(patcher=compat.manage(dit, "diffusion", device), dtype=dtype)
    dims = COMFY_FULL["2.1"] if os.environ.get("BENCH_FULL_VAE") else VAE
    real = wan21.WanVAE
    wan21.WanVAE = lambda **ddconfig: real(**{**ddconfig, **dims})
    try:
        vae = comfy.sd.VAE(sd=random_wan_state_dict(wan21, dims))
    finally:
        wan21.WanVAE = real
    cond = OmniDreamsConditioning(text=torch.randn(1, 512, cfg.text_in_dim, generator=torch.Generator().manual_seed(1)))
    frames = pipe.pixel_frames(chunks)
    marks: dict = {}

    class Chunks:  # the progress contract: progress(total) -> bar with update(n, preview=...)
        def __init__(self, total):
            pass

        def update(self, n=1, preview=None):
            marks.setdefault("chunks", []).append(time.perf_counter())

    ready = rss_mib("VmRSS")  # models built, nothing sampled yet
    reset_peak_rss()
    t0 = time.perf_counter()
    with torch.inference_mode(), StreamingVideoWriter("bench", 30) as writer:
        if variant == "batch":
            z = pipe.sample(model, cond, seed=1, frames=frames, steps=0, width=width, height=height, progress=Chunks)
            images = decode(vae, z, "auto")
            marks["first_frame"] = time.perf_counter()
            writer.write(images)
        else:

            def write(images):
                marks.setdefault("first_frame", time.perf_counter())
                writer.write(images)

            stream(
                model,
                cond,
                vae,
                seed=1,
                chunks=chunks,
                width=width,
                height=height,
                write=write,
                fusion="auto",
                compiled=variant == "compiled",
                cuda_graph=variant == "graphed",
                progress=Chunks,
            )
    total = time.perf_counter() - t0
    per_chunk = [b - a for a, b in zip(marks["chunks"], marks["chunks"][1:])]
    steady = sorted(per_chunk[len(per_chunk) // 2 :])  # the second half: after warm-up / compiles
    return {
        "peak_mib": rss_mib("VmHWM") - ready,
        "first_frame_s": marks["first_frame"] - t0,
        "total_s": total,
        "fps": writer.frames_written / total,
        "chunk_s": steady[len(steady) // 2] if steady else total,
        "frames": writer.frames_written,
    }


def run_child(config: str, variant: str, chunks: int) -> dict:
    # glibc returns freed blocks above 64 KiB at once: RSS then follows live memory, not what the allocator keeps
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", config, variant, str(chunks)], capture_output=True, text=True, env=env
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{config}/{variant}/{chunks} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--chunks", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--compile-chunks", type=int, default=20)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        config, variant, chunks = args.child
        print("RESULT " + json.dumps(child(config, variant, int(chunks))))
        return
    if "COMFYUI_PATH" not in os.environ:
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout (the Wan VAE is ComfyUI's)")
    print(
        f"OmniDreams {args.config}: streamed vs batch (each run in a fresh process; peak = VmHWM over the RSS with "
        "the models built)"
    )
    print(
        f"{'chunks':>6} {'frames':>6} | {'+peak MiB stream':>15} {'batch':>7} {'ratio':>6} | "
        f"{'1st frame s stream':>18} {'batch':>7} | {'fps stream':>10} {'batch':>7} {'ratio':>6}"
    )
    peaks = {}
    for n in args.chunks:
        s, b = run_child(args.config, "stream", n), run_child(args.config, "batch", n)
        peaks[n] = (s["peak_mib"], b["peak_mib"])
        print(
            f"{n:6d} {s['frames']:6d} | {s['peak_mib']:15.0f} {b['peak_mib']:7.0f} "
            f"{s['peak_mib'] / b['peak_mib']:6.2f} | {s['first_frame_s']:18.2f} {b['first_frame_s']:7.2f} | "
            f"{s['fps']:10.1f} {b['fps']:7.1f} {s['fps'] / b['fps']:6.2f}"
        )
    lo, hi = min(peaks), max(peaks)
    print(
        f"peak growth {lo} -> {hi} chunks: stream {peaks[hi][0] / peaks[lo][0] - 1:+.1%}, "
        f"batch {peaks[hi][1] / peaks[lo][1] - 1:+.1%}"
    )
    e, c, g = (run_child(args.config, v, args.compile_chunks) for v in ("stream", "compiled", "graphed"))
    print(
        f"per chunk with the decode ({args.compile_chunks} chunks, median of the second half): eager "
        f"{e['chunk_s'] * 1e3:.1f} ms, compiled {c['chunk_s'] * 1e3:.1f} ms (ratio {c['chunk_s'] / e['chunk_s']:.2f}), "
        f"graphed {g['chunk_s'] * 1e3:.1f} ms (ratio {g['chunk_s'] / e['chunk_s']:.2f}); frame rate (8 frames a "
        f"chunk): {8 / e['chunk_s']:.1f} / {8 / c['chunk_s']:.1f} / {8 / g['chunk_s']:.1f} fps; whole run incl. "
        f"compile {c['total_s']:.1f} s vs {e['total_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
