"""H3 nodes without ComfyUI (compat's fallback io): schemas, and execute() on tiny models end to end."""

from __future__ import annotations

import pytest
import torch
from support.comfy_folders import patch_comfy_folders
from support.h3_tiny import FRAMES, HEIGHT, WIDTH, make_models, write_folder
from support.h3_tiny_qwen import LAYER, tiny_processor, tiny_qwen3vl

from omnivideo import compat
from omnivideo.models.h3.geometry import FPS
from omnivideo.models.h3.text import H3TextEncoder
from omnivideo.nodes import h3 as nodes
from omnivideo.nodes.sampler import OmniVideoSampler


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    base = tmp_path_factory.mktemp("h3n")
    with pytest.MonkeyPatch.context() as mp:
        folders = patch_comfy_folders(mp, base)
        write_folder(folders.models("diffusers") / "MiniMax-H3-tiny", *make_models(seed=4))
        assert nodes.OmniVideoH3Loader.validate_inputs(folder="MiniMax-H3-tiny") is True
        out = nodes.OmniVideoH3Loader.execute("MiniMax-H3-tiny", dtype="fp32")
    model, tokenizer, image_processor = tiny_qwen3vl()
    te = H3TextEncoder(
        compat.manage(model, "text_encoder", torch.device("cpu")),
        tokenizer,
        tiny_processor(tokenizer, image_processor),
        layer=LAYER,
    )
    return out[0], out[1], out[2], te


def test_schemas():
    ids = {cls.define_schema().node_id for cls in nodes.NODES}
    assert ids == {
        "OmniVideoH3Loader",
        "OmniVideoH3TextEncoderLoader",
        "OmniVideoH3Keyframes",
        "OmniVideoH3TextEncode",
        "OmniVideoH3Decode",
        "OmniVideoH3Sampler",
        "OmniVideoH3Shift",
    }
    decode = nodes.OmniVideoH3Decode.define_schema()
    assert [o.io_type for o in decode.outputs] == ["IMAGE", "AUDIO"]
    with pytest.raises(ValueError, match="multiples of 32"):
        nodes.OmniVideoH3Keyframes.execute(None, width=100, height=64)


def test_fl2va_through_the_nodes(loaded, comfy_folders):
    model, vae, audio_vae, te = loaded
    comfy_folders.output.rmdir()  # save_as writes under the output folder: make it the embeddings' folder here
    comfy_folders.output.symlink_to(comfy_folders.models("text_encoders"))
    image = torch.rand(1, 80, 120, 3)
    kf = nodes.OmniVideoH3Keyframes.execute(vae, WIDTH, HEIGHT, first_image=image)[0]
    cond = nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, keyframes=kf, save_as="fox")[0]
    assert cond.family == "h3" and int((cond.text_token_tags == 0).sum()) > 0
    assert cond.keyframes["anchors"] == ("first",)
    # the saved embedding reproduces the conditioning without the encoder
    again = nodes.OmniVideoH3TextEncode.execute("", keyframes=kf, embedding_file="fox.safetensors")[0]
    assert torch.equal(again.text, cond.text)
    plain = nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, save_as="plain")[0]
    assert plain.keyframes is None
    with pytest.raises(ValueError, match="made without keyframes"):
        nodes.OmniVideoH3TextEncode.execute("", keyframes=kf, embedding_file="plain.safetensors")

    latent = nodes.OmniVideoH3Sampler.execute(model, cond, seed=1, frames=FRAMES, steps=2, width=WIDTH, height=HEIGHT)[
        0
    ]
    images, audio = nodes.OmniVideoH3Decode.execute(vae, audio_vae, latent).args
    assert images.shape == (FRAMES, HEIGHT, WIDTH, 3) and 0 <= images.min() and images.max() <= 1
    assert audio["sample_rate"] == 32000 and audio["waveform"].shape[:2] == (1, 2)
    seconds = audio["waveform"].shape[-1] / audio["sample_rate"]
    assert abs(seconds - FRAMES / FPS) < 0.05  # the soundtrack covers the video


def test_sampler_steps_default_and_interrupt(loaded, monkeypatch):
    model, _, _, te = loaded
    cond = nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te)[0]
    seen = []

    class CancelAfterFirstStep:  # stands in for ComfyUI's bar: the user presses cancel after step 1
        def __init__(self, total):
            seen.append(total)

        def update(self, n=1):
            compat.request_interrupt()
            compat.check_interrupt()

    monkeypatch.setattr(compat, "ProgressBar", CancelAfterFirstStep)
    before = {k: type(v) for k, v in model.transformer.attn_processors.items()}
    with pytest.raises(compat.ProcessingInterrupted):
        OmniVideoSampler.execute(model, cond, seed=1, frames=FRAMES, steps=0, width=WIDTH, height=HEIGHT)
    assert seen == [49]  # steps 0 -> the default 50 sigma points = 49 forwards; stopped after the first
    assert {k: type(v) for k, v in model.transformer.attn_processors.items()} == before  # restored


def test_text_encode_needs_an_encoder():
    with pytest.raises(ValueError, match="needs a text_encoder"):
        nodes.OmniVideoH3TextEncode.execute("A fox.")


