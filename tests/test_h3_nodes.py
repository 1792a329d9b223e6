"""H3 nodes without ComfyUI (compat's fallback io): schemas, and execute() on tiny models end to end."""

from __future__ import annotations

import pytest
import torch

from omnivideo import compat
from omnivideo.models.h3_loader import load_h3
from omnivideo.models.h3_text import H3TextEncoder
from omnivideo.nodes import h3 as nodes
from omnivideo.nodes.sampler import OmniVideoSampler
from omnivideo.pipelines.h3.geometry import FPS

from h3_tiny import FRAMES, HEIGHT, WIDTH, make_models, write_folder
from h3_tiny_qwen import LAYER, test_processor, tiny_qwen3vl


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = write_folder(tmp_path_factory.mktemp("h3n") / "MiniMax-H3-tiny", *make_models(seed=4))
    out = nodes.OmniVideoH3Loader.execute(str(root), dtype="float32")
    model, tokenizer, image_processor = tiny_qwen3vl()
    te = H3TextEncoder(model, tokenizer, test_processor(tokenizer, image_processor), layer=LAYER)
    return out[0], out[1], out[2], te


def test_schemas():
    ids = {cls.define_schema().node_id for cls in nodes.NODES}
    assert ids == {"OmniVideoH3Loader", "OmniVideoH3TextEncoderLoader", "OmniVideoH3Keyframes",
                   "OmniVideoH3TextEncode", "OmniVideoH3Decode"}
    decode = nodes.OmniVideoH3Decode.define_schema()
    assert [o.io_type for o in decode.outputs] == ["IMAGE", "AUDIO"]
    assert nodes.OmniVideoH3Keyframes.validate_inputs(width=100, height=64).startswith("width and height")


def test_fl2va_through_the_nodes(loaded, tmp_path):
    model, vae, audio_vae, te = loaded
    image = torch.rand(1, 80, 120, 3)
    kf = nodes.OmniVideoH3Keyframes.execute(vae, WIDTH, HEIGHT, first_image=image)[0]
    cond = nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, keyframes=kf,
                                               save_as=str(tmp_path / "fox"))[0]
    assert cond.family == "h3" and int((cond.extras["text_token_tags"] == 0).sum()) > 0
    assert cond.extras["h3_keyframes"]["anchors"] == ("first",)
    # the saved embedding reproduces the conditioning without the encoder
    again = nodes.OmniVideoH3TextEncode.execute("", keyframes=kf, embedding_file=str(tmp_path / "fox.safetensors"))[0]
    assert torch.equal(again.text, cond.text)
    plain = nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, save_as=str(tmp_path / "plain"))[0]
    assert plain.extras.get("h3_keyframes") is None
    with pytest.raises(ValueError, match="made without keyframes"):
        nodes.OmniVideoH3TextEncode.execute("", keyframes=kf, embedding_file=str(tmp_path / "plain.safetensors"))

    latent = OmniVideoSampler.execute(model, cond, seed=1, frames=FRAMES, steps=2, width=WIDTH, height=HEIGHT)[0]
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
    with pytest.raises(compat.InterruptedError_):
        OmniVideoSampler.execute(model, cond, seed=1, frames=FRAMES, steps=0, width=WIDTH, height=HEIGHT)
    assert seen == [49]  # steps 0 -> the default 50 sigma points = 49 forwards; stopped after the first
    assert {k: type(v) for k, v in model.transformer.attn_processors.items()} == before  # restored


def test_text_encode_needs_an_encoder():
    with pytest.raises(ValueError, match="needs a text_encoder"):
        nodes.OmniVideoH3TextEncode.execute("A fox.")
