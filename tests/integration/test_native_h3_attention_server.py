"""OmniVideo Patch Model Attention on ComfyUI core's own MiniMax-H3 (0.33+), in a real headless server over /prompt:
core's UNETLoader reads a tiny H3 single file in core's format from diffusion_models, core's EmptyMiniMaxH3LatentAV
and KSampler sample it with and without the patch, core's LTXVSeparateAVLatent + SaveLatent write the video and
audio latents, which are compared: RainFusion at sparsity 0 gives core's latents (float tolerance), at 0.8 it runs
and differs. Core has no H3 template; its H3 text encoder is Qwen3-VL-32B, which core builds only at full size
(comfy/text_encoders/llama.py Qwen3VL_32BConfig), so OmniVideoTestTextStandIn's random 4096-wide states stand in
for its conditioning (the tiny transformer takes 4096-wide text). Skipped on a ComfyUI without native H3 (0.3.64).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builders shared with the unit tests

from support.h3_core_files import core_keys, write  # noqa: E402
from support.h3_tiny import make_models  # noqa: E402

pytestmark = pytest.mark.integration

H3_FILE = "omnivideo_native_h3_tiny.safetensors"
STAND_IN_WIDTH = 4096  # OmniVideoTestTextStandIn's states (UMT5-XXL-shaped)


@pytest.fixture(scope="module")
def h3_file(comfy_server, object_info) -> str:
    if "EmptyMiniMaxH3LatentAV" not in object_info:
        pytest.skip("this ComfyUI has no native MiniMax-H3 (comfy_extras/nodes_minimax_h3.py, ComfyUI 0.33+)")
    transformer, _, _ = make_models(seed=0, text_dim=STAND_IN_WIDTH)
    write(comfy_server.models_dir / "diffusion_models" / H3_FILE, core_keys(transformer))
    return H3_FILE


def graph(unet: str, tag: str, sparsity: float | None) -> dict:
    """Core's H3 sampling graph at 512x512, 5 frames (video grid 2x16x16 = 512 rows, 32 blocks of 16); with the
    patch when `sparsity` is given."""
    model = ["1", 0]
    nodes = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "OmniVideoTestTextStandIn", "inputs": {"seed": 1, "tokens": 8}},
        "3": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 512, "height": 512, "length": 5}},
    }
    if sparsity is not None:
        settings = {"backend": "rainfusion", "sparsity": sparsity, "start_step": 0, "skip_layers": "", "block_size": 16}
        nodes["4"] = {"class_type": "OmniVideoAttention", "inputs": settings}
        nodes["5"] = {"class_type": "OmniVideoPatchModelAttention", "inputs": {"model": model, "attention": ["4", 0]}}
        model = ["5", 0]
    sampler = {"seed": 1, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}
    nodes["6"] = {
        "class_type": "KSampler",
        "inputs": {**sampler, "model": model, "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0]},
    }
    nodes["7"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["6", 0]}}
    for nid, output, stream in (("8", 0, "video"), ("9", 1, "audio")):
        nodes[nid] = {
            "class_type": "SaveLatent",
            "inputs": {"samples": ["7", output], "filename_prefix": f"native_h3/{tag}_{stream}"},
        }
    return nodes


def sampled(comfy_server, unet: str, tag: str, sparsity: float | None):
    """The sampled video and audio latents, flattened into one tensor."""
    import torch
    from safetensors.torch import load_file

    entry = comfy_server.run(graph(unet, tag, sparsity), timeout=300)
    streams = []
    for nid in ("8", "9"):
        (saved,) = entry["outputs"][nid]["latents"]
        path = comfy_server.output_dir / saved["subfolder"] / saved["filename"]
        streams.append(load_file(str(path))["latent_tensor"].flatten())
    return torch.cat(streams)


def test_patch_model_attention_on_core_native_h3(comfy_server, h3_file, report):
    plain = sampled(comfy_server, h3_file, "plain", None)
    scale = max(1.0, float(plain.abs().max()))
    zero = sampled(comfy_server, h3_file, "sparsity0", 0.0)
    assert float((zero - plain).abs().max()) <= 1e-5 * scale  # sparsity 0: core's own latents
    sparse = sampled(comfy_server, h3_file, "sparsity08", 0.8)
    diff = float((sparse - plain).abs().max())
    assert diff > 1e-4 * scale  # sparsity 0.8: runs and differs
    report.append(f"native MiniMax-H3 + Patch Model Attention (rainfusion 0.8): max |diff| vs core {diff:.3g}")
