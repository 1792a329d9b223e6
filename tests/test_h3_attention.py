"""H3 through our attention processors: backends agree with SDPA, RainFusion really sparsifies,
and every call receives the right rows (`AttnRows`)."""

from __future__ import annotations

import pytest
import torch
from support.h3_tiny import FRAMES, keyframe_images, make_models, text_inputs

from omnivideo import compat
from omnivideo.attention.config import AttentionConfig
from omnivideo.models.h3.attention import h3_attention
from omnivideo.models.h3.loader import geometry_of, latent_norm_of
from omnivideo.models.handles import H3Conditioning, H3Model
from omnivideo.pipelines.h3 import sample
from omnivideo.pipelines.h3.keyframes import encode_keyframes

CPU = torch.device("cpu")
W, H = 256, 256  # latent 16x16 -> patch grid (37, 8, 8): 2368 video rows = 19 blocks, 8x8 tiles exist
KW = dict(seed=3, frames=FRAMES, steps=3, width=W, height=H)


@pytest.fixture(scope="module")
def parts():
    transformer, vae, audio_vae = make_models(seed=1)
    parts = {"geometry": geometry_of(transformer, vae, audio_vae), "latent_norm": latent_norm_of(vae, audio_vae)}
    return transformer, vae, parts


def _model(parts, attention):
    transformer, _, loaded = parts
    patcher = compat.manage(transformer, "diffusion", CPU)
    return H3Model(patcher=patcher, dtype=torch.float32, attention=attention, **loaded)


@pytest.fixture(scope="module")
def cond():
    emb, tags = text_inputs()
    return H3Conditioning(text=emb, text_token_tags=tags)


@pytest.fixture(scope="module")
def dense(parts, cond):
    return sample(_model(parts, None), cond, **KW)


def _diff(a, b):
    return max(
        (a.video - b.video).abs().max().item(),
        (a.audio - b.audio).abs().max().item(),
    )


def test_flash_varlen_equals_sdpa(parts, cond, dense):
    out = sample(_model(parts, AttentionConfig(backend="flash_varlen")), cond, **KW)
    assert _diff(out, dense) <= 1e-5


def test_rainfusion_sparsity_zero_equals_sdpa(parts, cond, dense):
    out = sample(_model(parts, AttentionConfig(backend="rainfusion", sparsity=0.0, min_video_blocks=1)), cond, **KW)
    assert _diff(out, dense) <= 1e-5


def test_rainfusion_sparse_differs_but_finite(parts, cond, dense, caplog):
    caplog.set_level("INFO", logger="omnivideo")
    out = sample(_model(parts, AttentionConfig(backend="rainfusion", sparsity=0.8, min_video_blocks=1)), cond, **KW)
    assert torch.isfinite(out.video).all() and torch.isfinite(out.audio).all()
    assert _diff(out, dense) > 1e-4
    assert "sparse calls" in caplog.text  # realized sparsity reported once per run


def _recorded_run(monkeypatch, model, cond):
    """(kind, layer, AttnRows, seq_len) of every attention call the processors make during one sampler run."""
    from omnivideo.models.h3 import attention as h3_attn

    calls = []
    real = h3_attn.attention

    def recording(q, k, v, config=None, **kw):
        calls.append(("block" if "layer" in kw else "refiner", kw.get("layer"), kw["rows"], q.shape[1]))
        return real(q, k, v, config, **kw)

    monkeypatch.setattr(h3_attn, "attention", recording)
    sample(model, cond, **{**KW, "steps": 2})
    return calls


@pytest.mark.parametrize("backend", ["sdpa", "flash_varlen"])
def test_processor_gets_rows_t2va(monkeypatch, parts, cond, backend):
    calls = _recorded_run(monkeypatch, _model(parts, AttentionConfig(backend=backend)), cond)
    n_text = cond.text.shape[1]
    audio_rows = 2 * round(FRAMES / 24 * 40)
    video_rows = 37 * 8 * 8
    refiner = [c for c in calls if c[0] == "refiner"]
    blocks = [c for c in calls if c[0] == "block"]
    assert len(refiner) == 1 and len(blocks) == 2  # one forward: 1 refiner layer, 2 blocks
    assert [c[1] for c in blocks] == [0, 1]
    _, _, rows, seq = refiner[0]
    assert seq == n_text and rows.prefix_len == n_text and rows.grid is None
    real = n_text + audio_rows + video_rows
    for _, _, rows, seq in blocks:
        assert rows.prefix_len == n_text + audio_rows  # video start
        assert rows.grid == (37, 8, 8)
        if backend == "flash_varlen":
            assert seq % 128 == 0 and seq > real and rows.kv_lengths == (real,)
        else:
            assert seq == real and rows.kv_lengths is None


def test_processor_gets_rows_fl2va(monkeypatch, parts):
    transformer, vae, _ = parts
    first, last = keyframe_images()
    emb, tags = text_inputs(n_vision_blocks=2)
    kf = encode_keyframes(vae, first, last, W, H, CPU)
    cond = H3Conditioning(text=emb, text_token_tags=tags, keyframes=kf)
    calls = _recorded_run(monkeypatch, _model(parts, None), cond)
    blocks = [c for c in calls if c[0] == "block"]
    n_text, cond_rows, audio_rows = emb.shape[1], 2 * 8 * 8, 2 * round(FRAMES / 24 * 40)
    assert all(c[2].prefix_len == n_text + cond_rows + audio_rows and c[2].grid == (37, 8, 8) for c in blocks)


def test_processors_are_restored_and_layout_is_checked(parts):
    transformer = parts[0]
    before = {k: type(v) for k, v in transformer.attn_processors.items()}
    with pytest.raises(RuntimeError, match="did not set the layout"):
        with h3_attention(transformer, None):
            e, t = text_inputs()
            from omnivideo.models.h3.geometry import resolve_shape
            from omnivideo.pipelines.h3.layout import build_layout

            lay = build_layout(t, resolve_shape(FRAMES, W, H, parts[2]["geometry"]), parts[2]["geometry"])
            transformer(
                hidden_states=torch.zeros(1, 2368, 96),
                audio_hidden_states=torch.zeros(1, 414, 32),
                encoder_hidden_states=e,
                timestep=torch.tensor([0.5]),
                timestep_indices=torch.zeros(lay.total_len, dtype=torch.long),
                **lay.forward_kwargs(),
            )
    assert {k: type(v) for k, v in transformer.attn_processors.items()} == before
