"""Run by tests/test_lora.py in ComfyUI's interpreter (COMFYUI_PYTHON): OmniVideo LoRA on the tiny H3 under ComfyUI's
ModelPatcher. The weights ComfyUI patches in at load time equal `models.lora.merge` (what the parallel workers and
standalone use) bit for bit, two stacked too; the unpatched handle loads its own weights back; another strength needs
no reload; a partial load (a weight budget, LoRA applied per layer as it streams) samples as the full load does.
Prints one `PROBE_RESULT <json>` line. Not a test module itself (no test_ prefix).
"""

import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.environ["COMFYUI_PATH"])
sys.path.insert(0, str(Path(__file__).parent))  # tests/support
from comfy.cli_args import args  # noqa: E402

args.cpu = True

import comfy.model_management as mm  # noqa: E402
import folder_paths  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from support.differences import difference  # noqa: E402
from support.h3_tiny import FRAMES, HEIGHT, WIDTH, make_models, text_inputs, write_folder  # noqa: E402

from omnivideo import compat  # noqa: E402
from omnivideo.models import lora as lora_mod  # noqa: E402
from omnivideo.models.h3.loader import load_h3  # noqa: E402
from omnivideo.models.handles import H3Conditioning  # noqa: E402
from omnivideo.nodes.lora import OmniVideoLoRA  # noqa: E402
from omnivideo.pipelines.h3 import sample  # noqa: E402

MODULES = ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.net.0.proj", "proj_out")


def write_lora(folder: Path, name: str, transformer, seed: int) -> str:
    """A diffusers-format LoRA (`transformer.` names, lora_A / lora_B) of rank 4 on a few layers."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for module in MODULES:
        rows, cols = transformer.get_submodule(module).weight.shape
        sd[f"transformer.{module}.lora_A.weight"] = torch.randn(4, cols, generator=g) * 0.3
        sd[f"transformer.{module}.lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.3
    save_file(sd, str(folder / name))
    return str(folder / name)


def weights(model) -> dict[str, torch.Tensor]:
    """The transformer's weights as ComfyUI loads them for this handle (patches applied)."""
    return {k: v.detach().clone() for k, v in compat.loaded(model.patcher).state_dict().items()}


def run(model):
    emb, tags = text_inputs()
    cond = H3Conditioning(text=emb, text_token_tags=tags)
    return sample(model, cond, seed=3, frames=FRAMES, steps=3, width=WIDTH, height=HEIGHT).video


def main() -> dict:
    tmp = Path(tempfile.mkdtemp())
    (tmp / "loras").mkdir()
    folder_paths.add_model_folder_path("loras", str(tmp / "loras"), is_default=True)
    transformer, vae, audio_vae = make_models(seed=2)
    write_lora(tmp / "loras", "a.safetensors", transformer, 1)
    write_lora(tmp / "loras", "b.safetensors", transformer, 2)
    model = load_h3(write_folder(tmp / "h3", transformer, vae, audio_vae), "fp32", device=mm.get_torch_device())[0]
    base = weights(model)

    def merged(*loras):
        module = copy.deepcopy(model.transformer)
        lora_mod.merge(module, [(lora_mod.read(str(tmp / "loras" / n), "h3", module), s) for n, s in loras])
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    stacked = OmniVideoLoRA.execute(OmniVideoLoRA.execute(model, "a.safetensors", 0.7)[0], "b.safetensors", -0.4)[0]
    stacked_weights = weights(stacked)
    other_strength = OmniVideoLoRA.execute(model, "a.safetensors", 0.3)[0]
    other_weights = weights(other_strength)
    unpatched_again = weights(model)

    mm.unload_all_models()
    full = run(stacked)
    mm.unload_all_models()
    patcher = stacked.patcher
    patcher.load(mm.get_torch_device(), lowvram_model_memory=patcher.model_size() // 3)
    streamed = sum(bool(getattr(m, "comfy_cast_weights", False)) for m in patcher.model.modules())
    real_load, compat.load_models = compat.load_models, lambda *a, **k: None  # keep the partial load
    try:
        partial = run(stacked)
    finally:
        compat.load_models = real_load
        patcher.detach()
    return {
        "is_model_patcher": type(stacked.patcher).__name__ == "ModelPatcher",
        "shares_the_network": stacked.transformer is model.transformer
        and other_strength.transformer is model.transformer,
        "stacked_vs_merge": difference(stacked_weights, merged(("a.safetensors", 0.7), ("b.safetensors", -0.4))),
        "stacked_vs_base": difference(stacked_weights, base),
        "other_strength_vs_merge": difference(other_weights, merged(("a.safetensors", 0.3))),
        "unpatched_vs_base": difference(unpatched_again, base),
        "streamed_layers": streamed,
        "partial_vs_full": difference(partial, full),
        "load_args_loras": [(Path(r["path"]).name, r["strength"]) for r in stacked.load_args["loras"]],
    }


if __name__ == "__main__":
    print("PROBE_RESULT " + json.dumps(main()))
