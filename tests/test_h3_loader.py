"""H3 loader (folder, single file, dtype islands, errors), frame/size validation, text encoding and embeddings."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from support.h3_tiny import keyframe_images, make_models, to_original_keys, write_folder
from support.h3_tiny_qwen import LAYER, tiny_processor, tiny_qwen3vl

from omnivideo import compat
from omnivideo.models.h3.folder import H3LoadError
from omnivideo.models.h3.geometry import H3Geometry, check_canvas, resolve_shape, snap_frames
from omnivideo.models.h3.loader import load_h3
from omnivideo.models.h3.text import H3TextEncoder, encode_prompt, load_embedding, save_embedding

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    transformer, vae, audio_vae = make_models(seed=2)
    base = tmp_path_factory.mktemp("h3load")
    return transformer, vae, audio_vae, write_folder(base / "full", transformer, vae, audio_vae), base


def test_folder_loads_with_fp32_islands(tiny):
    transformer, _, _, root, _ = tiny
    model, vae, audio_vae = load_h3(root, "bf16", device=CPU)
    params = dict(model.transformer.named_parameters())
    assert params["proj_in.weight"].dtype == torch.float32  # island
    assert params["audio_proj_out.weight"].dtype == torch.float32
    assert params["time_embedder.linear_1.weight"].dtype == torch.float32
    assert params["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert model.transformer.rope.inv_freq.dtype == torch.float32
    assert torch.equal(model.transformer.rope.inv_freq, transformer.rope.inv_freq)
    assert all(p.dtype == torch.float32 for p in audio_vae.model.module.parameters())
    assert model.family == "h3" and model.scheduler_config["shift"] == 12.0
    assert model.audio_scheduler_config["shift"] == 3.0


def test_scaled_fp8_single_file_is_dequantized_with_its_scales(tiny):
    """ComfyUI's scaled-fp8 layout (fp8 matrices, `<layer>.scale_weight`, the `scaled_fp8` marker) in original
    keys: each matrix comes back as its fp8 value times its own scale."""
    transformer, _, _, root, base = tiny
    sd = to_original_keys(transformer.state_dict())
    scaled = dict(sd)
    for key, w in sd.items():
        if key.startswith("blocks.") and w.dim() == 2:
            scale = w.abs().max().float() / 448.0
            scaled[key] = (w.float() / scale).to(torch.float8_e4m3fn)
            scaled[key[: -len("weight")] + "scale_weight"] = scale.reshape(())
    quantized = [k for k in scaled if k.endswith("scale_weight")]
    assert quantized, "the tiny checkpoint's block keys changed: quantize its block matrices here"
    scaled["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    sf = base / "h3_scaled_fp8.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in scaled.items()}, str(sf))
    model, _, _ = load_h3(root, "fp32", transformer_file=sf, device=CPU)
    plain = load_h3(root, "fp32", device=CPU)[0].transformer.state_dict()
    ours = model.transformer.state_dict()
    assert ours.keys() == plain.keys()
    changed = [k for k in plain if not torch.equal(ours[k], plain[k])]
    assert changed and all(k.startswith("transformer_blocks.") for k in changed)  # only the quantized block matrices
    for key in changed:  # each by e4m3's rounding, scaled back
        torch.testing.assert_close(ours[key], plain[key], rtol=0.07, atol=plain[key].abs().max().item() / 448)


def test_wrong_and_incomplete_folders(tiny, tmp_path):
    transformer, vae, audio_vae, root, _ = tiny
    with pytest.raises(H3LoadError, match="is not a folder"):
        load_h3(tmp_path / "nope")
    with pytest.raises(H3LoadError, match="no transformer/config.json"):
        load_h3(tmp_path)
    other = tmp_path / "other"
    (other / "transformer").mkdir(parents=True)
    (other / "transformer" / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    with pytest.raises(H3LoadError, match="WanTransformer3DModel transformer, not MiniMax-H3"):
        load_h3(other)
    partial = write_folder(tmp_path / "partial", transformer, vae, audio_vae)
    (partial / "audio_vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(H3LoadError, match="missing: audio_vae weights"):
        load_h3(partial)
    noweights = write_folder(tmp_path / "now", transformer, vae, audio_vae, transformer_weights=False)
    with pytest.raises(H3LoadError, match="transformer weights"):
        load_h3(noweights)
    bad = write_folder(tmp_path / "bad", transformer, vae, audio_vae)
    cfg = json.loads((bad / "transformer" / "config.json").read_text())
    cfg["num_layers"] = 3
    (bad / "transformer" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(H3LoadError, match="missing .*transformer_blocks.2"):
        load_h3(bad)


def test_frame_and_size_validation():
    geo = H3Geometry()
    assert snap_frames(121, geo) == 124 and snap_frames(124, geo) == 124 and snap_frames(209, geo) == 209
    with pytest.raises(ValueError, match=r"snaps to 107 .*Use between 124 and 345 frames"):
        snap_frames(100, geo)
    with pytest.raises(ValueError, match=r"Use between 124 and 345"):
        snap_frames(400, geo)
    with pytest.raises(ValueError, match=r"multiples of 32: width 1000 -> 992 or 1024"):
        check_canvas(1000, 768, geo)
    with pytest.raises(ValueError, match=r"height 770 -> 768 or 800"):
        check_canvas(1344, 770, geo)
    s = resolve_shape(209, 1344, 768, geo)  # the spec's example: 62 x 48 x 84 latents, 696 audio rows
    assert (s.num_latent_frames, s.latent_height, s.latent_width) == (62, 48, 84)
    assert 2 * s.num_audio_latents == 696


def test_limits_agree_with_diffusers():
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline as P

    from omnivideo.models.h3 import geometry
    from omnivideo.pipelines.h3 import keyframes

    assert (geometry.MIN_SECONDS, geometry.MAX_SECONDS) == (P.min_duration.fget(None), P.max_duration.fget(None))
    assert keyframes.PIXEL_MEAN == P.pixel_mean.fget(None) and keyframes.ENCODE_SEED == P.keyframe_encode_seed.fget(
        None
    )


# --- text encoding: a tiny Qwen3-VL (4 layers, layer 2) and a byte-level tokenizer built in the test, no downloads


@pytest.fixture(scope="module")
def tiny_qwen():
    model, tokenizer, image_processor = tiny_qwen3vl()
    return H3TextEncoder(
        compat.manage(model, "text_encoder", CPU), tokenizer, tiny_processor(tokenizer, image_processor), layer=LAYER
    )


def _diffusers_text(te, monkeypatch, prompt, keyframes):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep, MiniMaxH3TextEncoderStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    monkeypatch.setattr(MiniMaxH3ModularPipeline, "text_encoder_layer", property(lambda self: te.layer))
    block = MiniMaxH3FL2VATextEncoderStep() if keyframes else MiniMaxH3TextEncoderStep()
    pipe = block.init_pipeline()
    pipe.update_components(text_encoder=te.model, tokenizer=te.tokenizer, processor=te.processor)
    kw = {"keyframes": keyframes} if keyframes else {}
    return pipe(prompt=prompt, output=["prompt_embeds", "text_token_tags"], **kw)


@pytest.mark.parametrize("with_keyframes", [False, True])
def test_text_encoding_matches_diffusers(tiny_qwen, monkeypatch, with_keyframes):
    first, last = keyframe_images()
    frames = [first.resize((96, 64)), last.resize((96, 64))] if with_keyframes else []
    ref = _diffusers_text(tiny_qwen, monkeypatch, "A red fox runs.", frames)
    emb, tags = encode_prompt(tiny_qwen, "A red fox runs.", frames)
    assert torch.equal(tags, ref["text_token_tags"])
    assert (emb - ref["prompt_embeds"]).abs().max() <= 1e-6
    assert int((tags == 0).sum()) == (2 * (2 + 6) if with_keyframes else 0)  # vision rows tagged video


def test_embeddings_roundtrip_and_errors(tmp_path):
    emb, tags = torch.randn(1, 5, 40), torch.tensor([1, 1, 0, 0, 1])
    path = save_embedding(str(tmp_path / "e.safetensors"), emb, tags)
    e2, t2 = load_embedding(path)
    assert torch.equal(e2, emb) and torch.equal(t2, tags)
    save_file({"other": emb}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="no 'prompt_embeds'"):
        load_embedding(tmp_path / "x.safetensors")


def test_text_encoder_folder_loads_and_checks_layer(tmp_path):
    from support.h3_tiny_qwen import write_text_encoder_folder

    from omnivideo.models.h3.text import load_text_encoder

    folder = write_text_encoder_folder(tmp_path / "qwen", *tiny_qwen3vl())
    with pytest.raises(ValueError, match="hidden layer 50 needs more than 50 decoder layers"):
        load_text_encoder(folder, torch.float32)  # the released layer on a 4-layer model
    with pytest.raises(ValueError, match="has no config.json"):
        load_text_encoder(tmp_path, torch.float32)


def test_build_model_reads_the_state_dict_once(tiny, monkeypatch):
    """Shapes are computed once, not a fresh model.state_dict() per key (quadratic on 1000s of keys)."""
    from diffusers import MiniMaxH3Transformer3DModel

    from omnivideo.models.h3 import build as h3_build

    transformer = tiny[0]
    calls = []
    real = torch.nn.Module.state_dict

    def counting(self, *a, **k):
        if isinstance(self, MiniMaxH3Transformer3DModel):
            calls.append(1)
        return real(self, *a, **k)

    sd = {k: v.clone() for k, v in transformer.state_dict().items()}
    monkeypatch.setattr(torch.nn.Module, "state_dict", counting)
    model = h3_build.build_component(MiniMaxH3Transformer3DModel, dict(transformer.config), sd, torch.float32, "tiny")
    assert len(calls) == 1 < len(sd)
    assert torch.equal(dict(model.named_parameters())["proj_in.weight"], transformer.proj_in.weight)
    key = "proj_in.weight"
    bad = {**sd, key: torch.zeros(3, 3)}
    with pytest.raises(H3LoadError, match=r"wrong shape \(1\): proj_in.weight \(3, 3\) \(expected \(\d+, \d+\)\)"):
        h3_build.build_component(MiniMaxH3Transformer3DModel, dict(transformer.config), bad, torch.float32, "tiny")
