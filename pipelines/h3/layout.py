"""The packed sequence `[text | keyframe or reference rows | audio | video]` and its per-step timestep plan.

Positions, tags and row indices come from diffusers' own public builders
(`MiniMaxH3PrepareLayoutStep.build_packed_sequence`, for ref2va
`MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence`,
`MiniMaxH3SetTimestepsStep.build_row_timesteps`), so the layout is the reference's by
construction. What is ours: its segment table `(start, stop, kind)` in core's vocabulary (`PackedLayout.segments`,
comfy/ldm/minimax/model.py), the counts and attention rows read from it, and the optional `[real | pad]` padding for
packed varlen backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
)

from ...attention.rows import AttnRows
from ...models.h3.geometry import AUDIO_CHANNELS, H3Geometry, H3Shape

KEYFRAME_T = 0.999  # MiniMaxH3ModularPipeline.keyframe_noise_aug: anchors are held just short of clean
REFERENCE_AUDIO_T = 1.0  # a reference soundtrack rides along clean (MiniMaxH3SetTimestepsStep)
PAD_MULTIPLE = 128  # packed varlen backends see S rounded up to this (the [real | pad] contract)

__all__ = [
    "H3Layout",
    "ReferenceBlocks",
    "ReferenceSlot",
    "build_layout",
    "patchify_video_latents",
    "unpatchify_video",
    "unpack_audio",
    "KEYFRAME_T",
]


class ReferenceSlot(NamedTuple):
    """One ref2va reference as the layout reads it (diffusers' builder reads `kind` and `has_audio` only)."""

    kind: str  # image | video | audio
    has_audio: bool


class ReferenceBlocks(NamedTuple):
    """The ref2va reference blocks: their slots in packed order, the video latents of the image / video references
    and the audio rows of the soundtracks / audio references (their shapes are the blocks' geometry)."""

    slots: tuple[ReferenceSlot, ...]
    latents: tuple[torch.Tensor, ...]
    audio_rows: tuple[torch.Tensor, ...]


@dataclass
class H3Layout:
    """One request's packed sequence: its segments in row order, the target video's patch grid and the row tensors
    diffusers' transformer reads. Segment kinds are core's: text, cond / cond_audio (fl2va keyframe rows), ref_img /
    ref_audio (ref2va reference rows), audio and video (the generated streams, always the last two before the
    padding), and ours, pad (the `[real | pad]` suffix)."""

    shape: H3Shape
    segments: tuple[tuple[int, int, str], ...]  # (start, stop, kind), contiguous from row 0
    grid: tuple[int, int, int]  # target video patch grid (t, h, w)
    position_ids: torch.Tensor  # [S_total, 3]
    token_tags: torch.Tensor  # [S_total]
    video_indices: torch.Tensor  # keyframe / reference rows first, then the target video
    audio_indices: torch.Tensor  # reference soundtrack rows first, then the target audio
    text_indices: torch.Tensor

    def rows_of(self, *kinds: str) -> int:
        """How many rows the segments of these kinds hold."""
        return sum(stop - start for start, stop, kind in self.segments if kind in kinds)

    @property
    def num_text(self) -> int:
        return self.rows_of("text")

    @property
    def num_condition_video_rows(self) -> int:
        return self.rows_of("cond", "ref_img")

    @property
    def num_condition_audio_rows(self) -> int:
        return self.rows_of("cond_audio", "ref_audio")

    @property
    def video_start(self) -> int:
        """First row of the target video = the dense prefix for sparse attention."""
        return next(start for start, _, kind in self.segments if kind == "video")

    @property
    def real_len(self) -> int:
        """Rows holding data."""
        return self.total_len - self.rows_of("pad")

    @property
    def total_len(self) -> int:
        """Rows including the padding suffix (== real_len when unpadded)."""
        return self.segments[-1][1]

    def attn_rows(self) -> AttnRows:
        """What the rows of a block's self-attention are: `[prefix | video grid]`, `[real | pad]` when padded."""
        return AttnRows(
            prefix_len=self.video_start,
            grid=self.grid,
            kv_lengths=(self.real_len,) if self.total_len > self.real_len else None,
        )

    def forward_kwargs(self) -> dict:
        return {
            "position_ids": self.position_ids,
            "token_tags": self.token_tags,
            "video_indices": self.video_indices,
            "audio_indices": self.audio_indices,
            "text_indices": self.text_indices,
        }

    def row_timesteps(self, video_t: float, audio_t: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct timesteps, per-row index) for one step; keyframe / reference rows sit at max(t, 0.999), reference
        audio rows at 1 (clean)."""
        unique, index = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            self.video_indices.cpu(),
            self.audio_indices.cpu(),
            self.num_condition_video_rows,
            self.num_condition_audio_rows,
            self.num_text,
            float(video_t),
            float(audio_t),
            max(float(video_t), KEYFRAME_T),
            REFERENCE_AUDIO_T,
        )
        if self.total_len > self.real_len:  # padding rows reuse entry 0; their outputs are never read
            index = torch.cat([index, index.new_zeros(self.total_len - self.real_len)])
        return unique, index

    def to(self, device) -> H3Layout:
        for name in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def build_layout(
    text_token_tags: torch.Tensor,
    shape: H3Shape,
    geo: H3Geometry,
    keyframe_anchors: tuple[str, ...] = (),
    pad_to: int | None = None,
    references: ReferenceBlocks | None = None,
) -> H3Layout:
    """`keyframe_anchors` (fl2va) or `references` (ref2va) or neither (t2va)."""
    target = (shape.num_latent_frames, shape.latent_height, shape.latent_width, shape.num_audio_latents)
    tags = (tuple(geo.patch_size), AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG)
    if references is None:
        packed = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            text_token_tags.cpu(), *target, *tags, tuple(keyframe_anchors)
        )
    else:
        packed = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
            text_token_tags.cpu(), list(references.slots), references.latents, references.audio_rows, *target, *tags
        )
    position_ids, token_tags, video_idx, audio_idx, text_idx, n_cond, n_cond_audio = packed
    _, ph, pw = geo.patch_size
    real_len = int(position_ids.shape[0])
    grid = (shape.num_latent_frames // geo.patch_size[0], shape.latent_height // ph, shape.latent_width // pw)
    cond = ("cond", "cond_audio") if references is None else ("ref_img", "ref_audio")
    runs = [
        *_runs(text_idx, "text"),
        *_runs(video_idx[:n_cond], cond[0]),
        *_runs(video_idx[n_cond:], "video"),
        *_runs(audio_idx[:n_cond_audio], cond[1]),
        *_runs(audio_idx[n_cond_audio:], "audio"),
    ]
    segments = sorted(runs)
    if pad_to:
        total_len = -(-real_len // pad_to) * pad_to
        pad = total_len - real_len
        if pad:  # pad rows: position 0, tagged text; never indexed by any modality
            position_ids = torch.cat([position_ids, position_ids.new_zeros(pad, 3)])
            token_tags = torch.cat([token_tags, token_tags.new_full((pad,), MINIMAX_H3_TEXT_TAG)])
            segments.append((real_len, total_len, "pad"))
    return H3Layout(shape, tuple(segments), grid, position_ids, token_tags, video_idx, audio_idx, text_idx)


def _runs(indices: torch.Tensor, kind: str) -> list[tuple[int, int, str]]:
    """The contiguous runs of ascending row `indices` as segments of `kind`."""
    if indices.numel() == 0:
        return []
    cuts = [0, *((torch.diff(indices) != 1).nonzero().flatten() + 1).tolist(), indices.numel()]
    return [(int(indices[a]), int(indices[b - 1]) + 1, kind) for a, b in zip(cuts, cuts[1:])]


def unpatchify_video(rows: torch.Tensor, shape: H3Shape, geo: H3Geometry) -> torch.Tensor:
    """Target video rows [N, C*pt*ph*pw] -> [1, C, T, H, W] (inverse of `patchify_video_latents`)."""
    pt, ph, pw = geo.patch_size
    c = geo.latent_channels
    x = rows.reshape(
        -1, shape.num_latent_frames // pt, shape.latent_height // ph, shape.latent_width // pw, c, pt, ph, pw
    )
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(-1, c, shape.num_latent_frames, shape.latent_height, shape.latent_width).contiguous()


def unpack_audio(rows: torch.Tensor, shape: H3Shape) -> torch.Tensor:
    """Channel-major audio rows [2*N, C] -> [2, C, N]: the stereo channels become the mono VAE's batch."""
    return rows.reshape(AUDIO_CHANNELS, shape.num_audio_latents, rows.shape[-1]).permute(0, 2, 1).contiguous()
