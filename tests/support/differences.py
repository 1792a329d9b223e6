"""What differs between two results, for a probe to print and a test to assert with (a failure then says which case,
by how much and in which shapes, not only that it failed). Runs in ComfyUI's interpreter too (torch only)."""

from __future__ import annotations

import torch


def difference(got, want) -> dict:
    """{"equal": bit for bit, "max_abs_diff", "shapes", "dtypes"} of two tensors (or lists / dicts of them)."""
    if isinstance(got, dict) and isinstance(want, dict):
        if got.keys() != want.keys():
            return {"equal": False, "keys": [sorted(map(str, got)), sorted(map(str, want))]}
        parts = {str(k): difference(got[k], want[k]) for k in got}
        worst = max((p.get("max_abs_diff") or 0.0 for p in parts.values()), default=0.0)
        unequal = sorted(k for k, p in parts.items() if not p["equal"])
        return {"equal": not unequal, "max_abs_diff": worst, "unequal": unequal[:8]}
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return {"equal": False, "lengths": [len(got), len(want)]}
        return difference(dict(enumerate(got)), dict(enumerate(want)))
    shapes, dtypes = [list(got.shape), list(want.shape)], [str(got.dtype), str(want.dtype)]
    if got.shape != want.shape:
        return {"equal": False, "max_abs_diff": None, "shapes": shapes, "dtypes": dtypes}
    diff = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    return {"equal": bool(torch.equal(got, want)), "max_abs_diff": diff, "shapes": shapes, "dtypes": dtypes}
