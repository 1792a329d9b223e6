"""Fused fast paths installed on ComfyUI's own Wan 2.1 / 2.2 VAE (comfy/ldm/wan/vae.py, vae2_2.py).

No second copy of the weights: the fast paths are per-instance method rebinds on the modules ComfyUI
loaded (the classes, parameters and state_dict keys stay untouched), installed only inside
`fused_decode(...)` and restored on exit, so a core VAE Decode of the same VAE object runs core's code.
`models/` never imports ComfyUI, so its classes are recognised by module and class name.

Each rebind runs ComfyUI's operations in ComfyUI's order, with bit-preserving changes only:

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
  layout the out-of-place add would give);
* `WanVAE.decode` writes each latent frame's pixels into one preallocated buffer instead of
  growing the output with `torch.cat` (a copy either way).

Every fused call site checks its guard first (inference, one dtype/device/memory format, a device the
ops support) and otherwise runs ComfyUI's exact operation order.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels.wan_vae_torch import memory_format_of

CACHE_T = 2  # comfy/ldm/wan/vae.py CACHE_T: frames each causal conv keeps for the next chunk
FUSIONS = ("reference", "torch_fused", "triton")  # the wan_vae implementations of the registry
COMFY_WAN21, COMFY_WAN22 = "comfy.ldm.wan.vae", "comfy.ldm.wan.vae2_2"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def comfy_class(module: object) -> str | None:
    """The class name of a ComfyUI Wan VAE module ('ResidualBlock', 'WanVAE', ...), else None."""
    cls = type(module)
    return cls.__name__ if cls.__module__ in (COMFY_WAN21, COMFY_WAN22) else None


def wan_version(model: object) -> str | None:
    """'2.1' / '2.2' for ComfyUI's WanVAE (comfy.sd.VAE.first_stage_model), else None."""
    if comfy_class(model) != "WanVAE":
        return None
    return "2.2" if type(model).__module__ == COMFY_WAN22 else "2.1"


# ----------------------------------------------------------------------------- fused call sites


def _fusable(ops, x: torch.Tensor, *others: torch.Tensor) -> bool:
    """The guard every fused call site checks first: inference, same dtype/device, and one
    memory format (as ATen reads it) across the operands, so outputs keep the reference's."""
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


def _cached_conv(module, conv, take: list, feat_cache, feat_idx):
    """conv(x, feat_cache[idx]) and store x's last CACHE_T frames as the next cache.

    `take` is a one-item list holding x, so x can be freed once it is copied into the padded input."""
    x = take.pop()
    idx = feat_idx[0]
    cache = feat_cache[idx]
    ops = module._omnivideo_ops
    module._omnivideo_check()
    if _fusable(ops, x, *([cache] if cache is not None else [])):
        padded, feat_cache[idx] = ops.cat_pad_5d(x, cache, conv._padding, keep_cache_frames=CACHE_T)
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
    if feat_cache[idx] is None:  # first chunk: ComfyUI marks "Rep" and skips time_conv
        feat_cache[idx] = "Rep"
        feat_idx[0] += 1
        return x
    if isinstance(feat_cache[idx], str):
        # After "Rep", ComfyUI pads two zero frames and caches [0, x] for a 1-frame x: the same as
        # a one-frame zero cache, which the cached conv handles exactly.
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


def _fast_forward(module: nn.Module):
    name = comfy_class(module)
    if name == "Resample":
        return _upsample_forward if module.mode in ("upsample2d", "upsample3d") else None
    return {
        "Decoder3d": _decoder_forward,
        "ResidualBlock": _residual_block_forward,
        "Up_ResidualBlock": _up_residual_block_forward,
    }.get(name or "")


# ----------------------------------------------------------------------------- decode loop


def _count_causal_convs(decoder: nn.Module) -> int:
    return sum(1 for m in decoder.modules() if comfy_class(m) == "CausalConv3d")


