"""OmniVideo Sampler: one node for both families; the math lives in pipelines/<family>."""

from __future__ import annotations

import importlib

from .. import compat
from ..compat import io
from .types import ConditioningType, ModelType

# family -> "module:function" with signature
#   sample(model, conditioning, *, seed, frames, steps, width, height, progress) -> LATENT dict
# `progress` is a factory: progress(total) -> object with update(n) (compat.ProgressBar).
MAX_FRAMES = 1021  # OmniDreams: 128 chunks, 34 s at 30 fps (H3 checks its own 5-15 s)

SAMPLERS = {
    "omnidreams": "..pipelines.omnidreams:sample",
    "h3": "..pipelines.h3:sample",
}


def sampler_for(family: str):
    if family not in SAMPLERS:
        raise ValueError(f"no sampler for model family {family!r}; known: {', '.join(SAMPLERS)}")
    module, _, attr = SAMPLERS[family].partition(":")
    return getattr(importlib.import_module(module, package=__package__), attr)


class OmniVideoSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoSampler",
            display_name="OmniVideo Sampler",
            category="OmniVideo/sampling",
            description=(
                "Generates a video latent with the model's own sampler. OmniDreams: autoregressive 2-frame "
                "chunks with a rolling KV cache; the video has 8N-3 frames (5, 13, 21, ..., 61), other frame "
                "counts round up; steps 0 = the distilled 2 steps; the first frame (if encoded) fixes the size. "
                "The LATENT is raw Wan latent space, so VAE Decode and OmniVideo Wan VAE Decode both accept it. "
                "MiniMax-H3: frames snap to 17n+5 (24 fps, 5-15 s), width/height multiples of 32, steps 0 = 50 "
                "(49 forwards; turbo LoRAs use 4-8); the LATENT holds video and audio latents for OmniVideo H3 Decode."
            ),
            inputs=[
                ModelType.Input("model"),
                ConditioningType.Input("conditioning"),
                io.Int.Input("seed", default=42, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True),
                io.Int.Input(
                    "frames",
                    default=61,
                    min=1,
                    max=MAX_FRAMES,
                    tooltip=f"Pixel frames to generate (at most {MAX_FRAMES}: the whole video is held in memory).",
                ),
                io.Int.Input("steps", default=0, min=0, max=200, tooltip="0 = the family's default."),
                io.Int.Input(
                    "width",
                    default=1280,
                    min=16,
                    max=8192,
                    step=16,
                    tooltip="Used when no image conditioning fixes the size.",
                ),
                io.Int.Input(
                    "height",
                    default=704,
                    min=16,
                    max=8192,
                    step=16,
                    tooltip="Used when no image conditioning fixes the size.",
                ),
            ],
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def execute(cls, model, conditioning, seed=42, frames=61, steps=0, width=1280, height=704) -> io.NodeOutput:
        # ComfyUI checks the declared min/max; the step of 16 is not checked by ComfyUI, so it is here.
        if width % 16 or height % 16:
            raise ValueError(f"width and height must be multiples of 16, got {width}x{height}")
        if model.family != conditioning.family:
            raise ValueError(
                f"the model is {model.family} but the conditioning was made for {conditioning.family}: "
                f"use that family's text encode node"
            )
        sample = sampler_for(model.family)
        latent = sample(
            model,
            conditioning,
            seed=seed,
            frames=frames,
            steps=steps,
            width=width,
            height=height,
            progress=compat.ProgressBar,
        )
        return io.NodeOutput(latent)
