"""Where our code hooks into the models core runs: ComfyUI's wrapper slots on a ModelPatcher, and whether its
attention honours an override."""

from __future__ import annotations


def wrapper_type(slot: str) -> str:
    """ComfyUI's wrapper slot `slot` (a name of its WrappersMP: 'DIFFUSION_MODEL' wraps the diffusion model's forward;
    'OUTER_SAMPLE' a whole sampling run, its executor's class_obj the guider with the run's conds). Where this ComfyUI
    has no such slot, the slot's lowercase name, as WrappersMP spells its values."""
    try:
        from comfy.patcher_extension import WrappersMP

        return getattr(WrappersMP, slot)
    except Exception:
        return slot.lower()


def attention_override_supported() -> bool:
    """Whether this ComfyUI honours transformer_options["optimized_attention_override"] (0.3.6x+)."""
    try:
        import comfy.ldm.modules.attention as attn

        return hasattr(attn, "wrap_attn")
    except Exception:
        return False
