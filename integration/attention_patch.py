"""Route a native ComfyUI video model's self-attention through our attention op.

ComfyUI (>= 0.3.6x) calls `transformer_options["optimized_attention_override"](original, q, k,
v, heads, mask=..., skip_reshape=..., skip_output_reshape=..., transformer_options=...)` for
every attention in Wan / Cosmos (and MiniMax-H3 in 0.33). That call does not know which of its rows are video, so
a DIFFUSION_MODEL wrapper (also a ComfyUI hook) records them (`AttnRows`) in transformer_options before the forward;
the override then reads them. Nothing here imports ComfyUI: the node installs these two callables on a cloned MODEL
through compat.

Wan / Cosmos attend over the video rows alone: their grid is the patch grid of the input latent. MiniMax-H3
(ComfyUI 0.33, comfy/ldm/minimax) attends over one packed sequence `[text | keyframe / reference rows | audio |
video]`: the wrapper takes core's own `PackedLayout` (the one extra_conds prebuilt in `minimax_payload`, else
built as the model builds it, through the class the model's module holds) and records `[prefix | video grid]`,
so RainFusion goes sparse over the generated video rows only and keeps every other row dense, as our own H3
path does. Its text refiner's calls (text rows only) keep ComfyUI's attention. Core does not pad the sequence:
the packed varlen backends get it as one unpadded sequence.

Declined, and answered as the MODEL would answer them without us: cross-attention (k rows != q rows), masked
calls, grouped-query calls (k / v with fewer heads), sequences that are not exactly the recorded video grid, and
every call the plan keeps dense (warm-up steps, skip_layers, short videos) - so a dense call is bit-identical to the
unpatched model. "Without us" is the attention override that was on the MODEL before ours (core's Model Attention
Backend, its Model Sparse Attention, another pack's), chained as core's own sparse attention chains, else ComfyUI's
function, through the call's `preferred_attention` backend where it names one (core's int8 attention layers).
Whatever else sits on the MODEL is said once in the log and in Backend Info: an override installed after ours (it
decides first; core's sparse attention re-installs itself above every other each step) and blocks another patch
replaces (their attention is that patch's).

Core's MultiGPU CFG Split runs the MODEL's clones, which share one patch, on a thread per device at once: the
per-forward state (the rows, the layer count) lives in that forward's own transformer_options, and the shared
stats and log take a lock.

ComfyUI 0.33 also passes `scale=` (honoured), `enable_gqa=` / `low_precision_attention=` and its
own bookkeeping keywords (forwarded to the original untouched), and may call attention with
q / k / v in AttentionTensorContainer boxes (MiniMax): the override has no `container_function`,
so ComfyUI unboxes them before calling it and it always sees tensors.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable

import torch

from ..attention.config import AttentionConfig
from ..attention.dispatch import AttentionStats, attention, dense_reason, log_dense_once
from ..attention.rows import AttnRows
from ..backends.log_once import log_once

log = logging.getLogger("omnivideo")

ROWS_KEY = "omnivideo_attention_rows"
ARG_NAMES = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def call_arguments(args, kwargs) -> dict:
    """An attention override's call (ComfyUI passes q, k, v, heads positionally or by name) by argument name."""
    call = dict(zip(ARG_NAMES, args))
    call.update((n, kwargs[n]) for n in ARG_NAMES if n in kwargs)
    return call


def forward_options(args, kwargs) -> dict | None:
    """The transformer_options of a DIFFUSION_MODEL call (core passes them by name or positionally after x)."""
    opts = kwargs.get("transformer_options")
    if not isinstance(opts, dict):
        opts = next((a for a in args[1:] if isinstance(a, dict)), None)
    return opts


def call_below(previous, original, args, kwargs):
    """A call answered as without the override that declines it: the override below it, else ComfyUI's function
    (through the call's preferred backend, as core's wrap_attn does)."""
    if previous is not None:
        return previous(original, *args, **kwargs)
    preferred = kwargs.get("preferred_attention")
    if getattr(preferred, "function", None) is not None:
        return preferred.function(*args, **{k: v for k, v in kwargs.items() if k != "preferred_attention"})
    return original(*args, **kwargs)


