"""A single-file MiniMax-H3 transformer in any format core ComfyUI reads -> diffusers' keys: original keys converted
with diffusers' `convert_minimax_h3_transformer_checkpoint_to_diffusers`, core's prefixes stripped, fp8 dequantized,
core's pruned AdaLN table kept for `adaln.py`.
"""

from __future__ import annotations

import os

import torch
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

from ..checkpoint_io import (
    comfy_quant_layers,
    dequantize_comfy_quant,
    dequantize_scaled_fp8,
    read_safetensors,
    safetensors_keys,
    safetensors_metadata,
    shown_name,
)
from . import adaln
from .folder import H3LoadError

ORIGINAL_KEY = "token_refiner.blocks.0.attn.qkv_proj.weight"  # diffusers' marker of an original H3 checkpoint
COMFY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def convert_single_file(
    path: str | os.PathLike, config: dict, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """A single-file H3 transformer as core ComfyUI reads it -> diffusers keys in `dtype`: original keys (or already
    diffusers keys), with or without core's `model.diffusion_model.` / `diffusion_model.` prefix (an all-in-one
    checkpoint: only the prefixed transformer is read), plain, scaled fp8 or core's per-tensor fp8 mixed precision."""
    keys = safetensors_keys(str(path))
    prefix = next((p for p in COMFY_PREFIXES if any(k.startswith(p) for k in keys)), "")
    sd = read_safetensors(str(path), keep=(lambda k: k.startswith(prefix)) if prefix else None)
    sd = {k[len(prefix) :]: v for k, v in sd.items()}
    layers = {
        k.removeprefix(prefix): c for k, c in comfy_quant_layers(sd, safetensors_metadata(str(path)), str(path)).items()
    }
    sd = dequantize_comfy_quant(dequantize_scaled_fp8(sd, dtype), layers, dtype, str(path))
    table = sd.pop(adaln.TABLE_KEY, None)  # core's pruned files: diffusers' converter refuses the table, we run it
    if ORIGINAL_KEY in sd:
        check_rope(sd.get("rope.inv_freq"), config, path)
        sd = convert_minimax_h3_transformer_checkpoint_to_diffusers(sd, config)
    elif "transformer_blocks.0.attn.to_q.weight" not in sd:
        raise H3LoadError(
            f"{shown_name(path)} is not a MiniMax-H3 transformer (no {ORIGINAL_KEY} or diffusers block keys)."
        )
    if table is not None:
        sd[adaln.OUR_TABLE_KEY] = table
    return sd


def check_rope(inv_freq: torch.Tensor | None, config: dict, path: str | os.PathLike) -> None:
    """Core runs a single file with the `rope.inv_freq` it stores, diffusers recomputes it from the config: refuse a
    file whose stored frequencies the config would not reproduce (a config from another model)."""
    if inv_freq is None:
        return
    ours = MiniMaxH3RotaryPosEmbed(config["rope_freq_dim"], config["rope_theta"]).inv_freq
    if inv_freq.shape != ours.shape or not torch.allclose(inv_freq.float(), ours, rtol=1e-5, atol=0):
        raise H3LoadError(
            f"{shown_name(path)}: rope.inv_freq {tuple(inv_freq.shape)} differs from the frequencies of the folder's "
            f"transformer config (rope_freq_dim={config['rope_freq_dim']}, rope_theta={config['rope_theta']}). "
            "Pick the MiniMax-H3 folder whose transformer/config.json belongs to this file."
        )
