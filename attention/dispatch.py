"""The one attention call every model in the pack uses, and the RainFusion plan resolution.

    attention(q, k, v, config, scale=..., layout=AttnLayout(prefix_len, grid, kv_lengths),
              step=i, layer=j, stats=stats)

q, k, v are [B, S, H, D]. `config` is the OmniVideo Attention node's output. For the
RainFusion backend the call decides, per call, whether block-sparse attention applies
(like vLLM-Omni's integration): dense during the first `start_step` steps, in
`skip_layers`, below `min_video_blocks` video blocks, and when the layout is missing or does
not describe the sequence - each reason logged once. Dense calls go to the fastest exact
backend; sparse calls to the fastest usable RainFusion executor. Nominal and realized
sparsity are accumulated in `AttentionStats`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field

from ..backends import PLATFORM, Platform, resolve
from ..backends.attention import block_size_error
from ..backends.log_once import log_once
from .layout import AttnLayout
from .registrations import sparse_names

BACKENDS = ("auto", "sdpa", "flash_varlen", "rainfusion")
MIN_VIDEO_BLOCKS = 32  # 4096 rows at block 128: below this the plan costs more than it saves
MAX_SPARSITY = 0.95
MAX_LAYER = 9999  # layer indices in skip_layers; real models have < 100 blocks
MAX_SKIP_LAYERS_CHARS = 1000  # the text is parsed in time and memory bounded by this, never expanded


@dataclass(frozen=True)
class LayerRanges:
    """Parsed skip_layers: inclusive (first, last) ranges, kept as ranges (a range is never expanded)."""

    ranges: tuple[tuple[int, int], ...] = ()

    def __contains__(self, layer: int) -> bool:
        return any(lo <= layer <= hi for lo, hi in self.ranges)


def parse_skip_layers(text: str) -> LayerRanges:
    """ "0-3,38" -> ranges (0, 3), (38, 38). Raises ValueError with the offending piece."""
    text = text or ""
    if len(text) > MAX_SKIP_LAYERS_CHARS:
        raise ValueError(
            f"skip_layers is {len(text)} characters long; at most {MAX_SKIP_LAYERS_CHARS} "
            '(write ranges such as "0-3,38")'
        )
    ranges = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        m = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", piece)
        if m is None:
            raise ValueError(f'skip_layers: {piece!r} is not a layer index or range; use e.g. "0-3,38"')
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"skip_layers: range {piece!r} runs backwards; write it as {hi}-{lo}")
        if hi > MAX_LAYER:
            raise ValueError(
                f"skip_layers: layer {hi} in {piece!r} is beyond {MAX_LAYER}; layers are block indices "
                "(0 = the first block)"
            )
        ranges.append((lo, hi))
    return LayerRanges(tuple(sorted(ranges)))


def validate(
    backend: str, sparsity: float, start_step: int, skip_layers: str, block_size: int, platform: Platform | None = None
) -> str | None:
    """None when the settings are usable, else a message saying what to change."""
    platform = platform or PLATFORM
    if backend not in BACKENDS and backend not in sparse_names():
        return f"backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}"
    if not (0.0 <= float(sparsity) <= MAX_SPARSITY):
        return f"sparsity {sparsity} is out of range: use 0.0 to {MAX_SPARSITY} (0.8 is a good start for video)"
    if int(start_step) < 0:
        return f"start_step {start_step} must be >= 0 (dense warm-up steps)"
    try:
        parse_skip_layers(skip_layers)
    except ValueError as exc:
        return str(exc)
    bs = int(block_size)
    if bs < 16 or bs & (bs - 1):
        return f"block_size {bs} must be a power of two >= 16 (128 is the RainFusion default)"
    return block_size_error(platform, bs)


@dataclass(frozen=True)
class AttentionConfig:
    """OMNIVIDEO_ATTENTION: plain settings, resolved against the registry at call time."""

    backend: str = "auto"  # auto | sdpa | flash_varlen | rainfusion | a RainFusion executor name
    sparsity: float = 0.8
    start_step: int = 0
    skip_layers: str = ""
    block_size: int = 128
    min_video_blocks: int = MIN_VIDEO_BLOCKS

    def __post_init__(self):
        problem = validate(self.backend, self.sparsity, self.start_step, self.skip_layers, self.block_size)
        if problem:
            raise ValueError(f"OmniVideo attention: {problem}")

    @property
    def skip_ranges(self) -> LayerRanges:
        return parse_skip_layers(self.skip_layers)

    @property
    def is_sparse(self) -> bool:
        return self.backend == "rainfusion" or self.backend in sparse_names()


def normalize_config(config) -> AttentionConfig:
    """The one reading of an attention input: an OMNIVIDEO_ATTENTION (AttentionConfig), a plain dict of its
    fields, or None (unconnected) = `AttentionConfig()`, i.e. backend "auto": the registry's fastest exact
    implementation on this machine - the same default for every model family."""
    if config is None:
        return AttentionConfig()
    if isinstance(config, AttentionConfig):
        return config
    if isinstance(config, dict):
        return AttentionConfig(**config)
    raise TypeError(
        f"attention config must be an OMNIVIDEO_ATTENTION (AttentionConfig), a dict or None, "
        f"got {type(config).__name__}"
    )


@dataclass
class AttentionStats:
    sparse_calls: int = 0
    dense_calls: Counter = field(default_factory=Counter)  # reason key -> count
    kept_blocks: int = 0
    total_blocks: int = 0
    nominal_sparsity: float | None = None
    impls: Counter = field(default_factory=Counter)

    @property
    def realized_sparsity(self) -> float | None:
        """Skipped block pairs over all sparse calls (None when the executor does not report it)."""
        return 1.0 - self.kept_blocks / self.total_blocks if self.total_blocks else None

    def summary(self) -> str:
        real = self.realized_sparsity
        dense = ", ".join(f"{k}: {n}" for k, n in sorted(self.dense_calls.items())) or "none"
        return (
            f"sparse calls {self.sparse_calls} via {dict(self.impls)}; nominal sparsity "
            f"{self.nominal_sparsity}, realized {'n/a' if real is None else f'{real:.3f}'}; dense calls {dense}"
        )


def log_dense_once(key: str, message: str) -> None:
    log_once(("attention dense", key), logging.INFO, "omnivideo attention: dense (%s) - %s", key, message)


def dense_reason(
    config: AttentionConfig, q, k, layout: AttnLayout | None, step: int | None, layer: int | None
) -> tuple[str, str] | None:
    """(key, message) when this call must stay dense, else None."""
    b, s = q.shape[:2]
    if k.shape[:2] != q.shape[:2]:
        return "not self-attention", f"q has {s} rows, k has {k.shape[1]}"
    if layer is not None and layer in config.skip_ranges:
        return "skip_layers", f"layer {layer} is in skip_layers {config.skip_layers!r}"
    if step is not None and step < config.start_step:
        return "warm-up", f"step {step} < start_step {config.start_step}"
    if layout is None or layout.grid is None:
        return "no layout", "the caller passed no latent grid (t, h, w); RainFusion needs it"
    if layout.kv_lengths is not None and (b != 1 or len(layout.kv_lengths) != 1):
        return "layout inconsistent", f"packed lengths {layout.kv_lengths} for batch {b}: only batch 1 is packed"
    if any(int(g) <= 0 for g in layout.grid) or layout.prefix_len < 0:
        return "layout inconsistent", f"grid {layout.grid} / prefix {layout.prefix_len} is not a video layout"
    real = layout.real_len(s)
    if layout.prefix_len + layout.video_len != real or real > s:
        return (
            "layout inconsistent",
            f"prefix {layout.prefix_len} + video {layout.grid} = "
            f"{layout.prefix_len + layout.video_len} rows, but the real sequence has {real}: the video must "
            f"be the tail of the real rows",
        )
    blocks = math.ceil(layout.video_len / config.block_size)
    if blocks < config.min_video_blocks:
        return "short video", f"{blocks} video blocks < {config.min_video_blocks}"
    return None


@functools.cache
def _accepted(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _call(fn, q, k, v, **kwargs):
    """Call an implementation with only the keyword arguments it declares."""
    accepted = _accepted(fn)
    return fn(q, k, v, **{name: value for name, value in kwargs.items() if name in accepted})


def _impl(requested: str, exact: bool | None, platform: Platform):
    # resolved per call: the registry caches its answers per (op, requested, platform, exact)
    res = resolve("attention", requested, platform, exact=exact)
    return res.name, res.load()


def dense_backend(config: AttentionConfig | None, platform: Platform | None = None):
    """(name, fn) of the exact implementation a dense call uses."""
    platform = platform or PLATFORM
    requested = config.backend if config is not None and config.backend in ("sdpa", "flash_varlen") else "auto"
    return _impl(requested, True, platform)


def sparse_backend(config: AttentionConfig, platform: Platform | None = None):
    """(name, fn) of the RainFusion executor: the named one (with fallbacks) or the fastest usable."""
    platform = platform or PLATFORM
    requested = config.backend if config.backend in sparse_names() else "auto"
    return _impl(requested, False, platform)


def attention(
    q,
    k,
    v,
    config: AttentionConfig | dict | None = None,
    *,
    scale: float | None = None,
    layout: AttnLayout | None = None,
    step: int | None = None,
    layer: int | None = None,
    stats: AttentionStats | None = None,
    platform: Platform | None = None,
):
    """Attention over [B, S, H, D] q, k, v through the registry; returns [B, S, H, D].

    `config`: see `normalize_config` (None = backend "auto", the registry's exact default)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q, k, v as [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    config = normalize_config(config)
    if not config.is_sparse:
        _, fn = dense_backend(config, platform)
        return _call(fn, q, k, v, scale=scale, layout=layout)

    why = dense_reason(config, q, k, layout, step, layer)
    if why is not None:
        log_dense_once(*why)
        if stats is not None:
            stats.dense_calls[why[0]] += 1
        _, fn = dense_backend(None, platform)
        return _call(fn, q, k, v, scale=scale, layout=layout)

    name, fn = sparse_backend(config, platform)
    assert layout is not None and layout.grid is not None  # dense_reason keeps calls without them dense
    s = q.shape[1]
    real = layout.real_len(s)
    t, h, w = (int(g) for g in layout.grid)
    run_layout = AttnLayout(layout.prefix_len, (t, h, w))
    info: dict = {}
    if real < s:  # packed [real | pad], batch 1: attend the real rows only, padding rows are never read
        out = q.new_zeros(q.shape)
        out[:, :real] = _call(
            fn,
            q[:, :real],
            k[:, :real],
            v[:, :real],
            scale=scale,
            layout=run_layout,
            sparsity=config.sparsity,
            block_size=config.block_size,
            stats=info,
        )
    else:
        out = _call(
            fn,
            q,
            k,
            v,
            scale=scale,
            layout=run_layout,
            sparsity=config.sparsity,
            block_size=config.block_size,
            stats=info,
        )
    if stats is not None:
        stats.sparse_calls += 1
        stats.impls[name] += 1
        stats.nominal_sparsity = config.sparsity
        if info.get("total_blocks"):
            stats.kept_blocks += info["kept_blocks"]
            stats.total_blocks += info["total_blocks"]
    return out
