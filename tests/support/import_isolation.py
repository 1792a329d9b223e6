"""Whether a process sees the pack only as a package: the facts behind tests/test_import_isolation.py, read in the
test process and, loaded by file path, inside a real ComfyUI (the probe pack's OmniVideoTestImports node).

With the repository root on sys.path (`python -m pytest` from the checkout) the pack's folders are top-level modules
too: its `kernels/` shadows Hugging Face's PyPI `kernels`, which transformers >= 5 imports
(`transformers.integrations.hub_kernels`), and its `nodes/` ComfyUI's own `nodes` module."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path


def pack_names(repo: Path) -> list[str]:
    """Every top-level folder / module of the pack, the names it would be importable under from its root."""
    return sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in repo.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    )


def isolation_report(repo: Path) -> dict:
    """`packages`: the names the pack is loaded as (`omnivideo`, ComfyUI's custom-node module); every other entry
    is empty (None) when the pack is isolated: `root_on_path` (sys.path entries that are the root), `shadowing` (pack
    names importable as top-level modules from it), `top_level` (such modules already imported), `hub_kernels` (the
    error of importing transformers' hub kernels) and `kernels` (`import kernels` resolving into the pack)."""
    repo = Path(os.path.realpath(repo))
    own = {*pack_names(repo), "__init__"}

    def inside_pack(path) -> bool:  # the pack's own files: not tests/, not a virtual environment in the checkout
        real = Path(os.path.realpath(path)) if path else None
        if real is None or real == repo or not real.is_relative_to(repo):
            return False
        return real.relative_to(repo).parts[0].removesuffix(".py") in own

    modules = list(sys.modules.items())
    init = str(repo / "__init__.py")
    packages = sorted(n for n, m in modules if os.path.realpath(getattr(m, "__file__", None) or "/") == init)
    top_level = sorted(
        name
        for name, module in modules
        if inside_pack(getattr(module, "__file__", None))
        and not any(name == p or name.startswith(p + ".") for p in packages)
    )
    shadowing = sorted(
        name for name in pack_names(repo) if (spec := importlib.util.find_spec(name)) and inside_pack(spec.origin)
    )
    try:
        importlib.import_module("transformers.integrations.hub_kernels")
        hub_kernels = None
    except Exception as exc:  # what a shadowed `kernels` makes of it
        hub_kernels = f"{type(exc).__name__}: {exc}"[:300]
    spec = importlib.util.find_spec("kernels")
    return {
        "packages": packages,
        "root_on_path": [entry for entry in sys.path if os.path.realpath(entry or os.getcwd()) == str(repo)],
        "shadowing": shadowing,
        "top_level": top_level,
        "hub_kernels": hub_kernels,
        "kernels": spec.origin if spec is not None and inside_pack(spec.origin) else None,
    }