def _unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """vae2_2.unpatchify: einops 'b (c r q) f h w -> b c f (h q) (w r)' (reshape, permute, reshape)."""
    b, crq, f, h, w = x.shape
    x = x.reshape(b, crq // (p * p), p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, crq // (p * p), f, h * p, w * p)


def _decode(self, z, on_frame: Callable[[int], None] | None = None):
    """WanVAE.decode (2.1 and 2.2), each latent frame's output copied into one buffer."""
    wan22 = type(self).__module__ == COMFY_WAN22
    feat_map = [None] * _count_causal_convs(self.decoder)
    if wan22:  # ComfyUI keeps 2.2's cache on the module (clear_cache); 2.1's is a local list
        self.clear_cache()
        feat_map = self._feat_map
    frames = z.shape[2]
    step = 2 ** sum(bool(u) for u in self.temperal_upsample)  # pixel frames per latent frame after the first
    try:
        x = self.conv2(z)
        out = None
        filled = 0
        for i in range(frames):
            kwargs = {"first_chunk": i == 0} if wan22 else {}
            frame = self.decoder(x[:, :, i : i + 1], feat_cache=feat_map, feat_idx=[0], **kwargs)
            if out is None:
                # the shape, dtype and memory format torch.cat would give, allocated once
                shape = (*frame.shape[:2], frame.shape[2] + step * (frames - 1), *frame.shape[3:])
                fmt = memory_format_of(frame) if frame.dim() == 5 else torch.contiguous_format
                out = torch.empty(shape, dtype=frame.dtype, device=frame.device, memory_format=fmt)
            elif frame.shape[2] != step:
                raise RuntimeError(f"decoder returned {frame.shape[2]} frames for latent frame {i}, expected {step}")
            out[:, :, filled : filled + frame.shape[2]] = frame
            filled += frame.shape[2]
            del frame
            if on_frame is not None:
                on_frame(z.shape[0])
    finally:
        feat_map[:] = [None] * len(feat_map)  # drop the feature cache, also when interrupted
        if wan22:
            self.clear_cache()
    assert out is not None  # frames >= 1
    return _unpatchify(out, 2) if wan22 else out


# ----------------------------------------------------------------------------- install / restore


_MISSING = object()
_ATTRS = ("forward", "_omnivideo_ops", "_omnivideo_check")


@contextlib.contextmanager
def fused_decode(
    model: nn.Module,
    fusion: str,
    ops=None,
    on_frame: Callable[[int], None] | None = None,
    check: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Within the block, ComfyUI's WanVAE `model` decodes through our loop and the fast forwards of
    `fusion` ('reference': ComfyUI's own module forwards); on exit every instance is as it was.

    `ops` is the loaded implementation module (from the backend registry); `on_frame(n)` is called after
    each latent frame (n = batch size); `check()` before every conv the fast paths run themselves."""
    if fusion not in FUSIONS:
        raise ValueError(f"unknown fusion {fusion!r}; expected one of {', '.join(FUSIONS)}")
    if fusion != "reference" and ops is None:
        raise ValueError(f"fusion {fusion!r} needs its ops module")
    if wan_version(model) is None:
        raise TypeError(f"not ComfyUI's Wan VAE: {type(model).__module__}.{type(model).__qualname__}")
    patches: list[tuple[object, dict]] = [
        (model, {"decode": types.MethodType(lambda self, z: _decode(self, z, on_frame), model)})
    ]
    if fusion != "reference":
        for module in model.get_submodule("decoder").modules():
            fast = _fast_forward(module)
            if fast is not None:
                patches.append(
                    (
                        module,
                        {
                            "forward": types.MethodType(fast, module),
                            "_omnivideo_ops": ops,
                            "_omnivideo_check": check or (lambda: None),
                        },
                    )
                )
    saved = [(obj, {k: obj.__dict__.get(k, _MISSING) for k in attrs}) for obj, attrs in patches]
    try:
        for obj, attrs in patches:
            obj.__dict__.update(attrs)
        yield
    finally:
        for obj, old in saved:
            for key, value in old.items():
                if value is _MISSING:
                    obj.__dict__.pop(key, None)
                else:
                    obj.__dict__[key] = value


def patched_modules(model: nn.Module) -> list[str]:
    """Names of `model`'s modules that carry an instance-level override of ours (empty outside `fused_decode`)."""
    return [name or "<root>" for name, m in model.named_modules() if any(k in m.__dict__ for k in (*_ATTRS, "decode"))]
