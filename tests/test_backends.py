"""Platform detection and implementation resolution, with a simulated Ascend NPU."""

import sys
import types

import pytest
import torch

from omnivideo import compat
from omnivideo.backends import Platform, backend_report, detect, implementations, platform, resolve
from omnivideo.backends.registry import clear_cache
from omnivideo.integration.attention_patch import describe_notes
from omnivideo.nodes.backend_info import OmniVideoBackendInfo

CPU = Platform("cpu", torch.device("cpu"), "test")


@pytest.fixture
def fake_npu(fake_torch_npu):
    return fake_torch_npu


@pytest.fixture
def NPU(fake_npu):
    return Platform("npu", torch.device("npu:0"), "test")


@pytest.fixture
def fake_mindiesd(monkeypatch):
    module = types.ModuleType("mindiesd")
    module.attention_forward_varlen = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "mindiesd", module)
    return module


def test_detects_npu_through_torch_npu(monkeypatch, fake_npu):
    monkeypatch.delenv("OMNIVIDEO_DEVICE", raising=False)
    monkeypatch.setattr(compat, "comfy_torch_device", lambda: None)
    found = detect()
    assert (found.name, found.device) == ("npu", torch.device("npu:0"))
    assert found.device_name == "Ascend910B (fake)"


def test_detects_cpu_without_accelerators(monkeypatch):
    monkeypatch.delenv("OMNIVIDEO_DEVICE", raising=False)
    monkeypatch.setattr(compat, "comfy_torch_device", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    assert detect().name == "cpu"
    monkeypatch.setenv("OMNIVIDEO_DEVICE", "npu")
    with pytest.raises(RuntimeError, match="OMNIVIDEO_DEVICE=npu needs torch_npu"):
        detect()


def test_env_override_wins_and_is_validated(monkeypatch, fake_npu):
    monkeypatch.setenv("OMNIVIDEO_DEVICE", "cpu")
    assert detect().name == "cpu" and "override" in detect().reason
    monkeypatch.setenv("OMNIVIDEO_DEVICE", "npu")
    assert detect().device == torch.device("npu:0")
    monkeypatch.setenv("OMNIVIDEO_DEVICE", "tpu")
    with pytest.raises(ValueError, match="OMNIVIDEO_DEVICE='tpu'"):
        detect()


def test_follows_comfyui_device_choice(monkeypatch, fake_npu):
    """Inside ComfyUI the registry agrees with comfy.model_management, even if torch_npu exists."""
    monkeypatch.delenv("OMNIVIDEO_DEVICE", raising=False)
    monkeypatch.setattr(compat, "comfy_torch_device", lambda: torch.device("cpu"))
    assert detect().name == "cpu" and "ComfyUI" in detect().reason
    monkeypatch.setattr(compat, "comfy_torch_device", lambda: torch.device("npu", 1))
    assert detect().device == torch.device("npu", 1)


def test_wan_vae_resolution_per_platform(monkeypatch, NPU):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve("wan_vae", "auto", CPU).name == "torch"
    fell = resolve("wan_vae", "triton", CPU)
    assert fell.name == "torch" and "fell back to torch" in fell.reason and "Triton" in fell.reason
    on_npu = resolve("wan_vae", "triton", NPU)
    assert on_npu.name == "torch" and "this is npu" in on_npu.reason
    assert resolve("wan_vae", "off", NPU).reason == "requested"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the CPU interpreter makes Triton usable (tests)
    assert resolve("wan_vae", "triton", CPU).name == "torch"  # answers are cached per process...
    clear_cache()  # ...until the cache is cleared
    assert resolve("wan_vae", "triton", CPU).name == "triton"


def test_npu_attention_needs_mindiesd(monkeypatch, fake_mindiesd, NPU):
    assert resolve("attention", "npu_fusion_varlen", NPU).name == "npu_fusion_varlen"
    monkeypatch.delitem(sys.modules, "mindiesd")
    monkeypatch.setitem(sys.modules, "mindiesd", None)
    clear_cache()
    fell = resolve("attention", "npu_fusion_varlen", NPU)
    assert fell.name != "npu_fusion_varlen" and "mindiesd is not importable" in fell.reason
    assert resolve("attention", "npu_fusion_varlen", CPU).name != "npu_fusion_varlen"


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="choose from auto, triton, torch, off"):
        resolve("wan_vae", "cudnn")
    with pytest.raises(KeyError, match="unknown op 'convolution'"):
        resolve("convolution")


def test_every_implementation_loads_and_runs_where_usable():
    """What "usable" promises: the implementation loads, and runs. Attention: each usable one on a tiny input
    (rows [prefix 8 | video 1x4x4]) at sparsity 0 gives SDPA's result. Wan VAE: the fusion module has its ops."""
    from omnivideo.attention.dispatch import _call
    from omnivideo.attention.rows import AttnRows

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 16, generator=g) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    ran = []
    for name, impl in implementations("attention").items():
        if impl.unusable_reason(platform.PLATFORM) is None:
            out = _call(impl.load(), q, k, v, scale=None, rows=AttnRows(8, (1, 4, 4)), sparsity=0.0, block_size=16)
            torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5, msg=f"attention/{name}")
            ran.append(name)
    assert {"sdpa", "flash_varlen", "torch_block_sparse", "rainfusion_reference"} <= set(ran), ran
    for name, impl in implementations("wan_vae").items():
        if impl.unusable_reason(platform.PLATFORM) is None and name != "off":
            ops = impl.load()
            assert callable(ops.cat_pad_5d) and callable(ops.dup_up3d_add), f"wan_vae/{name}"


def test_report_and_node(monkeypatch, NPU, fake_mindiesd):
    text = backend_report(NPU)
    assert "platform: npu" in text and "Ascend910B (fake)" in text
    assert "wan_vae: auto -> torch" in text
    assert "triton: unusable - triton runs on cuda/cpu, this is npu" in text
    assert "torch " + torch.__version__ in text and "diffusers" in text
    assert "torch.distributed backend cpu:gloo,npu:hccl" in text  # OmniVideo Parallel on Ascend
    out = OmniVideoBackendInfo.execute()
    expected = [backend_report(), "parallel: no workers running", describe_notes()]
    assert out.args[0] == "\n".join(expected) and out.args[0].startswith("platform: ")
    assert "\nattention patches:" in out.args[0]
