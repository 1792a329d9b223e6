"""MiniMax-H3 generation on diffusers' modules: layout, sampler, keyframes, decode."""

from .sampler import AUDIO_KEY, sample

__all__ = ["sample", "AUDIO_KEY"]
