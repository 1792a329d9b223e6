"""OmniDreams Stream's resume_from file is checked from its header before anything runs: a REAL saved state (tiny
DiT, ComfyUI's own Wan 2.1 VAE modules at tiny width, an HD-map video) resumes bit for bit, and each crafted copy of
it gets one clear message naming resume_from, the file and what is wrong: at /prompt (validate_inputs: every key,
dtype and shape, the chunk and fill counters, the generator, the VAE caches' frame counts) or, for what depends on
the run, at execute before any DiT call or written frame (the model's KV geometry, the VAE and the size; also with
fusion=off). The ComfyUI side runs in tests/stream_state_comfy_probe.py (ComfyUI's interpreter)."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import save_file
from support.comfy_probe import run_probe

from omnivideo.pipelines.omnidreams.stream_state import MAX_STATE_HEADER_BYTES, StateFileError, read_state_file

pytestmark = pytest.mark.integration

ADVICE = "save_state_as wrote, unchanged"


@pytest.fixture(scope="module")
def probe(comfyui_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("stream_state_output")
    return run_probe("stream_state_comfy_probe.py", comfyui_path, env={"STREAM_STATE_OUT": str(out)})


def test_a_genuine_state_passes_and_resumes_bit_for_bit(probe):
    assert probe["genuine_at_prompt"] is True
    assert probe["resumed_bit_for_bit"]["equal"], (probe["resumed_bit_for_bit"], probe["frames"])
    keys = set(probe["keys"])
    assert {"chunk", "generator", "kv.used", "kv.k.0", "decode.frames", "decode.rep", "encode.frames"} <= keys
    assert any(k.startswith("encode.") and k.split(".")[1].isdigit() for k in keys)  # the HD-map encoder's cache


@pytest.mark.parametrize(
    "case, what",
    [
        ("no_generator", "its 'generator' entry is missing"),
        ("no_used", "its KV window has no 'used' count"),
        ("chunk_minus_one", "its chunk index is -1"),
        ("chunk_float", "its 'chunk' entry is [] float32, not [] int64"),
        ("not_safetensors", "its first 8 bytes give a header of"),
        ("truncated", "it cannot be read as a .safetensors file"),
        ("tiny_file", "the file holds 2 bytes"),
        ("huge_header", f"a stream state's is at most {MAX_STATE_HEADER_BYTES}"),
        ("unknown_key", "it holds tensors no stream state has: extra"),
        ("unknown_vae_key", "its decode cache has entries no VAE cache has: 07"),
        ("wrong_dtype", "its KV window blocks differ in dtype or shape"),
        ("vae_400_frames", ", 400, 4, 4]; it must be [1, C, T, H, W] with T from 1 to 2 frames"),
        ("bad_generator", "its noise generator state is not one torch can continue"),
        ("used_vs_chunk", "after chunk 7 its KV window fills 2 slots"),
        ("not_a_state", "its metadata does not say format 'omnidreams_stream_state'"),
    ],
)
def test_crafted_states_are_refused_at_prompt(probe, case, what):
    message = probe["at_prompt"][case]
    assert isinstance(message, str), f"{case} was accepted at /prompt"
    assert message.startswith(f"resume_from '{case}.safetensors' is not a usable OmniDreams stream state: "), message
    assert what in message and ADVICE in message, message
    assert "/" not in message.split("'")[1]  # the name as typed, never the output folder's path


@pytest.mark.parametrize(
    "case, what",
    [
        ("vae_wrong_size", "its decode cache entry 0 is [1, 16, 2, 8, 8] float32; this VAE at this size needs [1, 16,"),
        ("encoder_wrong_channels", "its encode cache entry 0 is [1, 4, 2, 32, 32] float32; this VAE at this size"),
        ("other_model", "its KV window has 2 blocks of [1, 16, 2, 32] float32; this model, size and window settings "),
        ("other_seed", "belongs to another rollout: seed 5 (this run: 6)"),
    ],
)
def test_states_of_another_run_are_refused_before_any_dit_call(probe, case, what):
    assert probe["at_prompt_of_run_cases"][case] is True  # only the run knows its model, VAE, size and seed
    refused = probe["at_execute"][case]
    file = "real" if case.startswith("other_") else case
    assert refused["message"].startswith(f"StateFileError: resume_from '{file}.safetensors'"), refused
    assert what in refused["message"], refused
    assert refused["dit_calls"] == 0 and refused["frames"] == 0, refused


def test_a_400_frame_vae_cache_fails_with_fusion_off_before_anything_runs(probe):
    refused = probe["node_400_frames_off"]
    assert "resume_from 'vae_400_frames.safetensors'" in refused["message"] and "400" in refused["message"], refused
    assert refused["dit_calls"] == 0 and refused["videos"] == [], refused


def test_the_header_check_reads_only_the_header_and_counters(tmp_path, monkeypatch):
    """A state with a 64 MiB KV window is checked without reading it: the tensors read are the small ones."""
    import safetensors

    real, read = safetensors.safe_open, []

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self.file.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.file, name)

    path = _write_state(tmp_path)
    monkeypatch.setattr(safetensors, "safe_open", Recording)
    with pytest.raises(StateFileError, match=r"resume_from 'big.safetensors' is not a usable .* its decode cache"):
        read_state_file(str(path), "resume_from 'big.safetensors'")
    assert read and set(read) <= {"chunk", "generator", "kv.used"}, read


def _write_state(tmp_path):
    """A state with a big KV window and no VAE caches (refused at its decode cache, after the KV checks)."""
    path = tmp_path / "big.safetensors"
    window = torch.zeros(1, 4096, 16, 128)  # 32 MiB each
    tensors = {
        "chunk": torch.tensor(1),
        "generator": torch.Generator().manual_seed(1).get_state(),
        "kv.used": torch.tensor(1),
        "kv.k.0": window,
        "kv.v.0": window.clone(),
    }
    meta = {"format": "omnidreams_stream_state", "seed": "1", "latent_hw": "[4, 4]"}
    save_file(tensors, str(path), {**meta, "window_frames": "6", "sink_frames": "0", "len_t": "2"})
    with open(path, "rb") as f:
        assert struct.unpack("<Q", f.read(8))[0] < 4096  # the header is small, the file is not
    return path
