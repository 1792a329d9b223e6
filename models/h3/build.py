"""An H3 network from its config and checkpoint tensors, in the dtypes it runs.

Each model is built on the meta device and gets the checkpoint tensors assigned, instead of `from_pretrained`: these
classes declare `_keep_in_fp32_modules`, which makes `from_pretrained` demand `accelerate`. The fp32 islands are
applied here with diffusers' own rule (a listed name equal to a component of the parameter path). fp8 storage of the
block matrices (`store_blocks_in`) is chosen here too.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import MiniMaxH3VideoRotaryPosEmbed
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormModulation,
    MiniMaxH3RotaryPosEmbed,
)

from ..checkpoint_io import build_strict
from . import adaln
from .folder import H3LoadError


def _cast_with_islands(model: torch.nn.Module, dtype: torch.dtype) -> None:
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    also = getattr(model, "fp32_parameter", lambda name: False)  # a pruned model's AdaLN projections (adaln.py)
    for name, param in model.named_parameters():
        want = torch.float32 if any(k in name.split(".") for k in keep) or also(name) else dtype
        if param.dtype != want:
            param.data = param.data.to(want)


def _rebuild_computed_buffers(model: torch.nn.Module) -> None:
    """Non-persistent buffers are computed in __init__, so after a meta build they are empty: recompute them."""
    cfg: Any = model.config  # a diffusers FrozenDict
    for module in model.modules():
        if isinstance(module, MiniMaxH3RotaryPosEmbed) and module.inv_freq.is_meta:
            fresh: torch.nn.Module = MiniMaxH3RotaryPosEmbed(module.rope_freq_dim, cfg.rope_theta)
            module.register_buffer("inv_freq", fresh.inv_freq, persistent=False)
        elif isinstance(module, MiniMaxH3VideoRotaryPosEmbed) and module.inv_freq.is_meta:
            fresh = MiniMaxH3VideoRotaryPosEmbed(
                int(cfg.decoder_attention_head_dim * cfg.decoder_rope_dim_ratio), theta=cfg.decoder_rope_theta
            )
            module.register_buffer("inv_freq", fresh.inv_freq, persistent=False)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise H3LoadError(
            f"{type(model).__name__}: no values for {', '.join(left[:5])}; "
            "the checkpoint does not match this diffusers version."
        )


def build_component(
    cls, config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, source: str, adapt=lambda m: m
):
    """`adapt`: what turns the freshly built (meta) model into the checkpoint's structure before its weights arrive."""
    model = build_strict(
        lambda: adapt(cls.from_config(config)),
        state_dict,
        f"{source} does not fit {cls.__name__} with its config",
        "Check that config.json belongs to these weights.",
        H3LoadError,
    )
    _rebuild_computed_buffers(model)
    _cast_with_islands(model, dtype)
    return model.eval().requires_grad_(False)


def store_blocks_in(transformer: MiniMaxH3Transformer3DModel, weight_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """fp8 weights: every matrix of the token refiner and the block stack (AdaLN projections included: all but ~1%
    of the weights; a pruned model's tiny fp32 ones excepted) is stored in `weight_dtype`; ComfyUI's cast layers
    compute with it in `dtype`."""
    fp32 = getattr(transformer, "fp32_parameter", lambda name: False)
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith(("transformer_blocks.", "token_refiner.")):
            if not fp32(f"{name}.weight"):
                module.weight.data = module.weight.data.to(weight_dtype)
        elif isinstance(module, MiniMaxH3AdaLayerNormModulation) and not hasattr(module, "compute_dtype"):
            adaln.install_modulation(module, dtype, dtype)
