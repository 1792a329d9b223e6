"""The VAE side of OmniDreams' conditioning: the first frame and the HD-map video through ComfyUI's Wan 2.1 VAE
into normalised latents, and the checks of the size and the VAE before it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .latents import LATENT_MEAN, VAE_SPATIAL, VAE_TEMPORAL, normalize_latent


def resize_images(images: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """IMAGE [T,H,W,C] in [0,1] -> [T,height,width,3], resized without cropping."""
    x = images[..., :3].movedim(-1, 1).float()
    if x.shape[-2:] != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return x.clamp(0, 1).movedim(1, -1)


def check_size(width: int, height: int) -> None:
    unit = VAE_SPATIAL * 2  # VAE 8x, then the DiT's 2x2 patch
    if width % unit or height % unit or width <= 0 or height <= 0:
        raise ValueError(f"width and height must be positive multiples of {unit}; got {width}x{height}")


def check_wan21_vae(vae) -> None:
    """Before any encoding: ComfyUI's VAE object must be the Wan 2.1 VAE (16-channel video latents)."""
    channels, dims = getattr(vae, "latent_channels", None), getattr(vae, "latent_dim", None)
    network = type(getattr(vae, "first_stage_model", None)).__name__
    if channels != len(LATENT_MEAN) or dims != 3 or network not in ("WanVAE", "NoneType"):
        raise ValueError(
            f"OmniDreams needs the Wan 2.1 VAE (16-channel video latents); this VAE is {network} with "
            f"{channels} latent channels over {dims} dimensions. Load wan_2.1_vae.safetensors with Load VAE."
        )


def _vae_encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """ComfyUI's VAE.encode: IMAGE in [0,1] (it scales to [-1,1] itself) -> raw posterior mean."""
    mu = vae.encode(pixels)
    if mu.dim() != 5 or mu.shape[1] != len(LATENT_MEAN):
        raise ValueError(
            f"the VAE returned a latent of shape {tuple(mu.shape)}; OmniDreams needs the Wan 2.1 VAE "
            f"(16 latent channels, e.g. wan_2.1_vae.safetensors)"
        )
    return mu


def encode_first_frame(vae, image: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """First IMAGE frame -> normalised latent [1,16,1,height/8,width/8]."""
    check_size(width, height)
    return normalize_latent(_vae_encode(vae, resize_images(image[:1], width, height))[:, :, :1])


def encode_hdmap(vae, frames: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """HD-map video -> normalised latent [1,16,1+(F-1)//4,h,w] in one causal pass.

    Latent frames 2k, 2k+1 belong to chunk k: pixel frames [0,5) for chunk 0, then 8 per chunk.
    Trailing frames beyond the last 1+4m boundary are dropped.
    """
    check_size(width, height)
    usable = 1 + (frames.shape[0] - 1) // VAE_TEMPORAL * VAE_TEMPORAL
    return normalize_latent(_vae_encode(vae, resize_images(frames[:usable], width, height)))
