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

ComfyUI rewrote these modules in 2026 (v0.33: PRs #12036, #13014, #13101). Which code a fast path follows is
read off the installed modules, never off a version number:

* `CausalConv3d` with an int `_padding` pads only time itself (H and W are its Conv3d's own padding) and runs
  a single uncached frame on truncated taps: that call stays ComfyUI's, and `cat_pad_5d` writes only the
  temporal front;
* a 2.1 `Decoder3d` with `run_up` decodes 1, then 2 latent frames per call and splits after each temporal
  upsample into 2-frame pieces; its `ResidualBlock` (a `final` argument) keeps views of the conv inputs as
  caches and calls the convs with `cache_list`. There only the norm + SiLU chains, the residual add and the
  output buffer are ours; every conv call, cache and split is ComfyUI's. Core's `VAE.decode` then hands our
  decode its output buffer (`comfy_has_chunked_io`), so the pieces land in it without a `torch.cat` or a copy.
"""

from __future__ import annotations

import contextlib
import inspect
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


def unknown_shapes(model: nn.Module, latent_dims: int) -> str | None:
    """Why the decode loop here (and the stream's, stream.py) does not know this WanVAE and its latent, None when it
    does. Newer ComfyUI builds its Wan classes for other VAEs too (Qwen-Image 2.1: spatial patch 1, temporal kernel
    1, 4-D latents), so the class name alone is not enough: the loop knows video latents [B, C, T, H, W], a decoder
    whose causal convs have Wan's 3 temporal taps (CACHE_T, the frame grouping), and RGB pixels out of 2.1's head /
    2x2 patches out of 2.2's. Anything else runs core's decode unchanged (pipelines/wan_decode)."""
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
    if feat_cache[idx] is None:  # first chunk: ComfyUI marks "Rep" and skips time_conv
        feat_cache[idx] = "Rep"
        feat_idx[0] += 1
        return x
    if isinstance(feat_cache[idx], str) and isinstance(self.time_conv._padding, int):
        # After "Rep" the 2026 time_conv runs uncached (one frame: on its last taps); ComfyUI caches [0, x]
        cache_x = x[:, :, -CACHE_T:].clone()
        if cache_x.shape[2] < CACHE_T:
            cache_x = torch.cat([torch.zeros_like(cache_x), cache_x], dim=2)
        x = self.time_conv(x)
        feat_cache[idx] = cache_x
        feat_idx[0] += 1
    else:
        if isinstance(feat_cache[idx], str):
            # After "Rep", the 2025 ComfyUI pads two zero frames and caches [0, x] for a 1-frame x: the same
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


def pieces_layout(module: nn.Module) -> bool:
    """ComfyUI's 2026 2.1 modules: `final` in a block's forward, `run_up` on the decoder (see the module doc)."""
    cls = type(module)
    return hasattr(cls, "run_up") or "final" in inspect.signature(cls.forward).parameters


def _fast_forward(module: nn.Module) -> tuple[str, Callable] | None:
    """(the method to rebind, our version) for one of ComfyUI's decoder modules, or None to leave it as it is."""
    name = comfy_class(module)
    if name == "Decoder3d":
        return ("run_up", _run_up) if pieces_layout(module) else ("forward", _decoder_forward)
    if name == "ResidualBlock":
        return ("forward", _residual_block_pieces_forward if pieces_layout(module) else _residual_block_forward)
    if name == "Resample":
        upsample = module.mode in ("upsample2d", "upsample3d") and not pieces_layout(module)
        return ("forward", _upsample_forward) if upsample else None
    if name == "Up_ResidualBlock":
        return ("forward", _up_residual_block_forward)
    return None


# ----------------------------------------------------------------------------- decode loop


def _count_causal_convs(decoder: nn.Module) -> int:
    return sum(1 for m in decoder.modules() if comfy_class(m) == "CausalConv3d")


def _unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """vae2_2.unpatchify: einops 'b (c r q) f h w -> b c f (h q) (w r)' (reshape, permute, reshape)."""
    b, crq, f, h, w = x.shape
    x = x.reshape(b, crq // (p * p), p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, crq // (p * p), f, h * p, w * p)


def _latent_calls(model: nn.Module, frames: int) -> list[tuple[int, int]]:
    """The latent frames each decoder call of ComfyUI's WanVAE.decode takes: one at a time, or for the 2026 2.1
    decoder frame 0 and then two at a time (the last one alone when the count is even)."""
    if not pieces_layout(model.get_submodule("decoder")):
        return [(i, i + 1) for i in range(frames)]
    return [(0, 1)] + [(s, min(s + 2, frames)) for s in range(1, frames, 2)]


def _output_shape(self, latent_shape) -> tuple[int, ...]:
    """The pixel shape ComfyUI's WanVAE.decode returns for a latent shape (`decode_output_shape` of core's
    chunked-output protocol)."""
    b, _, frames, h, w = latent_shape
    step = 2 ** sum(bool(u) for u in self.temperal_upsample)  # pixel frames per latent frame after the first
    scale = 2 ** (len(self.decoder.dim_mult) - 1) * (2 if type(self).__module__ == COMFY_WAN22 else 1)
    return (b, 3, 1 + step * (frames - 1), h * scale, w * scale)


def _decode(self, z, output_buffer=None, on_frame: Callable[[int], None] | None = None):
    """WanVAE.decode (2.1 and 2.2, both layouts): ComfyUI's decoder calls, each piece of pixels copied into one
    buffer (core's, when it hands one over; else the shape, dtype and memory format torch.cat would give)."""
    wan22 = type(self).__module__ == COMFY_WAN22
    feat_map = [None] * _count_causal_convs(self.decoder)
    if hasattr(self, "clear_cache"):  # the 2025 2.2 module keeps its cache on itself; the others use a local list
        self.clear_cache()
        feat_map = self._feat_map
    out, filled = output_buffer, 0
    try:
        x = self.conv2(z)
        for start, stop in _latent_calls(self, z.shape[2]):
            kwargs = {"first_chunk": start == 0} if wan22 else {}
            pieces = self.decoder(x[:, :, start:stop], feat_cache=feat_map, feat_idx=[0], **kwargs)
            pieces = pieces if isinstance(pieces, list) else [pieces]
            while pieces:
                piece = pieces.pop(0)
                piece = _unpatchify(piece, 2) if wan22 else piece
                if out is None:
                    fmt = memory_format_of(piece) if piece.dim() == 5 else torch.contiguous_format
                    out = torch.empty(
                        _output_shape(self, z.shape), dtype=piece.dtype, device=piece.device, memory_format=fmt
                    )
                if filled + piece.shape[2] > out.shape[2] or piece.shape[3:] != out.shape[3:]:
                    raise RuntimeError(
                        f"the decoder returned {tuple(piece.shape)} pixels at frame {filled} of {tuple(out.shape)}"
                    )
                out[:, :, filled : filled + piece.shape[2]].copy_(piece)
                filled += piece.shape[2]
                del piece
            if on_frame is not None:
                on_frame(z.shape[0] * (stop - start))
    finally:
        feat_map[:] = [None] * len(feat_map)  # drop the feature cache, also when interrupted
        if hasattr(self, "clear_cache"):
            self.clear_cache()
    if out is None or filled != out.shape[2]:
        raise RuntimeError(f"the decoder returned {filled} pixel frames for {z.shape[2]} latent frames")
    return out


# ----------------------------------------------------------------------------- install / restore


_MISSING = object()
_ATTRS = ("forward", "run_up", "_omnivideo_ops", "_omnivideo_check")
_MODEL_ATTRS = ("decode", "comfy_has_chunked_io", "decode_output_shape")


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
    if (problem := unknown_shapes(model, 5)) is not None:
        raise TypeError(f"the fused decode does not know this Wan VAE: {problem}")
    decode = lambda self, z, output_buffer=None: _decode(self, z, output_buffer, on_frame)
    patches: list[tuple[object, dict]] = [
        (
            model,
            {  # core's VAE.decode (v0.33) then writes the pixels into its own output buffer through ours
                "decode": types.MethodType(decode, model),
                "comfy_has_chunked_io": True,
                "decode_output_shape": types.MethodType(_output_shape, model),
            },
        )
    ]
    if fusion != "reference":
        for module in model.get_submodule("decoder").modules():
            fast = _fast_forward(module)
            if fast is not None:
                method, forward = fast
                patches.append(
                    (
                        module,
                        {
                            method: types.MethodType(forward, module),
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
    return [
        name or "<root>" for name, m in model.named_modules() if any(k in m.__dict__ for k in (*_ATTRS, *_MODEL_ATTRS))
    ]
