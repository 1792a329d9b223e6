"""Streaming OmniDreams: ComfyUI's Wan 2.1 VAE decoding and encoding a chunk at a time with its causal caches
carried over (and through a saved state) gives exactly one decode / encode of the whole video. The ComfyUI side
runs in tests/wan_stream_comfy_probe.py (ComfyUI's interpreter)."""

from __future__ import annotations

import pytest
from support.comfy_probe import run_probe

from omnivideo.pipelines.omnidreams.stream import hdmap_pixel_frames

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def probe(comfyui_path):
    return run_probe("wan_stream_comfy_probe.py", comfyui_path, env={"TRITON_INTERPRET": "1"})


CASES = ["tiny/float32", "tiny/bfloat16", "slim/float32", "slim/bfloat16", "full/float32", "full/bfloat16"]


def result(probe, case: str) -> dict:
    r = probe[case]
    if "skipped" in r:  # full-size bf16 on a CPU without bf16 kernels (the probe says why)
        pytest.skip(r["skipped"])
    return r


@pytest.mark.parametrize("case", CASES)
def test_chunked_decode_equals_the_whole_decode(probe, case):
    r = result(probe, case)
    decodes = {k: v for k, v in r.items() if k.startswith("decode/")}
    assert decodes and all(d["equal"] for d in decodes.values()), decodes  # every fusion level, across a saved state
    assert r["frames"] == 1 + 4 * (r["frames"] // 4)  # 1 + 4 (T - 1) pixel frames


@pytest.mark.parametrize("case", CASES)
def test_chunked_encode_equals_the_whole_encode(probe, case):
    r = result(probe, case)
    assert r["encode"]["equal"] and r["encode/resumed"]["equal"], r


def test_hdmap_frames_follow_the_vae_grid():
    assert [hdmap_pixel_frames(k) for k in range(4)] == [5, 8, 8, 8]
    assert sum(hdmap_pixel_frames(k) for k in range(3)) == 1 + 4 * (2 * 3 - 1)


def test_resume_from_names_a_file_inside_the_output_folder(comfy_folders, tmp_path):
    import torch
    from safetensors.torch import load_file

    from omnivideo.nodes.omnidreams_stream import OmniDreamsStream, save_state
    from omnivideo.pipelines.omnidreams.stream_state import StreamState, check_state

    state = StreamState({"chunk": torch.tensor(3), "kv.k.0": torch.ones(1, 4, 2, 8)[:, :2]}, {"format": "x"})
    path = save_state("runs/drive", state)
    assert path.endswith("runs/drive.safetensors")
    assert save_state("runs/drive", state).endswith("runs/drive_00001.safetensors")  # never replaced
    assert torch.equal(load_file(path)["kv.k.0"], torch.ones(1, 2, 2, 8))
    node = OmniDreamsStream
    assert node.validate_inputs(resume_from="") is True
    # found, then read by its header: not a stream state (tests/test_stream_state_file.py: real and crafted states)
    refused = node.validate_inputs(resume_from="runs/drive.safetensors")
    assert refused.startswith("resume_from 'runs/drive.safetensors' is not a usable OmniDreams stream state"), refused
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"x")
    for bad in ("runs/missing.safetensors", "../elsewhere.safetensors", str(outside)):
        assert "resume_from" in node.validate_inputs(resume_from=bad), bad
    with pytest.raises(ValueError, match="not an OmniDreams stream state"):
        check_state({"format": "x"}, {"format": "omnidreams_stream_state"})
    with pytest.raises(ValueError, match=r"seed 1 \(this run: 2\)"):
        check_state({"format": "omnidreams_stream_state", "seed": "1"}, {"seed": "2"})
