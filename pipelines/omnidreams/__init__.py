"""OmniDreams generation: latents, the released AR schedule, the prompt schedule, the rollout (one chunk at a time,
its rolling KV window), over several processes (parallel), the VAE-side conditioning (encode) and the sampler; the
streamed rollout (stream, its saved state: stream_state) beside them."""

from .autoregressive import Rollout, rollout, run_chunks
from .encode import check_size, check_wan21_vae, encode_first_frame, encode_hdmap, resize_images
from .latents import LATENT_MEAN, LATENT_STD, VAE_SPATIAL, VAE_TEMPORAL, denormalize_latent, normalize_latent
from .parallel import KEY_PREFIX, DrivenRollout, ensure_workers, model_key, open_rollout
from .prompt_schedule import (
    MAX_PROMPT_SCHEDULE_BYTES,
    MAX_PROMPT_SCHEDULE_ENTRIES,
    PromptSwitch,
    encode_prompt_schedule,
    parse_prompt_schedule,
)
from .sampler import rollout_plan, sample
from .schedule import DEFAULT_STEPS, ARSettings, num_chunks_for_frames, pixel_frames, released_schedule, sigma_table

__all__ = [
    "ARSettings",
    "DEFAULT_STEPS",
    "DrivenRollout",
    "LATENT_MEAN",
    "KEY_PREFIX",
    "LATENT_STD",
    "MAX_PROMPT_SCHEDULE_BYTES",
    "MAX_PROMPT_SCHEDULE_ENTRIES",
    "PromptSwitch",
    "Rollout",
    "VAE_SPATIAL",
    "VAE_TEMPORAL",
    "check_size",
    "check_wan21_vae",
    "denormalize_latent",
    "encode_first_frame",
    "encode_hdmap",
    "encode_prompt_schedule",
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
