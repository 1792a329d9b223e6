"""Our transformers under ComfyUI's model management: a full load vs a weight budget of a third of the model (ComfyUI
keeps the rest on the offload device and its cast layers stream it per forward) vs fp8 weights, side by side.

Random weights, no downloads; needs COMFYUI_PATH (ComfyUI's ModelPatcher and cast layers). Each variant runs in a
fresh process so its peak is its own: on CUDA torch.cuda.max_memory_allocated, on CPU the RSS high-water mark.
The output checksum shows the budget run computes what the full load computes.

    python benchmarks/bench_model_memory.py                              # CPU: tiny models
    python benchmarks/bench_model_memory.py --family h3 --config mid     # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from step_timer import StepTimer  # benchmarks/ (this script's folder)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("full", "budget", "fp8")


def _omnidreams(config: str, weight, compute, compat):
    import dataclasses

    import torch
    from bench_omnidreams import CONFIGS
    from support.omnidreams_tiny import TINY, stored_state_dict

    from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel
    from omnivideo.models.omnidreams.loader import build_dit
    from omnivideo.pipelines.omnidreams import sample

    kwargs, height, width = CONFIGS[config]
    cfg = dataclasses.replace(TINY, **kwargs) if kwargs else dataclasses.replace(TINY.__class__())
    dit = build_dit(
        stored_state_dict(cfg),
        compute,
        weight_dtype=weight,
        operations=compat.operations(weight, compute, compat.comfy_torch_device()),
    )
    model = OmniDreamsModel(patcher=compat.manage(dit, "diffusion", compat.comfy_torch_device()), dtype=compute)
    cond = OmniDreamsConditioning(text=torch.randn(1, 512, cfg.text_in_dim, generator=torch.Generator().manual_seed(1)))
    return model, lambda progress: sample(
        model, cond, seed=1, frames=13, steps=0, width=width, height=height, progress=progress
    )


def _h3(config: str, weight, compute, compat):
    import torch
    from bench_h3 import CONFIGS
    from support.h3_tiny import TRANSFORMER, make_models, write_folder

    from omnivideo.models.h3.loader import load_h3
    from omnivideo.models.handles import H3Conditioning
    from omnivideo.pipelines.h3 import sample

    overrides, width, height, frames = CONFIGS[config]
    root = write_folder(Path(tempfile.mkdtemp()) / "h3", *make_models(seed=0, **overrides))
    model = load_h3(root, weight if weight != compute else compute, device=compat.comfy_torch_device())[0]
    text = torch.randn(1, 64, TRANSFORMER["text_dim"], generator=torch.Generator().manual_seed(1))
    cond = H3Conditioning(text=text, text_token_tags=torch.zeros(64, dtype=torch.long))
    return model, lambda progress: sample(
        model, cond, seed=0, frames=frames, steps=3, width=width, height=height, progress=progress
    )


def child(family: str, config: str, variant: str) -> dict:
    sys.path[:0] = [os.environ["COMFYUI_PATH"], str(ROOT / "tests"), str(ROOT / "benchmarks")]
    import torch
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()

    from omnivideo import compat

    device = compat.comfy_torch_device()
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = torch.float8_e4m3fn if variant == "fp8" else compute
    model, run = (_omnidreams if family == "omnidreams" else _h3)(config, weight, compute, compat)
    patcher = model.patcher
    size = patcher.model_size()
    if variant == "budget":  # what load_models_gpu does on a card with a third of the model's size free
        patcher.load(device, lowvram_model_memory=size // 3)
        compat.load_models = lambda *a, **k: None
    timer = StepTimer(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer.start()
    out = run(timer)
    times = timer.durations()
    latent = out if isinstance(out, torch.Tensor) else out.video
    return {
        "weights_mib": size / 2**20,
        "resident_mib": patcher.loaded_size() / 2**20 if variant == "budget" else size / 2**20,
        "streamed": sum(bool(getattr(m, "comfy_cast_weights", False)) for m in patcher.model.modules()),
        "step_s": min(times[1:]) if len(times) > 1 else times[0],
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "checksum": float(latent.double().abs().sum()),
        "device": str(device),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("omnidreams", "h3"), nargs="+", default=["omnidreams", "h3"])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--child", nargs=3, metavar=("FAMILY", "CONFIG", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)))
        return
    if "COMFYUI_PATH" not in os.environ:
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout (ComfyUI's ModelPatcher and cast layers are measured)")
    for family in args.family:
        rows = {}
        for variant in VARIANTS:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", family, args.config, variant], capture_output=True, text=True
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{family}/{variant} failed:\n{proc.stderr[-3000:]}")
            rows[variant] = json.loads(line[7:])
        full = rows["full"]
        print(f"\n{family} ({args.config}) on {full['device']}: weights {full['weights_mib']:.1f} MiB")
        head = ("variant", "resident MiB", "streamed", "peak MiB", "x full", "s/step", "x full")
        print("{:8} {:>12} {:>9} {:>9} {:>7} {:>8} {:>7}  checksum".format(*head))
        for variant, r in rows.items():
            print(
                f"{variant:8} {r['resident_mib']:12.1f} {r['streamed']:9d} {r['peak_mib']:9.0f} "
                f"{r['peak_mib'] / full['peak_mib']:7.2f} {r['step_s']:8.4f} {r['step_s'] / full['step_s']:7.2f}  "
                f"{r['checksum']:.6g}{'  (= full)' if r['checksum'] == full['checksum'] else ''}"
            )


if __name__ == "__main__":
    main()
