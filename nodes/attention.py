"""OmniVideo Attention (the selector) and OmniVideo Patch Model Attention (native ComfyUI models)."""

from __future__ import annotations

import logging

from .. import compat
from ..attention.config import BACKENDS, MAX_SPARSITY, AttentionConfig, parse_skip_layers
from ..compat import io
from ..integration.attention_patch import NativeAttentionPatch
from .input_checks import checks_inputs
from .types import AttentionType

log = logging.getLogger("omnivideo")

WRAPPER_KEY = "omnivideo_attention"


# Only skip_layers (free text) is checked at /prompt, in bounded time; ComfyUI's own checks stay on for the other
# inputs, and execute checks the rest (block size rules).
@checks_inputs(skip_layers=parse_skip_layers, combos=("backend",))
class OmniVideoAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoAttention",
            **compat.search_aliases("rainfusion", "sparse attention", "block sparse", "flash attention varlen"),
            display_name="OmniVideo Attention",
            category="OmniVideo/attention",
            description="Attention backend for OmniVideo loaders/samplers and for Patch Model Attention. "
            "rainfusion = RainFusion 2.0 block-sparse attention over the video rows.",
            inputs=[
                io.Combo.Input(
                    "backend",
                    options=list(BACKENDS),
                    default="auto",
                    tooltip="auto: fastest exact backend on this machine; rainfusion: block-sparse",
                ),
                io.Float.Input(
                    "sparsity",
                    default=0.8,
                    min=0.0,
                    max=MAX_SPARSITY,
                    step=0.05,
                    tooltip="fraction of key blocks skipped per query block (rainfusion only)",
                ),
                io.Int.Input(
                    "start_step",
                    default=0,
                    min=0,
                    max=10000,
                    tooltip="dense warm-up steps before sparse attention starts",
                ),
                io.String.Input("skip_layers", default="", tooltip='layers kept dense, e.g. "0-3,38"'),
                io.Int.Input(
                    "block_size",
                    default=128,
                    min=16,
                    max=512,
                    step=16,
                    tooltip="rows per block (128; Ascend NPU supports only 128)",
                ),
            ],
            outputs=[AttentionType.Output(display_name="attention")],
        )

    @classmethod
    def execute(cls, backend, sparsity, start_step, skip_layers, block_size) -> io.NodeOutput:
        # AttentionConfig checks every setting (backend choice, ranges, block size rules) and says what to change
        return io.NodeOutput(
            AttentionConfig(
                backend=backend,
                sparsity=float(sparsity),
                start_step=int(start_step),
                skip_layers=skip_layers,
                block_size=int(block_size),
            )
        )


class OmniVideoPatchModelAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoPatchModelAttention",
            **compat.search_aliases("rainfusion", "sparse attention"),
            display_name="OmniVideo Patch Model Attention",
            category="OmniVideo/attention",
            description="Route a native video MODEL's self-attention (Wan, Cosmos; MiniMax-H3 on ComfyUI 0.33: "
            "RainFusion over its video rows only) through the OmniVideo attention backend. Cross-attention and "
            "unsupported calls keep ComfyUI's own attention.",
            inputs=[io.Model.Input("model"), AttentionType.Input("attention")],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, attention) -> io.NodeOutput:
        if compat.HAS_COMFY and not compat.attention_override_supported():
            log.warning("omnivideo: this ComfyUI has no optimized_attention_override hook; the model is unchanged")
        patched = model.clone()
        opts = patched.model_options.setdefault("transformer_options", {})
        # an override already on the MODEL (core's Model Attention Backend, ...) answers the calls ours declines
        patch = NativeAttentionPatch(attention, previous=opts.get("optimized_attention_override"))
        opts["optimized_attention_override"] = patch.override
        patched.remove_wrappers_with_key(compat.wrapper_type("DIFFUSION_MODEL"), WRAPPER_KEY)  # re-patching replaces
        patched.add_wrapper_with_key(compat.wrapper_type("DIFFUSION_MODEL"), WRAPPER_KEY, patch.wrapper)
        return io.NodeOutput(patched)


__all__ = ["OmniVideoAttention", "OmniVideoPatchModelAttention"]
