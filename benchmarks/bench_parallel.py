"""OmniDreams context parallel (Ulysses): per-chunk time and peak memory per rank vs world size, and the bytes each
rank sends per chunk, computed from the shapes.

Random weights (the benchmarks' tiny/mid configs with 4 heads), written once to a temporary .safetensors file that
rank 0 and every worker load, no downloads. Each world size runs in a fresh process (rank 0; the pack's pool spawns
the N-1 workers): one warm-up chunk starts the pool and loads the workers' models, then N chunks are timed on rank 0
(steady state = the mean over chunks 1..N-1, chunk 0 excluded; the fastest of --runs rollouts). At the end, before
the pool stops: rank 0's peak (CPU: ru_maxrss; CUDA: torch.cuda.max_memory_allocated) and the workers' (CPU: VmHWM of
/proc/<pid>/status of `current_pool().pids`; CUDA: not collected, nvidia-smi's memory in use at the end instead).
Every world size must give the world-1 latent (max |diff| is printed).

Communication per chunk and rank, from the shapes (what the rank sends to the other N-1 ranks; its own slice is a
local copy). S = tokens per chunk = (len_t / p_t) (h / p) (w / p), S_r = this rank's rows (`tensor_split` rule, rank 0
holds the most), S_max = the largest slice, H heads of D = C / H features, e = the compute dtype's size in bytes,
L blocks, C_out = p_t p^2 out_channels (64), 3 DiT calls per chunk (2 denoising steps + the context write):
    per block, qkv all-to-all (to_heads):  S_r (N-1)/N * H * 3D * e      (q, k, v stacked: [B, S_r, H, 3D])
    per block, to_tokens all-to-all:      (S - S_r) * H/N * D * e        ([B, S, H/N, D], all rows but its own)
    per call, output all_gather:          (N-1) * S_max * C_out * e      (padded slices; ring all_gather)
    per chunk = 3 * (L * (qkv + to_tokens) + gather)
Not counted (rank 0 only, over gloo on the CPU): the step message with the chunk's HD-map latent (16 len_t h w fp32
bytes, broadcast) and an 8-byte cancel flag before each DiT call. KV window per rank = 2 (K, V) * L * window tokens *
H/N * D * e, window tokens = window_frames / p_t * (h / p) (w / p) (checked against rank 0's cache).

On a CPU all ranks share the machine's cores (--threads 1, the default, gives each rank one thread: a core per rank
while N <= cores, oversubscribed beyond; --threads auto gives each rank cores // N): the wall time shows the parallel
overhead on shared cores, not what separate devices would give; the per-rank memory and the bytes carry over. The
CPU children run with MALLOC_MMAP_THRESHOLD_=131072 (unless set): glibc then returns freed large buffers, so the
warm-up's freed KV window does not hide the timed runs' growth (run+).

    python benchmarks/bench_parallel.py                                   # CPU: mid config, world sizes 1 2 4
    python benchmarks/bench_parallel.py --device cuda --world-sizes 1 2 4 --latent 88x160   # 4 GPUs: 704x1280, bf16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_timer import StepTimer  # benchmarks/ (this script's folder)

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LEN_T, WINDOW_FRAMES = 2, 6  # the released AR settings (OmniDreamsModel defaults)


def _config(name: str):
    sys.path.insert(0, str(ROOT / "tests"))
    from support.omnidreams_tiny import MID, TINY_4_HEADS

    return {"tiny": TINY_4_HEADS, "mid": MID}[name]


def _latent(text: str) -> tuple[int, int]:
    h, w = (int(v) for v in text.lower().split("x"))
    if h % 2 or w % 2:
        raise argparse.ArgumentTypeError(f"latent {text}: height and width must be even (the DiT's 2x2 patch)")
    return h, w


def comm_bytes(cfg, n: int, h: int, w: int, element: int, rank: int = 0) -> dict:
    """Bytes rank `rank` sends to the other ranks per chunk (see the module docstring)."""
    from omnivideo.attention.sequence_parallel import slice_sizes

    p, pt = cfg.patch_spatial, cfg.patch_temporal
    tokens = LEN_T // pt * (h // p) * (w // p)
    sizes = slice_sizes(tokens, n)
    rows, heads, d = sizes[rank], cfg.num_heads, cfg.head_dim
    c_out = cfg.patch_volume * cfg.out_channels
    qkv = rows * (heads - heads // n) * 3 * d * element
    back = (tokens - rows) * (heads // n) * d * element
    gather = (n - 1) * sizes[0] * c_out * element
    calls = 3
    return {
        "tokens": tokens,
        "rows": rows,
        "all_to_all": calls * cfg.num_blocks * (qkv + back),
        "gather": calls * gather,
        "total": calls * (cfg.num_blocks * (qkv + back) + gather),
    }


def kv_bytes(cfg, n: int, h: int, w: int, element: int) -> int:
    p, pt = cfg.patch_spatial, cfg.patch_temporal
    window_tokens = WINDOW_FRAMES // pt * (h // p) * (w // p)
    return 2 * cfg.num_blocks * window_tokens * (cfg.num_heads // n) * cfg.head_dim * element


def _status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm(pid: int) -> int | None:
    """Reset a process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5); that RSS in KiB, None if
    not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_kib(pid, "VmRSS:")


