"""The attention settings (OMNIVIDEO_ATTENTION): which backend, RainFusion's sparsity, warm-up steps, dense layers
and block size, checked in bounded time (skip_layers is parsed into ranges, never expanded)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..backends import PLATFORM, Platform
from ..backends.attention import block_size_error
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
