"""Tiny random-weight MiniMax-H3 parts for the H3 tests: the configs and builders are the pack's
(omnivideo/selftest/tiny/h3.py, re-exported here); the test-only helpers (original single-file keys, keyframe
images, synthetic prompt embeddings, diffusers' reference pipeline) live here."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import MiniMaxH3Scheduler
from PIL import Image

from omnivideo.selftest.tiny.h3 import (  # noqa: F401
    AUDIO_VAE,
    FRAMES,
    HEIGHT,
    TEXT_DIM,
    TRANSFORMER,
    VAE,
    WIDTH,
    make_models,
    to_original_keys,
    write_folder,
)


def keyframe_images():
    rng = np.random.default_rng(0)
    first = Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8))  # stretched onto 96x64
    last = Image.fromarray(rng.integers(0, 255, (100, 100, 3), dtype=np.uint8))  # cover-cropped
    return first, last


def text_inputs(n_text: int = 9, n_vision_blocks: int = 0, seed: int = 1):
    """Synthetic prompt embeddings and row tags ([label | vision block] per keyframe, then prompt)."""
    g = torch.Generator().manual_seed(seed)
    tags = []
    for _ in range(n_vision_blocks):
        tags += [1, 1, 1] + [0] * 5
    tags += [1] * n_text
    return torch.randn(1, len(tags), TEXT_DIM, generator=g), torch.tensor(tags, dtype=torch.long)


def reference_pipeline(transformer, vae, audio_vae):
    """diffusers' modular minimax_h3 pipeline minus its text encoder (embeddings are fed in)."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    blocks = MiniMaxH3Blocks()
    blocks.sub_blocks.pop("text_encoder")
    pipe = blocks.init_pipeline()
    pipe.update_components(
        transformer=transformer,
        vae=vae,
        audio_vae=audio_vae,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    return pipe


# ref2va at the tiny size: diffusers' pipeline configured to the canvas rule our sampler derives from the request
# (short edge and pixel budget of WIDTH x HEIGHT) and a small image-reference edge (2048 would be slow on the CPU).
REF_IMAGE_EDGE = 64


def reference_ref2va_pipeline(transformer_ref, vae, audio_vae):
    """diffusers' modular pipeline for ref2va (its `transformer_ref`), minus its text encoder, at the tiny canvas."""
    pipe = reference_pipeline(transformer_ref, vae, audio_vae)
    pipe.update_components(transformer_ref=transformer_ref)
    pipe.register_to_config(
        reference_image_short_edge=REF_IMAGE_EDGE,
        canvas_short_edge=min(WIDTH, HEIGHT),
        canvas_max_pixels=WIDTH * HEIGHT,
    )
    return pipe


def reference_media(seed: int = 0):
    """(image, video frames [T, H, W, 3] uint8 at 24 fps, its soundtrack [2, n], an audio clip [1, n]) at the
    audio VAE's 32 kHz."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8))
    frames = rng.integers(0, 255, (30, 48, 80, 3), dtype=np.uint8)
    g = torch.Generator().manual_seed(seed)
    soundtrack = torch.randn(2, 32000, generator=g) * 0.1
    clip = torch.randn(1, 16000, generator=g) * 0.1
    return image, frames, soundtrack, clip
