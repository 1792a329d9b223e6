"""MiniMax-H3 generation on diffusers' modules: layout, sampler, keyframes, decode."""

from .sampler import H3Latents, sample

__all__ = ["sample", "H3Latents"]
