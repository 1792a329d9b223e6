"""The OmniDreams sampler: the rollout of a model handle for the frames asked, as one video latent."""

from __future__ import annotations

import torch

from ... import compat
from ...models.handles import check_family
from .autoregressive import run_chunks
from .encode import check_size
from .latents import VAE_SPATIAL, denormalize_latent
from .parallel import open_rollout
from .schedule import DEFAULT_STEPS, ARSettings, num_chunks_for_frames, pixel_frames


def rollout_plan(model, conditioning, width: int, height: int) -> tuple[tuple[int, int], ARSettings]:
    """Check the model and conditioning families; (latent size, AR settings) of their rollout. The first frame (if
    encoded) fixes the size, else width x height."""
    check_family(model, "omnidreams", "model", "load it with OmniDreams Model Loader")
    check_family(conditioning, "omnidreams", "conditioning", "use OmniDreams Text Encode or Load Text Embedding")
    if conditioning.first_frame is not None:
        h, w = conditioning.first_frame.shape[-2:]
    else:
        check_size(width, height)
        h, w = height // VAE_SPATIAL, width // VAE_SPATIAL
        compat.log.warning("OmniDreams: no first frame connected; generating without an image pin")
    settings = ARSettings.for_kv_finalize(
        model.kv_finalize,
        len_t=model.chunk_frames,
        window_frames=model.window_frames,
        sink_frames=model.sink_frames,
        short_history_blocks=model.short_history_blocks,
        kv_dtype=model.kv_dtype,
    )
    return (int(h), int(w)), settings


def sample(
    model, conditioning, *, seed: int, frames: int, steps: int, width: int, height: int, progress=None
) -> torch.Tensor:
    """The OmniDreams sampler: the video latent [1, 16, T, h, w] in raw Wan 2.1 space.

    frames: pixel frames wanted; rounded up to 8N - 3 (N chunks of 2 latent frames).
    steps: 0 or 2 (the distilled schedule). width/height: used when no first frame fixes the size.
    progress: a callable total -> object with update(n) (compat.ProgressBar).
    """
    if steps not in (0, DEFAULT_STEPS):
        raise ValueError(
            f"OmniDreams is distilled for {DEFAULT_STEPS} steps; set steps to 0 (default) or 2, not {steps}"
        )
    (h, w), settings = rollout_plan(model, conditioning, width, height)
    first = conditioning.first_frame
    n = num_chunks_for_frames(frames, settings.len_t)
    if pixel_frames(n, settings.len_t) != frames:
        compat.log.info(
            "OmniDreams: %d frames rounded up to %d (%d chunks)", frames, pixel_frames(n, settings.len_t), n
        )
    text, config = conditioning.text, model.transformer.config
    if text.dim() != 3 or text.shape[-1] != config.text_in_dim:
        raise ValueError(
            f"text embedding has shape {tuple(text.shape)}; this model needs [1, 512, "
            f"{config.text_in_dim}] (Cosmos-Reason1 full_concat)"
        )
    hdmap = conditioning.hdmap
    if hdmap is not None:
        need = settings.len_t * n
        if tuple(hdmap.shape[-2:]) != (h, w) or hdmap.shape[2] < need:
            raise ValueError(
                f"HD-map latent {tuple(hdmap.shape)} does not cover {need} latent frames at "
                f"{h}x{w}: give at least {pixel_frames(n, settings.len_t)} HD-map frames at "
                f"{w * VAE_SPATIAL}x{h * VAE_SPATIAL}"
            )
    bar = progress(n) if progress is not None else None
    try:
        run = open_rollout(
            model,
            text=text,
            prompt_schedule=conditioning.prompt_schedule,
            latent_hw=(h, w),
            seed=seed,
            first_frame=first,
            settings=settings,
        )
        z = run_chunks(run, n, hdmap=hdmap, bar=bar)
        z = denormalize_latent(z).to(compat.intermediate_device(torch.device("cpu")))
    finally:
        compat.free_memory()  # also on interrupt or error: return the freed KV window's blocks
    return z
