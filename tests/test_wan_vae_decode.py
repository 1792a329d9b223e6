"""The fused decoder against diffusers' AutoencoderKLWan.decode: bit for bit, strides included."""

import copy

import pytest
import torch
from support.wan_vae_fixtures import CONFIGS, tiny_from_config, tiny_latent, tiny_wan_vae, to_channels_last_3d

from omnivideo import compat
from omnivideo.backends import resolve
from omnivideo.models.wan_vae.fused import install_fused_decoder, installed_fusion
from omnivideo.pipelines.wan_decode import decode_latent, select_fusion, validate_latent

FUSIONS = ["reference", "torch_fused", "triton"]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton: GPU, else the interpreter


def _pair(version, dtype, channels_last, slim=False):
    """A tiny VAE to patch, an untouched deep copy as the reference, and a latent.

    `slim`: 2-channel base width and 2 latent frames (still every cache case: 0/1/2 cached
    frames, "Rep", the DupUp3D first chunk), because the Triton interpreter pays ~0.1 s
    per kernel launch and per program."""
    if slim:
        config = dict(CONFIGS[version], base_dim=2, **({"decoder_base_dim": 2} if version == "2.2" else {}))
        vae = tiny_from_config(config).to(dtype)
    else:
        vae = tiny_wan_vae(version, dtype=dtype)
    vae, z = vae.to(DEVICE), tiny_latent(vae, frames=2 if slim else 3).to(DEVICE)
    if channels_last:
        vae = to_channels_last_3d(vae)
        z = z.contiguous(memory_format=torch.channels_last_3d)
    return vae, copy.deepcopy(vae), z


def _install(vae, level):
    ops = None if level == "reference" else resolve("wan_vae", level).load()
    install_fused_decoder(vae, level, ops)


class CountingOps:
    """Wraps an ops module and counts fused calls (proves the fast path ran)."""

    def __init__(self, ops):
        self.ops, self.calls = ops, {"cat_pad_5d": 0, "dup_up3d_add": 0}
        self.__name__ = ops.__name__

    def cat_pad_5d(self, *a, **k):
        self.calls["cat_pad_5d"] += 1
        return self.ops.cat_pad_5d(*a, **k)

    def dup_up3d_add(self, *a, **k):
        self.calls["dup_up3d_add"] += 1
        return self.ops.dup_up3d_add(*a, **k)

    def supports(self, device):
        return self.ops.supports(device)


@pytest.mark.parametrize("level", FUSIONS)
@pytest.mark.parametrize("channels_last", [False, True], ids=["ncdhw", "cl3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_decode_bit_exact(version, dtype, channels_last, level):
    vae, reference, z = _pair(version, dtype, channels_last, slim=level == "triton")
    with torch.no_grad():
        expected = reference.decode(z).sample
    counting = None
    if level == "reference":
        _install(vae, level)
    else:
        counting = CountingOps(resolve("wan_vae", level).load())
        install_fused_decoder(vae, level, counting)
    out = decode_latent(vae, z)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert out.stride() == expected.stride()
    assert torch.equal(out, expected)
    if counting is not None:  # the fused ops did run, at every cached conv (and DupUp3D for 2.2)
        assert counting.calls["cat_pad_5d"] > 0
        assert (counting.calls["dup_up3d_add"] > 0) == (version == "2.2")


def test_install_is_idempotent_and_keeps_state_dict():
    vae = tiny_wan_vae("2.2")
    keys = {k: v.clone() for k, v in vae.state_dict().items()}
    _install(vae, "torch_fused")
    forwards = {name: m.forward for name, m in vae.decoder.named_modules() if "forward" in m.__dict__}
    _install(vae, "torch_fused")
    again = {name: m.forward for name, m in vae.decoder.named_modules() if "forward" in m.__dict__}
    assert forwards and forwards.keys() == again.keys()
    assert installed_fusion(vae) == "torch_fused"
    sd = vae.state_dict()
    assert sd.keys() == keys.keys() and all(torch.equal(sd[k], keys[k]) for k in keys)
    _install(vae, "reference")  # restores diffusers' class forwards
    assert not any("forward" in m.__dict__ for m in vae.decoder.modules())


def test_guard_falls_back_to_diffusers_order_when_grad_enabled():
    vae, reference, z = _pair("2.2", torch.float32, False)
    counting = CountingOps(resolve("wan_vae", "torch_fused").load())
    install_fused_decoder(vae, "torch_fused", counting)
    vae.clear_cache()
    with torch.enable_grad():  # the fused ops are inference-only
        x = vae.post_quant_conv(z)
        out = vae.decoder(x[:, :, :1], feat_cache=vae._feat_map, feat_idx=[0], first_chunk=True)
    with torch.no_grad():
        reference.clear_cache()
        x = reference.post_quant_conv(z)
        expected = reference.decoder(x[:, :, :1], feat_cache=reference._feat_map, feat_idx=[0], first_chunk=True)
    assert counting.calls == {"cat_pad_5d": 0, "dup_up3d_add": 0}
    assert torch.equal(out.detach(), expected)


def test_mixed_layout_cache_falls_back():
    """A cache in another layout than x (possible after an external cache edit) is not fused."""
    from omnivideo.models.wan_vae.fused import _fusable

    ops = resolve("wan_vae", "torch_fused").load()
    x = torch.randn(1, 4, 1, 3, 3).contiguous(memory_format=torch.channels_last_3d)
    cache = torch.randn(1, 4, 2, 3, 3)
    with torch.no_grad():
        assert _fusable(ops, x, x.clone())
        assert not _fusable(ops, x, cache)
        assert not _fusable(ops, x, cache.half())


def test_progress_per_frame_and_interrupt_frees_cache(monkeypatch):
    vae, _, z = _pair("2.1", torch.float32, False)
    _install(vae, "torch_fused")
    bar = compat.ProgressBar(z.shape[2])
    decode_latent(vae, z, bar)
    assert bar.current == z.shape[2]

    class Interrupting(compat.ProgressBar):
        def update(self, n=1):
            compat.request_interrupt()
            super().update(n)

    with pytest.raises(compat.ProcessingInterrupted):
        decode_latent(vae, z, Interrupting(z.shape[2]))
    assert all(entry is None for entry in vae._feat_map)  # feature cache released


def test_select_fusion_maps_node_choices():
    vae = tiny_wan_vae("2.1")
    assert select_fusion(vae, "off") == "reference"
    assert select_fusion(vae, "torch") == "torch_fused"
    assert select_fusion(vae, "auto") == resolve("wan_vae", "auto").name
    with pytest.raises(ValueError, match="fusion must be one of"):
        select_fusion(vae, "fast")


@pytest.mark.parametrize(
    "shape, message",
    [
        ((1, 16, 2, 4, 4), "16 channels but this Wan 2.1 VAE decodes 4-channel"),
        ((1, 4, 4, 4), r"needs a video latent \[B, C, T, H, W\]"),
        ((1, 4, 0, 4, 4), "empty"),
    ],
)
def test_validate_latent_messages(shape, message):
    vae = tiny_wan_vae("2.1")
    with pytest.raises(ValueError, match=message):
        validate_latent(vae, torch.zeros(shape))


def test_validate_latent_rejects_nan():
    vae = tiny_wan_vae("2.1")
    z = torch.zeros(1, 4, 2, 4, 4)
    z[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        validate_latent(vae, z)
