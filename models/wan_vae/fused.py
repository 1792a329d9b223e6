"""The pack's decode installed on ComfyUI's own Wan 2.1 / 2.2 VAE (comfy/ldm/wan/vae.py, vae2_2.py) for the duration of
`fused_decode(...)`, and restored on exit, so a core VAE Decode of the same VAE object runs core's code.

No second copy of the weights: everything installed is a per-instance attribute on the modules ComfyUI loaded (the
classes, parameters and state_dict keys stay untouched):

* on the WanVAE, at every fusion, our `decode`: ComfyUI's decoder calls (core_vae.decoder_calls), each piece of pixels
  copied into one preallocated buffer instead of growing the output with `torch.cat` (a copy either way), one
  `on_frame` call per decoder call. Core's `VAE.decode` (v0.33) hands it its own output buffer through the
  chunked-output protocol (`comfy_has_chunked_io`, `decode_output_shape`), so the pieces land there without a copy;
* on the decoder's modules, unless the fusion is `off`, the fast forwards of fast_forwards.py with the fused ops of
  the implementation the registry resolved (`off`: ComfyUI's own module forwards).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from ...backends.registry import implementations
from ...kernels import registrations
from ...kernels.wan_vae_torch import memory_format_of
from .core_vae import (
    COMFY_WAN22,
    causal_convs,
    decoder_calls,
    decodes_in_pieces,
    output_shape,
    unknown_shapes,
    unpatchify,
    wan_version,
)
from .fast_forwards import fast_forward

# ----------------------------------------------------------------------------- decode loop


def _decode(self, z, output_buffer=None, on_frame: Callable[[int], None] | None = None):
    """WanVAE.decode (2.1 and 2.2, 2025 and 2026 modules): ComfyUI's decoder calls, each piece of pixels copied into
    one buffer (core's, when it hands one over; else the shape, dtype and memory format torch.cat would give)."""
    wan22 = type(self).__module__ == COMFY_WAN22
    feat_map = [None] * causal_convs(self.decoder)
    if hasattr(self, "clear_cache"):  # the 2025 2.2 module keeps its cache on itself; the others use a local list
        self.clear_cache()
        feat_map = self._feat_map
    out, filled = output_buffer, 0
    try:
        x = self.conv2(z)
        for start, stop in decoder_calls(z.shape[2], decodes_in_pieces(self.decoder)):
            kwargs = {"first_chunk": start == 0} if wan22 else {}
            pieces = self.decoder(x[:, :, start:stop], feat_cache=feat_map, feat_idx=[0], **kwargs)
            pieces = pieces if isinstance(pieces, list) else [pieces]
            while pieces:
                piece = pieces.pop(0)
                piece = unpatchify(piece, 2) if wan22 else piece
                if out is None:
                    fmt = memory_format_of(piece) if piece.dim() == 5 else torch.contiguous_format
                    out = torch.empty(
                        output_shape(self, z.shape), dtype=piece.dtype, device=piece.device, memory_format=fmt
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
    `fusion`, a wan_vae implementation of the registry ('off': ComfyUI's own module forwards); on exit every
    instance is as it was.

    `ops` is the loaded implementation module (from the backend registry); `on_frame(n)` is called after
    each decoder call (n: its latent frames x the batch size); `check()` before every conv the fast paths
    run themselves."""
    fusions = implementations(registrations.OP)
    if fusion not in fusions:
        raise ValueError(f"unknown fusion {fusion!r}; expected one of {', '.join(fusions)}")
    if fusion != "off" and ops is None:
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
                "decode_output_shape": types.MethodType(output_shape, model),
            },
        )
    ]
    if fusion != "off":
        for module in model.get_submodule("decoder").modules():
            fast = fast_forward(module)
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
