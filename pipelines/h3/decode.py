"""Raw H3 latents -> ComfyUI IMAGE frames and AUDIO waveform (diffusers' decoders, same math as its decode steps)."""

from __future__ import annotations

import torch

from .keyframes import PIXEL_MEAN, PIXEL_STD


@torch.no_grad()
def decode_video(vae, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1, C, T, h, w] raw latents -> [F, H, W, 3] float 0..1. Tiling stays as the VAE has it (on by default)."""
    vae.to(device)
    video = vae.decode(latents.to(device), return_dict=False)[0]
    mean = torch.tensor(PIXEL_MEAN, device=video.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=video.device).view(1, -1, 1, 1, 1)
    video = (video.float() * std + mean).clamp(0, 1)
    return video[0].permute(1, 2, 3, 0).contiguous()  # [C, F, H, W] -> [F, H, W, C]


@torch.no_grad()
def decode_audio(audio_vae, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[2, C, N] raw latents (stereo as batch) -> [1, 2, samples] float32 waveform. The audio VAE stays fp32."""
    audio_vae.to(device=device, dtype=torch.float32)
    audio = audio_vae.decode(latents.to(device, torch.float32), return_dict=False)[0]
    return audio.float().permute(1, 0, 2).contiguous()
