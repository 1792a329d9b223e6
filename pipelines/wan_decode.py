"""Decode Wan 2.1 / 2.2 latents with the fused decoder, frame by frame.

`decode_latent` reproduces diffusers' `AutoencoderKLWan._decode` (non-tiled) value for
value, with three differences that change no bit: the decoder modules may carry fused
fast paths, each latent frame's output is written into one preallocated buffer instead
of a growing `torch.cat`, and the final clamp runs in place.
"""

from __future__ import annotations

import contextlib

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan, unpatchify

from .. import compat
from ..backends import PLATFORM, resolve
from ..kernels import registrations as _registrations  # noqa: F401  (the fusion levels resolve() picks from)
from ..models.wan_vae.convert import diffusers_vae_from_comfy, wan_version
from ..models.wan_vae.fused import install_fused_decoder

# node choice -> registry implementation name
FUSION_CHOICES = {"auto": "auto", "triton": "triton", "torch": "torch_fused", "off": "reference"}


def select_fusion(vae: AutoencoderKLWan, fusion: str = "auto") -> str:
    """Install the fused decoder the registry resolves for `fusion`; returns the implementation used."""
    if fusion not in FUSION_CHOICES:
        raise ValueError(f"fusion must be one of {', '.join(FUSION_CHOICES)}, got {fusion!r}")
    chosen = resolve("wan_vae", FUSION_CHOICES[fusion])
    if chosen.requested != "auto" and chosen.name != chosen.requested:
        compat.log.warning("OmniVideo Wan VAE Decode: %s", chosen.reason)
    install_fused_decoder(vae, chosen.name, None if chosen.name == "reference" else chosen.load())
    return chosen.name


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


def _temporal_upscale(vae: AutoencoderKLWan) -> int:
    return 2 ** sum(bool(t) for t in vae.temperal_upsample)


@torch.no_grad()
def decode_latent(vae: AutoencoderKLWan, z: torch.Tensor, progress: compat.ProgressBar | None = None) -> torch.Tensor:
    """[B, z_dim, T, h, w] raw latent -> [B, C, 1 + s*(T-1), H, W] video in [-1, 1]."""
    num_frames = z.shape[2]
    vae.clear_cache()
    try:
        x = vae.post_quant_conv(z)
        out = None
        step = _temporal_upscale(vae)
        for i in range(num_frames):
            vae._conv_idx = [0]
            with cancel_points(vae.decoder):
                frame = vae.decoder(
                    x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0
                )
            if num_frames == 1:
                out = frame
            elif out is None:
                # Same shape, dtype and memory format torch.cat would produce, allocated once.
                shape = (*frame.shape[:2], frame.shape[2] + step * (num_frames - 1), *frame.shape[3:])
                fmt = (
                    torch.channels_last_3d
                    if not frame.is_contiguous() and frame.is_contiguous(memory_format=torch.channels_last_3d)
                    else torch.contiguous_format
                )
                out = torch.empty(shape, dtype=frame.dtype, device=frame.device, memory_format=fmt)
                out[:, :, : frame.shape[2]] = frame
                filled = frame.shape[2]
            else:
                if frame.shape[2] != step:
                    raise RuntimeError(
                        f"decoder returned {frame.shape[2]} frames for latent frame {i}, expected {step}"
                    )
                out[:, :, filled : filled + step] = frame
                filled += step
            del frame
            if progress is not None:
                progress.update(1)
    finally:
        vae.clear_cache()  # drops the per-conv feature cache even when interrupted
    assert out is not None  # num_frames >= 1 (check_latent_tensor)
    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    return out.clamp_(min=-1.0, max=1.0)


def check_latent_tensor(z: torch.Tensor) -> None:
    """What any Wan decode needs of the latent itself (checked before the VAE is even converted)."""
    if not isinstance(z, torch.Tensor) or z.dim() != 5:
        shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(
            f"OmniVideo Wan VAE Decode needs a video latent [B, C, T, H, W]; got {shape}. "
            "Connect the LATENT of a Wan video sampler (image latents are 4-D)."
        )
    if min(z.shape[2:]) < 1 or not z.is_floating_point():
        raise ValueError(f"The latent {tuple(z.shape)} ({z.dtype}) is empty or not floating point.")
    if not torch.isfinite(z).all():
        raise ValueError("The latent contains NaN or Inf values; the sampler that produced it diverged.")


def check_latent_channels(vae: AutoencoderKLWan, z: torch.Tensor) -> None:
    expected, version = vae.config.z_dim, wan_version(vae)
    if z.shape[1] != expected:
        other = {16: "Wan 2.1 (wan_2.1_vae.safetensors)", 48: "Wan 2.2 TI2V-5B (wan2.2_vae.safetensors)"}
        hint = f" It looks like a {other[z.shape[1]]} latent; load that VAE." if z.shape[1] in other else ""
        raise ValueError(
            f"The latent has {z.shape[1]} channels but this Wan {version} VAE decodes {expected}-channel latents."
            + hint
        )


def validate_latent(vae: AutoencoderKLWan, z: torch.Tensor) -> None:
    """Reject what the decoder cannot take, before any heavy work."""
    check_latent_tensor(z)
    check_latent_channels(vae, z)


def decode(comfy_vae, z: torch.Tensor, fusion: str = "auto") -> torch.Tensor:
    """ComfyUI's VAE + raw Wan latent -> video [B, 3, frames, H, W] float32 in [-1, 1] on ComfyUI's intermediate
    device."""
    device, offload = PLATFORM.device, torch.device("cpu")
    # The converted copy is cached on the VAE object in CPU memory, outside ComfyUI's model
    # management; it visits the device only while decoding.
    check_latent_tensor(z)
    vae = diffusers_vae_from_comfy(comfy_vae, device=offload)
    check_latent_channels(vae, z)
    select_fusion(vae, fusion)
    try:
        vae.to(device)
        video = decode_latent(vae, z.to(device=device, dtype=vae.dtype), compat.ProgressBar(z.shape[2]))
        return video.to(device=compat.intermediate_device(offload), dtype=torch.float32)
    finally:
        vae.to(offload)
        compat.free_memory()
