"""Named implementations per operation, and how one is chosen on this machine.

An implementation declares the platforms it runs on and a probe (is its package
importable, is its op present). `resolve(op, requested)` returns the requested one
when usable, else walks its fallback chain and says in one line why.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .log_once import log_once
from .platform import PLATFORM, Platform

Probe = Callable[[Platform], "str | None"]  # None when usable, else why not


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    platforms: tuple[str, ...]
    loader: str  # "module:attr", imported lazily; a leading "." is relative to this pack
    probe: Probe | None = None
    fallback: str | None = None  # next implementation to try when this one is unusable
    exact: bool = True  # bit-for-bit/numerically the reference (False: approximate, e.g. sparse)
    packed: bool = False  # takes a [real | pad] sequence mask-free (padding to a multiple of 128 pays off)
    doc: str = ""

    def unusable_reason(self, platform: Platform) -> str | None:
        if platform.name not in self.platforms:
            return f"{self.name} runs on {'/'.join(self.platforms)}, this is {platform.name}"
        return self.probe(platform) if self.probe is not None else None

    def load(self) -> Any:
        module, _, attr = self.loader.partition(":")
        mod = importlib.import_module(module, package=_PACK)
        return getattr(mod, attr) if attr else mod


@dataclass(frozen=True)
class Resolution:
    impl: Impl
    requested: str
    reason: str  # one line: why this implementation

    @property
    def name(self) -> str:
        return self.impl.name

    def load(self) -> Any:
        return self.impl.load()


@dataclass
class _Op:
    impls: dict[str, Impl] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)  # "auto" preference: lower first

    @property
    def auto_order(self) -> list[str]:
        return sorted(self.ranks, key=lambda name: self.ranks[name])  # stable: ties keep registration order


_PACK = __package__.rpartition(".")[0]  # "omnivideo", or "custom_nodes.<folder>" in ComfyUI
_OPS: dict[str, _Op] = {}
_cache: dict[tuple[str, str, str, bool | None], Resolution] = {}


def clear_cache() -> None:
    """Forget cached `resolve` answers (after registering, or when a test fakes modules/env vars)."""
    _cache.clear()


def register(impl: Impl, *, auto_rank: int | None = None) -> Impl:
    """Add an implementation; "auto" tries those with an `auto_rank`, lowest rank first."""
    op = _OPS.setdefault(impl.op, _Op())
    op.impls[impl.name] = impl
    if auto_rank is not None:
        op.ranks[impl.name] = auto_rank
    clear_cache()
    return impl


def ops() -> list[str]:
    return sorted(_OPS)


def implementations(op: str) -> dict[str, Impl]:
    if op not in _OPS:
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(ops())}")
    return dict(_OPS[op].impls)


def resolve(
    op: str, requested: str = "auto", platform: Platform | None = None, *, exact: bool | None = True
) -> Resolution:
    """The implementation of `op` to run, with a one-line reason (logged once per answer).

    `exact` filters what "auto" may pick: True (default) only exact implementations, False
    only approximate ones (e.g. block-sparse attention), None any. Named requests ignore it.

    Answers are cached per (op, requested, platform name, exact): probes run once per process.
    Call `clear_cache()` after changing what the probes look at (environment, importable modules).
    """
    platform = platform or PLATFORM
    key = (op, requested, platform.name, exact)
    hit = _cache.get(key)
    if hit is None:
        hit = _cache[key] = _resolve(op, requested, platform, exact)
    return hit


def _resolve(op: str, requested: str, platform: Platform, exact: bool | None) -> Resolution:
    impls = implementations(op)
    if requested == "auto":
        kind = "approximate " if exact is False else ""
        for name in _OPS[op].auto_order:
            if exact is not None and impls[name].exact != exact:
                continue
            why_not = impls[name].unusable_reason(platform)
            if why_not is None:
                return _logged_once(
                    Resolution(impls[name], requested, f"auto: fastest usable {kind}on {platform.name}")
                )
        raise RuntimeError(f"no usable {kind}implementation of {op} on {platform.name}")
    if requested not in impls:
        raise ValueError(f"unknown {op} implementation {requested!r}; choose from auto, {', '.join(impls)}")

    reasons: list[str] = []
    seen: set[str] = set()
    current: str | None = requested
    while current is not None and current not in seen:
        seen.add(current)
        why_not = impls[current].unusable_reason(platform)
        if why_not is None:
            reason = "requested" if current == requested else f"fell back to {current}: " + "; ".join(reasons)
            return _logged_once(Resolution(impls[current], requested, reason))
        reasons.append(why_not)
        current = impls[current].fallback
    raise RuntimeError(f"{op}: {requested} is unusable and has no usable fallback: " + "; ".join(reasons))


def _logged_once(res: Resolution) -> Resolution:
    log_once(
        ("resolve", res.impl.op, res.requested, res.name),
        logging.INFO,
        "omnivideo %s: %s -> %s (%s)",
        res.impl.op,
        res.requested,
        res.name,
        res.reason,
    )
    return res


def triton_interpreted() -> bool:
    """Triton kernels run by the CPU interpreter (TRITON_INTERPRET=1: tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device) -> bool:
    """Where a Triton kernel can take tensors: CUDA, or CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreted())


def triton_probe(platform: Platform) -> str | None:
    """Probe for Triton kernels: CUDA, or the CPU interpreter (TRITON_INTERPRET=1, tests only)."""
    missing = module_probe("triton")(platform)
    if missing:
        return missing
    if platform.name == "cpu" and not triton_interpreted():
        return "Triton runs on CUDA (on CPU only under TRITON_INTERPRET=1, for tests)"
    return None


def module_probe(module: str, attr: str | None = None) -> Probe:
    """Probe: `module` importable (and has `attr`)."""

    def probe(platform: Platform) -> str | None:
        try:
            mod = importlib.import_module(module)
        except Exception as exc:
            return f"{module} is not importable ({type(exc).__name__})"
        if attr is not None and not hasattr(mod, attr):
            return f"{module} has no {attr}"
        return None

    return probe
