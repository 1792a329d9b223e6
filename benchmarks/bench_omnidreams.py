"""OmniDreams AR rollout: time per chunk with the rolling KV cache vs recomputing the history.

Random weights, the released schedule (3 DiT calls per chunk), chunks 0..N-1. For each chunk it
prints the wall time, the context-refresh call's share, and the time the same chunk costs without
a cache (every call runs the DiT over all history frames + the chunk). Once the window is full
(chunk 3 on) the cached cost must be flat: chunk 7 within 15% of chunk 3.

    python benchmarks/bench_omnidreams.py                          # CPU: tiny and mid configs
    python benchmarks/bench_omnidreams.py --config 2b --height 704 --width 1280 --dtype bf16 --no-baseline  # GPU
    python benchmarks/bench_omnidreams.py --kv-finalize context_noise --kv-finalize skip --kv-dtype auto \
        --kv-dtype fp8_e4m3fn --step eager --step graphed --no-baseline  # kv_finalize x kv_dtype x step

Each variant (the loader's kv_finalize: the released context write or FlashDreams' skip; its kv_dtype: the compute
dtype or fp8; the step: eager, compiled blocks, or graphed: static buffers replayed as a CUDA graph, eager on a CPU)
runs in its own subprocess; the last lines give each one's steady chunks (3 on) and its time and KV window as ratios
to the first variant's. A graphed run times whole chunks only (no per-call timing inside a captured graph).

Each config runs in its own subprocess so its peak memory is its own (CPU: peak RSS growth over the
loaded model; CUDA: max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CONFIGS = {  # name -> (config kwargs, default pixel height, width)
    "tiny": (
        dict(
            model_channels=64, num_blocks=2, num_heads=2, mlp_hidden=256, adaln_lora_dim=16, text_in_dim=96, text_dim=32
        ),
        64,
        96,
    ),
    "mid": (
        dict(
            model_channels=512,
            num_blocks=8,
            num_heads=4,
            mlp_hidden=2048,
            adaln_lora_dim=64,
            text_in_dim=1024,
            text_dim=256,
        ),
        128,
        224,
    ),
    "2b": ({}, 704, 1280),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(args) -> dict:
    import torch

    from omnivideo.models.omnidreams.dit import OmniDreamsConfig, OmniDreamsDiT
    from omnivideo.pipelines.omnidreams import ARSettings, autoregressive, rollout

    class Measured(autoregressive.RollingKVCache):  # the rollout's KV cache, its size read after the run
        nbytes_seen = 0

        def free(self):
            Measured.nbytes_seen = self.nbytes
            super().free()

    autoregressive.RollingKVCache = Measured

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, DTYPES[args.dtype])
    kwargs, height, width = CONFIGS[args.config]
    height, width = args.height or height, args.width or width
    cfg = OmniDreamsConfig(**kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = OmniDreamsDiT(cfg, dtype=dtype).to(dtype).eval().requires_grad_(False)
    text = torch.randn(1, 512, cfg.text_in_dim)
    h, w = height // 8, width // 8
    first = torch.randn(1, 16, 1, h, w)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)

    # time every DiT call; the context refresh is the one at t = 128
    calls = []
    real_forward = model.forward

    def timed_forward(x, t, *a, **kw):
        _sync(torch, device)
        start = time.perf_counter()
        out = real_forward(x, t, *a, **kw)
        _sync(torch, device)
        calls.append((t, time.perf_counter() - start))
        return out

    if args.step != "graphed":  # a host sync per call would break the capture
        model.forward = timed_forward
    runs = []
    cache_bytes = {}
    for run in range(args.runs + 1):  # run 0 warms up (allocator, oneDNN/cuBLAS plans) and is dropped
        calls.clear()
        marks = [time.perf_counter()]

        class ChunkTimer:  # the rollout's progress bar: update(1) after every chunk
            def __init__(self, total):
                pass

            def update(self, n=1):
                _sync(torch, device)
                marks.append(time.perf_counter())

        rollout(
            model,
            text,
            num_chunks=args.chunks,
            latent_hw=(h, w),
            seed=42,
            first_frame=first,
            bar=ChunkTimer(args.chunks),
            device=device,
            settings=ARSettings.for_kv_finalize(args.kv_finalize, kv_dtype=args.kv_dtype),
            compiled=args.step == "compiled",
            cuda_graph=args.step == "graphed",
        )
        cache_bytes["kv"] = Measured.nbytes_seen
        per_chunk = [b - a for a, b in zip(marks, marks[1:])]
        context = [d for t, d in calls if t == 128.0] or [0.0] * args.chunks  # none with kv_finalize skip
        if run:
            runs.append((per_chunk, context))
    model.forward = real_forward
    # min over runs: on a shared CPU, interference only ever adds time
    chunk_ms = [1000 * min(r[0][k] for r in runs) for k in range(args.chunks)]
    context_ms = [1000 * min(r[1][k] for r in runs) for k in range(args.chunks)]
    result = {
        "config": args.config,
        "variant": f"{args.kv_finalize}/{args.kv_dtype}/{args.step}",
        "latent": [h, w],
        "tokens_per_chunk": 2 * (h // 2) * (w // 2),
        "chunk_ms": chunk_ms,
        "context_ms": context_ms,
        "kv_cache_mb": cache_bytes["kv"] / 2**20,
    }
    if device.type == "cuda":
        result["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base_alloc) / 2**20
    else:
        result["peak_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024

    if args.baseline:  # no cache: each call re-runs the DiT over history + chunk (3 calls per chunk)
        cross = model.cross_kv(text.to(device))
        base = []
        for k in range(args.chunks):
            x = torch.randn(1, 16, 2 * (k + 1), h, w)
            best = float("inf")
            for _ in range(args.runs):
                _sync(torch, device)
                start = time.perf_counter()
                with torch.no_grad():
                    for t in (1000.0, 804.0, 128.0):
                        model(x, t, cross)
                _sync(torch, device)
                best = min(best, time.perf_counter() - start)
            base.append(1000 * best)
        result["recompute_ms"] = base
    return result


def main() -> None:
    from omnivideo.pipelines.omnidreams.schedule import KV_DTYPE_CHOICES, KV_FINALIZE_CHOICES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=list(CONFIGS), action="append", help="repeatable; default: tiny and mid")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--height", type=int, help="pixel height (default per config)")
    parser.add_argument("--width", type=int)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false")
    parser.add_argument("--kv-finalize", choices=KV_FINALIZE_CHOICES, action="append", help="default: context_noise")
    parser.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, action="append", help="repeatable; default: auto")
    parser.add_argument("--step", choices=["eager", "compiled", "graphed"], action="append", help="default: eager")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    if args.child:
        args.config, args.kv_finalize, args.kv_dtype = args.config[0], args.kv_finalize[0], args.kv_dtype[0]
        args.step = args.step[0]
        print(json.dumps(run_config(args)))
        return

    results = []
    variants = [
        (f, d, s)
        for f in args.kv_finalize or ["context_noise"]
        for d in args.kv_dtype or ["auto"]
        for s in args.step or ["eager"]
    ]
    for name, (finalize, kv_dtype, step) in [(name, v) for name in args.config or ["tiny", "mid"] for v in variants]:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--config",
            name,
            "--chunks",
            str(args.chunks),
            "--dtype",
            args.dtype,
            "--device",
            args.device,
            "--runs",
            str(args.runs),
            "--threads",
            str(args.threads),
            "--kv-finalize",
            finalize,
            "--kv-dtype",
            kv_dtype,
            "--step",
            step,
        ]
        cmd += ["--height", str(args.height)] if args.height else []
        cmd += ["--width", str(args.width)] if args.width else []
        cmd += [] if args.baseline else ["--no-baseline"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            raise SystemExit(f"{name} failed")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(
            f"\n== {name}, {finalize}/{kv_dtype}/{step}: latent {r['latent'][0]}x{r['latent'][1]}, "
            f"{r['tokens_per_chunk']} tokens/chunk, "
            f"{args.dtype} on {args.device}; KV cache {r['kv_cache_mb']:.1f} MB, peak +{r['peak_mb']:.0f} MB"
        )
        print(
            f"{'chunk':>5} {'cached ms':>10} {'context %':>10}"
            + (f" {'recompute ms':>13} {'ratio':>6}" if "recompute_ms" in r else "")
        )
        for k, ms in enumerate(r["chunk_ms"]):
            line = f"{k:>5} {ms:>10.1f} {100 * r['context_ms'][k] / ms:>9.1f}%"
            if "recompute_ms" in r:
                line += f" {r['recompute_ms'][k]:>13.1f} {r['recompute_ms'][k] / ms:>6.2f}"
            print(line)
        if args.chunks > 7:
            flat = r["chunk_ms"][7] / r["chunk_ms"][3]
            print(f"chunk 7 / chunk 3 = {flat:.3f} ({'flat' if abs(flat - 1) <= 0.15 else 'NOT flat'}: within 15%)")
        if "recompute_ms" in r:
            print(f"all chunks: recompute / cached = {sum(r['recompute_ms']) / sum(r['chunk_ms']):.2f}x")
    first = {r["config"]: r for r in results[:: len(variants)]}
    for r in results:
        ms, base = r["chunk_ms"][3:] or r["chunk_ms"], first[r["config"]]
        base_ms = base["chunk_ms"][3:] or base["chunk_ms"]
        print(
            f"{r['config']} {r['variant']}: steady chunk {sum(ms) / len(ms):.1f} ms "
            f"({1000 * len(ms) / sum(ms):.1f} chunks/s), {sum(ms) / sum(base_ms):.3f}x the time and "
            f"{r['kv_cache_mb'] / base['kv_cache_mb']:.2f}x the KV window of {base['variant']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
