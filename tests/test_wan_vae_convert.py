"""ComfyUI Wan VAE (original key names) -> diffusers AutoencoderKLWan.

Tiny random models: a diffusers model is written out in the original Wan layout with an
inverse mapping written here (independently of the converter), converted back, and must
decode bit-identically. With COMFYUI_PATH set, ComfyUI's own tiny WanVAE classes are
converted too and compared with a tolerance.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from support.wan_vae_fixtures import (
    FakeComfyVAE,
    StateDictModule,
    decode,
    randomize,
    tiny_from_config,
    to_original_names,
)

from omnivideo.models.checkpoint_io import check_state_dict, expected_shapes
from omnivideo.models.wan_vae import convert as wc

# 2.1: diffusers' converter hard-codes the released depth (4 levels, 2 res blocks); only widths shrink.
TINY21 = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2)
# 2.2: our own mapping, so a layout that differs from the release in depth and widths too.
TINY22 = dict(
    base_dim=8,
    decoder_base_dim=12,
    z_dim=6,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
)


@pytest.fixture(scope="module")
def wan21():
    model = tiny_from_config(TINY21, 0)
    return model, to_original_names(model.state_dict(), TINY21["num_res_blocks"], nested=False)


@pytest.fixture(scope="module")
def wan22():
    model = tiny_from_config(TINY22, 1)
    return model, to_original_names(model.state_dict(), TINY22["num_res_blocks"], nested=True)


# ---------------------------------------------------------------------------------------------
# Configs, detection, inference
# ---------------------------------------------------------------------------------------------


def test_wan21_config_is_diffusers_default():
    with torch.device("meta"):
        default = AutoencoderKLWan().config
    for k, v in wc.WAN21_CONFIG.items():
        assert default[k] == v, k


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_released_configs_round_trip_through_inference(version):
    """Full-size key layout and shapes (meta tensors, no memory): detect, infer, map, fit strictly."""
    config = wc.WAN21_CONFIG if version == "2.1" else wc.WAN22_CONFIG
    with torch.device("meta"):
        model = AutoencoderKLWan(**config)
    original = to_original_names(model.state_dict(), config["num_res_blocks"], nested=version == "2.2")
    assert wc.detect_wan_version(original) == version
    assert wc.infer_wan_config(original) == config
    converted, inferred, seen = wc.convert_wan_state_dict(original)
    assert seen == version and inferred == config
    check_state_dict(expected_shapes(model), converted, "test", "")  # raises on any key/shape mismatch


def test_infer_tiny_configs(wan21, wan22):
    cfg21 = wc.infer_wan_config(wan21[1])
    for k, v in TINY21.items():
        assert cfg21[k] == v, k
    assert cfg21["latents_mean"] == [0.0] * 4 and cfg21["scale_factor_spatial"] == 8
    cfg22 = wc.infer_wan_config(wan22[1])
    for k, v in TINY22.items():
        assert cfg22[k] == v, k
    assert cfg22["temperal_downsample"] == [False, True, True] and cfg22["scale_factor_temporal"] == 4


# ---------------------------------------------------------------------------------------------
# Bit-exact round trips
# ---------------------------------------------------------------------------------------------


def test_wan21_round_trip_bit_exact(wan21):
    model, original = wan21
    assert wc.detect_wan_version(original) == "2.1"
    converted = wc.convert_wan21_to_diffusers(original)
    reference = model.state_dict()
    # identical to diffusers' own converter, and to the model we started from
    ours_vs_diffusers = convert_wan_vae_to_diffusers(dict(original))
    assert converted.keys() == ours_vs_diffusers.keys() == reference.keys()
    for k in reference:
        assert converted[k] is ours_vs_diffusers[k] or torch.equal(converted[k], ours_vs_diffusers[k])
        assert torch.equal(converted[k], reference[k]), k

    rebuilt = wc.build_diffusers_wan_vae(original)
    assert not rebuilt.training and wc.wan_version(rebuilt) == "2.1"
    assert rebuilt.config.z_dim == 4 and rebuilt.config.scale_factor_spatial == 8
    z = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    want, got = decode(model, z), decode(rebuilt, z)
    assert want.shape == (1, 3, 9, 32, 32)
    assert (want.abs() < 1).float().mean() > 0.5  # not saturated by the final clamp
    assert torch.equal(want, got)


def test_wan22_round_trip_bit_exact(wan22):
    model, original = wan22
    assert wc.detect_wan_version(original) == "2.2"
    assert any(".upsampler." in k for k in model.state_dict())  # the singular attribute is covered
    converted = wc.convert_wan22_to_diffusers(original)
    reference = model.state_dict()
    assert converted.keys() == reference.keys()
    for k in reference:
        assert torch.equal(converted[k], reference[k]), k

    rebuilt = wc.build_diffusers_wan_vae(original)
    assert wc.wan_version(rebuilt) == "2.2"
    assert rebuilt.config.z_dim == 6 and rebuilt.config.scale_factor_spatial == 16
    z = torch.randn(1, 6, 3, 2, 2, generator=torch.Generator().manual_seed(3))
    want, got = decode(model, z), decode(rebuilt, z)
    assert want.shape == (1, 3, 9, 32, 32)
    assert (want.abs() < 1).float().mean() > 0.5
    assert torch.equal(want, got)


def test_from_comfy_object_caches_per_dtype_and_device(wan22):
    model, original = wan22
    vae = FakeComfyVAE(StateDictModule(original), latent_channels=6)
    a = wc.diffusers_vae_from_comfy(vae)
    assert wc.diffusers_vae_from_comfy(vae) is a  # second call is free
    assert next(a.parameters()).dtype == torch.float32
    assert all(not p.requires_grad for p in a.parameters())
    # copies, not views of ComfyUI's tensors
    assert a.decoder.conv_in.weight.data_ptr() != original["decoder.conv1.weight"].data_ptr()
    b = wc.diffusers_vae_from_comfy(vae, dtype=torch.bfloat16)
    assert b is not a and next(b.parameters()).dtype == torch.bfloat16
    assert wc.diffusers_vae_from_comfy(vae, dtype=torch.bfloat16, device="cpu") is b


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def test_non_wan_vae_refused():
    class AutoencoderKL(torch.nn.Module):  # what ComfyUI builds for an SD/Flux VAE
        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.conv_in = torch.nn.Conv2d(4, 8, 3)

    vae = FakeComfyVAE(AutoencoderKL(), latent_channels=4)
    with pytest.raises(wc.WanVAEConversionError) as e:
        wc.diffusers_vae_from_comfy(vae)
    msg = str(e.value)
    for part in ("AutoencoderKL", "latent_channels=4", "wan_2.1_vae.safetensors", "wan2.2_vae.safetensors"):
        assert part in msg
    with pytest.raises(wc.WanVAEConversionError, match="not a Wan VAE"):
        wc.detect_wan_version({"decoder.conv_in.weight": torch.zeros(1)})

    invalid = FakeComfyVAE(None, latent_channels=4)  # ComfyUI's VAE with no weights detected
    with pytest.raises(wc.WanVAEConversionError, match="needs a Wan VAE"):
        wc.diffusers_vae_from_comfy(invalid)


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_missing_unexpected_and_misshaped_keys_are_named(version, wan21, wan22):
    original = dict((wan21 if version == "2.1" else wan22)[1])
    del original["decoder.head.2.bias"]
    original["decoder.extra.weight"] = torch.zeros(1)
    original["decoder.middle.1.proj.bias"] = torch.zeros(3)
    with pytest.raises(wc.WanVAEConversionError) as e:
        wc.build_diffusers_wan_vae(original, source="tiny.safetensors")
    msg = str(e.value)
    assert "tiny.safetensors" in msg and f"Wan {version}" in msg
    assert "missing (1): decoder.conv_out.bias" in msg
    assert "unexpected (1): decoder.extra.weight" in msg
    assert "wrong shape (1): decoder.mid_block.attentions.0.proj.bias (3,) (expected" in msg

    del original["decoder.head.2.weight"]  # a tensor the config is read from
    with pytest.raises(wc.WanVAEConversionError, match="lack 'decoder.head.2.weight'"):
        wc.build_diffusers_wan_vae(original)


# ---------------------------------------------------------------------------------------------
# ComfyUI's own WanVAE classes (needs COMFYUI_PATH)
# ---------------------------------------------------------------------------------------------


def _comfy_wan_modules(comfyui_path):
    path = str(comfyui_path)
    if not os.path.isfile(os.path.join(path, "comfy", "ldm", "wan", "vae2_2.py")):
        pytest.skip(f"COMFYUI_PATH={path} has no comfy/ldm/wan/vae2_2.py")
    pytest.importorskip("einops", reason="ComfyUI's Wan VAE needs einops")
    pytest.importorskip("psutil", reason="comfy.model_management needs psutil")
    if path not in sys.path:
        sys.path.insert(0, path)
    from comfy.cli_args import args

    if not torch.cuda.is_available():
        args.cpu = True  # comfy.model_management probes CUDA at import otherwise
    import comfy.ldm.wan.vae as vae21
    import comfy.ldm.wan.vae2_2 as vae22

    return vae21, vae22


@pytest.mark.integration
@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_comfy_wanvae_matches(version, capsys, comfyui_path):
    vae21, vae22 = _comfy_wan_modules(comfyui_path)
    tiny = TINY21 if version == "2.1" else TINY22
    geometry = dict(
        z_dim=tiny["z_dim"],
        dim_mult=tiny["dim_mult"],
        num_res_blocks=tiny["num_res_blocks"],
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )  # what comfy.sd.VAE passes
    if version == "2.1":
        comfy_model = vae21.WanVAE(dim=tiny["base_dim"], **geometry)
    else:
        comfy_model = vae22.WanVAE(dim=tiny["base_dim"], dec_dim=tiny["decoder_base_dim"], **geometry)
    randomize(comfy_model, 4)  # comfy ops skip weight init: fill every tensor
    sd = comfy_model.state_dict()

    # our test's inverse mapping names tensors exactly as ComfyUI does
    with torch.device("meta"):
        twin = AutoencoderKLWan(**tiny)
    assert set(to_original_names(twin.state_dict(), tiny["num_res_blocks"], nested=version == "2.2")) == set(sd)

    vae = FakeComfyVAE(comfy_model, latent_channels=tiny["z_dim"])
    ours = wc.diffusers_vae_from_comfy(vae)
    assert ours.config.z_dim == vae.latent_channels
    z = torch.randn(
        1,
        tiny["z_dim"],
        3,
        4 if version == "2.1" else 2,
        4 if version == "2.1" else 2,
        generator=torch.Generator().manual_seed(5),
    )
    with torch.no_grad():
        want = comfy_model.decode(z).clamp(-1, 1)  # diffusers clamps inside decode, ComfyUI afterwards
    got = decode(ours, z)
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    with capsys.disabled():
        print(f"\n[wan {version}] ComfyUI WanVAE vs converted diffusers decode: max abs diff {diff:.3g}")
    assert diff < 1e-4
