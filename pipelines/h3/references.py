"""ref2va references: checked, put on MiniMax-H3's rates and sizes, and encoded into the rows the sampler packs.

The references are diffusers' own dataclasses (`MiniMaxH3ImageReference`, `MiniMaxH3VideoReference` with its
soundtrack, `MiniMaxH3AudioReference`), in the order the model reads them. The limits and the rules are those of
diffusers' `MiniMaxH3Ref2VASetupStep` (at most 9 images, 3 videos, 3 audio, 12 in all; audio never alone), checked
before any work. Normalising reuses its static helpers (a video onto 24 fps and a canvas, a soundtrack onto the
audio VAE's rate, truncated to the generated duration); encoding follows `MiniMaxH3Ref2VAReferenceEncoderStep`
(`encode_vae_condition` for images and videos, the audio VAE's posterior mean for soundtracks). Noise is added later
by the sampler, from the request's seed, in packed order.

Two choices are ours, both equal to diffusers at the released geometry:
- a video reference is put on the canvas rule of the generated video (its short edge, its pixel budget), which at
  1344x768 is diffusers' 768 / 768x1344;
- an image reference's size (`ref_image_size`): "diffusers" = diffusers' 2048-pixel short edge, scaled up or down;
  "max" = core ComfyUI's: the same edge, only ever scaled down; "match" = core's: scaled down (never up) to the
  generated video's pixel area.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition
from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3Reference,
    MiniMaxH3VideoReference,
)
from PIL import Image

from ...models.h3.geometry import FPS, H3Geometry
from .keyframes import ENCODE_SEED, PIXEL_MEAN, PIXEL_STD
from .layout import ReferenceBlocks, ReferenceSlot

__all__ = [
    "EncodedReferences",
    "IMAGE_SIZES",
    "LIMITS",
    "MiniMaxH3AudioReference",
    "MiniMaxH3ImageReference",
    "MiniMaxH3VideoReference",
    "check_counts",
    "check_references",
    "encode_references",
    "normalize_references",
]

_SETUP = MiniMaxH3Ref2VASetupStep()  # its limits (constructor defaults) and its static normalisers
LIMITS = {"image": _SETUP.max_images, "video": _SETUP.max_videos, "audio": _SETUP.max_audios}
MAX_REFERENCES = _SETUP.max_references
REFERENCE_IMAGE_SHORT_EDGE = 2048  # MiniMaxH3Ref2VASetupStep's reference_image_short_edge (released checkpoint)
IMAGE_SIZES = ("diffusers", "max", "match")
MAX_ASPECT = 4  # an image reference lies within 1:4 .. 4:1 (diffusers' check)


@dataclass
class EncodedReferences:
    """What OmniVideo H3 References hands on: the normalised media (the text encoder's vision blocks) and their
    latents (the sampler's rows), for one canvas and frame count."""

    references: list[MiniMaxH3Reference]  # normalised, packed order
    latents: list[torch.Tensor]  # per image / video reference: normalised (1, C, T, h, w), CPU fp32
    audio_rows: list[torch.Tensor]  # per soundtrack / audio reference: normalised channel-major rows, CPU fp32
    width: int
    height: int
    frames: int

    def blocks(self) -> ReferenceBlocks:
        return ReferenceBlocks(slots_of(self.references), tuple(self.latents), tuple(self.audio_rows))


def slots_of(references: list[MiniMaxH3Reference]) -> tuple[ReferenceSlot, ...]:
    return tuple(ReferenceSlot(r.kind, bool(r.has_audio)) for r in references)


def check_counts(references: list) -> None:
    """The per-kind and total limits alone (what a chain of references may hold at any point)."""
    kinds = [r.kind for r in references]
    for kind, limit in LIMITS.items():
        if kinds.count(kind) > limit:
            raise ValueError(f"MiniMax-H3 accepts at most {limit} {kind} references, got {kinds.count(kind)}.")
    if len(kinds) > MAX_REFERENCES:
        raise ValueError(f"MiniMax-H3 accepts at most {MAX_REFERENCES} references in total, got {len(kinds)}.")


def check_references(references: list) -> None:
    """diffusers' rules (MiniMaxH3Ref2VASetupStep), with what to do; cheap, so every node calls it first."""
    if not references:
        raise ValueError("ref2va needs at least one reference; for text only use OmniVideo H3 Text Encode alone.")
    check_counts(references)
    if {r.kind for r in references} == {"audio"}:
        raise ValueError(
            "An audio reference has to be paired with at least one image or video reference; chain an "
            "OmniVideo H3 Reference Image or Reference Video with it."
        )


def image_reference_size(
    width: int, height: int, mode: str, multiple: int, canvas_pixels: int, short_edge: int = REFERENCE_IMAGE_SHORT_EDGE
) -> tuple[int, int]:
    """(width, height) an image reference is encoded at (see the module note for the three modes)."""
    if width > MAX_ASPECT * height or height > MAX_ASPECT * width:
        raise ValueError(f"A reference image must be within 1:4 and 4:1, got {width}x{height}.")
    if mode == "diffusers":
        scale = short_edge / min(width, height)
    elif mode == "max":
        scale = min(1.0, short_edge / min(width, height))
    elif mode == "match":
        scale = min(1.0, math.sqrt(canvas_pixels / (width * height)))
    else:
        raise ValueError(f"ref_image_size {mode!r}: choose one of {', '.join(IMAGE_SIZES)}.")
    return (
        max(multiple, round(width * scale / multiple) * multiple),
        max(multiple, round(height * scale / multiple) * multiple),
    )


def normalize_references(
    references: list,
    *,
    width: int,
    height: int,
    frames: int,
    geo: H3Geometry,
    ref_image_size: str = "diffusers",
    image_short_edge: int = REFERENCE_IMAGE_SHORT_EDGE,
) -> list[MiniMaxH3Reference]:
    """The references on H3's rates and sizes for a `width` x `height`, `frames` (17n+5) request."""
    check_references(references)
    seconds = frames / FPS
    out: list[MiniMaxH3Reference] = []
    for ref in references:
        audio = None
        if ref.has_audio:
            rate = ref.sample_rate or geo.audio_sample_rate
            audio = _SETUP._normalize_audio_condition(ref.audio, rate, geo.audio_sample_rate, max_duration=seconds)
        if ref.kind == "image":
            image = ref.image  # PIL (the Reference Image node makes one)
            w, h = image.size
            size = image_reference_size(w, h, ref_image_size, geo.canvas_multiple, width * height, image_short_edge)
            out.append(
                MiniMaxH3ImageReference(image if image.size == size else image.resize(size, Image.Resampling.LANCZOS))
            )
        elif ref.kind == "video":
            video = _SETUP._normalize_video_condition(
                ref.frames, float(ref.fps), frames, geo.canvas_multiple, min(width, height), width * height, float(FPS)
            )
            least = geo.frames_per_chunk + geo.latents_per_chunk
            if video.shape[0] < least:
                raise ValueError(
                    f"A reference video needs at least {least} frames at {FPS} fps (the video VAE encodes 17n+5), "
                    f"got {video.shape[0]} after resampling from {ref.fps:g} fps."
                )
            rate = None if audio is None else geo.audio_sample_rate
            out.append(MiniMaxH3VideoReference(video, fps=float(FPS), audio=audio, sample_rate=rate))
        else:
            out.append(MiniMaxH3AudioReference(audio, sample_rate=geo.audio_sample_rate))
    return out


@torch.no_grad()
def encode_references(
    vae, audio_vae, normalized: list[MiniMaxH3Reference], geo: H3Geometry, vae_device, audio_device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(video latents per image / video reference, audio rows per soundtrack / audio reference), as diffusers'
    MiniMaxH3Ref2VAReferenceEncoderStep makes them."""
    mean = torch.tensor(audio_vae.config.latents_mean).view(1, 1, -1)
    std = torch.tensor(audio_vae.config.latents_std).view(1, 1, -1)
    latents, audio_rows = [], []
    for ref in normalized:
        if ref.kind == "image":
            pixels = torch.from_numpy(np.array(ref.image)).to(vae_device).permute(2, 0, 1)[None, :, None]
        elif ref.kind == "video":
            # snapped down to 17n+5, so the VAE encodes without padding
            n = ref.frames.shape[0]
            n = max(1, (n - geo.latents_per_chunk) // geo.frames_per_chunk) * geo.frames_per_chunk
            n += geo.latents_per_chunk
            pixels = torch.from_numpy(ref.frames[:n].copy()).to(vae_device).permute(3, 0, 1, 2)[None]
        if ref.kind in ("image", "video"):
            latents.append(encode_vae_condition(vae, pixels, PIXEL_MEAN, PIXEL_STD, ENCODE_SEED))
        if ref.has_audio:
            posterior = audio_vae.encode(ref.audio.to(audio_device)[:, None], return_dict=False)[0]
            # the stereo channels are the mono audio VAE's batch; a soundtrack takes the posterior mean
            rows = (posterior.mode().float().cpu().transpose(1, 2) - mean) / std
            audio_rows.append(rows.reshape(-1, geo.audio_latent_channels))
    return latents, audio_rows
