"""Every registered kernel against its torch twin, on this process's device.

The twin of an implementation is the end of its fallback chain in the backend registry (wan_vae: `off`, whose
module is kernels/wan_vae_reference, diffusers' own operation order; dense attention: `sdpa`; RainFusion executors:
`rainfusion_reference`, the boolean-mask SDPA of the same block plan). Exact kernels must equal their twin bit for
bit (values and strides); the block-sparse executors compute the same plan with other reductions, so they must agree
within a tolerance stated in the row. The time ratio (kernel / twin, medians) is reported, never judged: it depends on
the machine.

Triton without a GPU: the kernels run under Triton's CPU interpreter on small tensors, which proves them correct;
their time says nothing then, so no ratio is printed. The interpreter must be chosen before `triton` is first
imported (importing the pack may import it), so the checks run in a child process (`run_checks`: `python -m
omnivideo.selftest.kernels`, TRITON_INTERPRET=1 in its environment on a machine without CUDA). Implementations of
another device (Ascend NPU here on CUDA, ...) are skipped with the registry's reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .report import FAIL, PASS, SKIP, Row

RESULT_PREFIX = "OMNIVIDEO_KERNEL_ROWS "


def run_checks(platform_name: str, inject: set[str], timeout: float = 1800) -> list[Row]:
    """kernel_rows in a child process of this interpreter (Triton interpreted there when there is no CUDA)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if platform_name == "cpu":
        env["TRITON_INTERPRET"] = "1"
    module = f"{__package__}.kernels"  # omnivideo.selftest.kernels, or custom_nodes.<pack>.selftest.kernels
    cmd = [sys.executable, "-m", module, *(f"--inject-failure={k}" for k in sorted(inject))]
    try:
        proc = subprocess.run(cmd, cwd=package_home(), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [Row(key="kernel:checks", status=FAIL, result=f"the kernel checks did not finish in {timeout:g} s")]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)), None)
    if line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return [Row(key="kernel:checks", status=FAIL, result=f"the kernel checks crashed: {tail[0][:300]}")]
    return [Row(**fields) for fields in json.loads(line[len(RESULT_PREFIX) :])]


def package_home() -> Path:
    """The folder that holds this pack's top-level package (ComfyUI's folder for `custom_nodes.<pack>`, the parent of
    the checkout or site-packages for `omnivideo`): a child started there with `-m` imports the pack as the parent
    does, and never finds the pack's own folders (`kernels`, `nodes`, ...) as top-level modules, which the pack's
    root as its working directory would put first on sys.path."""
    top = sys.modules[__package__.split(".")[0]]
    return Path(next(iter(top.__path__))).parent


def main(argv: list[str] | None = None) -> int:
    """The child of `run_checks`: prints the rows as one JSON line."""
    import argparse

    from ..backends import PLATFORM

    parser = argparse.ArgumentParser(prog="python -m omnivideo.selftest.kernels")
    parser.add_argument("--inject-failure", action="append", default=[])
    args = parser.parse_args(argv)
    rows = kernel_rows(PLATFORM, set(args.inject_failure), os.environ.get("TRITON_INTERPRET") == "1")
    print(RESULT_PREFIX + json.dumps([dataclasses.asdict(r) for r in rows]), flush=True)
    return 0


