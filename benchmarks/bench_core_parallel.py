"""OmniVideo Sequence Parallel on ComfyUI's own models: time per sampling step and peak memory per device of core's
Wan and MiniMax-H3 MODEL at 1, 2 and 4 ranks, as ratios to one device, in one run.

Runs in ComfyUI's interpreter (COMFYUI_PATH: the ComfyUI folder; MiniMax-H3 needs 0.33+). Random weights in core's
own classes (comfy.ldm.wan.model.WanModel, comfy.ldm.minimax.model.MiniMaxH3Model) at the released models' width with
`--layers` blocks (the ratio of a split is per block: attention and the all-to-alls grow with the sequence, the rest
with the rows each rank holds), loaded through core (load_diffusion_model_state_dict) and sampled with core's
sampler (euler, CFG 1: the turbo / distilled way people run them, where core's CFG split gains nothing). Each world
size runs in a fresh process: one warm-up step (loads the model and, on several GPUs, core's per-device clones), then
`--steps` timed steps; the latent of every world size is compared with world 1's (max |diff| printed).

Peak memory per device: CUDA, torch.cuda.max_memory_allocated of each device the ranks used; CPU, the process's
ru_maxrss (the ranks are threads sharing one copy of the weights and the cores: the CPU figures show the overhead of
the split, not what separate devices give).

    COMFYUI_PATH=../shared/comfyui-0.33 .comfy33-venv/bin/python -P benchmarks/bench_core_parallel.py    # CPU, tiny
    python -P benchmarks/bench_core_parallel.py --model h3 --config full --layers 4 --size 1344x768x124 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {  # core's constructor arguments; "full" = the released models' width
    ("wan", "tiny"): dict(dim=512, ffn_dim=1024, num_heads=4, text_dim=4096, freq_dim=256, in_dim=16, out_dim=16),
    ("wan", "full"): dict(dim=5120, ffn_dim=13824, num_heads=40, text_dim=4096, freq_dim=256, in_dim=16, out_dim=16),
    ("h3", "tiny"): dict(
        hidden_size=256,
        num_attention_heads=4,
        attention_head_dim=64,
        ffn_hidden_size=512,
        text_dim=256,
        time_embed_hidden_size=256,
        time_embed_dim=128,
        token_refiner_num_layers=1,
        rope_inv_freq_len=8,
    ),
    ("h3", "full"): dict(),  # MiniMaxH3Model's defaults: hidden 5376, 56 heads of 128, ffn 14336
}
SIZES = {"wan": "480x272x33", "h3": "512x288x29"}  # CPU defaults (width x height x frames)


def build(model: str, config: str, layers: int, seed: int = 0) -> dict:
    """A random state dict of core's own class (core's key names, so core's detection reads it)."""
    import comfy.ops
    import torch

    torch.manual_seed(seed)
    args = dict(CONFIGS[(model, config)], num_layers=layers, operations=comfy.ops.disable_weight_init)
    if model == "wan":
        from comfy.ldm.wan.model import WanModel

        net = WanModel(model_type="t2v", patch_size=(1, 2, 2), **args)
    else:
        from comfy.ldm.minimax.model import MiniMaxH3Model

        net = MiniMaxH3Model(**args)
    sd = {}
    for name, t in net.state_dict().items():
        scale = 1.0 / max(1, t.shape[-1]) ** 0.5 if t.dim() > 1 else 0.02
        value = torch.randn(t.shape) * scale
        if name.endswith("inv_freq"):  # the rope's frequencies, as the file stores them
            value = 1.0 / (10000 ** (torch.arange(t.shape[0], dtype=torch.float32) / t.shape[0]))
        sd[name] = value
    return sd


