"""Route a native ComfyUI video model's self-attention through our attention op.

ComfyUI (>= 0.3.6x) calls `transformer_options["optimized_attention_override"](original, q, k,
v, heads, mask=..., skip_reshape=..., skip_output_reshape=..., transformer_options=...)` for
every attention in Wan / Cosmos. That call does not know the video layout, so a
DIFFUSION_MODEL wrapper (also a ComfyUI hook) records the patch grid of the input latent
in transformer_options before the forward; the override then reads it. Nothing here imports
ComfyUI: the node installs these two callables on a cloned MODEL through compat.

Passed to the original function untouched: cross-attention (k rows != q rows), masked
calls, grouped-query calls (k / v with fewer heads), sequences that are not exactly the recorded
video grid, and every call the plan keeps dense (warm-up steps, skip_layers, short videos) - so a
dense call is bit-identical to the unpatched model.

ComfyUI 0.33 also passes `scale=` (honoured), `enable_gqa=` / `low_precision_attention=` and its
own bookkeeping keywords (forwarded to the original untouched), and may call attention with
q / k / v in AttentionTensorContainer boxes (MiniMax): the override has no `container_function`,
so ComfyUI unboxes them before calling it and it always sees tensors.
"""

from __future__ import annotations

import logging
import math

import torch

from ..attention.config import AttentionConfig
from ..attention.dispatch import AttentionStats, attention, dense_reason, log_dense_once
from ..attention.layout import AttnLayout

log = logging.getLogger("omnivideo")

LAYOUT_KEY = "omnivideo_attention_layout"
_ARG_NAMES = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def patch_grid(latent_shape, model) -> tuple[int, int, int] | None:
    """Token grid (t, h, w) of a [B, C, T, H, W] latent after the model's patch embedding."""
    if len(latent_shape) != 5:
        return None
    patch = getattr(model, "patch_size", None)  # Wan: (1, 2, 2)
    if patch is None and hasattr(model, "patch_spatial"):  # Cosmos-Predict2
        patch = (getattr(model, "patch_temporal", 1), model.patch_spatial, model.patch_spatial)
    if patch is None or len(tuple(patch)) != 3:
        return None
    return tuple(math.ceil(n / p) for n, p in zip(latent_shape[2:], patch))


def sampling_step(transformer_options: dict) -> int | None:
    """Index of the current sigma in the sampler's schedule (None when ComfyUI did not say)."""
    sigmas, schedule = transformer_options.get("sigmas"), transformer_options.get("sample_sigmas")
    if not isinstance(sigmas, torch.Tensor) or not isinstance(schedule, torch.Tensor) or schedule.numel() == 0:
        return None
    current = sigmas.flatten()[0].to(schedule.device, schedule.dtype)
    return int(torch.argmin((schedule - current).abs()))


class NativeAttentionPatch:
    """The override and the wrapper for one patched MODEL (shared by its clones)."""

    def __init__(self, config: AttentionConfig):
        self.config = config
        self.stats = AttentionStats()

    def __deepcopy__(self, memo):  # MODEL.clone() deep-copies model_options: keep one patch and its stats
        return self

    # DIFFUSION_MODEL wrapper: wrapper(executor, x, timestep, ..., transformer_options, ...)
    def wrapper(self, executor, *args, **kwargs):
        x = args[0] if args else kwargs.get("x")
        opts = kwargs.get("transformer_options")
        if not isinstance(opts, dict):
            opts = next((a for a in args[1:] if isinstance(a, dict)), None)
        grid = patch_grid(tuple(x.shape), getattr(executor, "class_obj", None)) if isinstance(x, torch.Tensor) else None
        if opts is None:
            return executor(*args, **kwargs)
        opts[LAYOUT_KEY] = {"grid": grid, "layer": 0}
        try:
            return executor(*args, **kwargs)
        finally:
            opts.pop(LAYOUT_KEY, None)

    def override(self, original, *args, **kwargs):
        call = dict(zip(_ARG_NAMES, args))
        call.update((n, kwargs[n]) for n in _ARG_NAMES if n in kwargs)
        q, k, v = call.get("q"), call.get("k"), call.get("v")
        opts = kwargs.get("transformer_options") or {}
        heads = call.get("heads")
        if (
            call.get("mask") is not None
            or heads is None
            or not all(isinstance(t, torch.Tensor) for t in (q, k, v))
            or k.shape != q.shape
            or v.shape != q.shape
        ):
            return original(*args, **kwargs)  # masked, cross- or grouped-query attention: not ours
        skip_reshape = bool(call.get("skip_reshape", False))
        if skip_reshape:  # [B, H, S, D]
            b, h, s, d = q.shape
            q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
        else:  # [B, S, H*D]
            b, s, hd = q.shape
            h, d = int(heads), hd // int(heads)
            q4, k4, v4 = (t.view(b, s, h, d) for t in (q, k, v))

        info = opts.get(LAYOUT_KEY)
        layer = opts.get("block_index")
        if info is not None:
            layer = info["layer"] if layer is None else layer
            info["layer"] += 1  # self-attention calls in this forward = block index for Wan in 0.3.x
        grid = info["grid"] if info is not None else None
        layout = AttnLayout(0, grid) if grid is not None else None
        step = sampling_step(opts)
        why = dense_reason(self.config, q4, k4, layout, step, layer)
        if why is not None:
            log_dense_once(*why)
            self.stats.dense_calls[why[0]] += 1
            return original(*args, **kwargs)

        scale = kwargs.get("scale")
        scale = d**-0.5 if scale is None else float(scale)
        out = attention(q4, k4, v4, self.config, scale=scale, layout=layout, step=step, layer=layer, stats=self.stats)
        if call.get("skip_output_reshape", False):
            return out.transpose(1, 2)
        return out.reshape(b, s, h * d)