def patch_grid(latent_shape, model) -> tuple[int, int, int] | None:
    """Token grid (t, h, w) of a [B, C, T, H, W] latent after the model's patch embedding."""
    if len(latent_shape) != 5:
        return None
    patch = getattr(model, "patch_size", None)  # Wan: (1, 2, 2)
    if patch is None and hasattr(model, "patch_spatial"):  # Cosmos-Predict2
        patch = (getattr(model, "patch_temporal", 1), model.patch_spatial, model.patch_spatial)
    if patch is None or len(tuple(patch)) != 3:
        return None
    return tuple(math.ceil(n / p) for n, p in zip(latent_shape[2:], patch))


def packed_h3_rows(model, streams, context, payload) -> tuple[AttnRows, int] | None:
    """MiniMax-H3's ([video, audio] streams): `[prefix | video grid]` of its packed sequence and the sequence's
    length, from the PackedLayout its forward uses (the payload's when its signature matches, else one built the
    same way; comfy/ldm/minimax/model.py MiniMaxH3Model._forward). None when this is not such a model."""
    packed_layout = getattr(sys.modules.get(type(model).__module__), "PackedLayout", None)
    if packed_layout is None or len(streams) != 2 or not all(isinstance(t, torch.Tensor) for t in (*streams, context)):
        return None
    video, audio = streams
    grid = patch_grid(tuple(video.shape), model)
    if grid is None:
        return None
    # the forward pads the video to whole patches first
    signature = (context.shape[1], *(n * p for n, p in zip(grid, model.patch_size)), audio.shape[-1])
    payload = payload or {}
    layout = payload.get("layout")
    if layout is None or layout.signature != signature:
        layout = packed_layout(*signature, keyframes=payload.get("keyframes"), refs=payload.get("refs"))
    start, stop, kind = layout.segments[-1]  # the generated video: always the last segment
    if kind != "video" or stop != layout.seq_len or stop - start != math.prod(grid):
        return None
    return AttnRows(start, grid), layout.seq_len


def call_rows(model, args, kwargs) -> tuple[AttnRows | None, int | None]:
    """(rows of the forward's self-attention, its packed sequence length or None) from the DIFFUSION_MODEL
    call's arguments: Wan / Cosmos forward(x, t, context, ...), MiniMax-H3 forward([video, audio], t, context,
    transformer_options, minimax_payload=...)."""
    x = args[0] if args else kwargs.get("x")
    if isinstance(x, (list, tuple)):
        context = args[2] if len(args) > 2 else kwargs.get("context")
        packed = packed_h3_rows(model, x, context, kwargs.get("minimax_payload"))
        return packed if packed is not None else (None, None)
    grid = patch_grid(tuple(x.shape), model) if isinstance(x, torch.Tensor) else None
    return (AttnRows(0, grid) if grid is not None else None), None


def sampling_step(transformer_options: dict) -> int | None:
    """Index of the current sigma in the sampler's schedule (None when ComfyUI did not say)."""
    sigmas, schedule = transformer_options.get("sigmas"), transformer_options.get("sample_sigmas")
    if not isinstance(sigmas, torch.Tensor) or not isinstance(schedule, torch.Tensor) or schedule.numel() == 0:
        return None
    current = sigmas.flatten()[0].to(schedule.device, schedule.dtype)
    return int(torch.argmin((schedule - current).abs()))


MAX_NOTES = 32  # what Backend Info lists of other patches seen on patched models (distinct lines, the first ones)
_notes: dict[tuple, str] = {}


def note(key: tuple, message: str) -> None:
    """Say once (log and Backend Info) what else decides about attention on a MODEL we patched."""
    if log_once(("attention patch", *key), logging.INFO, "OmniVideo Patch Model Attention: %s", message):
        if len(_notes) < MAX_NOTES:
            _notes[key] = message


def describe_notes() -> str:
    """One line per note, for Backend Info."""
    lines = [f"  - {message}" for message in _notes.values()]
    return "attention patches:" + ("\n" + "\n".join(lines) if lines else " no other override or block patch seen")


def override_name(override) -> str:
    """Where an attention override comes from, for a user: its module and function, without core's '<locals>'."""
    target = getattr(override, "__func__", override)
    module = getattr(target, "__module__", None) or type(target).__module__
    name = getattr(target, "__qualname__", type(target).__qualname__).replace(".<locals>", "")
    return f"{module}.{name}"


