"""OmniDreams nodes and the shared OmniVideo Sampler node, end to end on a tiny checkpoint with a
stand-in for ComfyUI's VAE object."""

from __future__ import annotations

import pytest
import torch
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo import compat
from omnivideo.models.handles import OmniDreamsConditioning
from omnivideo.models.omnidreams.text import save_embedding
from omnivideo.nodes import omnidreams as nodes
from omnivideo.nodes import omnidreams_text as text_nodes
from omnivideo.nodes.sampler import FAMILY_SAMPLERS, OmniVideoSampler
from omnivideo.pipelines import omnidreams as pipe


class StandInWanVAE:
    """Behaves like comfy.sd.VAE for Wan 2.1: IMAGE [T,H,W,3] in [0,1] in, scaled to [-1,1] inside,
    raw latent (posterior mean) [1,16,1+(T-1)//4,H/8,W/8] out. The mean is a fixed function of
    the pixels so tests can predict it."""

    latent_channels, latent_dim = 16, 3  # what comfy.sd.VAE sets for the Wan 2.1 VAE

    def __init__(self):
        self.calls = []

    def encode(self, pixels):
        self.calls.append(pixels.clone())
        x = pixels.movedim(-1, 0)[None] * 2 - 1  # [1,3,T,H,W] in [-1,1]
        t = 1 + (x.shape[2] - 1) // 4
        pooled = torch.nn.functional.avg_pool3d(x[:, :, : 1 + (t - 1) * 4], (1, 8, 8))
        frames = torch.cat([pooled[:, :, :1], pooled[:, :, 1:].unflatten(2, (t - 1, 4)).mean(3)], 2)
        return torch.cat([frames] * 6, 1)[:, :16] * 0.5 + 0.25


def _conditioning(dim=TINY.text_in_dim):
    return OmniDreamsConditioning(text=torch.randn(1, 512, dim, generator=torch.Generator().manual_seed(0)))


def test_encode_first_frame_resizes_encodes_and_normalises():
    vae = StandInWanVAE()
    image = torch.rand(2, 40, 50, 3)  # a batch: only the first image is used
    cond = nodes.OmniDreamsEncodeFirstFrame.execute(_conditioning(), vae, image, width=64, height=32)[0]
    pixels = vae.calls[0]
    assert pixels.shape == (1, 32, 64, 3) and pixels.min() >= 0 and pixels.max() <= 1  # [0,1]: the VAE scales
    latent = cond.first_frame
    assert latent.shape == (1, 16, 1, 4, 8)
    mean = torch.tensor(pipe.LATENT_MEAN).view(1, 16, 1, 1, 1)
    std = torch.tensor(pipe.LATENT_STD).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(latent, (vae.encode(pixels) - mean) / std)


def test_encode_hdmap_one_causal_pass_and_frame_trim():
    vae = StandInWanVAE()
    frames = torch.rand(15, 32, 32, 3)  # 13 usable (1 + 3*4), the last 2 dropped
    cond = nodes.OmniDreamsEncodeHDMap.execute(_conditioning(), vae, frames, width=32, height=32)[0]
    assert len(vae.calls) == 1 and vae.calls[0].shape[0] == 13
    assert cond.hdmap.shape == (1, 16, 4, 4, 4)


def test_wrong_vae_is_explained():
    class ImageVAE:
        def encode(self, pixels):
            return torch.zeros(1, 4, 1, 4, 4)

    with pytest.raises(ValueError, match="Wan 2.1 VAE"):
        nodes.OmniDreamsEncodeFirstFrame.execute(_conditioning(), ImageVAE(), torch.rand(1, 32, 32, 3), 32, 32)


def test_steps_comfyui_does_not_check_are_checked_before_work():
    """ComfyUI checks min/max only; the step rules (multiples of 16, even window) are checked when the node
    starts, before any file is read or VAE run."""
    vae = StandInWanVAE()
    with pytest.raises(ValueError, match="multiples of 16"):
        nodes.OmniDreamsEncodeFirstFrame.execute(_conditioning(), vae, torch.rand(1, 32, 32, 3), 1280, 700)
    assert not vae.calls
    with pytest.raises(ValueError, match="multiple of the chunk"):
        nodes.OmniDreamsModelLoader.execute("missing.pt", window_frames=5, sink_frames=0)
    with pytest.raises(ValueError, match="multiples of 16"):
        nodes.OmniDreamsSampler.execute(None, None, frames=13, width=100, height=64)


def test_load_text_embedding_node(comfy_folders):
    emb = torch.randn(1, 512, 12)
    save_embedding(str(comfy_folders.models("text_encoders") / "prompt.safetensors"), emb, "p")
    assert text_nodes.OmniDreamsLoadTextEmbedding.validate_inputs(embedding="prompt.safetensors") is True
    cond = text_nodes.OmniDreamsLoadTextEmbedding.execute("prompt.safetensors")[0]
    assert cond.family == "omnidreams"
    torch.testing.assert_close(cond.text, emb)


