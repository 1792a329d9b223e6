"""Test-wide settings. Triton kernels run on CPU through the interpreter, which must be
switched on before any kernel module is imported."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMNIVIDEO_DEVICE", "")  # detection, unless a test overrides it
# A parallel rank waits at most this long in one collective (also in the ComfyUI servers the integration tests start,
# which inherit it): a desynchronised world fails the test instead of hanging the suite.
os.environ.setdefault("OMNIVIDEO_DIST_TIMEOUT", "120")
torch.backends.cudnn.benchmark = False  # bit-equality on GPU needs deterministic algorithm choice
# ComfyUI runs in its own working directory: relative COMFYUI_PATH / COMFYUI_PYTHON (as README's commands give them)
# are made absolute here (not resolved: a venv's python is a link that must stay one).
if os.environ.get("COMFYUI_PATH"):
    os.environ["COMFYUI_PATH"] = os.path.abspath(os.path.expanduser(os.environ["COMFYUI_PATH"]))
if os.sep in os.environ.get("COMFYUI_PYTHON", ""):  # a path, not a command name looked up on PATH
    os.environ["COMFYUI_PYTHON"] = os.path.abspath(os.path.expanduser(os.environ["COMFYUI_PYTHON"]))


# ---------------------------------------------------------------------------------------------
# A simulated Ascend NPU. The real torch_npu renames torch's extension backend to "npu" and
# registers a `torch.npu` module; both are process-wide, so the fake stays registered but
# reports no device outside the tests that ask for one (torch.compile consults it).

import sys  # noqa: E402
import types  # noqa: E402

_NPU_MODULE = None


def _npu_module():
    global _NPU_MODULE
    if _NPU_MODULE is None:
        if torch._C._get_privateuse1_backend_name() != "npu":
            torch.utils.rename_privateuse1_backend("npu")
        module = types.ModuleType("torch.npu")
        module.is_available = lambda: False
        module.device_count = lambda: 0
        module.current_device = lambda: 0
        module.get_device_name = lambda device=None: "Ascend910B (fake)"
        torch._register_device_module("npu", module)
        _NPU_MODULE = module
    return _NPU_MODULE


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """`import torch_npu` works and `torch.npu` reports one device; CUDA reports none."""
    module = _npu_module()
    monkeypatch.setattr(module, "is_available", lambda: True)
    monkeypatch.setattr(module, "device_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return module


@pytest.fixture(autouse=True)
def _fresh_backend_resolutions():
    """`resolve()` caches its answers per process; tests fake modules and env vars, so each starts clean."""
    from omnivideo.backends.registry import clear_cache

    clear_cache()
    yield
    clear_cache()


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    """The ComfyUI checkout named by COMFYUI_PATH; tests that need a real ComfyUI skip without one."""
    raw = os.environ.get("COMFYUI_PATH")
    if not raw:
        pytest.skip(
            "COMFYUI_PATH is not set: point it at a ComfyUI checkout (the folder with main.py) to run the "
            "real-ComfyUI tests; COMFYUI_PYTHON selects its interpreter"
        )
    path = Path(raw).expanduser().resolve()
    if not (path / "main.py").is_file() or not (path / "comfy").is_dir():
        pytest.skip(f"COMFYUI_PATH={raw} is not a ComfyUI checkout (no main.py / comfy/ there)")
    return path


REPO = Path(__file__).resolve().parents[1]


class _RootIsNotAPackage:
    """pytest collects a folder holding an __init__.py as a Package, and imports that __init__.py (for a setup_module)
    under the folder's name with the folder above it put on sys.path. The repository root is the pack itself, so that
    made a second copy of the pack (`main.*` beside `omnivideo.*`, support/import_isolation.py catches it) and its
    parent folder importable: collected as a plain folder instead (a plugin, so it applies above this conftest)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path == REPO:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    config.pluginmanager.register(_RootIsNotAPackage(), "omnivideo-root-is-not-a-package")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Every test that needs a real ComfyUI (its fixture closure holds `comfyui_path`: the server, the probes, the
    browser, comfy-cli) is marked `comfyui`, so CI can rerun just those against a second ComfyUI (`-m comfyui`)."""
    for item in items:
        if "comfyui_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.comfyui)


@pytest.fixture
def comfy_folders(tmp_path, monkeypatch):
    """ComfyUI's folders (models/<kind>, output) in a temp dir, as compat reports them inside ComfyUI."""
    from support.comfy_folders import patch_comfy_folders

    return patch_comfy_folders(monkeypatch, tmp_path / "comfyui")
