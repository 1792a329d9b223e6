"""OmniVideo Sampler: the sampler both families shared before each got its own (OmniDreams Sampler, OmniVideo H3
Sampler). It stays, hidden from search, so saved workflows and API graphs keep loading and running: it hands
the inputs to the sampler of the model's family."""

from __future__ import annotations

from typing import Any

from ..compat import io
from .h3 import OmniVideoH3Sampler
from .omnidreams import MAX_FRAMES, OmniDreamsSampler
from .sampling import sampler_inputs

FAMILY_SAMPLERS: dict[str, Any] = {"omnidreams": OmniDreamsSampler, "h3": OmniVideoH3Sampler}


class OmniVideoSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoSampler",
            display_name="OmniVideo Sampler (use the family's sampler)",
            category="OmniVideo/sampling",
            description=(
                "Kept for saved workflows: runs OmniDreams Sampler or OmniVideo H3 Sampler, whichever belongs to "
                "the connected model. New workflows use those nodes, whose inputs and limits are the family's own."
            ),
            inputs=sampler_inputs(
                frames=61,
                max_frames=MAX_FRAMES,
                frames_tip="Pixel frames to generate.",
                max_steps=200,
                steps_tip="0 = the family's default.",
                size_step=16,
                width=1280,
                height=704,
                size_tip="Used when no image conditioning fixes the size.",
            ),
            outputs=[io.Latent.Output(display_name="LATENT")],
            is_deprecated=True,
        )

    @classmethod
    def execute(cls, model, conditioning, seed=42, frames=61, steps=0, width=1280, height=704) -> io.NodeOutput:
        if model.family != conditioning.family:
            raise ValueError(
                f"the model is {model.family} but the conditioning was made for {conditioning.family}: "
                "use that family's text encode node"
            )
        node = FAMILY_SAMPLERS.get(model.family)
        if node is None:
            raise ValueError(f"no sampler for model family {model.family!r}; known: {', '.join(FAMILY_SAMPLERS)}")
        return node.execute(model, conditioning, seed=seed, frames=frames, steps=steps, width=width, height=height)
