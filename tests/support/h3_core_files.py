"""Tiny MiniMax-H3 single-file transformers in the layouts core ComfyUI 0.33 reads (`comfy/model_detection.py`
detects H3 by `video_patch_proj` + `audio_patch_proj`, reads `rope.inv_freq` from the file, and loads plain, scaled
fp8 and `comfy_quant` mixed-precision weights): the tiny diffusers transformer in original keys, as core ships them."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from omnivideo.selftest.tiny.h3 import core_keys  # noqa: F401  (the self-test writes core files too)

FP8 = torch.float8_e4m3fn


def pruned_keys(transformer, grid: int = 1025) -> dict[str, torch.Tensor]:
    """Core's pruned layout of `transformer`: no time embedder, `adaln_t_table` = its activated time embedding on a
    grid of t in [0, 1] (with the full width as the basis, k = time_embed_dim), the AdaLN projections in fp32."""
    t = torch.arange(grid, dtype=torch.float32) / (grid - 1)
    with torch.no_grad():
        table = torch.nn.functional.silu(transformer.time_embedder(transformer.time_proj(t)))
    sd = {k: v for k, v in core_keys(transformer).items() if not k.startswith("time_embedder.")}
    return {**sd, "adaln_t_table": table.float()}


def fp8_per_tensor(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Core's mixed-precision layout: the block matrices in float8_e4m3fn with one `weight_scale` each (the
    `<layer>.comfy_quant` configs are returned, for the caller to store as tensors or as header metadata)."""
    out, layers = dict(sd), {}
    for key, w in sd.items():
        if key.startswith("blocks.") and key.endswith(".weight") and w.dim() == 2:
            layer = key[: -len(".weight")]
            scale = w.abs().max().float() / 448.0
            out[key] = (w.float() / scale).to(FP8)
            out[f"{layer}.weight_scale"] = scale.reshape(())
            layers[layer] = {"format": "float8_e4m3fn"}
    assert layers, "the tiny checkpoint's block keys changed: quantize its block matrices here"
    return out, layers


def as_tensor(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def write(path, sd, prefix: str = "model.diffusion_model.", metadata: dict | None = None, others: dict | None = None):
    """`others`: tensors stored beside the transformer's (an all-in-one checkpoint's VAE / text encoder keys)."""
    save_file({**{prefix + k: v.contiguous() for k, v in sd.items()}, **(others or {})}, str(path), metadata=metadata)
    return path


def core_files(transformer, folder) -> dict[str, object]:
    """name -> path of each single-file layout core reads, all holding `transformer`'s weights."""
    sd = core_keys(transformer)
    quant, layers = fp8_per_tensor(sd)
    per_key = {**quant, **{f"{layer}.comfy_quant": as_tensor(c) for layer, c in layers.items()}}
    others = {"vae.decoder.conv_in.weight": torch.zeros(2, 2), "text_encoders.qwen3vl_32b.x": torch.zeros(3)}
    return {
        "model.diffusion_model.": write(folder / "h3_bf16.safetensors", sd),
        "all-in-one checkpoint": write(folder / "h3_all_in_one.safetensors", sd, others=others),
        "no prefix": write(folder / "h3_bare.safetensors", sd, prefix=""),
        "fp8 comfy_quant keys": write(folder / "h3_fp8_keys.safetensors", per_key),
        "pruned (adaln_t_table)": write(folder / "h3_pruned.safetensors", pruned_keys(transformer)),
        "fp8 _quantization_metadata": write(
            folder / "h3_fp8_meta.safetensors",
            quant,
            metadata={"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})},
        ),
    }