def _nvidia_smi_used() -> list[int]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return [int(v) for v in out.split()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


def child(args) -> dict:
    """Rank 0 of one world size (a fresh process; OMNIVIDEO_DEVICE and OMP_NUM_THREADS come from the parent, the
    workers inherit them)."""
    import torch

    from omnivideo import compat
    from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel
    from omnivideo.models.omnidreams.loader import load_omnidreams, weights_recipe
    from omnivideo.parallel import pool as pool_mod
    from omnivideo.pipelines import omnidreams as pipe
    from omnivideo.pipelines.omnidreams import autoregressive

    class Measured(autoregressive.RollingKVCache):  # rank 0's KV window, its size read when the rollout closes it
        nbytes_seen = 0

        def free(self):
            Measured.nbytes_seen = self.nbytes
            super().free()

    autoregressive.RollingKVCache = Measured

    n = args.child
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, DTYPES[args.dtype])
    cfg = _config(args.config)
    h, w = args.latent
    dit = load_omnidreams(args.weights, dtype, dtype)
    model = OmniDreamsModel(
        patcher=compat.manage(dit, "diffusion", device),
        dtype=dtype,
        world_size=n,
        load_args=weights_recipe(args.weights, dtype, dtype),
    )
    g = torch.Generator().manual_seed(3)
    frames = LEN_T * args.chunks
    cond = OmniDreamsConditioning(
        text=torch.randn(1, args.text_tokens, cfg.text_in_dim, generator=g),
        first_frame=torch.randn(1, 16, 1, h, w, generator=g),
        hdmap=torch.randn(1, 16, frames, h, w, generator=g),
    )
    timer = StepTimer(device)

    def run(chunks: int, progress=None):
        return pipe.sample(
            model,
            cond,
            seed=42,
            frames=pipe.pixel_frames(chunks, LEN_T),
            steps=0,
            width=w * 8,
            height=h * 8,
            progress=progress,
        )

    compat.loaded(model.patcher)  # the weights on rank 0's device, as the sampler will find them
    started = time.perf_counter()
    run(1)  # warm-up: starts the pool, loads the workers' models, one chunk
    warmup_s = time.perf_counter() - started
    pool = pool_mod.current_pool()
    pids = pool.pids if pool is not None else []
    # Peaks so far (imports, loads, warm-up), then the high-water marks reset: what the timed rollouts add.
    if device.type == "cuda":
        load_peak = [torch.cuda.max_memory_allocated(device) / 2**10]
        torch.cuda.reset_peak_memory_stats(device)
        base = [torch.cuda.memory_allocated(device) / 2**10]
    else:
        time.sleep(1.0)  # the workers close their warm-up rollout after rank 0 returns: let them free it first
        load_peak = [_status_kib(pid, "VmHWM:") for pid in (os.getpid(), *pids)]
        base = [_reset_hwm(pid) for pid in (os.getpid(), *pids)]
    best = None
    for _ in range(args.runs):
        timer.start()
        latent = run(args.chunks, timer)
        times = timer.durations()
        steady = times[1:] or times
        if best is None or sum(steady) < sum(best[1:] or best):
            best = times
    times = best
    if device.type == "cuda":
        run_peak = [torch.cuda.max_memory_allocated(device) / 2**10]
    else:
        run_peak = [_status_kib(pid, "VmHWM:") for pid in (os.getpid(), *pids)]
    smi = _nvidia_smi_used() if device.type == "cuda" else []
    pool_mod.stop_pool()
    torch.save(latent.cpu(), args.out)
    steady = times[1:] or times
    peaks = [max(a or 0, b or 0) / 1024 for a, b in zip(load_peak, run_peak)]  # whole-process peaks, MiB
    grown = [(p - b) / 1024 if p is not None and b is not None else None for p, b in zip(run_peak, base)]
    return {
        "n": n,
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "warmup_s": warmup_s,
        "chunk0_s": times[0],
        "chunk_s": sum(steady) / len(steady),
        "chunk_min_s": min(steady),
        "rank0_peak_mib": peaks[0],
        "rank0_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rank0_run_mib": grown[0],
        "worker_peaks_mib": peaks[1:],
        "worker_run_mib": grown[1:],
        "gpu_used_mib": smi,
        "kv_bytes_rank0": Measured.nbytes_seen,
        "weights_mib": sum(p.numel() * p.element_size() for p in dit.parameters()) / 2**20,
    }


