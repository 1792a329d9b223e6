"""The one attention call every model in the pack uses, and the RainFusion plan resolution.

    attention(q, k, v, config, scale=..., rows=AttnRows(prefix_len, grid, kv_lengths),
              step=i, layer=j, stats=stats)

q, k, v are [B, S, H, D]. `config` is the OmniVideo Attention node's output. For the
RainFusion backend the call decides, per call, whether block-sparse attention applies
(like vLLM-Omni's integration): dense during the first `start_step` steps, in
`skip_layers`, below `min_video_blocks` video blocks, and when the rows (`AttnRows`) are missing or do
not describe the sequence - each reason logged once. Dense calls go to the fastest exact
backend; sparse calls to the fastest usable RainFusion executor. Nominal and realized
sparsity are accumulated in `AttentionStats`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass, field

from ..backends import PLATFORM, Platform, resolve
from ..backends.log_once import log_once
from .config import AttentionConfig, normalize_config
from .registrations import sparse_names
from .rows import AttnRows


@dataclass
class AttentionStats:
    """Counts over every call of one patched model. Core's MultiGPU CFG Split runs the model's clones (which share
    one patch, and so these stats) on one thread per device at once: every update holds the lock."""

    sparse_calls: int = 0
    dense_calls: Counter = field(default_factory=Counter)  # reason key -> count
    kept_blocks: int = 0
    total_blocks: int = 0
    nominal_sparsity: float | None = None
    impls: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_dense(self, reason: str) -> None:
        with self.lock:
            self.dense_calls[reason] += 1

    def count_sparse(self, impl: str, sparsity: float, info: dict) -> None:
        with self.lock:
            self.sparse_calls += 1
            self.impls[impl] += 1
            self.nominal_sparsity = sparsity
            if info.get("total_blocks"):
                self.kept_blocks += info["kept_blocks"]
                self.total_blocks += info["total_blocks"]

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
    config: AttentionConfig, q, k, rows: AttnRows | None, step: int | None, layer: int | None
) -> tuple[str, str] | None:
    """(key, message) when this call must stay dense, else None."""
    b, s = q.shape[:2]
    if k.shape[:2] != q.shape[:2]:
        return "not self-attention", f"q has {s} rows, k has {k.shape[1]}"
    if layer is not None and layer in config.skip_ranges:
        return "skip_layers", f"layer {layer} is in skip_layers {config.skip_layers!r}"
    if step is not None and step < config.start_step:
        return "warm-up", f"step {step} < start_step {config.start_step}"
    if rows is None or rows.grid is None:
        return "no layout", "the caller passed no latent grid (t, h, w); RainFusion needs it"
    if rows.kv_lengths is not None and (b != 1 or len(rows.kv_lengths) != 1):
        return "layout inconsistent", f"packed lengths {rows.kv_lengths} for batch {b}: only batch 1 is packed"
    if any(int(g) <= 0 for g in rows.grid) or rows.prefix_len < 0:
        return "layout inconsistent", f"grid {rows.grid} / prefix {rows.prefix_len} is not a video layout"
    real = rows.real_len(s)
    if rows.prefix_len + rows.video_len != real or real > s:
        return (
            "layout inconsistent",
            f"prefix {rows.prefix_len} + video {rows.grid} = "
            f"{rows.prefix_len + rows.video_len} rows, but the real sequence has {real}: the video must "
            f"be the tail of the real rows",
        )
    blocks = math.ceil(rows.video_len / config.block_size)
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


def bind(config: AttentionConfig | dict | None = None, platform: Platform | None = None):
    """`attention` with `config` applied and its implementation resolved now, for a model that calls it many
    times: `fn(q, k, v, *, scale=None, rows=None, layer=None)`. A dense config binds the implementation itself
    (nothing but the kernel call is left per call, so torch.compile traces it without a break); a sparse one
    keeps `attention`'s per-call dense/sparse decision."""
    config = normalize_config(config)
    if config.is_sparse:
        return functools.partial(attention, config=config, platform=platform)
    _, fn = dense_backend(config, platform)
    accepted = _accepted(fn)

    def dense(q, k, v, *, scale=None, rows=None, layer=None):
        kwargs = {"scale": scale, "rows": rows}
        return fn(q, k, v, **{name: value for name, value in kwargs.items() if name in accepted})

    return dense


def attention(
    q,
    k,
    v,
    config: AttentionConfig | dict | None = None,
    *,
    scale: float | None = None,
    rows: AttnRows | None = None,
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
        return _call(fn, q, k, v, scale=scale, rows=rows)

    why = dense_reason(config, q, k, rows, step, layer)
    if why is not None:
        log_dense_once(*why)
        if stats is not None:
            stats.count_dense(why[0])
        _, fn = dense_backend(None, platform)
        return _call(fn, q, k, v, scale=scale, rows=rows)

    name, fn = sparse_backend(config, platform)
    assert rows is not None and rows.grid is not None  # dense_reason keeps calls without them dense
    s = q.shape[1]
    real = rows.real_len(s)
    t, h, w = (int(g) for g in rows.grid)
    run_rows = AttnRows(rows.prefix_len, (t, h, w))
    info: dict = {}
    if real < s:  # packed [real | pad], batch 1: attend the real rows only, padding rows are never read
        out = q.new_zeros(q.shape)
        out[:, :real] = _call(
            fn,
            q[:, :real],
            k[:, :real],
            v[:, :real],
            scale=scale,
            rows=run_rows,
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
            rows=run_rows,
            sparsity=config.sparsity,
            block_size=config.block_size,
            stats=info,
        )
    if stats is not None:
        stats.count_sparse(name, config.sparsity, info)
    return out