def test_save_as_stays_in_the_output_folder(loaded, tmp_path, comfy_folders):
    te = loaded[3]
    out = comfy_folders.output
    for bad, why in [
        (str(tmp_path / "abs"), "absolute paths"),
        ("../escape", "'..' is not accepted"),
        ("a/../../escape", "'..' is not accepted"),
    ]:
        with pytest.raises(ValueError, match=why):
            nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, save_as=bad)
    assert not (tmp_path / "abs.safetensors").exists() and not (tmp_path / "escape.safetensors").exists()
    (tmp_path / "elsewhere").mkdir()
    (out / "link").symlink_to(tmp_path / "elsewhere")  # a name that leaves through a symlink
    with pytest.raises(ValueError, match="outside ComfyUI's output folder"):
        nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, save_as="link/fox")
    nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, save_as="prompts/fox")
    assert (out / "prompts" / "fox.safetensors").is_file()
    first = (out / "prompts" / "fox.safetensors").read_bytes()
    nodes.OmniVideoH3TextEncode.execute("A cat.", text_encoder=te, save_as="prompts/fox")  # never overwrites
    assert (out / "prompts" / "fox.safetensors").read_bytes() == first
    assert (out / "prompts" / "fox_00001.safetensors").is_file()


def test_embedding_file_lists_exactly_the_h3_embeddings(loaded, comfy_folders):
    from safetensors.torch import save_file

    te = loaded[3]
    cond = nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, save_as="fox")[0]
    encoders = comfy_folders.models("text_encoders")
    (comfy_folders.output / "fox.safetensors").rename(encoders / "fox.safetensors")
    (encoders / "qwen").mkdir()
    (encoders / "qwen" / "tokenizer.json").write_text("{}")
    save_file({"weight": torch.zeros(2)}, str(encoders / "qwen" / "model.safetensors"))  # weights, not an embedding
    port = {p.id: p for p in nodes.OmniVideoH3TextEncode.define_schema().inputs}["embedding_file"]
    assert port.io_type == "COMBO"
    assert port.options["options"] == ["", "fox.safetensors"]
    assert nodes.OmniVideoH3TextEncode.validate_inputs(embedding_file="fox.safetensors") is True
    assert "not an H3 prompt embedding" in nodes.OmniVideoH3TextEncode.validate_inputs(
        embedding_file="qwen/model.safetensors"
    )
    again = nodes.OmniVideoH3TextEncode.execute("", embedding_file="fox.safetensors")[0]
    assert torch.equal(again.text, cond.text)


def _record_model_management(monkeypatch, events: list) -> None:
    """Log each network handed to ComfyUI's model management and each activation release, in order."""
    real_load = compat.load_models

    def load_models(patchers, memory_required=0):
        events.extend(("load", type(p.model.module).__name__) for p in patchers)
        real_load(patchers, memory_required)

    monkeypatch.setattr(compat, "load_models", load_models)
    monkeypatch.setattr(compat, "free_memory", lambda: events.append(("free",)))


def test_decode_reports_progress_and_loads_each_vae_through_model_management(loaded, monkeypatch):
    model, vae, audio_vae, te = loaded
    cond = nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te)[0]
    latent = OmniVideoSampler.execute(model, cond, seed=1, frames=FRAMES, steps=2, width=WIDTH, height=HEIGHT)[0]
    events: list = []

    class Bar:
        def __init__(self, total):
            events.append(("total", total))

        def update(self, n=1):
            events.append(("update", n))

    _record_model_management(monkeypatch, events)
    monkeypatch.setattr(compat, "ProgressBar", Bar)
    images, audio = nodes.OmniVideoH3Decode.execute(vae, audio_vae, latent).args
    assert images.shape == (FRAMES, HEIGHT, WIDTH, 3) and audio["waveform"].shape[:2] == (1, 2)
    video_vae, audio_vae_name = type(vae.model.module).__name__, type(audio_vae.model.module).__name__
    assert events == [
        ("total", 2),
        ("load", video_vae),
        ("update", 1),
        ("load", audio_vae_name),
        ("update", 1),
        ("free",),
    ]

    events.clear()
    monkeypatch.setattr(Bar, "update", lambda self, n=1: (compat.request_interrupt(), compat.check_interrupt()))
    with pytest.raises(compat.ProcessingInterrupted):  # cancelled after the video: the audio VAE never runs
        nodes.OmniVideoH3Decode.execute(vae, audio_vae, latent)
    assert events == [("total", 2), ("load", video_vae), ("free",)]  # activations released on cancel too
    with pytest.raises(ValueError, match="no H3 audio latents"):
        nodes.OmniVideoH3Decode.execute(vae, audio_vae, {"samples": latent["samples"]})


def test_sampler_loads_the_transformer_through_model_management_and_checks_text_width(loaded, monkeypatch):
    model, _, _, te = loaded
    cond = nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te)[0]
    events: list = []
    _record_model_management(monkeypatch, events)
    OmniVideoSampler.execute(model, cond, seed=1, frames=FRAMES, steps=2, width=WIDTH, height=HEIGHT)
    assert events == [("load", "MiniMaxH3Transformer3DModel"), ("free",)]
    assert model.transformer.proj_in.weight.device == model.device  # loaded where ComfyUI said

    events.clear()
    monkeypatch.setattr(
        compat,
        "ProgressBar",
        lambda total: type(
            "Cancel", (), {"update": lambda self, n=1: (compat.request_interrupt(), compat.check_interrupt())}
        )(),
    )
    with pytest.raises(compat.ProcessingInterrupted):
        OmniVideoSampler.execute(model, cond, seed=1, frames=FRAMES, steps=3, width=WIDTH, height=HEIGHT)
    assert events[-1] == ("free",)  # activations released on cancel too

    events.clear()
    text_dim = model.transformer.config.text_dim
    wide = cond.replace(text=torch.zeros(1, cond.text.shape[1], text_dim + 8))
    with pytest.raises(ValueError, match=f"{text_dim + 8} wide but this transformer expects text_dim={text_dim}"):
        OmniVideoSampler.execute(model, wide, seed=1, frames=FRAMES, steps=2, width=WIDTH, height=HEIGHT)
    assert events == []  # refused before the transformer is loaded or run
