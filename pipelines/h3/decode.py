"""Raw H3 latents -> ComfyUI IMAGE frames and AUDIO waveform (diffusers' decoders, same math as its decode steps)."""

from __future__ import annotations

import torch

from ... import compat
from .keyframes import PIXEL_MEAN, PIXEL_STD
from .sampler import AUDIO_KEY

DECODE_STEPS = 2  # progress: video, then audio


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


def decode(vae, audio_vae, samples: dict, device: torch.device, progress=None) -> tuple[torch.Tensor, dict]:
    """An H3 LATENT -> (IMAGE [F, H, W, 3], AUDIO {"waveform" [1, 2, n], "sample_rate"}), what H3 Decode returns.

    Video then audio, one progress step each (`progress`: a factory progress(total) -> object with update(n);
    None = compat.ProgressBar), a cancel point before each; both VAEs go back to CPU afterwards, also on error.
    """
    if AUDIO_KEY not in samples:
        raise ValueError("this LATENT has no H3 audio latents; it must come from the OmniVideo Sampler in H3 mode.")
    bar = (progress or compat.ProgressBar)(DECODE_STEPS)
    out = compat.intermediate_device(torch.device("cpu"))
    try:
        compat.check_interrupt()
        frames = decode_video(vae, samples["samples"], device).to(out)
        bar.update(1)
        compat.check_interrupt()
        wave = decode_audio(audio_vae, samples[AUDIO_KEY], device).to(out)
        bar.update(1)
    finally:
        vae.to("cpu")
        audio_vae.to("cpu")
        compat.free_memory()
    rate = int(samples.get("h3_sample_rate", audio_vae.config.sampling_rate))
    return frames, {"waveform": wave, "sample_rate": rate}
