"""Fused fast paths installed on a diffusers `AutoencoderKLWan` decoder.

Two data-movement fusions replace diffusers' call sites, bit for bit:

* every cached causal conv: `cache_x = x[:, :, -2:].clone()` + `torch.cat([cache, x])` +
  `F.pad` become one `cat_pad_5d` pass that also returns the next cache;
* the Wan 2.2 residual up block: `x + DupUp3D(x_copy)` becomes `dup_up3d_add`, without
  materialising the repeated shortcut (and without the defensive `x_copy` clone: nothing
  writes into the block input in place);
* RMS norm + SiLU: diffusers' `normalize(x) * scale * gamma + bias` then SiLU allocate four
  full-size temporaries; the same operations in the same order run in place on the one
  normalized tensor (same arithmetic, so the same bits).

The fast paths are per-instance `forward` rebinds (state_dict keys are untouched, the
module classes are unchanged) and installing twice is a no-op. Each call site checks
its guard and, when the fused op cannot run (grad enabled, torch.compile tracing,
unsupported dtype/layout/device), runs diffusers' exact operation order instead.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.autoencoders import autoencoder_kl_wan as dwan

from ...kernels.wan_vae_torch import memory_format_of

CACHE_T = dwan.CACHE_T
FUSIONS = ("reference", "torch_fused", "triton")  # the wan_vae implementations of the registry
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fusable(ops, x: torch.Tensor, *others: torch.Tensor) -> bool:
    """The guard every fused call site checks first: inference, same dtype/device, and one
    memory format (as ATen reads it) across the operands, so outputs keep the reference's."""
    if ops is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if x.dtype not in _DTYPES or not ops.supports(x.device):
        return False
    fmt = memory_format_of(x)
    return all(o.dtype == x.dtype and o.device == x.device and memory_format_of(o) == fmt for o in others)


def _reference_cached_conv(conv, x, cache):
    """diffusers' order for a cached causal conv: returns (output, next cache)."""
    cache_x = x[:, :, -CACHE_T:, :, :].clone()
    if cache_x.shape[2] < 2 and cache is not None:
        cache_x = torch.cat([cache[:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
    return conv(x, cache), cache_x


def _cached_conv(module, conv, x, feat_cache, feat_idx):
    """conv(x, feat_cache[idx]) and store x's last frames as the next cache."""
    idx = feat_idx[0]
    cache = feat_cache[idx]
    ops = module._omnivideo_ops
    if _fusable(ops, x, *([cache] if cache is not None else [])):
        padded, feat_cache[idx] = ops.cat_pad_5d(x, cache, conv._padding, keep_cache_frames=CACHE_T)
        out = nn.Conv3d.forward(conv, padded)  # conv.padding is (0, 0, 0): padding is in `padded`
    else:
        out, feat_cache[idx] = _reference_cached_conv(conv, x, cache)
    feat_idx[0] += 1
    return out


def _rms_norm_silu(module, norm, x):
    """SiLU(WanRMS_norm(x)), the elementwise tail in place on the fresh normalized tensor."""
    if not _fusable(module._omnivideo_ops, x) or not isinstance(module.nonlinearity, nn.SiLU):
        return module.nonlinearity(norm(x))
    upcast = x.dtype in (torch.float16, torch.bfloat16)  # diffusers normalizes these in fp32
    y = F.normalize(x.float() if upcast else x, dim=1 if norm.channel_first else -1).to(x.dtype)
    y.mul_(norm.scale).mul_(norm.gamma).add_(norm.bias)
    return F.silu(y, inplace=True)


def _residual_block_forward(self, x, feat_cache=None, feat_idx=[0]):
    if feat_cache is None:
        return type(self).forward(self, x)
    h = self.conv_shortcut(x)
    x = _rms_norm_silu(self, self.norm1, x)
    x = _cached_conv(self, self.conv1, x, feat_cache, feat_idx)
    x = self.dropout(_rms_norm_silu(self, self.norm2, x))
    x = _cached_conv(self, self.conv2, x, feat_cache, feat_idx)
    return x + h


def _decoder_forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):
    if feat_cache is None:
        return type(self).forward(self, x, first_chunk=first_chunk)
    x = _cached_conv(self, self.conv_in, x, feat_cache, feat_idx)
    x = self.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    for up_block in self.up_blocks:
        x = up_block(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
    x = _rms_norm_silu(self, self.norm_out, x)
    return _cached_conv(self, self.conv_out, x, feat_cache, feat_idx)


def _upsample3d_forward(self, x, feat_cache=None, feat_idx=[0]):
    """WanResample(upsample3d) with its time_conv through `cat_pad_5d`."""
    if feat_cache is None:
        return type(self).forward(self, x)
    b, c, t, h, w = x.shape
    idx = feat_idx[0]
    if feat_cache[idx] is None:  # first chunk: diffusers marks "Rep" and skips time_conv
        feat_cache[idx] = "Rep"
        feat_idx[0] += 1
    else:
        if isinstance(feat_cache[idx], str):
            # After "Rep", diffusers zero-pads two frames and caches [0, x] for a 1-frame x: the
            # same as a one-frame zero cache, which the cached-conv path handles exactly.
            feat_cache[idx] = torch.zeros_like(x[:, :, -1:])
        x = _cached_conv(self, self.time_conv, x, feat_cache, feat_idx)
        x = x.reshape(b, 2, c, t, h, w)
        x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
        x = x.reshape(b, c, t * 2, h, w)
    t = x.shape[2]
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = self.resample(x)
    return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)


def _residual_up_block_forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):
    """WanResidualUpBlock (Wan 2.2) with the DupUp3D shortcut fused into the add."""
    if feat_cache is None:
        return type(self).forward(self, x, first_chunk=first_chunk)
    source = x  # diffusers clones here; the resnets never write into their input
    for resnet in self.resnets:
        x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if self.upsampler is not None:
        x = self.upsampler(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if self.avg_shortcut is None:
        return x
    up = self.avg_shortcut
    if _fusable(self._omnivideo_ops, x, source):
        return self._omnivideo_ops.dup_up3d_add(x, source, up.factor_t, up.factor_s, up.repeats, first_chunk)
    return x + up(source, first_chunk=first_chunk)


_FAST_FORWARDS = {
    dwan.WanDecoder3d: _decoder_forward,
    dwan.WanResidualBlock: _residual_block_forward,
    dwan.WanResidualUpBlock: _residual_up_block_forward,
}


def _fast_forward(module: nn.Module):
    if isinstance(module, dwan.WanResample):
        return _upsample3d_forward if module.mode == "upsample3d" else None
    return _FAST_FORWARDS.get(type(module))


def install_fused_decoder(vae: dwan.AutoencoderKLWan, fusion: str, ops=None) -> None:
    """Route `vae.decoder` through the fused ops of `fusion` ('reference' restores diffusers).

    `ops` is the loaded implementation module (from the backend registry); idempotent.
    """
    if fusion not in FUSIONS:
        raise ValueError(f"unknown fusion {fusion!r}; expected one of {', '.join(FUSIONS)}")
    if fusion != "reference" and ops is None:
        raise ValueError(f"fusion {fusion!r} needs its ops module")
    for module in vae.decoder.modules():
        fast = _fast_forward(module)
        if fast is None:
            continue
        if fusion == "reference":
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_omnivideo_ops", None)
        else:
            module.forward = types.MethodType(fast, module)
            module._omnivideo_ops = ops
    vae._omnivideo_fusion = fusion


def installed_fusion(vae: dwan.AutoencoderKLWan) -> str:
    return getattr(vae, "_omnivideo_fusion", "reference")
