"""Load an OmniDreams checkpoint (.pt / .safetensors): read safely, fuse, validate strictly, build.

The released file is a flat `torch.save` dict (bf16, 570 keys, optional `net.` prefix). It is read
with `weights_only=True` so a pickle carrying code is refused, never executed. Two load-time
fusions turn the stored layout into the one `OmniDreamsDiT` runs:
- `x_embedder.proj.1.weight` [C, 72] -> [C, 68]: the last 4 columns multiply a padding-mask
  channel that is always zero at inference, so dropping them changes no output;
- `final_layer.linear.weight` rows (kt kh kw c) -> (c kt kh kw), so unpatchify is patchify's inverse.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from ..checkpoint_io import (
    CheckpointError,
    build_strict,
    dequantize_scaled_fp8,
    read_safetensors,
    read_torch_file,
    shown_name,
    store_weights,
)
from .dit import OmniDreamsConfig, OmniDreamsDiT

PREFIX = "net."


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors or torch.save file, without executing any pickled code."""
    name = shown_name(path)
    sd = read_safetensors(path) if path.endswith(".safetensors") else read_torch_file(path)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(
            f"{name}: expected a flat dict of tensors, found {type(sd).__name__}"
            f"{' with non-tensor values' if isinstance(sd, dict) else ''}."
        )
    if any(k.startswith(PREFIX) for k in sd):
        sd = {(k[len(PREFIX) :] if k.startswith(PREFIX) else k): v for k, v in sd.items()}
    return sd


def _shape(sd, key, name) -> tuple[int, ...]:
    if key not in sd:
        raise CheckpointError(
            f"{name}: key '{key}' is missing, so the model size cannot be inferred. "
            f"This does not look like an OmniDreams (Cosmos-Predict2.5) DiT checkpoint."
        )
    return tuple(sd[key].shape)


def infer_config(sd: dict[str, torch.Tensor], name: str = "checkpoint") -> OmniDreamsConfig:
    """Model size from tensor shapes (accepts stored or fused layouts)."""
    dim = _shape(sd, "x_embedder.proj.1.weight", name)[0]
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not blocks:
        raise CheckpointError(f"{name}: no 'blocks.N.*' keys found.")
    head_dim = _shape(sd, "blocks.0.self_attn.q_norm.weight", name)[0]
    if dim % head_dim:
        raise CheckpointError(f"{name}: model_channels {dim} is not a multiple of head dim {head_dim}.")
    in_ch = 16
    out_features = _shape(sd, "final_layer.linear.weight", name)[0]
    if out_features % in_ch or int(round((out_features // in_ch) ** 0.5)) ** 2 != out_features // in_ch:
        raise CheckpointError(
            f"{name}: final_layer.linear.weight has {out_features} rows; expected 16 latent "
            f"channels x a square spatial patch (64 for patch 2)."
        )
    patch = int(round((out_features // in_ch) ** 0.5))
    text_dim, text_in = _shape(sd, "crossattn_proj.0.weight", name)
    hd_in = _shape(sd, "additional_patch_embedding.proj.1.weight", name)[1]
    return OmniDreamsConfig(
        model_channels=dim,
        num_blocks=max(blocks) + 1,
        num_heads=dim // head_dim,
        mlp_hidden=_shape(sd, "blocks.0.mlp.layer1.weight", name)[0],
        adaln_lora_dim=_shape(sd, "blocks.0.adaln_modulation_self_attn.1.weight", name)[0],
        in_channels=in_ch,
        out_channels=in_ch,
        patch_spatial=patch,
        patch_temporal=1,
        hdmap_channels=hd_in // (patch * patch),
        text_in_dim=text_in,
        text_dim=text_dim,
    )


def final_rows_to_model(w: torch.Tensor, cfg: OmniDreamsConfig) -> torch.Tensor:
    """Stored (kt kh kw c) rows -> (c kt kh kw)."""
    pt, p, c = cfg.patch_temporal, cfg.patch_spatial, cfg.out_channels
    return w.reshape(pt, p, p, c, -1).permute(3, 0, 1, 2, 4).reshape(w.shape)


def final_rows_to_storage(w: torch.Tensor, cfg: OmniDreamsConfig) -> torch.Tensor:
    """Inverse of `final_rows_to_model` (for writing checkpoints in the released layout)."""
    pt, p, c = cfg.patch_temporal, cfg.patch_spatial, cfg.out_channels
    return w.reshape(c, pt, p, p, -1).permute(1, 2, 3, 0, 4).reshape(w.shape)


def fuse_state_dict(sd: dict[str, torch.Tensor], cfg: OmniDreamsConfig, name: str = "checkpoint") -> dict:
    """Stored layout -> model layout (a new dict; tensors not touched are shared)."""
    out = dict(sd)
    w = sd["x_embedder.proj.1.weight"]
    padded = cfg.x_embed_in + cfg.patch_volume  # + the padding-mask channel's patch
    if w.shape[1] == padded:
        out["x_embedder.proj.1.weight"] = w[:, : cfg.x_embed_in]
    elif w.shape[1] != cfg.x_embed_in:
        raise CheckpointError(
            f"{name}: x_embedder.proj.1.weight has {w.shape[1]} input columns; expected "
            f"{padded} (latent + condition mask + padding mask) or {cfg.x_embed_in}."
        )
    out["final_layer.linear.weight"] = final_rows_to_model(sd["final_layer.linear.weight"], cfg)
    return out


def fp8_candidate(key: str) -> bool:
    """The matrices stored in fp8 when fp8 weights are chosen: the block stack and the text projection (all
    but ~1% of the weights); the patch embedders, timestep MLP and final layer keep the compute dtype."""
    return key.startswith(("blocks.", "crossattn_proj."))


def build_dit(
    sd: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    weight_dtype: torch.dtype | None = None,
    operations=nn,
    name: str = "checkpoint",
) -> OmniDreamsDiT:
    """Stored-layout state dict -> an eval-mode DiT on the CPU computing in `dtype`, its block matrices stored
    in `weight_dtype` (default `dtype`; fp8 needs cast layers in `operations`)."""
    cfg = infer_config(sd, name)
    sd = fuse_state_dict(dequantize_scaled_fp8(sd, dtype), cfg, name)
    model = build_strict(
        lambda: OmniDreamsDiT(cfg, operations=operations, dtype=dtype),
        store_weights(sd, weight_dtype or dtype, dtype, fp8_candidate),
        f"{name} does not match the OmniDreams DiT inferred from its shapes",
        "Use the complete checkpoint (e.g. 2b_res720p_30fps_i2v_hdmap_distilled.pt); partial loads are refused.",
    )
    return model.eval().requires_grad_(False)


def weights_recipe(path: str, dtype: torch.dtype, weight_dtype: torch.dtype) -> dict:
    """What another process needs to load the same weights (a parallel worker: `load_omnidreams(**recipe)` minus
    the modification time, which tells a replaced file from the one already loaded)."""
    return {"path": path, "mtime_ns": os.stat(path).st_mtime_ns, "dtype": str(dtype), "weight_dtype": str(weight_dtype)}


def load_omnidreams(path: str, dtype: torch.dtype, weight_dtype: torch.dtype, operations=nn) -> OmniDreamsDiT:
    return build_dit(
        read_state_dict(path), dtype, weight_dtype=weight_dtype, operations=operations, name=shown_name(path)
    )
