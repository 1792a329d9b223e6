"""Test-wide settings. Triton kernels run on CPU through the interpreter, which must be
switched on before any kernel module is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMNIVIDEO_DEVICE", "")  # detection, unless a test overrides it
torch.backends.cudnn.benchmark = False  # bit-equality on GPU needs deterministic algorithm choice


# ---------------------------------------------------------------------------------------------
# A simulated Ascend NPU. The real torch_npu renames torch's extension backend to "npu" and
# registers a `torch.npu` module; both are process-wide, so the fake stays registered but
# reports no device outside the tests that ask for one (torch.compile consults it).

import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402

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
