"""Raw H3 latents -> video frames and the stereo waveform (diffusers' decoders, same math as its decode steps)."""

from __future__ import annotations

import torch

from ... import compat
from .keyframes import PIXEL_MEAN, PIXEL_STD

DECODE_STEPS = 2  # progress: video, then audio


@torch.no_grad()
def decode_video(vae, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1, C, T, h, w] raw latents -> video [1, 3, F, H, W] float in [0, 1]. Tiling stays as the VAE has it (on by
    default)."""
    vae.to(device)
    video = vae.decode(latents.to(device), return_dict=False)[0]
    mean = torch.tensor(PIXEL_MEAN, device=video.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=video.device).view(1, -1, 1, 1, 1)
    return (video.float() * std + mean).clamp(0, 1)


@torch.no_grad()
def decode_audio(audio_vae, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[2, C, N] raw latents (stereo as batch) -> [1, 2, samples] float32 waveform. The audio VAE stays fp32."""
    audio_vae.to(device=device, dtype=torch.float32)
    audio = audio_vae.decode(latents.to(device, torch.float32), return_dict=False)[0]
    return audio.float().permute(1, 0, 2).contiguous()


def decode(
    vae, audio_vae, video: torch.Tensor, audio: torch.Tensor, device: torch.device, progress=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw video and audio latents -> (video [1, 3, F, H, W] in [0, 1], waveform [1, 2, n]).

    Video then audio, one progress step each (`progress`: a factory progress(total) -> object with update(n);
    None = compat.ProgressBar), a cancel point before each; both VAEs go back to CPU afterwards, also on error.
    """
    bar = (progress or compat.ProgressBar)(DECODE_STEPS)
    out = compat.intermediate_device(torch.device("cpu"))
    try:
        compat.check_interrupt()
        frames = decode_video(vae, video, device).to(out)
        bar.update(1)
        compat.check_interrupt()
        wave = decode_audio(audio_vae, audio, device).to(out)
        bar.update(1)
    finally:
        vae.to("cpu")
        audio_vae.to("cpu")
        compat.free_memory()
    return frames, wave
