"""ComfyUI's core types, packed and unpacked in one place: LATENT dicts, IMAGE [N, H, W, C] in [0, 1],
AUDIO {"waveform": [B, channels, samples], "sample_rate"}. The pipelines return plain tensors; nodes use these."""

from __future__ import annotations

import torch

H3_AUDIO_KEY = "h3_audio_samples"  # the H3 audio latents ride in the LATENT beside ComfyUI's "samples"


def latent(samples: torch.Tensor) -> dict:
    return {"samples": samples}


def h3_latent(video: torch.Tensor, audio: torch.Tensor, num_frames: int, fps: int, sample_rate: int) -> dict:
    """H3's LATENT: samples [1, 24, T, H/16, W/16] video latents, h3_audio_samples [2, 32, N] audio latents (the
    stereo channels as the mono audio VAE's batch), both raw; what the decode needs to cut and label the outputs."""
    return {
        "samples": video,
        H3_AUDIO_KEY: audio,
        "type": "minimax_h3",
        "h3_frames": num_frames,
        "h3_fps": fps,
        "h3_sample_rate": sample_rate,
    }


def h3_latents(samples: dict) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(video latents, audio latents, sample rate or None) of an H3 LATENT."""
    if H3_AUDIO_KEY not in samples:
        raise ValueError("this LATENT has no H3 audio latents; it must come from OmniVideo H3 Sampler.")
    return samples["samples"], samples[H3_AUDIO_KEY], samples.get("h3_sample_rate")


def image_from_video(video: torch.Tensor, *, signed: bool = False) -> torch.Tensor:
    """[B, C, F, H, W] video -> IMAGE [B*F, H, W, C]. signed: the video is in [-1, 1] and is mapped to [0, 1] as
    ComfyUI's VAE.process_output does (in place)."""
    if signed:
        video = video.add_(1.0).div_(2.0).clamp_(0.0, 1.0)
    return video.movedim(1, -1).flatten(0, 1).contiguous()


def audio(waveform: torch.Tensor, sample_rate: int) -> dict:
    return {"waveform": waveform, "sample_rate": int(sample_rate)}
