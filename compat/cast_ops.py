"""ComfyUI's cast layers (comfy.ops): the layer classes a model is built with, so ComfyUI's model management can keep
some weights on the offload device and cast them per forward; torch.nn outside ComfyUI."""

from __future__ import annotations

import torch

from .comfyui import HAS_COMFY
from .comfyui import ops as comfy_ops


def operations(weight_dtype: torch.dtype, compute_dtype: torch.dtype, load_device: torch.device):
    """The layer classes a model is built with (`operations=`): ComfyUI's, so its model management can
    leave some weights on the offload device and cast them per forward; torch.nn outside ComfyUI."""
    if HAS_COMFY:
        return comfy_ops.pick_operations(weight_dtype, compute_dtype, load_device=load_device)
    if weight_dtype != compute_dtype:
        raise RuntimeError(
            f"storing weights in {weight_dtype} and computing in {compute_dtype} needs ComfyUI's cast layers; "
            "run inside ComfyUI or pick the compute dtype"
        )
    return torch.nn


_CASTABLE = ("Linear", "Conv1d", "Conv2d", "Conv3d", "GroupNorm", "LayerNorm", "RMSNorm", "Embedding")


def make_castable(module: torch.nn.Module, ops) -> int:
    """Give a model built by another library (diffusers, transformers) ComfyUI's cast layers in place: each
    plain torch layer becomes the same-named class of `ops` (a subclass of it: same parameters, same
    forward until ComfyUI asks for casting). Returns how many layers changed; nothing happens outside ComfyUI."""
    if ops is torch.nn or not HAS_COMFY:
        return 0
    swaps = {getattr(torch.nn, name): getattr(ops, name) for name in _CASTABLE}
    changed = 0
    for sub in module.modules():
        cls = swaps.get(type(sub))
        if cls is not None:
            sub.__class__ = cls
            if not hasattr(sub, "bias"):  # torch's RMSNorm / Embedding have none; the cast path reads it
                sub.register_parameter("bias", None)
            changed += 1
    return changed
