"""OmniDreams generation: latents, the released AR schedule, the prompt schedule, the rollout (one chunk at a time,
its rolling KV window), over several processes (parallel), the VAE-side conditioning (encode) and the sampler; the
streamed rollout (stream, its saved state: stream_state) beside them."""

from .autoregressive import Rollout, rollout, run_chunks
from .encode import check_size, check_wan21_vae, encode_first_frame, encode_hdmap, resize_images
from .latents import LATENT_MEAN, LATENT_STD, VAE_SPATIAL, VAE_TEMPORAL, denormalize_latent, normalize_latent
from .parallel import FAMILY, DrivenRollout, ensure_workers, model_key, open_rollout
from .prompts import (
    MAX_SCHEDULE_BYTES,
    MAX_SCHEDULE_ENTRIES,
    PromptCross,
    PromptSwitch,
    encode_schedule,
    parse_prompt_schedule,
)
from .sampler import rollout_plan, sample
from .schedule import DEFAULT_STEPS, ARSettings, num_chunks_for_frames, pixel_frames, released_schedule, sigma_table

__all__ = [
    "ARSettings",
    "DEFAULT_STEPS",
    "DrivenRollout",
    "FAMILY",
    "LATENT_MEAN",
    "LATENT_STD",
    "MAX_SCHEDULE_BYTES",
    "MAX_SCHEDULE_ENTRIES",
    "PromptCross",
    "PromptSwitch",
    "Rollout",
    "VAE_SPATIAL",
    "VAE_TEMPORAL",
    "check_size",
    "check_wan21_vae",
    "denormalize_latent",
    "encode_first_frame",
    "encode_hdmap",
    "encode_schedule",
    "ensure_workers",
    "model_key",
    "normalize_latent",
    "num_chunks_for_frames",
    "open_rollout",
    "parse_prompt_schedule",
    "pixel_frames",
    "released_schedule",
    "resize_images",
    "rollout",
    "rollout_plan",
    "run_chunks",
    "sample",
    "sigma_table",
]
