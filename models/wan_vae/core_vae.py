"""What the pack knows about ComfyUI's own Wan 2.1 / 2.2 VAE (comfy/ldm/wan/vae.py, vae2_2.py), written once.

`models/` never imports ComfyUI, so its classes are recognised by module and class name. ComfyUI rewrote these modules
in 2026 (v0.33: PRs #12036, #13014, #13101); which code the pack follows is read off the installed modules, never off
a version number (`decodes_in_pieces` here; an int `CausalConv3d._padding`: fast_forwards.py).

* Causal convs: each keeps the last CACHE_T frames of its input as the next call's cache, one slot per causal conv
  (`causal_convs`) in the list the decode passes down; a Resample's time_conv slot holds REP before its first frame.
* Frame grouping (`decoder_calls`): `WanVAE.decode` calls the decoder on one latent frame at a time; the 2026 2.1
  decoder takes latent frame 0 alone and then pairs (the last frame alone when the count is even), splits after each
  temporal upsample into 2-frame pieces and returns the list of them. Its encoder takes pixel frame 0 and then pairs,
  and its temporal downsamples hold single frames back until a `final` call (stream.StreamEncoder follows it).
* Pixels: latent frame 0 decodes to one pixel frame, every later one to `pixel_frames_per_latent`; the 2.2 decoder
  returns 2x2 patches (`unpatchify`).
* Chunked output (v0.33): core's `VAE.decode` hands a WanVAE whose `comfy_has_chunked_io` is true an output buffer of
  `decode_output_shape(latent shape)` (`output_shape`), and the decode writes its pixels into it (fused.py).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

COMFY_WAN21, COMFY_WAN22 = "comfy.ldm.wan.vae", "comfy.ldm.wan.vae2_2"
CACHE_T = 2  # comfy/ldm/wan/vae.py CACHE_T: frames each causal conv keeps for the next call
REP = "Rep"  # what ComfyUI's Resample stores in its cache slot before its first real frame


def comfy_class(module: object) -> str | None:
    """The class name of a ComfyUI Wan VAE module ('ResidualBlock', 'WanVAE', ...), else None."""
    cls = type(module)
    return cls.__name__ if cls.__module__ in (COMFY_WAN21, COMFY_WAN22) else None


def wan_version(model: object) -> str | None:
    """'2.1' / '2.2' for ComfyUI's WanVAE (comfy.sd.VAE.first_stage_model), else None."""
    if comfy_class(model) != "WanVAE":
        return None
    return "2.2" if type(model).__module__ == COMFY_WAN22 else "2.1"


def decodes_in_pieces(module: nn.Module) -> bool:
    """Whether `module` is of ComfyUI's 2026 Wan 2.1 code, whose decoder takes frame 0 and then pairs and returns
    2-frame pieces: `run_up` on the decoder, `final` in a block's forward."""
    cls = type(module)
    return hasattr(cls, "run_up") or "final" in inspect.signature(cls.forward).parameters


def unknown_shapes(model: nn.Module, latent_dims: int) -> str | None:
    """Why the pack's decode loop (fused.py) and the stream's (stream.py) do not know this WanVAE and its latent, None
    when they do. Newer ComfyUI builds its Wan classes for other VAEs too (Qwen-Image 2.1: spatial patch 1, temporal
    kernel 1, 4-D latents), so the class name alone is not enough: the loops know video latents [B, C, T, H, W], a
    decoder whose causal convs have Wan's 3 temporal taps (CACHE_T, the frame grouping), and RGB pixels out of 2.1's
    head / 2x2 patches out of 2.2's. Anything else runs core's decode unchanged (pipelines/wan_decode)."""
    if latent_dims != 5:
        return f"a {latent_dims}-D latent (the fast path decodes video latents [B, C, T, H, W])"
    patch = 2 if wan_version(model) == "2.2" else 1
    try:
        decoder: Any = model.get_submodule("decoder")
        taps, out_channels = decoder.conv1.kernel_size[0], decoder.head[-1].out_channels
        model.get_submodule("conv2")
    except (AttributeError, IndexError, TypeError) as exc:
        return f"its modules are not laid out as Wan 2.1 / 2.2's ({type(exc).__name__}: {exc})"
    if getattr(model, "patch_size", patch) != patch:
        return f"spatial patch {model.patch_size} (Wan {wan_version(model)}'s is {patch})"
    if taps != 3:
        return f"temporal kernel {taps} (Wan's causal convs have 3 taps)"
    if out_channels != 3 * patch * patch:
        return f"{out_channels} output channels (Wan {wan_version(model)}'s head gives {3 * patch * patch})"
    return None


def causal_convs(module: nn.Module) -> int:
    """ComfyUI's causal convs inside `module`: the cache slots its decoder's calls use."""
    return sum(1 for m in module.modules() if comfy_class(m) == "CausalConv3d")


def pixel_frames_per_latent(model: Any) -> int:
    """Pixel frames each latent frame after the first decodes to (2 per temporal upsample of the decoder: 4)."""
    return 2 ** sum(bool(u) for u in model.temperal_upsample)


def decoder_calls(frames: int, pieces: bool, first: bool = True, whole: bool = True) -> list[tuple[int, int]]:
    """The latent frames [start, stop) each decoder call takes of `frames` latent frames (after conv2) that begin a
    video (`first`) or continue one: one at a time, or for the 2026 2.1 decoder (`pieces`) frame 0 alone and then
    pairs. A frame left after the last pair is the whole decode's last call (`whole`); a stream holds it back for its
    pair instead (not listed)."""
    if not pieces:
        return [(i, i + 1) for i in range(frames)]
    start = 1 if first else 0
    pairs = [(s, min(s + 2, frames)) for s in range(start, frames if whole else frames - 1, 2)]
    return [(0, 1), *pairs] if first else pairs


def holds_back_one(frames: int, pieces: bool) -> bool:
    """Whether a stream of the video's first `frames` latent frames holds one back (what `decoder_calls` with `whole`
    false leaves out, counted without listing the calls): frame 0 alone, then pairs leave one of an even count."""
    return pieces and frames > 0 and frames % 2 == 0


def output_shape(model: Any, latent_shape) -> tuple[int, ...]:
    """The pixel shape ComfyUI's WanVAE.decode returns for a latent shape (`decode_output_shape` of core's
    chunked-output protocol)."""
    b, _, frames, h, w = latent_shape
    scale = 2 ** (len(model.decoder.dim_mult) - 1) * (2 if type(model).__module__ == COMFY_WAN22 else 1)
    return (b, 3, 1 + pixel_frames_per_latent(model) * (frames - 1), h * scale, w * scale)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """vae2_2.unpatchify: einops 'b (c r q) f h w -> b c f (h q) (w r)' (reshape, permute, reshape)."""
    b, crq, f, h, w = x.shape
    x = x.reshape(b, crq // (p * p), p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, crq // (p * p), f, h * p, w * p)