def test_loader_encode_sample_pipeline(comfy_folders):
    torch.save(stored_state_dict(TINY, seed=2), comfy_folders.models("diffusion_models") / "omnidreams_tiny.pt")
    assert nodes.OmniDreamsModelLoader.validate_inputs(ckpt_name="omnidreams_tiny.pt") is True
    model = nodes.OmniDreamsModelLoader.execute("omnidreams_tiny.pt", dtype="fp32", window_frames=4, sink_frames=0)[0]
    assert model.family == "omnidreams" and (model.window_frames, model.sink_frames) == (4, 0)
    vae = StandInWanVAE()
    cond = nodes.OmniDreamsEncodeFirstFrame.execute(_conditioning(), vae, torch.rand(1, 32, 48, 3), 48, 32)[0]
    cond = nodes.OmniDreamsEncodeHDMap.execute(cond, vae, torch.rand(13, 32, 48, 3), 48, 32)[0]
    latent = nodes.OmniDreamsSampler.execute(model, cond, seed=1, frames=13, steps=0, width=1280, height=704)[0]
    # the shared node kept for saved workflows runs the family's sampler: the same latent
    again = OmniVideoSampler.execute(model, cond, seed=1, frames=13, steps=0, width=1280, height=704)[0]
    assert torch.equal(again["samples"], latent["samples"]) and set(latent) == {"samples"}  # a core LATENT
    z = latent["samples"]
    assert z.shape == (1, 16, 4, 4, 6) and torch.isfinite(z).all()
    mean = torch.tensor(pipe.LATENT_MEAN).view(1, 16, 1, 1, 1)
    std = torch.tensor(pipe.LATENT_STD).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(z[:, :, :1], cond.first_frame * std + mean)  # raw Wan space


def test_sampler_dispatch_and_family_mismatch():
    assert FAMILY_SAMPLERS["omnidreams"] is nodes.OmniDreamsSampler

    class Model:
        family = "h3"

    with pytest.raises(ValueError, match="conditioning was made for omnidreams"):
        OmniVideoSampler.execute(Model(), _conditioning(), seed=0, frames=5)
    with pytest.raises(ValueError, match="needs a omnidreams model but got a h3 model"):
        nodes.OmniDreamsSampler.execute(Model(), _conditioning(), seed=0, frames=5, width=64, height=64)


def test_node_schemas():
    ids = [n.define_schema().node_id for n in (*nodes.NODES, *text_nodes.NODES, OmniVideoSampler)]
    assert ids == [
        "OmniDreamsModelLoader",
        "OmniDreamsEncodeFirstFrame",
        "OmniDreamsEncodeHDMap",
        "OmniDreamsSampler",
        "OmniDreamsTextEncoderLoader",
        "OmniDreamsTextEncode",
        "OmniDreamsPromptSchedule",
        "OmniDreamsLoadTextEmbedding",
        "OmniVideoSampler",
    ]
    assert "zeros" in nodes.OmniDreamsEncodeHDMap.define_schema().description


def test_text_encode_rejects_another_familys_encoder():
    with pytest.raises(ValueError, match="Cosmos-Reason1"):
        text_nodes.OmniDreamsTextEncode.execute(object(), "a prompt")


def test_text_encode_save_as_stays_in_the_output_folder(tmp_path, comfy_folders, monkeypatch):
    from omnivideo.models.omnidreams.text import TextEncoder, load_embedding

    out_dir = comfy_folders.output
    encoded = []
    emb = torch.randn(1, 512, 12)

    def fake_encode(encoder, prompt):
        encoded.append(prompt)
        return emb

    monkeypatch.setattr(text_nodes, "encode_prompt", fake_encode)
    encoder = TextEncoder(compat.manage(torch.nn.Identity(), "text_encoder", torch.device("cpu")), None, "tiny")

    cond = text_nodes.OmniDreamsTextEncode.execute(encoder, "a car", save_as=" prompts/night ")[0]
    torch.testing.assert_close(cond.text, emb)
    torch.testing.assert_close(load_embedding(str(out_dir / "prompts" / "night.safetensors")), emb)
    text_nodes.OmniDreamsTextEncode.execute(encoder, "a truck", save_as="prompts/night")  # never overwrites
    torch.testing.assert_close(load_embedding(str(out_dir / "prompts" / "night.safetensors")), emb)
    assert (out_dir / "prompts" / "night_00001.safetensors").is_file()
    assert encoded == ["a car", "a truck"]

    (tmp_path / "elsewhere").mkdir()
    (out_dir / "link").symlink_to(tmp_path / "elsewhere")
    for bad, why in (
        (str(tmp_path / "abs.safetensors"), "absolute"),
        ("/etc/x", "absolute"),
        ("../escape", "'..'"),
        ("prompts/../../escape", "'..'"),
        ("a/../day", "'..'"),
        ("link/x", "outside"),
        ("x" * 300, "longer than"),
        ("C:\\x", "absolute"),
    ):
        assert "refused" in text_nodes.OmniDreamsTextEncode.validate_inputs(save_as=bad)
        with pytest.raises(ValueError, match=why):
            text_nodes.OmniDreamsTextEncode.execute(encoder, "a car", save_as=bad)
    assert encoded == ["a car", "a truck"]  # refused before the (heavy) encode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["comfyui", "elsewhere"]
    assert not any((tmp_path / "elsewhere").iterdir())  # nothing written outside
