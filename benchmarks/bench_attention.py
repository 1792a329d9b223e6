"""Dense SDPA vs every RainFusion (rf_v2) block-sparse path, side by side.

For each sequence size: a `[prefix 512 | video t x 24 x 42]` sequence (Wan-like grid, t chosen to fit
the target row count), dense SDPA time, then each sparse path at sparsity 0.5 / 0.8 / 0.9 with its
time, ratio to dense, realized sparsity and relative error vs dense. Times include the plan
(permutation, pooling, top-k) - the real per-call cost.

    python benchmarks/bench_attention.py                        # CPU: S ~ 8k and 32k, fp32
    python benchmarks/bench_attention.py --dtype bf16 --heads 12 # GPU (adds the Triton kernel)

q and k carry a smooth function of each row's (t, h, w) position plus noise, like RoPE'd video
features, so attention has the locality RainFusion exploits (`--random` for pure noise).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from omnivideo.attention.rows import AttnRows
from omnivideo.attention.torch_impl import sdpa
from omnivideo.backends import PLATFORM, implementations

PATHS = ("flex_block_sparse", "triton_block_sparse", "torch_block_sparse", "rainfusion_reference")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(grid, prefix, heads, dim, dtype, device, random=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    s = prefix + t * h * w
    noise = lambda: torch.randn(1, s, heads, dim, generator=g)
    q, k, v = noise(), noise(), noise()
    if not random:
        pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
        pos = pos.reshape(-1, 3).float()
        freqs = torch.rand(3, dim // 2, generator=g) * 0.15  # smooth at tile scale: nearby rows look alike
        angle = pos @ freqs  # [video, dim/2]
        feat = torch.cat([angle.sin(), angle.cos()], -1)[None, :, None, :] * 2.0
        q[:, prefix:] = q[:, prefix:] * 0.5 + feat
        k[:, prefix:] = k[:, prefix:] * 0.5 + feat
    return [x.to(device, dtype) for x in (q, k, v)]


def _once(fn, device):
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def paired(dense_fn, fn, repeats, device):
    """Median time of `fn` and median of its per-pair ratio to a dense call made right before it.

    Pairing keeps the ratio honest on a shared machine whose load drifts during the run.
    """
    out = _once(fn, device)[1]  # warm-up (compiles flex once per shape)
    times, ratios = [], []
    for _ in range(repeats):
        t_dense, _ = _once(dense_fn, device)
        t, out = _once(fn, device)
        times.append(t)
        ratios.append(t / t_dense)
    return statistics.median(times), statistics.median(ratios), out


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_size(target, args, device, dtype):
    prefix, (h, w) = 512, (24, 42)
    t = max(1, (target - prefix) // (h * w))
    grid, heads = (t, h, w), args.heads if target <= 16384 else args.heads_32k
    repeats = args.repeats if target <= 16384 else args.repeats_32k
    q, k, v = make_inputs(grid, prefix, heads, args.dim, dtype, device, args.random)
    s = q.shape[1]
    video = AttnRows(prefix, grid)
    print(
        f"\n== S = {s} rows ([prefix {prefix} | video {t}x{h}x{w}]), B=1 H={heads} D={args.dim} {args.dtype}, "
        f"block 128, median of {repeats}; 'x dense' = median ratio to a dense call timed just before =="
    )
    dense_fn = lambda: sdpa(q, k, v)  # noqa: E731
    with torch.no_grad():
        t_dense, _, dense = paired(dense_fn, dense_fn, repeats, device)
    print(f"{'path':<22}{'sparsity':>9}{'time s':>10}{'x dense':>9}{'realized':>10}{'rel err':>10}")
    print(f"{'dense sdpa':<22}{'-':>9}{t_dense:>10.3f}{1.0:>9.2f}{0.0:>10.3f}{0.0:>10.1e}")
    rows = []
    for name in args.paths:
        impl = implementations("attention")[name]
        why = impl.unusable_reason(PLATFORM)
        if why is None and name == "rainfusion_reference" and s > 16384:
            why = "builds the O(S^2) boolean mask: small inputs only"
        if why is None and name == "triton_block_sparse" and device.type == "cpu":
            why = "CPU runs Triton only in the interpreter (tests)"
        if why is not None:
            print(f"{name:<22}   skipped: {why}")
            continue
        fn = impl.load()
        n = 1 if name == "rainfusion_reference" else repeats  # the reference is a correctness twin, not a contender
        for sparsity in args.sparsity:
            stats = {}
            with torch.no_grad():
                sec, ratio, out = paired(
                    dense_fn,
                    lambda: fn(q, k, v, rows=video, sparsity=sparsity, block_size=128, stats=stats),
                    n,
                    device,
                )
            err = rel_err(out, dense)
            rows.append((name, sparsity, ratio))
            print(
                f"{name:<22}{sparsity:>9.2f}{sec:>10.3f}{ratio:>9.2f}{stats['realized_sparsity']:>10.3f}{err:>10.1e}",
                flush=True,
            )
    return s, t_dense, rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--heads-32k", type=int, default=1, help="heads above 16k rows (CPU time)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--repeats-32k", type=int, default=1)
    p.add_argument("--random", action="store_true", help="pure-noise q/k (no spatial locality)")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = p.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    print(f"device {device} ({PLATFORM.device_name}), torch {torch.__version__}, threads {torch.get_num_threads()}")
    summary = []
    for target in args.sizes:
        s, _, rows = bench_size(target, args, device, dtype)
        best = min((r for r in rows if math.isclose(r[1], 0.8)), key=lambda r: r[2], default=None)
        if best:
            summary.append(f"S={s}: best at sparsity 0.8 = {best[0]} {best[2]:.2f}x dense")
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