def _mib(v: float) -> str:
    return f"{v / 2**20:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--config", choices=("tiny", "mid"), default="mid")
    parser.add_argument("--latent", type=_latent, default=(16, 28), help="latent HxW (pixels = 8x), default 16x28")
    parser.add_argument("--chunks", type=int, default=4, help="timed chunks (chunk 0 is left out of the mean)")
    parser.add_argument("--runs", type=int, default=2, help="timed rollouts per world size; the fastest is kept")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument(
        "--threads", default="1", help="torch threads per rank (default 1: a core per rank); auto = cores // world size"
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return

    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from support.omnidreams_tiny import stored_state_dict

    cfg = _config(args.config)
    h, w = args.latent
    element = getattr(torch, DTYPES[args.dtype]).itemsize
    cores = os.cpu_count() or 1
    sizes = []
    for n in args.world_sizes:
        if cfg.num_heads % n:
            print(f"world size {n} skipped: it must divide the {cfg.num_heads} heads")
        elif args.device == "cuda" and n > torch.cuda.device_count():
            print(f"world size {n} skipped: {torch.cuda.device_count()} GPU(s) visible")
        else:
            sizes.append(n)
    if not sizes:
        sys.exit("no world size to run")
    tmp = Path(tempfile.mkdtemp(prefix="bench_parallel_"))
    try:
        weights = tmp / f"omnidreams_{args.config}.safetensors"
        save_file(stored_state_dict(cfg, seed=1), str(weights))
        rows, outputs = {}, {}
        for n in sizes:
            threads = max(1, cores // n) if args.threads == "auto" else int(args.threads)
            env = {**os.environ, "OMNIVIDEO_DEVICE": args.device, "OMP_NUM_THREADS": str(threads)}
            if args.device == "cpu":  # a fixed mmap threshold: freed buffers leave the RSS, so run+ sees each run's own
                env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
            out = tmp / f"latent_{n}.pt"
            cmd = [sys.executable, __file__, "--child", str(n), "--weights", str(weights), "--out", str(out)]
            cmd += ["--config", args.config, "--latent", f"{h}x{w}", "--chunks", str(args.chunks)]
            cmd += ["--text-tokens", str(args.text_tokens), "--device", args.device, "--dtype", args.dtype]
            cmd += ["--runs", str(args.runs)]
            started = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"world size {n} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            rows[n] = json.loads(line[7:])
            rows[n]["process_s"] = time.perf_counter() - started
            outputs[n] = torch.load(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the weights file: 138 MiB at mid

    first = rows[sizes[0]]
    tokens = comm_bytes(cfg, 1, h, w, element)["tokens"]
    print(
        f"OmniDreams {args.config} ({cfg.num_blocks} blocks, {cfg.model_channels} ch, {cfg.num_heads} heads), "
        f"latent {h}x{w} = {w * 8}x{h * 8} px, {tokens} tokens/chunk, {args.dtype} on {first['device']}, "
        f"torch {first['torch']}, {cores} CPU cores; weights {first['weights_mib']:.1f} MiB per rank; "
        f"{args.chunks} timed chunks after 1 warm-up chunk, s/chunk = mean of chunks 1..{args.chunks - 1} "
        f"(fastest of {args.runs} rollouts)"
    )
    print(
        "ws thr  s/chunk  x ws1  chunk0 s  r0 peak  r0 run+  wk peak  wk run+  KV/rank    a2a  gather   total  "
        "proc s  max|diff|"
    )
    base = rows[sizes[0]]

    def fmt(v, n) -> str:
        return "-" if n == 1 else "n/a" if v is None else f"{v:.0f}"

    for n, r in rows.items():
        comm = comm_bytes(cfg, n, h, w, element)
        kv = kv_bytes(cfg, n, h, w, element)
        if r["kv_bytes_rank0"] != kv:
            print(f"  note: rank 0's KV window holds {r['kv_bytes_rank0']} bytes, the formula says {kv}")
        wk_peak = max(r["worker_peaks_mib"], default=None)
        wk_run = max((v for v in r["worker_run_mib"] if v is not None), default=None)
        r0_run = "n/a" if r["rank0_run_mib"] is None else f"{r['rank0_run_mib']:.0f}"
        diff = float((outputs[n] - outputs[sizes[0]]).abs().max())
        print(
            f"{n:2d} {r['threads']:3d}  {r['chunk_s']:7.3f}  {base['chunk_s'] / r['chunk_s']:5.2f}  "
            f"{r['chunk0_s']:8.3f}  {r['rank0_peak_mib']:7.0f}  {r0_run:>7}  {fmt(wk_peak, n):>7}  "
            f"{fmt(wk_run, n):>7}  "
            f"{_mib(kv):>7}  {_mib(comm['all_to_all']):>5}  {_mib(comm['gather']):>6}  {_mib(comm['total']):>6}  "
            f"{r['process_s']:6.1f}  {diff:.2e}"
        )
        if r["gpu_used_mib"]:
            print(f"    nvidia-smi memory.used per GPU at the end (MiB, not a peak): {r['gpu_used_mib']}")
    memory = (
        "peak = the process's whole peak RSS (VmHWM = ru_maxrss: imports, weights, load, runs; each rank holds the "
        "full weights), run+ = its peak during the timed rollouts over its RSS before them (the high-water mark "
        "reset after the warm-up: the KV window and activations), r0 = rank 0, wk = the largest worker"
        if args.device == "cpu"
        else "r0 peak = rank 0's torch.cuda.max_memory_allocated, r0 run+ = its peak during the timed rollouts over "
        "memory_allocated before them; wk: the workers' GPU peaks are not collected"
    )
    print(
        f"thr = torch threads per rank; x ws1 = s/chunk at world size {sizes[0]} / s/chunk; memory in MiB: {memory}; "
        "KV/rank = the rolling window's K/V (H/N heads per rank); a2a / gather / total = MiB rank 0 sends to the "
        "other ranks per chunk (3 DiT calls; qkv + to_tokens all-to-alls, output all_gather), computed from the "
        "shapes (see the docstring); proc s = the whole process (imports, pool start, loads, warm-up, runs); "
        f"max|diff| = the latent vs world size {sizes[0]}'s."
    )
    if args.device == "cpu":
        used = {n: min(cores, n * r["threads"]) for n, r in rows.items()}
        print(
            f"On this {cores}-core CPU the ranks share the cores (gloo over loopback): cores busy per world size "
            f"{used}. A speedup up to the core count comes from the extra cores, not from what separate devices would "
            "give, and beyond it the ranks oversubscribe the cores: the wall time does not scale with the world size. "
            "The per-rank memory and the bytes per chunk are what carries over to GPUs."
        )


if __name__ == "__main__":
    main()