class NativeAttentionPatch:
    """The override and the wrapper for one patched MODEL (shared by its clones). `previous`: the attention override
    that was on the MODEL before ours; it answers the calls ours declines."""

    def __init__(self, config: AttentionConfig, previous=None):
        self.config = config
        self.stats = AttentionStats()
        owner = getattr(previous, "__self__", None)
        if isinstance(owner, NativeAttentionPatch):  # patching a patched MODEL again replaces ours, not stacks it
            previous = owner.previous
        self.previous: Callable | None = previous
        if previous is not None:
            note(
                ("below", override_name(previous)),
                f"the calls it declines (cross-attention, dense steps and layers) go to the attention override "
                f"installed before it: {override_name(previous)}",
            )

    def __deepcopy__(self, memo):  # MODEL.clone() deep-copies model_options: keep one patch and its stats
        return self

    def decline(self, original, args, kwargs):
        """A call ours does not take, answered as without us."""
        return call_below(self.previous, original, args, kwargs)

    def _notice_others(self, opts: dict) -> None:
        """What else sits on this forward's MODEL: an override above ours, blocks another patch replaces."""
        current = opts.get("optimized_attention_override")
        if current is not None and current != self.override:
            note(
                ("above", override_name(current)),
                f"another attention override sits above it and decides first: {override_name(current)} (OmniVideo's "
                "runs only for the calls that one passes on)",
            )
        for name, patches in (opts.get("patches_replace") or {}).items():
            if isinstance(patches, dict) and patches:
                kinds = sorted({str(key[0]) if isinstance(key, tuple) else str(key) for key in patches})
                note(
                    ("replaced", name, *kinds),
                    f"{len(patches)} {'/'.join(kinds)} block(s) are replaced by another patch (patches_replace "
                    f"{name!r}): their attention is that patch's, and reaches OmniVideo only if it calls ComfyUI's",
                )

    # DIFFUSION_MODEL wrapper: wrapper(executor, x, timestep, ..., transformer_options, ...)
    def wrapper(self, executor, *args, **kwargs):
        opts = forward_options(args, kwargs)
        if opts is None:
            return executor(*args, **kwargs)
        self._notice_others(opts)
        rows, seq_len = call_rows(getattr(executor, "class_obj", None), args, kwargs)
        opts[ROWS_KEY] = {"rows": rows, "seq_len": seq_len, "layer": 0}
        try:
            return executor(*args, **kwargs)
        finally:
            opts.pop(ROWS_KEY, None)

    def override(self, original, *args, **kwargs):
        call = call_arguments(args, kwargs)
        q, k, v = call.get("q"), call.get("k"), call.get("v")
        opts = kwargs.get("transformer_options") or {}
        heads = call.get("heads")
        if (
            call.get("mask") is not None
            or heads is None
            or not all(isinstance(t, torch.Tensor) for t in (q, k, v))
            or k.shape != q.shape
            or v.shape != q.shape
        ):
            return self.decline(original, args, kwargs)  # masked, cross- or grouped-query attention: not ours
        skip_reshape = bool(call.get("skip_reshape", False))
        if skip_reshape:  # [B, H, S, D]
            b, h, s, d = q.shape
            q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
        else:  # [B, S, H*D]
            b, s, hd = q.shape
            h, d = int(heads), hd // int(heads)
            q4, k4, v4 = (t.view(b, s, h, d) for t in (q, k, v))

        info = opts.get(ROWS_KEY)
        if info is not None and info["seq_len"] is not None and s != info["seq_len"]:
            # MiniMax-H3's text refiner: text rows only, outside the packed sequence and its block count
            log_dense_once("text refiner", f"{s} rows, not the {info['seq_len']}-row packed sequence")
            self.stats.count_dense("text refiner")
            return self.decline(original, args, kwargs)
        layer = opts.get("block_index")
        if info is not None:
            layer = info["layer"] if layer is None else layer
            info["layer"] += 1  # self-attention calls in this forward = block index (Wan in 0.3.x, MiniMax-H3)
        rows = info["rows"] if info is not None else None
        step = sampling_step(opts)
        why = dense_reason(self.config, q4, k4, rows, step, layer)
        if why is not None:
            log_dense_once(*why)
            self.stats.count_dense(why[0])
            return self.decline(original, args, kwargs)

        scale = kwargs.get("scale")
        scale = d**-0.5 if scale is None else float(scale)
        out = attention(q4, k4, v4, self.config, scale=scale, rows=rows, step=step, layer=layer, stats=self.stats)
        if call.get("skip_output_reshape", False):
            return out.transpose(1, 2)
        return out.reshape(b, s, h * d)
