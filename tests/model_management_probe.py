"""Run by tests/test_model_management.py in ComfyUI's interpreter (COMFYUI_PYTHON): the tiny OmniDreams and H3
transformers under ComfyUI's ModelPatcher, fully loaded vs loaded with a weight budget below their size (the rest
streamed by ComfyUI's cast layers), and with fp8 weights. Prints one `PROBE_RESULT <json>` line.

Not a test module itself (no test_ prefix).
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.environ["COMFYUI_PATH"])
sys.path.insert(0, str(Path(__file__).parent))  # tests/support
from comfy.cli_args import args  # noqa: E402

args.cpu = not torch.cuda.is_available()  # on a GPU the budget run really streams weights from the CPU

import comfy.model_management as mm  # noqa: E402
from support.differences import difference  # noqa: E402
from support.h3_tiny import FRAMES, HEIGHT, WIDTH, make_models, write_folder  # noqa: E402
from support.omnidreams_tiny import TINY, stored_state_dict  # noqa: E402

from omnivideo import compat  # noqa: E402
from omnivideo.models.checkpoint_io import SCALED_FP8_MARKER  # noqa: E402
from omnivideo.models.h3.loader import load_h3  # noqa: E402
from omnivideo.models.handles import H3Conditioning, OmniDreamsConditioning, OmniDreamsModel  # noqa: E402
from omnivideo.models.omnidreams.loader import build_dit  # noqa: E402
from omnivideo.pipelines import omnidreams as omnidreams_pipe  # noqa: E402
from omnivideo.pipelines.h3 import sample as h3_sample  # noqa: E402

DEVICE = compat.comfy_torch_device()
FP8 = torch.float8_e4m3fn


def streamed_layers(patcher) -> int:
    return sum(bool(getattr(m, "comfy_cast_weights", False)) for m in patcher.model.modules())


def full_and_partial(model, run) -> dict:
    """The same run fully loaded (ComfyUI's own load_models_gpu) and with a third of the weights' size as
    the budget (ModelPatcher.load, as load_models_gpu does on a card that is too small)."""
    patcher = model.patcher
    full = run(model)
    listed = [type(p.model.module).__name__ for p in mm.loaded_models()]
    full_streamed = streamed_layers(patcher)
    mm.unload_all_models()
    size = patcher.model_size()
    patcher.load(DEVICE, lowvram_model_memory=size // 3)
    streamed = streamed_layers(patcher)
    real_load, compat.load_models = compat.load_models, lambda *a, **k: None  # keep the partial load
    try:
        partial = run(model)
    finally:
        compat.load_models = real_load
        patcher.detach()
    tensors = lambda x: [x] if isinstance(x, torch.Tensor) else [x.video, x.audio]  # noqa: E731
    castable = sum(hasattr(m, "comfy_cast_weights") for m in patcher.model.modules())
    return {
        "listed_while_loaded": listed,
        "full_streamed_layers": full_streamed,
        "streamed_layers": streamed,
        "castable_layers": castable,
        "budget_bytes": size // 3,
        "model_bytes": size,
        "partial_vs_full": difference(tensors(partial), tensors(full)),
    }


def bytes_as_on_gpu(module: torch.nn.Module) -> int:
    """Weight bytes with bf16 compute, as on an accelerator ('auto' computes in fp32 on a CPU)."""
    return sum(p.numel() * (1 if p.dtype == FP8 else 2) for p in module.parameters())


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------ OmniDreams

OMNI_SD = stored_state_dict(TINY, seed=1)
g = torch.Generator().manual_seed(5)
OMNI_COND = OmniDreamsConditioning(
    text=torch.randn(1, 8, TINY.text_in_dim, generator=g), first_frame=torch.randn(1, 16, 1, 4, 6, generator=g)
)


def omnidreams_model(sd, weight, compute) -> OmniDreamsModel:
    dit = build_dit(sd, compute, weight_dtype=weight, operations=compat.operations(weight, compute, DEVICE))
    return OmniDreamsModel(patcher=compat.manage(dit, "diffusion", DEVICE), dtype=compute)


def omnidreams_run(model):
    return omnidreams_pipe.sample(model, OMNI_COND, seed=3, frames=13, steps=0, width=48, height=32)


def scaled_fp8(sd: dict) -> dict:
    """The tiny checkpoint as ComfyUI's scaled-fp8 files store it: block matrices in fp8 with a per-tensor scale."""
    out = dict(sd)
    for key, w in sd.items():
        if key.startswith("blocks.") and w.dim() == 2:
            scale = w.abs().max().float() / 448.0
            out[key] = (w.float() / scale).to(FP8)
            out[key[: -len("weight")] + "scale_weight"] = scale.reshape(())
    out[SCALED_FP8_MARKER] = torch.empty(0, dtype=FP8)
    return out


def omnidreams() -> dict:
    result = full_and_partial(omnidreams_model(OMNI_SD, torch.float32, torch.float32), omnidreams_run)
    bf16 = omnidreams_model(OMNI_SD, torch.bfloat16, torch.bfloat16)
    fp8 = omnidreams_model(OMNI_SD, FP8, torch.bfloat16)
    fp32_out = omnidreams_run(omnidreams_model(OMNI_SD, torch.float32, torch.float32))
    bf16_out, fp8_out = omnidreams_run(bf16), omnidreams_run(fp8)
    scaled = omnidreams_model(scaled_fp8(OMNI_SD), torch.float32, torch.float32)
    result["fp8"] = {
        "bytes_fp8": mm.module_size(fp8.transformer),
        "bytes_bf16": mm.module_size(bf16.transformer),
        "fp8_matrices": sum(p.dtype == FP8 for p in fp8.transformer.parameters()),
        "rel_err_fp8_vs_fp32": relative_error(fp8_out, fp32_out),
        "rel_err_bf16_vs_fp32": relative_error(bf16_out, fp32_out),
        "rel_err_scaled_fp8_vs_fp32": relative_error(omnidreams_run(scaled), fp32_out),
    }
    return result


# ------------------------------------------------------------------ H3


def h3() -> dict:
    root = write_folder(Path(tempfile.mkdtemp()) / "MiniMax-H3-tiny", *make_models(seed=2))
    g = torch.Generator().manual_seed(6)
    text_dim = 40  # support.h3_tiny TRANSFORMER["text_dim"]
    cond = H3Conditioning(
        text=torch.randn(1, 12, text_dim, generator=g), text_token_tags=torch.zeros(12, dtype=torch.long)
    )

    def run(model):
        return h3_sample(model, cond, seed=1, frames=FRAMES, steps=3, width=WIDTH, height=HEIGHT)

    model, vae, audio_vae = load_h3(root, "fp32", device=DEVICE)
    result = full_and_partial(model, run)
    result["vae_castable_layers"] = sum(hasattr(m, "comfy_cast_weights") for m in vae.model.modules())
    bf16, fp8 = load_h3(root, "bf16", device=DEVICE)[0], load_h3(root, FP8, device=DEVICE)[0]
    fp32_out, fp8_out = run(model), run(fp8)
    result["fp8"] = {
        "compute_dtype": str(fp8.dtype),
        "bytes_fp8": bytes_as_on_gpu(fp8.transformer),
        "bytes_bf16": mm.module_size(bf16.transformer),
        "fp8_matrices": sum(p.dtype == FP8 for p in fp8.transformer.parameters()),
        "rel_err_fp8_vs_fp32": relative_error(fp8_out.video, fp32_out.video),
        "rel_err_bf16_vs_fp32": relative_error(run(bf16).video, fp32_out.video),
    }
    return result


if __name__ == "__main__":
    assert compat.HAS_COMFY, "the probe must run where ComfyUI imports"
    print("PROBE_RESULT " + json.dumps({"omnidreams": omnidreams(), "h3": h3()}))
