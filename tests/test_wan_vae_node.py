"""OmniVideo Wan VAE Decode's schema and its clear errors, raised before any heavy work (no ComfyUI needed:
the VAE object is a stand-in whose decode must never be reached)."""

import pytest
import torch

from omnivideo.backends import resolve
from omnivideo.models.wan_vae.core_vae import wan_version
from omnivideo.models.wan_vae.fused import fused_decode
from omnivideo.nodes import node_classes
from omnivideo.pipelines.wan_decode import select_fusion

Decode = node_classes()["OmniVideoWanVAEDecode"]


def _comfy_class(name: str, module: str):
    """A class that duck-types as one of ComfyUI's Wan VAE classes (same module and class name)."""
    return type(name, (torch.nn.Module,), {"__module__": module})


class NoDecode:
    """core VAE object stand-in: errors must come before core's decode."""

    def __init__(self, model):
        self.first_stage_model = model

    def decode(self, *_):
        raise AssertionError("decoded although the input is invalid")


def _wan(version="2.1", z_dim=16):
    model = _comfy_class("WanVAE", "comfy.ldm.wan.vae" if version == "2.1" else "comfy.ldm.wan.vae2_2")()
    model.z_dim = z_dim
    return NoDecode(model)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((1, 48, 2, 4, 4), "48 channels but this Wan 2.1 VAE decodes 16-channel latents.*wan2.2_vae"),
        ((1, 5, 2, 4, 4), "5 channels but this Wan 2.1 VAE decodes 16-channel latents.$"),
        ((16, 4, 4), r"needs a video latent \[B, C, T, H, W\]"),
        ((1, 16, 0, 4, 4), "empty"),
    ],
)
def test_node_rejects_wrong_latent_before_decoding(shape, message):
    with pytest.raises(ValueError, match=message):
        Decode.execute(vae=_wan(), samples={"samples": torch.zeros(shape)}, fusion="auto")


def test_node_names_the_wan22_vae_for_a_48_channel_latent_only_on_21():
    with pytest.raises(ValueError, match="16 channels but this Wan 2.2 VAE decodes 48-channel.*wan_2.1_vae"):
        Decode.execute(vae=_wan("2.2", 48), samples={"samples": torch.zeros(1, 16, 2, 4, 4)}, fusion="auto")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_node_rejects_non_finite_latent(bad):
    z = torch.zeros(1, 16, 2, 4, 4)
    z[0, 0, 1] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        Decode.execute(vae=_wan(), samples={"samples": z}, fusion="auto")


def test_node_rejects_other_vaes():
    sd_vae = NoDecode(_comfy_class("AutoencoderKL", "comfy.ldm.models.autoencoder")())
    with pytest.raises(ValueError, match="needs a Wan 2.1 or 2.2 VAE.*AutoencoderKL"):
        Decode.execute(vae=sd_vae, samples={"samples": torch.zeros(1, 16, 2, 4, 4)}, fusion="auto")
    lookalike = NoDecode(_comfy_class("WanVAE", "someone_else.wan")())  # same class name, not ComfyUI's
    with pytest.raises(ValueError, match="needs a Wan 2.1 or 2.2 VAE"):
        Decode.execute(vae=lookalike, samples={"samples": torch.zeros(1, 16, 2, 4, 4)}, fusion="auto")


class CoreDecode(NoDecode):
    """A core VAE object stand-in whose decode is core's (records the latent, returns 5-D pixels as core does)."""

    def decode(self, z):
        self.decoded = z
        return torch.arange(2 * 3 * 4 * 5 * 3, dtype=torch.float32).view(2, 3, 4, 5, 3)


def test_a_wan_class_vae_of_other_shapes_gets_cores_decode_unchanged(caplog):
    """Newer core builds its Wan classes for other VAEs too (Qwen-Image 2.1: a 64-channel 4-D latent, spatial patch
    1): the fast path is not taken, core's decode runs, and one log line says why."""
    vae = CoreDecode(_wan("2.2", 64).first_stage_model)  # a stand-in without a Wan decoder inside
    z = torch.randn(1, 64, 8, 8)
    with caplog.at_level("INFO", logger="omnivideo"):
        images = Decode.execute(vae=vae, samples={"samples": z}, fusion="triton").args[0]
    assert vae.decoded is z
    assert torch.equal(images, torch.arange(360, dtype=torch.float32).view(6, 4, 5, 3))  # VAEDecode's reshape
    assert "core's decode runs unchanged" in caplog.text and "4-D latent" in caplog.text, caplog.text
    vae.first_stage_model.patch_size = 1  # a video latent, but a module the fast path does not know
    images = Decode.execute(vae=vae, samples={"samples": torch.randn(1, 64, 2, 8, 8)}, fusion="torch").args[0]
    assert vae.decoded.shape == (1, 64, 2, 8, 8) and images.shape == (6, 4, 5, 3)


def test_wan_version_by_module():
    assert wan_version(_wan("2.1").first_stage_model) == "2.1"
    assert wan_version(_wan("2.2").first_stage_model) == "2.2"
    assert wan_version(_comfy_class("Decoder3d", "comfy.ldm.wan.vae")()) is None
    with pytest.raises(TypeError, match="not ComfyUI's Wan VAE"):
        with fused_decode(torch.nn.Linear(1, 1), "off"):
            pass


def test_select_fusion_maps_node_choices():
    assert select_fusion("off") == ("off", None)
    name, ops = select_fusion("torch")
    assert name == "torch" and callable(ops.cat_pad_5d) and callable(ops.dup_up3d_add)
    assert select_fusion("auto")[0] == resolve("wan_vae", "auto").name
    with pytest.raises(ValueError, match="fusion must be one of"):
        select_fusion("fast")


def test_schema_lists_fusion_choices():
    schema = Decode.define_schema()
    fusion = next(i for i in schema.inputs if i.id == "fusion")
    assert fusion.options["options"] == ["auto", "triton", "torch", "off"]
    assert [i.id for i in schema.inputs] == ["vae", "samples", "fusion"]
    assert "same pixels as core VAE Decode" in schema.description