def twin_of(op: str, name: str) -> str:
    """The end of `name`'s fallback chain: the plain-torch implementation it must match."""
    from ..backends.registry import implementations

    impls, seen = implementations(op), [name]
    while impls[seen[-1]].fallback is not None and impls[seen[-1]].fallback not in seen:
        seen.append(impls[seen[-1]].fallback)  # type: ignore[arg-type]
    return seen[-1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()  # warm-up (compilation, caches)
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _perturbed(out):
    """A wrong answer (one element off by 1), for --inject-failure: the comparison below must catch it."""
    first = out[0] if isinstance(out, tuple) else out
    bad = first.clone()  # same strides
    bad[(0,) * bad.dim()] += 1
    return (bad, *out[1:]) if isinstance(out, tuple) else bad


@dataclass
class Case:
    args: tuple
    kwargs: dict
    rows: slice | None = None  # the output rows that must agree (packed attention: the real rows)


def _compare(got, want, rows: slice | None, tol: float | None) -> tuple[bool, str]:
    """(ok, text): exact (values, dtype, strides), or within `tol` when given."""
    pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
    worst = 0.0
    for g, w in pairs:
        if g is None or w is None:
            if g is not w:
                return False, "one returned None"
            continue
        if rows is not None:
            g, w = g[:, rows], w[:, rows]
        if g.shape != w.shape or g.dtype != w.dtype:
            return False, f"shape/dtype {tuple(g.shape)} {g.dtype} != {tuple(w.shape)} {w.dtype}"
        if tol is None and rows is None and g.stride() != w.stride():
            return False, f"strides {g.stride()} != {w.stride()}"
        if not torch.equal(g, w):
            worst = max(worst, (g.float() - w.float()).abs().max().item())
    if worst == 0.0:
        return True, "exact"
    if tol is None:
        return False, f"max|diff| {worst:.3g} (exact expected)"
    return worst <= tol, f"max|diff| {worst:.3g} (tol {tol:g})"


# ---------------------------------------------------------------------------------------------------------------
# The cases: small on CPU (and under the Triton interpreter), the shipped sizes' order of magnitude on a GPU


def _rand(shape, dtype, device, seed, channels_last=False):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    return t.contiguous(memory_format=torch.channels_last_3d) if channels_last else t


def _wan_vae_cases(device: torch.device, big: bool) -> dict[str, list[Case]]:
    dtype = torch.bfloat16 if big else torch.float32
    c, h, w = (96, 120, 208) if big else (8, 12, 16)
    pad = (1, 1, 1, 1, 2, 0)  # a 3x3x3 causal conv
    cat_pad = []
    for cl in (False, True):
        x = _rand((1, c, 2, h, w), dtype, device, 1, cl)
        cat_pad.append(Case((x, _rand((1, c, 2, h, w), dtype, device, 2, cl), pad, 2), {}))
        x1 = _rand((1, c, 1, h, w), dtype, device, 3, cl)  # one new frame: the cache's last frame is prepended
        cat_pad.append(Case((x1, _rand((1, c, 1, h, w), dtype, device, 4, cl), pad, 2), {}))
    dup = []
    for ft, fs, r, drop, cl in ((2, 2, 8, True, False), (1, 2, 2, False, True)):
        cout = c
        cin = cout * ft * fs * fs // r
        t = 3
        source = _rand((1, cin, t, h // fs, w // fs), dtype, device, 5, cl)
        main = _rand((1, cout, t * ft - (ft - 1 if drop else 0), h, w), dtype, device, 6, cl)
        dup.append(Case((main, source, ft, fs, r, drop), {}))
    return {"cat_pad_5d": cat_pad, "dup_up3d_add": dup}


def _attention_cases(device: torch.device, big: bool, one_head: bool) -> tuple[list[Case], list[Case]]:
    """(dense cases, RainFusion cases) as [B, S, H, D] fp32."""
    from ..attention.rows import AttnRows

    grid, prefix, heads, dim, block = ((4, 30, 52), 32, 12, 128, 128) if big else ((3, 16, 16), 16, 2, 16, 32)
    heads = 1 if one_head else heads
    s = prefix + grid[0] * grid[1] * grid[2]
    q, k, v = (_rand((1, s, heads, dim), torch.float32, device, seed) for seed in (7, 8, 9))
    used = s - 40
    dense = [
        Case((q, k, v), {}),
        Case((q, k, v), {"rows": AttnRows(kv_lengths=(used,))}, rows=slice(0, used)),  # packed [real | pad]
    ]
    video = AttnRows(prefix, grid)
    sparse = [Case((q, k, v), {"rows": video, "sparsity": sparsity, "block_size": block}) for sparsity in (0.8, 0.0)]
    return dense, sparse


# ---------------------------------------------------------------------------------------------------------------


def _caller(fn: Callable[..., object]) -> Callable[[Case], object]:
    def call(case: Case) -> object:
        return fn(*case.args, **case.kwargs)

    return call


def _check(
    key: str,
    run: Callable[[Case], object],
    twin: Callable[[Case], object],
    cases: list[Case],
    device: torch.device,
    *,
    tol: float | None,
    inject: bool,
    timed: bool,
    impl: str,
    note: str,
) -> Row:
    row = Row(key=key, impl=impl, note=note)
    try:
        start = time.perf_counter()
        results = []
        for case in cases:
            got = run(case)
            results.append(_compare(_perturbed(got) if inject else got, twin(case), case.rows, tol))
        _sync(device)
        row.seconds = time.perf_counter() - start
        bad = [text for ok, text in results if not ok]
        row.status = FAIL if bad else PASS
        row.result = bad[0] if bad else max((text for _, text in results), key=lambda t: (t != "exact", t))
        if timed:
            reps = 20 if device.type == "cuda" else 3
            mine = _median_seconds(lambda: run(cases[0]), device, reps)
            ref = _median_seconds(lambda: twin(cases[0]), device, reps)
            row.seconds, row.ratio = mine, mine / ref if ref > 0 else None
    except Exception as exc:  # a kernel that raises is a failed check, reported in its row
        row.status, row.result = FAIL, f"{type(exc).__name__}: {exc}"
    return row


def kernel_rows(platform, inject: set[str], interpreted: bool) -> list[Row]:
    """One row per (op function, implementation) of the registry's `wan_vae` and `attention` ops."""
    from ..attention import registrations as _attention_registrations  # noqa: F401  (registers the impls)
    from ..backends.registry import clear_cache, implementations
    from ..kernels import registrations as _kernel_registrations  # noqa: F401

    clear_cache()  # the probes read TRITON_INTERPRET now
    device = platform.device
    big = device.type != "cpu"
    rows: list[Row] = []

    # -- Wan VAE decode data movement
    cases = _wan_vae_cases(device, big)
    impls = implementations("wan_vae")
    for name, impl in impls.items():
        twin_name = twin_of("wan_vae", name)
        if name == twin_name:
            continue
        why_not = impl.unusable_reason(platform)
        for fn in cases:
            key = f"kernel:wan_vae.{fn}:{name}"
            if why_not is not None:
                rows.append(Row(key=key, impl=name, status=SKIP, result=why_not))
                continue
            module, twin = impl.load(), impls[twin_name].load()
            interp = interpreted and "triton" in name
            rows.append(
                _check(
                    key,
                    _caller(getattr(module, fn)),
                    _caller(getattr(twin, fn)),
                    cases[fn],
                    device,
                    tol=None,
                    inject=key in inject,
                    timed=not interp,
                    impl=name,
                    note=f"vs {twin_name}" + (", Triton CPU interpreter: no timing" if interp else ""),
                )
            )

    # -- attention: dense implementations vs sdpa, RainFusion executors vs rainfusion_reference
    impls = implementations("attention")
    for name, impl in impls.items():
        twin_name = twin_of("attention", name)
        if name == twin_name:
            continue
        key = f"kernel:attention:{name}"
        why_not = impl.unusable_reason(platform)
        if why_not is not None:
            rows.append(Row(key=key, impl=name, status=SKIP, result=why_not))
            continue
        interp = interpreted and "triton" in name
        dense, sparse = _attention_cases(device, big, one_head=interp)
        fn, twin = impl.load(), impls[twin_name].load()
        # exact implementations: bit for bit on CPU; on accelerators another SDPA kernel may reduce in another
        # order. RainFusion executors: the unit tests' 2e-5 on CPU; on accelerators Triton's fp32 dot may use TF32.
        cpu = device.type == "cpu"
        tol = (None if cpu else 1e-4) if impl.exact else (2e-5 if cpu else 2e-3)
        rows.append(
            _check(
                key,
                _caller(fn),
                _caller(twin),
                dense if impl.exact else sparse,
                device,
                tol=tol,
                inject=key in inject,
                timed=not interp,
                impl=name,
                note=f"vs {twin_name}, fp32"
                + (", packed and plain" if impl.exact else ", RainFusion sparsity 0.8 and 0")
                + (", Triton CPU interpreter (1 head): no timing" if interp else ""),
            )
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
