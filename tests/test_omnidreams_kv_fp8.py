"""The fp8 KV window (the loader's kv_dtype "fp8_e4m3fn", FlashDreams' fp8 K/V cache): half the bytes of a bf16
window, K/V stored with scale 1 (saturating at e4m3's 448) and read back in the compute dtype; the video's
difference from the full-precision window measured on tiny random weights and bounded; a stream state resumes bit for
bit in fp8 and only in the dtype it was saved in."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo.models.omnidreams.kv_cache import FP8_STORAGE, RollingKVCache
from omnivideo.models.omnidreams.loader import build_dit
from omnivideo.pipelines import omnidreams as pipe
from omnivideo.pipelines.omnidreams.stream_state import check_state, state_metadata

H, W = 4, 6
CPU = torch.device("cpu")
FP8 = pipe.ARSettings(kv_dtype="fp8_e4m3fn")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return build_dit(stored_state_dict(TINY, seed=1), torch.float32)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(3)
    text = torch.randn(1, 16, TINY.text_in_dim, generator=g)
    return text, torch.randn(1, 16, 1, H, W, generator=g), torch.randn(1, 16, 12, H, W, generator=g)


def _run(model, text, settings, seed=5, **kw) -> pipe.Rollout:
    return pipe.Rollout(model, text=text, latent_hw=(H, W), seed=seed, device=CPU, settings=settings, **kw)


def _chunks(run, hdmap, chunks):
    try:
        return torch.cat([run.step(hdmap[:, :, 2 * k : 2 * k + 2]) for k in range(chunks)], dim=2)
    finally:
        run.close()


def _cache(dtype, storage_dtype=None):
    return RollingKVCache(
        num_blocks=2, chunk_tokens=3, window_chunks=2, heads=2, head_dim=4, dtype=dtype, device=CPU,
        storage_dtype=storage_dtype,
    )  # fmt: skip


def test_the_fp8_window_is_half_a_bf16_window_and_reads_back_in_the_compute_dtype():
    bf16, fp8 = _cache(torch.bfloat16), _cache(torch.bfloat16, FP8_STORAGE)
    assert fp8.nbytes * 2 == bf16.nbytes and fp8.k[0].dtype == FP8_STORAGE
    fp8.begin_chunk()
    k = torch.tensor([0.3, -1.7, 500.0, -1000.0]).repeat(1, 3, 2, 1).to(torch.bfloat16)
    seen_k, seen_v = fp8.update(0, k, k)
    assert seen_k.dtype == seen_v.dtype == torch.bfloat16
    # scale 1: e4m3 rounding (3 mantissa bits) inside the range, saturation at +-448 outside it
    assert seen_k[0, 0, 0].tolist() == [0.3125, -1.75, 448.0, -448.0]
    with pytest.raises(ValueError, match="stores torch.bfloat16 or torch.float8_e4m3fn, not torch.float16"):
        _cache(torch.bfloat16, torch.float16)


def test_an_fp8_window_changes_the_video_by_a_bounded_amount(model, inputs):
    text, first, hdmap = inputs
    full = _chunks(_run(model, text, pipe.ARSettings(), first_frame=first), hdmap, 6)
    fp8 = _chunks(_run(model, text, FP8, first_frame=first), hdmap, 6)
    other_seed = _chunks(_run(model, text, pipe.ARSettings(), seed=6, first_frame=first), hdmap, 6)
    error, signal = float((fp8 - full).abs().max()), float((other_seed - full).abs().max())
    assert 0 < error < 0.05 * signal, f"fp8 window: max |diff| {error:.3g}; another seed's: {signal:.3g}"
    assert torch.equal(fp8[:, :, :1], full[:, :, :1])  # the pinned first frame is the clean latent in both


def test_an_fp8_state_resumes_bit_for_bit_and_only_in_fp8(model, inputs, tmp_path):
    text, first, hdmap = inputs
    want = _chunks(_run(model, text, FP8, first_frame=first), hdmap, 5)
    part = _run(model, text, FP8, first_frame=first)
    head = [part.step(hdmap[:, :, 2 * k : 2 * k + 2]) for k in range(3)]
    save_file(part.state_dict(), str(tmp_path / "state.safetensors"))
    state = load_file(str(tmp_path / "state.safetensors"))
    assert state["kv.k.0"].dtype == FP8_STORAGE
    resumed = _run(model, text, FP8, first_frame=first)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([*head, _chunks(resumed, hdmap[:, :, 6:], 2)], dim=2), want)

    with pytest.raises(ValueError, match=r"float8_e4m3fn; this model, size and window settings need .* float32"):
        _run(model, text, pipe.ARSettings()).load_state_dict(state)
    with pytest.raises(ValueError, match=r"kv_dtype fp8_e4m3fn \(this run: auto\)"):
        check_state(state_metadata(5, (H, W), FP8), state_metadata(5, (H, W), pipe.ARSettings()))
    with pytest.raises(ValueError, match="kv_dtype 'fp16' is not one of auto, fp8_e4m3fn"):
        pipe.ARSettings(kv_dtype="fp16")
