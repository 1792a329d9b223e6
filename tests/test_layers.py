"""The package's layers point down only, and only compat/ imports ComfyUI.

    nodes -> integration -> pipelines -> parallel -> models -> attention | kernels -> backends;  compat: a leaf anyone
    may use

`integration/` holds what follows ComfyUI's rules (names resolved inside its folders, the attention patch of core
models); `parallel/` is the torch.distributed world the pipelines drive (its worker loop finds a family's pipeline
module by name, `parallel/ops.py`); `attention/` and `kernels/` sit side by side and do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACK = Path(__file__).resolve().parents[1]
RANK = {
    "nodes": 7,
    "integration": 6,
    "pipelines": 5,
    "parallel": 4,
    "models": 3,
    "attention": 2,
    "kernels": 2,
    "backends": 1,
}
COMFYUI_MODULES = {
    "comfy",
    "comfy_api",
    "comfy_execution",
    "comfy_extras",
    "folder_paths",
    "server",
    "execution",
    "node_helpers",
    "latent_preview",
}
FILES = sorted(
    p
    for p in PACK.rglob("*.py")
    if not {"tests", "benchmarks", ".venv", ".comfy-venv", ".comfy33-venv", "build"} & set(p.relative_to(PACK).parts)
)


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(PACK).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path):
    """(line, absolute module parts inside the pack or None, top-level name of an outside import)."""
    here = _module(path)
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = [*base, *(node.module.split(".") if node.module else [])]
            names = [a.name for a in node.names]
            # `from .. import compat` names a module; `from ..x import y` names something in x
            yield node.lineno, (target + names[:1]) if not node.module else target, None
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, None, node.module.split(".")[0]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, None, alias.name.split(".")[0]


def _layer(parts: list[str]) -> tuple[str, int]:
    top = parts[0] if parts else ""
    if top == "compat":
        return top, 0
    if top in RANK:
        return top, RANK[top]
    return top, 8  # the pack's __init__ (registration) sits on top


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACK)) for p in FILES])
def test_imports_point_down(path):
    here_top, here_rank = _layer(_module(path))
    wrong = []
    for line, target, outside in _imports(path):
        if target is None:
            if outside in COMFYUI_MODULES and here_top != "compat":
                wrong.append(f"line {line}: imports ComfyUI's {outside}; only compat/ may (use compat instead)")
            continue
        top, rank = _layer(target)
        if top == here_top or top == "compat" and here_top != "compat":
            continue
        if here_top == "compat" or rank >= here_rank:
            wrong.append(f"line {line}: {here_top} (layer {here_rank}) imports {'.'.join(target)} (layer {rank})")
    assert not wrong, f"{path.relative_to(PACK)} points up or sideways:\n" + "\n".join(wrong)


def _module_named(parts: list[str]) -> tuple[str, ...] | None:
    """The pack's module an import names: `parts` itself (a module or a package), or the module holding the name."""
    for candidate in (parts, parts[:-1]):
        base = PACK.joinpath(*candidate)
        if candidate and (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            return tuple(candidate)
    return None


def _import_graph() -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    """Each module of the pack -> the pack's modules it imports (anywhere in the file, lazy imports included)."""
    graph = {}
    for path in FILES:
        here = tuple(_module(path))
        named = (_module_named(target) for _, target, _ in _imports(path) if target)
        graph[here] = {module for module in named if module and module != here}
    return graph


def _cycle(graph: dict) -> list | None:
    """One import cycle of `graph` (its modules in order, the first again at the end), or None."""
    done: set = set()
    path: list = []

    def visit(module):
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if found := visit(imported):
                return found
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if found := visit(module):
            return found
    return None


def test_no_import_cycles():
    """No module imports one that imports it back, directly or around a circle; a lazy import inside a function only
    hides a circle (the two modules still need each other), so it counts too."""
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(".".join(module) or "omnivideo" for module in cycle)


def test_the_cycle_check_is_checked():
    """The graph holds the pack's imports (lazy ones too) and a circle in it is found."""
    graph = _import_graph()
    assert ("pipelines", "h3", "parallel") in graph[("pipelines", "h3", "sampler")]
    assert ("parallel", "ops") in graph[("parallel", "worker")]
    back = {**graph, ("pipelines", "h3", "denoise"): {("pipelines", "h3", "sampler")}}
    assert _cycle(back) is not None
    assert _cycle({("a",): {("b",)}, ("b",): {("c",)}, ("c",): {("a",)}}) == [("a",), ("b",), ("c",), ("a",)]


def test_the_rule_is_checked():
    """The walk sees relative imports: a pipeline importing a node would be found."""
    fake = PACK / "pipelines" / "omnidreams" / "autoregressive.py"
    found = {tuple(t) for _, t, _ in _imports(fake) if t}
    assert ("models", "omnidreams", "dit") in found and ("compat",) in found
    assert _layer(["nodes", "h3"])[1] > _layer(["pipelines"])[1] > _layer(["models"])[1] > _layer(["attention"])[1]
