"""Shared Wan VAE test fixtures: tiny random-weight VAEs shaped like the released 2.1 / 2.2
ones, and their weights under the original Wan (ComfyUI) key names via an inverse mapping
written independently of the converter."""

import re

import torch
from diffusers import AutoencoderKLWan

TINY_WAN21 = dict(
    base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2, latents_mean=[0.0] * 4, latents_std=[1.0] * 4
)
# Wan 2.2 TI2V-5B layout: residual up blocks with DupUp3D (factor_t, factor_s, repeats) =
# (2, 2, 8), (2, 2, 8), (1, 2, 2) as in the real VAE, patch size 2, 12 in/out channels.
TINY_WAN22 = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=8,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=1,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    latents_mean=[0.0] * 8,
    latents_std=[1.0] * 8,
)
CONFIGS = {"2.1": TINY_WAN21, "2.2": TINY_WAN22}


def tiny_from_config(config: dict, seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return randomize(AutoencoderKLWan(**config), seed)


def tiny_wan_vae(version: str, seed: int = 0, dtype=torch.float32) -> AutoencoderKLWan:
    return tiny_from_config(CONFIGS[version], seed).to(dtype)


def tiny_latent(vae: AutoencoderKLWan, frames: int = 3, size: int = 4, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, vae.config.z_dim, frames, size, size, generator=g)
    return z.to(vae.dtype)


def to_channels_last_3d(vae: AutoencoderKLWan) -> AutoencoderKLWan:
    """channels_last_3d 3-D conv weights, so activations flow in that layout (2-D convs stay)."""
    for module in vae.modules():
        if isinstance(module, torch.nn.Conv3d):
            module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last_3d)
    return vae


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


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Distinct values everywhere (also norm gammas), so a swapped key cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = max(1, p[0].numel()) if p.dim() > 1 else 16
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
    return model.eval()


def _tiny(cfg: dict, seed: int) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return randomize(AutoencoderKLWan(**cfg), seed)


def decode(model, z):
    with torch.no_grad():
        return model.decode(z).sample


class FakeComfyVAE:
    """The parts of comfy.sd.VAE that the converter reads (v0.3.64)."""

    def __init__(self, first_stage_model, latent_channels, vae_dtype=torch.float32, device="cpu"):
        self.first_stage_model = first_stage_model
        self.latent_channels = latent_channels
        self.vae_dtype = vae_dtype
        self.device = torch.device(device)

    def get_sd(self):
        return self.first_stage_model.state_dict()


class StateDictModule(torch.nn.Module):
    """Holds an arbitrary state dict (original names) like ComfyUI's WanVAE would."""

    def __init__(self, sd):
        super().__init__()
        self._sd = sd

    def state_dict(self, *args, **kwargs):
        return dict(self._sd)
