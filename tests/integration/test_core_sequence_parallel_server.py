"""OmniVideo Sequence Parallel on ComfyUI's own models in a real headless server over /prompt: core's UNETLoader
reads a tiny Wan 2.1 DiT (both ComfyUIs) and a tiny MiniMax-H3 single file (0.33+), core's KSampler samples them
with the MODEL split over 2 ranks and unsplit, SaveLatent writes the latents, which must match (fp32, the same
seed). The text is OmniVideoTestTextStandIn's random UMT5-shaped states (core builds its text encoders only at full
size)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builders shared with the unit tests

from support.h3_core_files import core_keys, write  # noqa: E402
from support.h3_tiny import make_models  # noqa: E402

from omnivideo.selftest.tiny.wan import write_tiny_wan21_dit  # noqa: E402

pytestmark = pytest.mark.integration

WAN_FILE, H3_FILE = "omnivideo_split_wan_tiny.safetensors", "omnivideo_split_h3_tiny.safetensors"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def wan_file(comfy_server) -> str:
    write_tiny_wan21_dit(comfy_server.models_dir / "diffusion_models" / WAN_FILE, seed=4)
    return WAN_FILE


@pytest.fixture(scope="module")
def h3_file(comfy_server, object_info) -> str:
    if "EmptyMiniMaxH3LatentAV" not in object_info:
        pytest.skip("this ComfyUI has no native MiniMax-H3 (comfy_extras/nodes_minimax_h3.py, ComfyUI 0.33+)")
    transformer, _, _ = make_models(seed=0, text_dim=4096, num_attention_heads=4)
    write(comfy_server.models_dir / "diffusion_models" / H3_FILE, core_keys(transformer))
    return H3_FILE


def graph(unet: str, latent: dict, devices: int, tag: str, cfg: float, streams: int = 1) -> dict:
    """Core's sampling graph; `streams` 2: H3's video and audio latents apart (LTXVSeparateAVLatent), each saved."""
    nodes = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "OmniVideoTestTextStandIn", "inputs": {"seed": 1, "tokens": 8}},
        "3": {"class_type": "OmniVideoTestTextStandIn", "inputs": {"seed": 2, "tokens": 8}},
        "4": latent,
        "5": {"class_type": "OmniVideoSequenceParallel", "inputs": {"model": ["1", 0], "devices": devices}},
    }
    sampler = {"seed": 1, "steps": 2, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}
    nodes["6"] = {
        "class_type": "KSampler",
        "inputs": {**sampler, "model": ["5", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0]},
    }
    if streams == 1:
        nodes["7"] = {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"split/{tag}"}}
        return nodes
    nodes["s"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["6", 0]}}
    for slot in range(streams):
        nodes[str(7 + slot)] = {
            "class_type": "SaveLatent",
            "inputs": {"samples": ["s", slot], "filename_prefix": f"split/{tag}_{slot}"},
        }
    return nodes


def sampled(comfy_server, nodes: dict, streams: int = 1):
    """Every saved latent, flattened into one tensor."""
    import torch
    from safetensors.torch import load_file

    entry = comfy_server.run(nodes, timeout=300)
    flat = []
    for nid in (str(7 + slot) for slot in range(streams)):
        (saved,) = entry["outputs"][nid]["latents"]
        flat.append(load_file(str(comfy_server.output_dir / saved["subfolder"] / saved["filename"]))["latent_tensor"])
    return torch.cat([t.flatten() for t in flat])


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_core_wan_split_over_two_ranks_equals_one_device(comfy_server, wan_file, cfg, report):
    latent = {
        "class_type": "EmptyHunyuanLatentVideo",
        "inputs": {"width": 96, "height": 80, "length": 9, "batch_size": 1},
    }
    one = sampled(comfy_server, graph(wan_file, latent, 1, f"wan_1_{cfg}", cfg))
    two = sampled(comfy_server, graph(wan_file, latent, 2, f"wan_2_{cfg}", cfg))
    diff = float((two - one).abs().max())
    assert diff <= TOLERANCE * max(1.0, float(one.abs().max())), f"2 ranks differ from 1 by {diff}"
    report.append(f"core Wan 2.1 (tiny) over /prompt, 2 ranks vs 1, CFG {cfg}: max |diff| {diff:.3g}")


def test_core_h3_split_over_two_ranks_equals_one_device(comfy_server, h3_file, report):
    latent = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 256, "height": 256, "length": 5}}
    one = sampled(comfy_server, graph(h3_file, latent, 1, "h3_1", 1.0, streams=2), streams=2)
    two = sampled(comfy_server, graph(h3_file, latent, 2, "h3_2", 1.0, streams=2), streams=2)
    diff = float((two - one).abs().max())
    assert diff <= TOLERANCE * max(1.0, float(one.abs().max())), f"2 ranks differ from 1 by {diff}"
    report.append(f"core MiniMax-H3 (tiny) over /prompt, 2 ranks vs 1: max |diff| {diff:.3g}")


def test_a_model_it_cannot_split_is_refused_before_sampling(comfy_server, wan_file):
    latent = {
        "class_type": "EmptyHunyuanLatentVideo",
        "inputs": {"width": 64, "height": 64, "length": 5, "batch_size": 1},
    }
    nodes = graph(wan_file, latent, 4, "refused", 1.0)  # the tiny Wan has 2 heads
    with pytest.raises(Exception) as failure:
        comfy_server.run(nodes, timeout=120)
    message = str(failure.value)
    assert "which 4 devices cannot share" in message and "OmniVideoSequenceParallel" in message, message
