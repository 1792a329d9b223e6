"""Request geometry for MiniMax-H3: frame snapping, canvas checks, latent shapes.

The arithmetic is diffusers' own (`align_num_frames`, `video_latent_num_frames`,
`audio_latent_num_frames`); this module only adds the user-facing messages and
reads the numbers from the loaded model instead of a pipeline object.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_FPS,
    align_num_frames,
    audio_latent_num_frames,
    video_latent_num_frames,
)

log = logging.getLogger("omnivideo")

FPS = MINIMAX_H3_FPS
AUDIO_CHANNELS = MINIMAX_H3_AUDIO_CHANNELS
# MiniMaxH3ModularPipeline.min_duration / max_duration (properties, not module constants upstream).
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0


@dataclass(frozen=True)
class H3Geometry:
    """What the sampler needs from the two VAEs and the transformer config (kept in H3Model.geometry)."""

    spatial_ratio: int = 16
    frames_per_chunk: int = 17  # video VAE clip_length
    latents_per_chunk: int = 5  # video VAE tokens_chunk_size
    latent_channels: int = 24
    audio_latent_channels: int = 32
    audio_sample_rate: int = 32000
    patch_size: tuple[int, int, int] = (1, 2, 2)

    @property
    def canvas_multiple(self) -> int:
        return self.spatial_ratio * self.patch_size[2]


@dataclass(frozen=True)
class H3Shape:
    num_frames: int
    height: int
    width: int
    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_audio_latents: int


def snap_frames(frames: int, geo: H3Geometry) -> int:
    """Round a frame count up to the next 17n+5 and check the 5-15 s window MiniMax-H3 was trained on."""
    if frames < 1:
        raise ValueError(f"frames must be positive, got {frames}.")
    aligned = align_num_frames(int(frames), geo.frames_per_chunk, geo.latents_per_chunk)
    seconds = aligned / FPS
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        lo = align_num_frames(int(MIN_SECONDS * FPS), geo.frames_per_chunk, geo.latents_per_chunk)
        hi = int(MAX_SECONDS * FPS)
        while hi % geo.frames_per_chunk != geo.latents_per_chunk:
            hi -= 1
        raise ValueError(
            f"frames={frames} snaps to {aligned} ({geo.frames_per_chunk}n+{geo.latents_per_chunk}), i.e. "
            f"{seconds:.2f} s at {FPS} fps; MiniMax-H3 generates {MIN_SECONDS:g}-{MAX_SECONDS:g} s. "
            f"Use between {lo} and {hi} frames."
        )
    if aligned != frames:
        log.info(
            "omnivideo h3: frames %d snapped up to %d (%dn+%d)",
            frames,
            aligned,
            geo.frames_per_chunk,
            geo.latents_per_chunk,
        )
    return aligned


def check_canvas(width: int, height: int, geo: H3Geometry) -> None:
    m = geo.canvas_multiple
    bad = [(name, v) for name, v in (("width", width), ("height", height)) if v < m or v % m]
    if bad:
        hints = ", ".join(f"{name} {v} -> {max(m, v // m * m)} or {max(m, -(-v // m) * m)}" for name, v in bad)
        raise ValueError(f"MiniMax-H3 needs width and height that are multiples of {m}: {hints}.")


def resolve_shape(frames: int, width: int, height: int, geo: H3Geometry) -> H3Shape:
    check_canvas(width, height, geo)
    num_frames = snap_frames(frames, geo)
    return H3Shape(
        num_frames=num_frames,
        height=height,
        width=width,
        num_latent_frames=video_latent_num_frames(num_frames, geo.frames_per_chunk, geo.latents_per_chunk),
        latent_height=height // geo.spatial_ratio,
        latent_width=width // geo.spatial_ratio,
        num_audio_latents=audio_latent_num_frames(num_frames, FPS),
    )
