"""The fast forwards the fused decode installs on ComfyUI's own Wan 2.1 / 2.2 VAE modules (fused.py installs and
restores them), one per module class, chosen by `fast_forward`.

Each runs ComfyUI's operations in ComfyUI's order, with bit-preserving changes only:

* every cached causal conv: `cache_x = x[:, :, -2:].clone()` + `torch.cat([cache, x])` + `F.pad`
  become one `cat_pad_5d` pass that also returns the next cache, and the conv input is dropped
  before the conv runs;
* the Wan 2.2 residual up block: `x_main + DupUp3D(x)` becomes `dup_up3d_add` (no repeated shortcut);
* RMS norm + SiLU: `normalize(x) * scale * gamma + bias` then SiLU allocate five full-size tensors;
  the same operations in the same order run in place on the one normalized tensor (on conv1's own
  output inside a residual block, which then needs no allocation at all);
* Resample: each per-frame temporary (the rearranged input, the nearest-upsampled frames) is freed
  as soon as the next one exists instead of living through the 2-D conv;
* the residual add runs in place on the fresh conv output when both operands are contiguous (the
  layout the out-of-place add would give).

Every fused call site checks its guard first (inference, one dtype/device/memory format, a device the
ops support) and otherwise runs ComfyUI's exact operation order. `cat_pad_5d` / `dup_up3d_add` come from
the module's `_omnivideo_ops` (the implementation the registry resolved), `_omnivideo_check()` runs before
each conv the fast paths run themselves.

Which core code a fast path follows is read off the installed modules (core_vae.py):

* `CausalConv3d` with an int `_padding` (2026) pads only time itself (H and W are its Conv3d's own padding) and runs
  a single uncached frame on truncated taps: that call stays ComfyUI's, and `cat_pad_5d` writes only the
  temporal front;
* the 2026 2.1 decoder (`decodes_in_pieces`): its `ResidualBlock` keeps views of the conv inputs as caches and calls
  the convs with `cache_list`. There only the norm + SiLU chains and the residual add are ours; every conv call,
  cache and split is ComfyUI's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels.wan_vae_torch import memory_format_of
from .core_vae import CACHE_T, COMFY_WAN22, REP, comfy_class, decodes_in_pieces

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- fused call sites


def _fusable(ops, x: torch.Tensor, *others: torch.Tensor) -> bool:
    """The guard every fused call site checks first: inference, same dtype/device, and one
    memory format (as ATen reads it) across the operands, so outputs keep the formats ComfyUI's ops give."""
    if ops is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if x.dtype not in _DTYPES or not ops.supports(x.device):
        return False
    fmt = memory_format_of(x)
    return all(o.dtype == x.dtype and o.device == x.device and memory_format_of(o) == fmt for o in others)


def _conv_base(cls: type) -> Any:
    """The class CausalConv3d derives from (comfy.ops' Conv3d), for any subclass of CausalConv3d too."""
    mro = cls.__mro__
    return mro[next(i for i, c in enumerate(mro) if c.__name__ == "CausalConv3d") + 1]


def _conv(conv: nn.Module, padded: torch.Tensor) -> torch.Tensor:
    # CausalConv3d.forward would pad again: run the Conv3d it derives from (comfy.ops' Conv3d, which casts
    # the weights when ComfyUI streams them in low-VRAM mode). Its own padding is (0, 0, 0).
    return _conv_base(type(conv)).forward(conv, padded)


def _single_frame_taps(conv, x, cache) -> bool:
    """ComfyUI's 2026 CausalConv3d runs one uncached frame on the conv's last temporal taps (no zero frames):
    a different conv call from the padded one, so the fused code leaves it to ComfyUI."""
    return isinstance(conv._padding, int) and cache is None and x.shape[2] == 1


def _cat_padding(conv) -> tuple:
    """What `cat_pad_5d` pads for a CausalConv3d, in F.pad order: everything for the 2025 module (its Conv3d
    pads nothing), only the temporal front for the 2026 one (its Conv3d pads H and W itself)."""
    p = conv._padding
    return tuple(p) if not isinstance(p, int) else (0, 0, 0, 0, p, 0)


