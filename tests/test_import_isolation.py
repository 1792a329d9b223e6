"""The pack is importable only as a package (`omnivideo.*`), never its folders as top-level modules: the repository
root must not be on sys.path (support/import_isolation.py says why). `python -m pytest` from the checkout puts it
there and fails these tests; `pytest` does not (README "Tests"). The same facts inside a real ComfyUI:
integration/test_import_isolation_server.py."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import pytest
from support.import_isolation import isolation_report, pack_names

REPO = Path(__file__).resolve().parents[1]


def test_the_pack_names_cover_the_folders_that_shadow():
    assert {"kernels", "nodes", "models", "backends", "attention", "parallel", "compat"} <= set(pack_names(REPO))


def test_the_root_is_not_on_sys_path_and_no_pack_folder_is_a_top_level_module():
    import omnivideo  # noqa: F401  (the pack as a package: what `packages` must list)

    report = isolation_report(REPO)
    assert report["packages"] == ["omnivideo"], report
    problems = {k: v for k, v in report.items() if k != "packages" and v}
    assert not problems, (
        f"{problems}\nThe repository root is on sys.path (`python -m pytest` in the checkout?): run `pytest`"
    )


def test_pypi_kernels_is_the_one_imported():
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the PyPI package `kernels` is not installed here (transformers < 5 does not need it)")
    module = importlib.import_module("kernels")
    assert Path(module.__file__).resolve().parents[1] != REPO, module.__file__
    assert hasattr(module, "get_kernel"), sorted(vars(module))[:40]  # the hub's API, not the pack's kernels/
