"""fl2va keyframes: put the first/last image on the canvas and encode each as one frame.

Resizing follows diffusers' `MiniMaxH3ResizeStep` (first image stretched with LANCZOS,
a following last image cover-cropped with the released model's rounding); encoding is
diffusers' `encode_vae_condition` (ImageNet-normalised pixels, posterior sampled with
seed 42, rounded through fp16, normalised). Noise is added later by the sampler, from
the request's seed.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition
from PIL import Image

PIXEL_MEAN = (0.485, 0.456, 0.406)  # MiniMaxH3ModularPipeline.pixel_mean / pixel_std
PIXEL_STD = (0.229, 0.224, 0.225)
ENCODE_SEED = 42  # MiniMaxH3ModularPipeline.keyframe_encode_seed


def image_to_pil(image: torch.Tensor) -> Image.Image:
    """One ComfyUI IMAGE frame [H, W, 3] float 0..1 (or a batch: its first frame) -> PIL RGB."""
    if image.ndim == 4:
        image = image[0]
    if image.ndim != 3 or image.shape[-1] < 3:
        raise ValueError(f"expected an IMAGE of shape [B, H, W, 3], got {list(image.shape)}.")
    arr = (image[..., :3].float().clamp(0, 1) * 255.0).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(arr)


def place_on_canvas(images: list[Image.Image], width: int, height: int) -> list[Image.Image]:
    """Index 0 is stretched; later ones cover-cropped (diffusers MiniMaxH3ResizeStep arithmetic)."""
    out = []
    for index, img in enumerate(images):
        if img.size == (width, height):
            out.append(img)
        elif index == 0:
            out.append(img.resize((width, height), Image.Resampling.LANCZOS))
        else:
            scale = max(width / img.size[0], height / img.size[1])
            size = (max(width, round(img.size[0] * scale)), max(height, round(img.size[1] * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            out.append(img.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return out


def encode_keyframes(
    vae, first: Image.Image | None, last: Image.Image | None, width: int, height: int, device: torch.device
) -> dict:
    """-> {"latents": [CPU fp32 (1, C, 1, h, w)], "anchors": ("first"/"last", ...), "images": [PIL], width, height}."""
    pairs = [(a, im) for a, im in (("first", first), ("last", last)) if im is not None]
    if not pairs:
        raise ValueError("OmniVideo H3 Keyframes needs a first_image, a last_image or both.")
    placed = place_on_canvas([im.convert("RGB") for _, im in pairs], width, height)
    latents = []
    with torch.no_grad():
        for img in placed:
            pixels = torch.from_numpy(np.array(img)).to(device).permute(2, 0, 1)[None, :, None]
            latents.append(encode_vae_condition(vae, pixels, PIXEL_MEAN, PIXEL_STD, ENCODE_SEED))
    return {
        "latents": latents,
        "anchors": tuple(a for a, _ in pairs),
        "images": placed,
        "width": width,
        "height": height,
    }
