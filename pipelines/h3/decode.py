"""Raw H3 latents -> video frames and the stereo waveform (diffusers' decoders, same math as its decode steps)."""

from __future__ import annotations

import torch

from ... import compat
from .keyframes import PIXEL_MEAN, PIXEL_STD

DECODE_STEPS = 2  # progress: video, then audio


@torch.no_grad()
def decode_video(vae, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1, C, T, h, w] raw latents -> video [1, 3, F, H, W] float in [0, 1] with the VAE module on `device`. Tiling
    stays as the VAE has it (on by default)."""
    video = vae.decode(latents.to(device), return_dict=False)[0]
    mean = torch.tensor(PIXEL_MEAN, device=video.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=video.device).view(1, -1, 1, 1, 1)
    return (video.float() * std + mean).clamp(0, 1)


@torch.no_grad()
def decode_audio(audio_vae, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[2, C, N] raw latents (stereo as batch) -> [1, 2, samples] float32 waveform. The audio VAE is fp32."""
    audio = audio_vae.decode(latents.to(device, torch.float32), return_dict=False)[0]
    return audio.float().permute(1, 0, 2).contiguous()


def decode(
    vae, audio_vae, video: torch.Tensor, audio: torch.Tensor, progress=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw video and audio latents -> (video [1, 3, F, H, W] in [0, 1], waveform [1, 2, n]).

    `vae` / `audio_vae` are the ModelPatchers the H3 loader returns: ComfyUI loads each for its step. Video then
    audio, one progress step each (`progress`: a factory progress(total) -> object with update(n); None =
    compat.ProgressBar), a cancel point before each.
    """
    bar = (progress or compat.ProgressBar)(DECODE_STEPS)
    out = compat.intermediate_device(torch.device("cpu"))
    try:
        compat.check_interrupt()
        frames = decode_video(compat.loaded(vae), video, vae.load_device).to(out)
        bar.update(1)
        compat.check_interrupt()
        wave = decode_audio(compat.loaded(audio_vae), audio, audio_vae.load_device).to(out)
        bar.update(1)
    finally:
        compat.free_memory()  # the activations, also on interrupt; the weights are ComfyUI's to evict
    return frames, wave
