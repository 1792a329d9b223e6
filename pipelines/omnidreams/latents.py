"""The Wan 2.1 latent space OmniDreams works in: its normalisation and the VAE's strides."""

from __future__ import annotations

import torch

from ...models.wan_vae.latent_stats import WAN21_CONFIG

# Wan 2.1 latent normalisation (= ComfyUI's Wan21 latent format): model latent = (mu - mean) / std
LATENT_MEAN: tuple[float, ...] = tuple(WAN21_CONFIG["latents_mean"])  # type: ignore[arg-type]
LATENT_STD: tuple[float, ...] = tuple(WAN21_CONFIG["latents_std"])  # type: ignore[arg-type]
VAE_SPATIAL, VAE_TEMPORAL = 8, 4


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, len(LATENT_MEAN), 1, 1, 1)
    mean = torch.tensor(LATENT_MEAN, device=x.device).view(shape)
    return mean, torch.tensor(LATENT_STD, device=x.device).view(shape)


def normalize_latent(mu: torch.Tensor) -> torch.Tensor:
    mean, std = _stats(mu)
    return (mu.float() - mean) / std


def denormalize_latent(x: torch.Tensor) -> torch.Tensor:
    mean, std = _stats(x)
    return x.float() * std + mean
