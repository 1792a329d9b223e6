"""OmniVideo Wan VAE Decode against core VAE Decode on ComfyUI's own Wan VAE modules: bit for bit at every
fusion level, with no second copy of the VAE and core's forwards back in place afterwards.

ComfyUI's Wan VAE classes need ComfyUI importable, so tests/wan_vae_comfy_probe.py runs in ComfyUI's
interpreter (COMFYUI_PYTHON) and reports JSON; skipped without COMFYUI_PATH."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _probe(group: str, comfy_path: str) -> dict:
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    env = {**os.environ, "COMFYUI_PATH": comfy_path}
    proc = subprocess.run(
        [python, str(REPO / "tests" / "wan_vae_comfy_probe.py"), group],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")), None)
    assert line is not None, (
        f"probe {group} failed (rc {proc.returncode}; set COMFYUI_PYTHON to ComfyUI's interpreter):\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture(scope="module")
def probe(comfyui_path):
    if not (comfyui_path / "comfy" / "ldm" / "wan" / "vae2_2.py").is_file():
        pytest.skip(f"COMFYUI_PATH={comfyui_path} has no comfy/ldm/wan/vae2_2.py")
    return lambda group: _probe(group, str(comfyui_path))


def _check_levels(case: dict, version: str):
    assert case["levels"], case
    for fusion, got in case["levels"].items():
        where = f"fusion={fusion}"
        assert got["shape"] == case["shape"] and got["dtype"] == "torch.float32", (where, got)
        assert got["equal"], f"{where}: differs from core VAE Decode by {got['max_abs_diff']}"
        assert got["resolved"] == fusion, (where, got["resolved"])  # the node's choice is the registry's name
        if fusion == "off":
            assert got["calls"] == {}, (where, got["calls"])  # ComfyUI's own forwards
        else:  # the fast forwards ran, and the fused ops of that level: every cached conv, and DupUp3D for 2.2
            module = "wan_vae_triton" if fusion == "triton" else "wan_vae_torch"
            assert got["calls"].get("fast_forwards._norm_silu", 0) > 0, (where, got["calls"])
            # ComfyUI's 2026 2.1 decoder: one cat per conv already, nothing for cat_pad_5d to fuse
            assert (got["calls"].get(f"{module}.cat_pad_5d", 0) > 0) != case["pieces"], (where, got["calls"])
            assert (got["calls"].get(f"{module}.dup_up3d_add", 0) > 0) == (version == "2.2"), (where, got["calls"])


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_tiny_vaes_bit_identical_to_core(probe, version, dtype):
    result = probe("tiny")
    _check_levels(result[f"{version}/{dtype}"], version)
    _check_levels(result[f"{version}/{dtype}/slim"], version)  # Triton (interpreted on CPU)
    frames = 1 + 4 * (3 - 1)  # 3 latent frames -> core's frame count
    batch = 2 if dtype == "float32" else 1
    assert result[f"{version}/{dtype}"]["shape"] == [batch * frames, 32, 32, 3]


@pytest.mark.integration
def test_no_second_copy_and_core_forwards_afterwards(probe):
    s = probe("tiny")["structure"]
    # no parameter tensor is created, before, during or after our decode; the weights stay where they were
    assert s["params_before"] == s["params_during"] == s["params_after"], s
    assert s["same_parameter_storage"]
    # the fast forwards are on ComfyUI's modules only while our decode runs
    assert s["patched_during"] > 0 and s["patched_after"] == [], s
    # core VAE Decode of the same VAE object afterwards: no fused op runs, and the same pixels
    assert s["core_after_ours_fused_calls"] == 0 and s["core_after_ours"]["equal"], s["core_after_ours"]
    # one progress step per decoder call (its latent frames x batch), through ComfyUI's progress bar
    assert [v for v, _ in s["progress"]] == s["expected_progress"], s["progress"]
    assert s["expected_progress"][-1] == s["latent_frames"] and len(s["progress"]) > 1
    assert {t for _, t in s["progress"]} == {s["latent_frames"]}
    # an interrupt inside the decode stops it and still restores the VAE
    assert s["interrupt"] == "raised" and s["patched_after_interrupt"] == []


@pytest.mark.integration
def test_full_size_wan21_bit_identical_to_core(probe):
    result = probe("full21")
    assert result["params"] > 100_000_000  # the released Wan 2.1 VAE geometry (~127M with the encoder)
    for key in ("fp32", "fp32/triton", "bf16"):
        _check_levels(result[key], "2.1")
    assert result["fp32"]["shape"] == [9, 64, 64, 3]


def test_wan_class_vaes_of_other_shapes_get_cores_decode_unchanged(probe):
    """VAEs on core's Wan classes whose shapes the fast path does not know (a spatial patch of 1, a one-tap temporal
    conv, on 0.33 a 6-channel head): core's decode, bit for bit, at every fusion level, no fused op called."""
    result = probe("unknown")
    assert len(result) >= 6, result  # two cases (three on 0.33) x three fusion levels
    for case, got in result.items():
        assert got["equal"], f"{case}: {got}"
        assert got.get("fused_calls", 0) == 0, f"{case}: the fast path ran ({got})"
