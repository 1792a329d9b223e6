"""What the samplers of both families share: their inputs (with each family's limits) and the run."""

from __future__ import annotations

from .. import compat
from ..compat import io
from .types import ConditioningType, ModelType

SEED_MAX = 0xFFFFFFFFFFFFFFFF  # core's sampler range


def sampler_inputs(
    *,
    frames: int,
    max_frames: int,
    frames_tip: str,
    max_steps: int,
    steps_tip: str,
    size_step: int,
    width: int,
    height: int,
    size_tip: str,
) -> list:
    return [
        ModelType.Input("model"),
        ConditioningType.Input("conditioning"),
        io.Int.Input("seed", default=42, min=0, max=SEED_MAX, control_after_generate=True),
        io.Int.Input("frames", default=frames, min=1, max=max_frames, tooltip=frames_tip),
        io.Int.Input("steps", default=0, min=0, max=max_steps, tooltip=steps_tip),
        io.Int.Input("width", default=width, min=size_step, max=8192, step=size_step, tooltip=size_tip),
        io.Int.Input("height", default=height, min=size_step, max=8192, step=size_step, tooltip=size_tip),
    ]


def run_sampler(sample, size_step: int, model, conditioning, seed, frames, steps, width, height):
    """`sample(model, conditioning, *, seed, frames, steps, width, height, progress)`'s result."""
    # ComfyUI checks the declared min/max; the step is not checked by ComfyUI, so it is here, before any work
    if width % size_step or height % size_step:
        raise ValueError(f"width and height must be multiples of {size_step}, got {width}x{height}")
    return sample(
        model,
        conditioning,
        seed=seed,
        frames=frames,
        steps=steps,
        width=width,
        height=height,
        progress=compat.ProgressBar,
    )