def child(opts) -> dict:
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = opts.device == "cpu"
    import comfy.model_management as mm
    import comfy.sample
    import comfy.sd
    import torch
    from safetensors.torch import save_file

    from omnivideo.nodes.parallel import OmniVideoSequenceParallel

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[opts.dtype]
    # through a file, as UNETLoader loads: core's per-device copies are made by the loader's own factory
    path = opts.out + ".safetensors"
    save_file(build(opts.model, opts.config, opts.layers), path)
    model = comfy.sd.load_diffusion_model(path, model_options={"dtype": dtype})
    if opts.world > 1:
        model = OmniVideoSequenceParallel.execute(model, opts.world).args[0]
    width, height, frames = (int(v) for v in opts.size.split("x"))
    g = torch.Generator().manual_seed(1)
    if opts.model == "wan":
        latent = torch.zeros(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
        cond = [[torch.randn(1, 64, 4096, generator=g), {}]]
    else:
        from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

        latent = EmptyMiniMaxH3LatentAV.execute(width=width, height=height, length=frames).args[0]["samples"]
        text_dim = CONFIGS[(opts.model, opts.config)].get("text_dim", 5120)
        cond = [[torch.randn(1, 64, text_dim, generator=g), {}]]

    def run(steps):
        if opts.model == "h3":
            from comfy.nested_tensor import NestedTensor

            noise = NestedTensor(
                [torch.randn(t.shape, generator=torch.Generator().manual_seed(2)) for t in latent.unbind()]
            )
        else:
            noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(2))
        out = comfy.sample.sample(
            model, noise, steps, 1.0, "euler", "simple", cond, cond, latent, seed=2, disable_pbar=True
        )
        parts = out.unbind() if hasattr(out, "unbind") and not isinstance(out, torch.Tensor) else [out]
        return torch.cat([p.flatten().float().cpu() for p in parts])

    run(1)  # warm-up: loads the model (and the clones)
    if opts.device == "cuda":
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
            torch.cuda.reset_peak_memory_stats(i)
    start = time.perf_counter()
    out = run(opts.steps)
    if opts.device == "cuda":
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
    seconds = (time.perf_counter() - start) / opts.steps
    if opts.device == "cuda":
        peaks = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(min(opts.world, torch.cuda.device_count()))]
    else:
        peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20]
    torch.save(out, opts.out)
    mm.unload_all_models()
    return {"world": opts.world, "s_per_step": seconds, "peak_gib": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["wan", "h3"], nargs="+", default=["wan", "h3"])
    parser.add_argument("--config", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--size", default=None, help="WxHxFRAMES (default: a small CPU size per model)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    opts.dtype = opts.dtype or ("bf16" if opts.device == "cuda" else "fp32")
    if opts.child:
        opts.model = opts.model[0]
        print("RESULT " + json.dumps(child(opts)))
        return
    if not os.environ.get("COMFYUI_PATH"):
        sys.exit("set COMFYUI_PATH to a ComfyUI folder (MiniMax-H3 needs 0.33+) and run with its interpreter")
    print(
        f"core models split by OmniVideo Sequence Parallel: {opts.config} width, {opts.layers} blocks, "
        f"{opts.device} {opts.dtype}, {opts.steps} euler steps at CFG 1, each world size in a fresh process"
    )
    for model in opts.model:
        size = opts.size or SIZES[model]
        rows, base = [], None
        with tempfile.TemporaryDirectory() as tmp:
            for world in opts.worlds:
                out = Path(tmp) / f"{world}.pt"
                cmd = [
                    sys.executable,
                    "-P",
                    __file__,
                    "--child",
                    "--model",
                    model,
                    "--config",
                    opts.config,
                    "--layers",
                    str(opts.layers),
                    "--size",
                    size,
                    "--world",
                    str(world),
                    "--steps",
                    str(opts.steps),
                    "--device",
                    opts.device,
                    "--dtype",
                    opts.dtype,
                    "--out",
                    str(out),
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(f"{model} world {world}: failed\n{proc.stderr[-3000:]}")
                    continue
                result = json.loads(line[len("RESULT ") :])
                import torch

                latent = torch.load(out)
                base = latent if world == 1 else base
                result["max_diff"] = float((latent - base).abs().max()) if base is not None else float("nan")
                rows.append(result)
        print(f"\n{model} at {size}")
        print(f"{'ranks':>5}  {'s/step':>9}  {'speed-up':>8}  {'peak GiB per device':>28}  {'max |diff| vs 1':>15}")
        one = next((r["s_per_step"] for r in rows if r["world"] == 1), None)
        for r in rows:
            speed = f"{one / r['s_per_step']:.2f}x" if one else "-"
            peaks = " ".join(f"{p:.2f}" for p in r["peak_gib"])
            print(f"{r['world']:>5}  {r['s_per_step']:>9.4f}  {speed:>8}  {peaks:>28}  {r['max_diff']:>15.3g}")


if __name__ == "__main__":
    main()
