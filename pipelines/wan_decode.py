"""Decode Wan 2.1 / 2.2 latents through core's own VAE decode, with our decode loop and fast forwards on it meanwhile.

`decode` calls `comfy.sd.VAE.decode` itself (ComfyUI's model management loads the VAE, picks its dtype,
batches and post-processes), so the pixels are core VAE Decode's bit for bit; only while that call runs
does ComfyUI's WanVAE carry the pack's decode loop (models/wan_vae/fused: a preallocated output buffer, progress
counted in latent frames) and, unless `fusion` is off, its decoder modules the fused forwards
(models/wan_vae/fast_forwards; no second copy of the weights), with frequent cancel points.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .. import compat
from ..backends import implementations, resolve
from ..backends.log_once import log_once
from ..kernels import registrations
from ..models.wan_vae.core_vae import unknown_shapes, wan_version
from ..models.wan_vae.fused import fused_decode

FUSIONS = ("auto", *implementations(registrations.OP))  # the node's choices: the registry's names (and auto)
LATENT_CHANNELS = {"2.1": "Wan 2.1 (wan_2.1_vae.safetensors)", "2.2": "Wan 2.2 TI2V-5B (wan2.2_vae.safetensors)"}


def select_fusion(fusion: str = "auto"):
    """(implementation name, its ops module or None for 'off') the registry resolves for a node choice."""
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, got {fusion!r}")
    chosen = resolve(registrations.OP, fusion)
    if chosen.requested != "auto" and chosen.name != chosen.requested:
        compat.log.warning("OmniVideo Wan VAE Decode: %s", chosen.reason)
    return chosen.name, (None if chosen.name == "off" else chosen.load())


@contextlib.contextmanager
def cancel_points(module: torch.nn.Module):
    """A cancel check before every sub-module call of `module`, so an interrupt lands within one convolution
    (seconds at 832x480 on a CPU) instead of one latent frame (about a minute). The check reads a flag."""
    handles = [m.register_forward_pre_hook(lambda *_: compat.check_interrupt()) for m in module.modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def check_latent_tensor(z: torch.Tensor) -> None:
    """What any Wan decode needs of the latent itself (checked before any heavy work)."""
    if not isinstance(z, torch.Tensor) or z.dim() not in (4, 5):
        shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(
            f"OmniVideo Wan VAE Decode needs a video latent [B, C, T, H, W] (or the 4-D latent of an image VAE built "
            f"on Wan's classes); got {shape}. Connect the LATENT of a Wan video sampler."
        )
    if min(z.shape) < 1 or not z.is_floating_point():
        raise ValueError(f"The latent {tuple(z.shape)} ({z.dtype}) is empty or not floating point.")
    if not torch.isfinite(z).all():
        raise ValueError("The latent contains NaN or Inf values; the sampler that produced it diverged.")


def wan_model(comfy_vae) -> tuple[torch.nn.Module, str]:
    """(ComfyUI's WanVAE module inside a core VAE object, '2.1' | '2.2'), or a clear error for any other VAE."""
    model = getattr(comfy_vae, "first_stage_model", None)
    version = wan_version(model)
    if version is None:
        kind = type(model).__name__ if model is not None else type(comfy_vae).__name__
        raise ValueError(
            f"OmniVideo Wan VAE Decode needs a Wan 2.1 or 2.2 VAE (wan_2.1_vae / wan2.2_vae.safetensors in Load VAE); "
            f"this VAE is a {kind}. Use core VAE Decode for other VAEs."
        )
    assert isinstance(model, torch.nn.Module)
    return model, version


def check_latent_channels(model: torch.nn.Module, version: str, z: torch.Tensor) -> None:
    expected = model.z_dim
    if z.shape[1] != expected:
        other = {16: LATENT_CHANNELS["2.1"], 48: LATENT_CHANNELS["2.2"]}
        hint = f" It looks like a {other[z.shape[1]]} latent; load that VAE." if z.shape[1] in other else ""
        raise ValueError(
            f"The latent has {z.shape[1]} channels but this Wan {version} VAE decodes {expected}-channel latents."
            + hint
        )


def validate_latent(comfy_vae, z: torch.Tensor) -> torch.nn.Module:
    """Reject what the decoder cannot take, before any heavy work; returns the WanVAE module."""
    check_latent_tensor(z)
    model, version = wan_model(comfy_vae)
    check_latent_channels(model, version, z)
    return model


def decode(comfy_vae, z: torch.Tensor, fusion: str = "auto") -> torch.Tensor:
    """Core VAE + raw Wan latent [B, C, T, h, w] -> IMAGE [B * frames, H, W, 3], exactly as core VAE Decode
    returns it (core's `vae.decode` plus VAEDecode's 5-D reshape)."""
    model = validate_latent(comfy_vae, z)
    problem = unknown_shapes(model, z.dim())
    if problem is not None:  # a VAE newer core builds on Wan's classes (Qwen-Image 2.1, ...): core's own decode
        log_once(
            ("wan decode: core's", problem),
            logging.INFO,
            "OmniVideo Wan VAE Decode: core's decode runs unchanged, without fast paths: this VAE has %s",
            problem,
        )
        images = comfy_vae.decode(z)
    else:
        name, ops = select_fusion(fusion)
        bar = compat.ProgressBar(z.shape[0] * z.shape[2])
        # no_grad: ComfyUI's executor runs nodes in inference mode; a direct call gets the fast paths too
        with torch.no_grad(), fused_decode(model, name, ops, on_frame=bar.update, check=compat.check_interrupt):
            with cancel_points(model.get_submodule("decoder")):
                images = comfy_vae.decode(z)
    if images.dim() == 5:  # core VAEDecode: combine batches
        images = images.reshape(-1, images.shape[-3], images.shape[-2], images.shape[-1])
    return images
