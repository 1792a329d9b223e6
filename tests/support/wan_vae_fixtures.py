"""Shared Wan VAE test fixtures: random weights for ComfyUI's own Wan VAE classes, and the original Wan
(ComfyUI) key names of diffusers' AutoencoderKLWan tensors (an inverse mapping written independently of
diffusers' converter, which the integration tests use to write a full-size random VAE file)."""

import re

import torch

# comfy.sd.VAE's WanVAE geometry for the released files (it reads dims from its ddconfig, not from the tensors)
COMFY_GEOMETRY = dict(dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True])
COMFY_FULL = {"2.1": dict(dim=96, z_dim=16), "2.2": dict(dim=160, z_dim=48)}


def random_wan_state_dict(wan_module, cfg: dict, seed: int = 0) -> dict:
    """A state dict for `wan_module.WanVAE(**COMFY_GEOMETRY, **cfg)` (comfy/ldm/wan/vae.py or vae2_2.py) under its
    own module names, which are the original Wan key names; distinct random values everywhere (norm gammas
    too), so a swapped tensor cannot go unnoticed. ComfyUI's ops skip weight init, so every tensor is filled."""
    model = wan_module.WanVAE(**{**COMFY_GEOMETRY, **cfg})
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("gamma"):
            sd[name] = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
        elif t.dim() > 1:
            sd[name] = torch.randn(t.shape, generator=g) / max(1, t[0].numel()) ** 0.5
        else:
            sd[name] = 0.1 * torch.randn(t.shape, generator=g)
    return sd


# ---------------------------------------------------------------------------------------------
# Independent inverse mapping: diffusers names -> original Wan names
# ---------------------------------------------------------------------------------------------

_RES = [
    ("norm1.gamma", "residual.0.gamma"),
    ("conv1.", "residual.2."),
    ("norm2.gamma", "residual.3.gamma"),
    ("conv2.", "residual.6."),
    ("conv_shortcut.", "shortcut."),
]


def _res_leaf(leaf: str) -> str:
    for diffusers_name, original in _RES:
        if leaf.startswith(diffusers_name):
            return original + leaf[len(diffusers_name) :]
    raise AssertionError(f"unknown resnet leaf {leaf}")


def to_original_names(diffusers_sd: dict, num_res_blocks: int, nested: bool) -> dict:
    """What the released Wan checkpoints (and ComfyUI's WanVAE.state_dict()) call each tensor."""
    out = {}
    for key, value in diffusers_sd.items():
        k = key
        k = re.sub(r"^quant_conv\.", "conv1.", k)
        k = re.sub(r"^post_quant_conv\.", "conv2.", k)
        k = re.sub(r"^(encoder|decoder)\.conv_in\.", r"\1.conv1.", k)
        k = re.sub(r"^(encoder|decoder)\.norm_out\.", r"\1.head.0.", k)
        k = re.sub(r"^(encoder|decoder)\.conv_out\.", r"\1.head.2.", k)
        k = re.sub(r"^(encoder|decoder)\.mid_block\.attentions\.0\.", r"\1.middle.1.", k)
        if m := re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)$", k):
            k = f"{m[1]}.middle.{2 * int(m[2])}.{_res_leaf(m[3])}"
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", k):
            block, rest = int(m[1]), m[2]
            if not nested:  # 2.1: the encoder list is already flat and indexed like the original
                leaf = rest if rest.startswith(("resample.", "time_conv.")) else _res_leaf(rest)
                k = f"encoder.downsamples.{block}.{leaf}"
            elif r := re.match(r"^resnets\.(\d+)\.(.+)$", rest):
                k = f"encoder.downsamples.{block}.downsamples.{r[1]}.{_res_leaf(r[2])}"
            else:
                k = f"encoder.downsamples.{block}.downsamples.{num_res_blocks}." + rest.removeprefix("downsampler.")
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.(.+)$", k):
            block, rest = int(m[1]), m[2]
            per_level = num_res_blocks + 1  # resblocks per level, then the level's resample
            if r := re.match(r"^resnets\.(\d+)\.(.+)$", rest):
                j, leaf = int(r[1]), _res_leaf(r[2])
            else:
                j, leaf = per_level, re.sub(r"^(upsamplers\.0|upsampler)\.", "", rest)
            if nested:
                k = f"decoder.upsamples.{block}.upsamples.{j}.{leaf}"
            else:
                k = f"decoder.upsamples.{block * (per_level + 1) + j}.{leaf}"
        assert k not in out, f"two tensors map to {k}"
        out[k] = value
    return out
