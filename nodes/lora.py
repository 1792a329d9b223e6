"""OmniVideo LoRA: a LoRA file on an OmniVideo model (H3 or OmniDreams), through ComfyUI's model patcher."""

from __future__ import annotations

from .. import compat
from ..compat import io
from ..integration import safe_paths
from ..models import lora as lora_mod
from ..models.handles import FAMILIES
from .input_checks import checks_inputs
from .types import ModelType

# core's LoraLoaderModelOnly limits
MIN_STRENGTH, MAX_STRENGTH, STRENGTH_STEP = -100.0, 100.0, 0.01


def _lora_file(name: str) -> str:
    return safe_paths.resolve_model_file("loras", name, lora_mod.EXTS, what="lora_name")


@checks_inputs(lora_name=_lora_file, combos=("lora_name",))
class OmniVideoLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoLoRA",
            **compat.search_aliases("lora", "turbo", "distill"),
            display_name="OmniVideo LoRA",
            category="OmniVideo/utils",
            description=(
                "Applies a LoRA from models/loras to an OmniVideo model (MiniMax-H3 or OmniDreams) through ComfyUI's "
                "model patcher: the weights stay as loaded and ComfyUI adds the LoRA when it loads them (fp8 and "
                "partial loading included), so another strength needs no reload. H3 files of every published format "
                "(ComfyUI, ai-toolkit, musubi-tuner, DiffSynth, kohya, diffusers) are read by diffusers' converter. "
                "Chain nodes to stack LoRAs; strength 0 = the model unchanged. Parallel workers apply the same LoRAs."
            ),
            inputs=[
                ModelType.Input("model"),
                io.Combo.Input("lora_name", options=safe_paths.list_model_files("loras", lora_mod.EXTS)),
                io.Float.Input("strength", default=1.0, min=MIN_STRENGTH, max=MAX_STRENGTH, step=STRENGTH_STEP),
            ],
            outputs=[ModelType.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, lora_name, strength=1.0) -> io.NodeOutput:
        family = getattr(model, "family", None)
        if family not in FAMILIES:
            raise ValueError(f"OmniVideo LoRA needs an OmniVideo model, got {type(model).__name__}")
        if strength == 0:  # as core's LoRA loaders: nothing to add
            return io.NodeOutput(model)
        path = _lora_file(lora_name)
        lora = lora_mod.read(path, family, model.transformer)
        load_args = model.load_args and {
            **model.load_args,
            "loras": [*model.load_args.get("loras", []), lora_mod.recipe(path, strength)],
        }
        patched = model.replace(patcher=lora_mod.patched(model.patcher, lora, strength), load_args=load_args)
        return io.NodeOutput(patched, ui={"text": [lora.describe()]})


NODES = [OmniVideoLoRA]
