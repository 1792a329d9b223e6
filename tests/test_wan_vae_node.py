"""OmniVideo Wan VAE Decode as ComfyUI calls it: core VAE object + LATENT dict in, IMAGE out."""

import pytest
import torch
from support.wan_vae_fixtures import (
    CONFIGS,
    FakeComfyVAE,
    StateDictModule,
    tiny_latent,
    tiny_wan_vae,
    to_original_names,
)

from omnivideo.models.wan_vae.convert import CACHE_ATTR
from omnivideo.nodes import node_classes

Decode = node_classes()["OmniVideoWanVAEDecode"]


def _comfy_vae(version):
    """A tiny Wan VAE as core VAELoader would hand it over (original key names)."""
    model = tiny_wan_vae(version)
    config = CONFIGS[version]
    original = to_original_names(model.state_dict(), config["num_res_blocks"], nested=version == "2.2")
    return model, FakeComfyVAE(StateDictModule(original), latent_channels=config["z_dim"])


@pytest.mark.parametrize("fusion", ["torch", "off"])
@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_node_matches_diffusers_pixels(version, fusion):
    model, vae = _comfy_vae(version)
    z = tiny_latent(model, frames=2)
    with torch.no_grad():
        video = model.decode(z).sample  # [B, C, F, H, W] in [-1, 1]
    expected = ((video.float() + 1.0) / 2.0).clamp(0, 1).movedim(1, -1).flatten(0, 1)

    images = Decode.execute(vae=vae, samples={"samples": z}, fusion=fusion).args[0]
    assert images.shape == (1 + 4 * (z.shape[2] - 1), *expected.shape[1:3], 3)  # core VAEDecode's frame count
    assert images.dtype == torch.float32 and images.is_contiguous()
    assert torch.equal(images, expected)
    assert getattr(vae, CACHE_ATTR) is not None  # converted once, kept on the VAE object


def test_node_rejects_wrong_latent_before_decoding():
    _, vae = _comfy_vae("2.1")
    with pytest.raises(ValueError, match="48 channels but this Wan 2.1 VAE decodes 4-channel latents.*wan2.2_vae"):
        Decode.execute(vae=vae, samples={"samples": torch.zeros(1, 48, 2, 4, 4)}, fusion="auto")


def test_node_rejects_nan_latent_before_converting_the_vae():
    _, vae = _comfy_vae("2.1")
    z = torch.zeros(1, 4, 2, 4, 4)
    z[0, 0, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        Decode.execute(vae=vae, samples={"samples": z}, fusion="auto")
    assert getattr(vae, CACHE_ATTR, None) is None  # failed before the conversion


def test_schema_lists_fusion_choices():
    schema = Decode.define_schema()
    fusion = next(i for i in schema.inputs if i.id == "fusion")
    assert fusion.options["options"] == ["auto", "triton", "torch", "off"]
    assert [i.id for i in schema.inputs] == ["vae", "samples", "fusion"]
