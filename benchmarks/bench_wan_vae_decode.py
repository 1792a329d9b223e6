"""Fused Wan VAE decode vs diffusers' AutoencoderKLWan.decode, side by side.

Full-size Wan 2.1 (or 2.2) VAE with random weights; the same latent decoded by
diffusers and by each fusion level. Prints median time, peak memory and ours/reference
ratios, and checks every output is bit-identical to diffusers'.

    python benchmarks/bench_wan_vae_decode.py                      # CPU: 9 frames at 256x256, fp32
    python benchmarks/bench_wan_vae_decode.py --frames 81 --height 480 --width 832 --dtype bf16   # GPU

Each variant runs in its own subprocess. Peak memory is what one decode adds on top of
the loaded model and latent: on CUDA max_memory_allocated, on CPU (Linux) the resident-set
high-water mark, reset before each decode through /proc/self/clear_refs, with glibc told to
return freed blocks at once (MALLOC_MMAP_THRESHOLD_) so RSS follows live memory rather than
the allocator's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("diffusers", "reference", "torch_fused", "triton")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def run_variant(args) -> dict:
    import torch
    from diffusers import AutoencoderKLWan

    from omnivideo.models.wan_vae.convert import WAN21_CONFIG, WAN22_CONFIG
    from omnivideo.pipelines.wan_decode import decode_latent, select_fusion

    torch.backends.cudnn.benchmark = False
    device = torch.device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**(WAN22_CONFIG if args.version == "2.2" else WAN21_CONFIG)).eval().to(device, dtype)
    factor = vae.config.scale_factor_spatial
    latent_frames = (args.frames - 1) // 4 + 1
    z = torch.randn(
        1,
        vae.config.z_dim,
        latent_frames,
        args.height // factor,
        args.width // factor,
        generator=torch.Generator().manual_seed(1),
    ).to(device, dtype)

    if args.variant == "diffusers":

        def decode():
            with torch.no_grad():
                return vae.decode(z).sample
    else:
        if (
            select_fusion(vae, {"torch_fused": "torch", "reference": "off"}.get(args.variant, args.variant))
            != args.variant
        ):
            return {"variant": args.variant, "skipped": "not usable on this machine"}

        def decode():
            return decode_latent(vae, z)

    decode()  # warm-up (allocator, kernels' JIT)
    times, peaks, out = [], [], None
    for _ in range(args.runs):
        del out
        base = _reset_peak(device)
        start = time.perf_counter()
        out = decode()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peaks.append(_peak(device) - base)
    torch.save(out.cpu(), args.out_path)
    return {"variant": args.variant, "median_s": statistics.median(times), "peak_bytes": max(peaks)}


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak(device) -> int:
    """Reset the peak-memory counter; returns the memory in use now."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset VmHWM (peak RSS) to the current RSS
    return _proc_status_bytes("VmRSS")


def _peak(device) -> int:
    import torch

    return torch.cuda.max_memory_allocated() if device.type == "cuda" else _proc_status_bytes("VmHWM")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", choices=["2.1", "2.2"], default="2.1")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out-path", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.variant:  # child process
        print(json.dumps(run_variant(args)))
        return

    import tempfile

    print(
        f"Wan {args.version} VAE, {args.frames} frames {args.height}x{args.width}, {args.dtype}, "
        f"{args.device}, median of {args.runs}"
    )
    results, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            path = os.path.join(tmp, variant + ".pt")
            cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--out-path", path]
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                results[variant] = {"skipped": proc.stderr.strip().splitlines()[-1]}
                continue
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            if "skipped" not in results[variant]:
                outputs[variant] = torch.load(path, weights_only=True)

    ref = results["diffusers"]
    print(f"{'variant':<12} {'median s':>9} {'peak MiB':>9} {'time/diffusers':>15} {'mem/diffusers':>14}  bit-exact")
    for variant in VARIANTS:
        r = results[variant]
        if "skipped" in r:
            print(f"{variant:<12} skipped: {r['skipped']}")
            continue
        exact = torch.equal(outputs[variant], outputs["diffusers"])
        print(
            f"{variant:<12} {r['median_s']:>9.3f} {r['peak_bytes'] / 2**20:>9.1f} "
            f"{r['median_s'] / ref['median_s']:>15.3f} {r['peak_bytes'] / max(ref['peak_bytes'], 1):>14.3f}  {exact}"
        )


if __name__ == "__main__":
    main()