def _cached_conv(module, conv, take: list, feat_cache, feat_idx):
    """conv(x, feat_cache[idx]) and store x's last CACHE_T frames as the next cache.

    `take` is a one-item list holding x, so x can be freed once it is copied into the padded input."""
    x = take.pop()
    idx = feat_idx[0]
    cache = feat_cache[idx]
    ops = module._omnivideo_ops
    module._omnivideo_check()
    fusable = _fusable(ops, x, *([cache] if cache is not None else []))
    if fusable and not _single_frame_taps(conv, x, cache):
        padded, feat_cache[idx] = ops.cat_pad_5d(x, cache, _cat_padding(conv), keep_cache_frames=CACHE_T)
        del x, cache
        out = _conv(conv, padded)
    else:  # ComfyUI's order
        cache_x = x[:, :, -CACHE_T:].clone()
        if cache_x.shape[2] < 2 and cache is not None:
            cache_x = torch.cat([cache[:, :, -1].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
        feat_cache[idx] = None
        out = conv(x, cache)
        feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return out


def _norm_silu(module, norm, act, x, owned: bool = False):
    """SiLU(RMS_norm(x)): ComfyUI's `normalize(x) * scale * gamma + bias`, then SiLU, in place on the
    fresh normalized tensor (same operations, same order, same bits; one allocation instead of five).
    `owned`: x is a temporary nobody else holds, so even the normalization writes into it (no allocation)."""
    if not _fusable(module._omnivideo_ops, x) or not isinstance(act, nn.SiLU):
        return act(norm(x))
    dim = 1 if norm.channel_first else -1
    y = F.normalize(x, dim=dim, out=x) if owned else F.normalize(x, dim=dim)
    y.mul_(norm.scale).mul_(norm.gamma.to(x))
    y.add_(norm.bias.to(x) if norm.bias is not None else 0)
    return F.silu(y, inplace=True)


def _add(out: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`out + other` for a fresh `out`: in place when the out-of-place add would be contiguous too."""
    same = out.shape == other.shape and out.dtype == other.dtype and out.device == other.device
    if same and out.is_contiguous() and other.is_contiguous() and not torch.is_grad_enabled():
        return out.add_(other)
    return out + other


# ----------------------------------------------------------------------------- fast forwards


def _residual_block_forward(self, x, feat_cache=None, feat_idx=[0]):
    if feat_cache is None:
        return type(self).forward(self, x)
    norm1, act1, conv1, norm2, act2, dropout, conv2 = self.residual
    y = _cached_conv(self, conv1, [_norm_silu(self, norm1, act1, x)], feat_cache, feat_idx)
    # conv1's output is ours alone: normalized in place, and handed over (the list) so it is freed
    # once copied into conv2's padded input, before conv2 runs
    take = [dropout(_norm_silu(self, norm2, act2, y, owned=True))]
    del y
    y = _cached_conv(self, conv2, take, feat_cache, feat_idx)
    return _add(y, self.shortcut(x))


def _core_cached_conv(conv, x, feat_cache, feat_idx):
    """A cached conv call as ComfyUI's 2026 2.1 blocks make it: the cache is a view of the conv's input."""
    idx = feat_idx[0]
    cache_x = x[:, :, -CACHE_T:]
    out = conv(x, cache_list=feat_cache, cache_idx=idx)
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return out


def _residual_block_pieces_forward(self, x, feat_cache=None, feat_idx=[0], final=False):
    """ComfyUI's 2026 2.1 ResidualBlock with its norm + SiLU chains and the residual add in place."""
    if feat_cache is None:
        return type(self).forward(self, x)
    norm1, act1, conv1, norm2, act2, dropout, conv2 = self.residual
    y = _core_cached_conv(conv1, _norm_silu(self, norm1, act1, x), feat_cache, feat_idx)
    # conv1's output is ours alone (its cache is a view of conv1's input): normalized in place
    y = _core_cached_conv(conv2, dropout(_norm_silu(self, norm2, act2, y, owned=True)), feat_cache, feat_idx)
    return _add(y, self.shortcut(x))


def _run_up(self, layer_idx, x_ref, feat_cache, feat_idx, out_chunks):
    """ComfyUI's 2026 2.1 Decoder3d.run_up (the same recursion, splits and cache slots) with the head's
    norm + SiLU in one tensor."""
    if layer_idx < len(self.upsamples) or feat_cache is None:
        return type(self).run_up(self, layer_idx, x_ref, feat_cache, feat_idx, out_chunks)
    x = x_ref[0]
    x_ref[0] = None
    norm, act, conv = self.head
    y = _norm_silu(self, norm, act, x)
    del x
    out_chunks.append(_core_cached_conv(conv, y, feat_cache, feat_idx))


def _decoder_forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):
    wan22 = type(self).__module__ == COMFY_WAN22
    if feat_cache is None:
        return type(self).forward(self, x, first_chunk=first_chunk) if wan22 else type(self).forward(self, x)
    x = _cached_conv(self, self.conv1, [x], feat_cache, feat_idx)
    for layer in self.middle:
        x = layer(x, feat_cache, feat_idx) if comfy_class(layer) == "ResidualBlock" else layer(x)
    for layer in self.upsamples:
        x = layer(x, feat_cache, feat_idx, first_chunk) if wan22 else layer(x, feat_cache, feat_idx)
    norm, act, conv = self.head
    take = [_norm_silu(self, norm, act, x)]
    del x  # freed before the head conv runs
    return _cached_conv(self, conv, take, feat_cache, feat_idx)


def _time_upsample(self, x, feat_cache, feat_idx):
    """Resample('upsample3d')'s temporal half: time_conv through `cat_pad_5d`, frames interleaved."""
    b, c, t, h, w = x.size()
    idx = feat_idx[0]
    if feat_cache[idx] is None:  # first chunk: ComfyUI marks REP and skips time_conv
        feat_cache[idx] = REP
        feat_idx[0] += 1
        return x
    if isinstance(feat_cache[idx], str) and isinstance(self.time_conv._padding, int):
        # After REP the 2026 time_conv runs uncached (one frame: on its last taps); ComfyUI caches [0, x]
        cache_x = x[:, :, -CACHE_T:].clone()
        if cache_x.shape[2] < CACHE_T:
            cache_x = torch.cat([torch.zeros_like(cache_x), cache_x], dim=2)
        x = self.time_conv(x)
        feat_cache[idx] = cache_x
        feat_idx[0] += 1
    else:
        if isinstance(feat_cache[idx], str):
            # After REP, the 2025 ComfyUI pads two zero frames and caches [0, x] for a 1-frame x: the same
            # as a one-frame zero cache, which the cached conv handles exactly.
            feat_cache[idx] = torch.zeros_like(x[:, :, -1:])
        x = _cached_conv(self, self.time_conv, [x], feat_cache, feat_idx)
    x = x.reshape(b, 2, c, t, h, w)
    x = torch.stack((x[:, 0], x[:, 1]), 3)
    return x.reshape(b, c, t * 2, h, w)


def _upsample_forward(self, x, feat_cache=None, feat_idx=[0]):
    """Resample('upsample2d' / 'upsample3d') with each per-frame temporary freed as soon as the next one
    exists (ComfyUI's nn.Sequential call keeps its input alive through the 2-D conv)."""
    if feat_cache is None:
        return type(self).forward(self, x)
    if self.mode == "upsample3d":
        x = _time_upsample(self, x, feat_cache, feat_idx)
    b, c, t, h, w = x.size()
    # einops' rearrange 'b c t h w -> (b t) c h w' and back, as ComfyUI writes it
    frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    del x
    upsample, conv = self.resample
    frames = conv(upsample(frames))
    return frames.reshape(b, t, *frames.shape[1:]).permute(0, 2, 1, 3, 4)


def _up_residual_block_forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):
    """Up_ResidualBlock (Wan 2.2) with the DupUp3D shortcut fused into the add."""
    if feat_cache is None:
        return type(self).forward(self, x, first_chunk=first_chunk)
    x_main = x
    for module in self.upsamples:
        x_main = module(x_main, feat_cache, feat_idx)
    up = self.avg_shortcut
    if up is None:
        return x_main
    if _fusable(self._omnivideo_ops, x_main, x):
        return self._omnivideo_ops.dup_up3d_add(x_main, x, up.factor_t, up.factor_s, up.repeats, first_chunk)
    return x_main + up(x, first_chunk)


def fast_forward(module: nn.Module) -> tuple[str, Callable] | None:
    """(the method to rebind, our version) for one of ComfyUI's decoder modules, or None to leave it as it is."""
    name = comfy_class(module)
    if name == "Decoder3d":
        return ("run_up", _run_up) if decodes_in_pieces(module) else ("forward", _decoder_forward)
    if name == "ResidualBlock":
        return ("forward", _residual_block_pieces_forward if decodes_in_pieces(module) else _residual_block_forward)
    if name == "Resample":
        upsample = module.mode in ("upsample2d", "upsample3d") and not decodes_in_pieces(module)
        return ("forward", _upsample_forward) if upsample else None
    if name == "Up_ResidualBlock":
        return ("forward", _up_residual_block_forward)
    return None
