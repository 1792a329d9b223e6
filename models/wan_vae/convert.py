"""Turn ComfyUI's Wan 2.1 / 2.2 VAE (original Wan key names) into diffusers' AutoencoderKLWan.

The fused decoder is defined as "bit-exact with diffusers' AutoencoderKLWan.decode", so the
VAE that users load with core `VAELoader` is rebuilt as that diffusers model:

* 2.1 keys go through diffusers' own single-file converter (`convert_wan_vae_to_diffusers`).
* 2.2 keys use the nested layout (`decoder.upsamples.{i}.upsamples.{j}`, one `Resample` at
  the end of each level) that diffusers 0.42.1's single-file converter does not handle, so
  they are mapped here, explicitly.
* The diffusers config is inferred from the tensor shapes, so the released files and tiny
  test checkpoints go through the same code. Loading is strict: every key and shape must
  match, otherwise the error lists what is missing / unexpected.

Nothing here imports ComfyUI: the VAE object is duck-typed (`get_sd()` or
`first_stage_model.state_dict()`, `latent_channels`).
"""

from __future__ import annotations

import copy
import re

import torch

from ..checkpoint_io import build_strict

# --------------------------------------------------------------------------------------
# Released configs (no hub access: written out here)
# --------------------------------------------------------------------------------------

# Wan 2.1 = AutoencoderKLWan() defaults (latent stats also in ComfyUI latent_formats.Wan21).
WAN21_CONFIG = {
    "base_dim": 96,
    "decoder_base_dim": None,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": [
        -0.7571,
        -0.7089,
        -0.9113,
        0.1075,
        -0.1745,
        0.9653,
        -0.1517,
        1.5508,
        0.4134,
        -0.0715,
        0.5517,
        -0.3632,
        -0.1922,
        -0.9497,
        0.2503,
        -0.2921,
    ],
    "latents_std": [
        2.8184,
        1.4541,
        2.3275,
        2.6558,
        1.2196,
        1.7708,
        2.6052,
        2.0743,
        3.2687,
        2.1526,
        2.8652,
        1.5579,
        1.6382,
        1.1253,
        2.8251,
        1.9160,
    ],
    "is_residual": False,
    "in_channels": 3,
    "out_channels": 3,
    "patch_size": None,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}

# Wan 2.2 TI2V-5B VAE: RGB is patchified 2x2 into 12 channels, 48 latent channels, x16.
# Latent stats from ComfyUI comfy/latent_formats.py class Wan22.
WAN22_CONFIG = {
    **WAN21_CONFIG,
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "latents_mean": [
        -0.2289,
        -0.0052,
        -0.1323,
        -0.2339,
        -0.2799,
        0.0174,
        0.1838,
        0.1557,
        -0.1382,
        0.0542,
        0.2813,
        0.0891,
        0.1570,
        -0.0098,
        0.0375,
        -0.1825,
        -0.2246,
        -0.1207,
        -0.0698,
        0.5109,
        0.2665,
        -0.2108,
        -0.2158,
        0.2502,
        -0.2055,
        -0.0322,
        0.1109,
        0.1567,
        -0.0729,
        0.0899,
        -0.2799,
        -0.1230,
        -0.0313,
        -0.1649,
        0.0117,
        0.0723,
        -0.2839,
        -0.2083,
        -0.0520,
        0.3748,
        0.0152,
        0.1957,
        0.1433,
        -0.2944,
        0.3573,
        -0.0548,
        -0.1681,
        -0.0667,
    ],
    "latents_std": [
        0.4765,
        1.0364,
        0.4514,
        1.1677,
        0.5313,
        0.4990,
        0.4818,
        0.5013,
        0.8158,
        1.0344,
        0.5894,
        1.0901,
        0.6885,
        0.6165,
        0.8454,
        0.4978,
        0.5759,
        0.3523,
        0.7135,
        0.6804,
        0.5833,
        1.4146,
        0.8986,
        0.5659,
        0.7069,
        0.5338,
        0.4889,
        0.4917,
        0.4069,
        0.4999,
        0.6866,
        0.4093,
        0.5709,
        0.6065,
        0.6415,
        0.4944,
        0.5726,
        1.2042,
        0.5458,
        1.6887,
        0.3971,
        1.0600,
        0.3943,
        0.5537,
        0.5444,
        0.4089,
        0.7468,
        0.7744,
    ],
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
}

EXPECTED_FILES = "wan_2.1_vae.safetensors (Wan 2.1, 16 latent channels) or wan2.2_vae.safetensors (Wan 2.2, 48)"
CACHE_ATTR = "_omnivideo_diffusers_vae"


class WanVAEConversionError(ValueError):
    """The weights are not a Wan VAE, or do not fit the diffusers model built for them."""


# --------------------------------------------------------------------------------------
# Detection and config inference (original Wan key names, as ComfyUI holds them)
# --------------------------------------------------------------------------------------

_WAN_MARKER = "decoder.middle.0.residual.0.gamma"  # the key ComfyUI itself uses to spot a Wan VAE
_WAN22_NESTED = re.compile(r"^decoder\.upsamples\.\d+\.upsamples\.\d+\.")


def detect_wan_version(state_dict) -> str:
    """Return "2.1" or "2.2" from the key layout; raise WanVAEConversionError for anything else."""
    if _WAN_MARKER not in state_dict:
        raise WanVAEConversionError(f"not a Wan VAE state dict (no '{_WAN_MARKER}'); expected {EXPECTED_FILES}")
    # 2.2 nests the decoder levels (decoder.upsamples.{i}.upsamples.{j}); 2.1 is flat.
    return "2.2" if any(_WAN22_NESTED.match(k) for k in state_dict) else "2.1"


def _indices(state_dict, pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return sorted({int(m.group(1)) for k in state_dict if (m := rx.match(k))})


def infer_wan_config(state_dict) -> dict:
    """The AutoencoderKLWan config that fits these weights, read from key layout and shapes.

    Everything geometric (widths, depth, temporal up/down flags, channels, patch size) comes
    from the decoder; the encoder and the rest are then checked by the strict load.
    """
    version = detect_wan_version(state_dict)
    try:
        return _infer(state_dict, version)
    except KeyError as e:  # a truncated or edited file: name the tensor instead of a bare KeyError
        raise WanVAEConversionError(
            f"Wan {version} VAE weights lack {e.args[0]!r}; expected {EXPECTED_FILES}"
        ) from None


def _infer(sd, version: str) -> dict:
    z_dim = sd["decoder.conv1.weight"].shape[1]
    out_ch = sd["decoder.head.2.weight"].shape[0]
    in_ch = sd["encoder.conv1.weight"].shape[1] if "encoder.conv1.weight" in sd else out_ch
    enc_base = sd["encoder.conv1.weight"].shape[0] if "encoder.conv1.weight" in sd else None

    if version == "2.2":
        levels = _indices(sd, r"^decoder\.upsamples\.(\d+)\.upsamples\.")
        last = levels[-1]  # the last level has no upsampler: only its resblocks
        num_res_blocks = len(_indices(sd, rf"^decoder\.upsamples\.{last}\.upsamples\.(\d+)\.residual\.")) - 1
        level_out = [sd[f"decoder.upsamples.{i}.upsamples.0.residual.2.weight"].shape[0] for i in levels]
        t_up = [f"decoder.upsamples.{i}.upsamples.{num_res_blocks + 1}.time_conv.weight" in sd for i in levels[:-1]]
    else:
        # Flat: per level (num_res_blocks + 1) resblocks, then a Resample except after the last.
        resamples = _indices(sd, r"^decoder\.upsamples\.(\d+)\.resample\.")
        if not resamples:
            raise WanVAEConversionError("Wan 2.1 VAE decoder has no upsampling blocks")
        step = resamples[0] + 1
        num_res_blocks = step - 2
        n_levels = len(resamples) + 1
        level_out = [sd[f"decoder.upsamples.{i * step}.residual.2.weight"].shape[0] for i in range(n_levels)]
        t_up = [f"decoder.upsamples.{r}.time_conv.weight" in sd for r in resamples]

    dec_base = level_out[-1]  # dim_mult[0] == 1 in every Wan VAE: the last level runs at base width
    dim_mult = [c // dec_base for c in reversed(level_out)]
    patch = round((in_ch // 3) ** 0.5)
    base = WAN22_CONFIG if version == "2.2" else WAN21_CONFIG
    config = copy.deepcopy(base)  # callers may edit the lists; keep the module constants intact
    config.update(
        base_dim=enc_base if enc_base is not None else dec_base,
        decoder_base_dim=dec_base if version == "2.2" else None,
        z_dim=z_dim,
        dim_mult=dim_mult,
        num_res_blocks=num_res_blocks,
        temperal_downsample=list(reversed(t_up)),  # the decoder runs the encoder's flags backwards
        is_residual=version == "2.2",
        in_channels=in_ch,
        out_channels=out_ch,
        patch_size=patch if patch > 1 else None,
        scale_factor_temporal=2 ** sum(t_up),
        scale_factor_spatial=2 ** (len(dim_mult) - 1) * patch,
    )
    if z_dim != base["z_dim"]:  # not the released latent space (tiny test models): neutral stats
        config["latents_mean"], config["latents_std"] = [0.0] * z_dim, [1.0] * z_dim
    return config


# --------------------------------------------------------------------------------------
# Key mapping
# --------------------------------------------------------------------------------------


def convert_wan21_to_diffusers(state_dict) -> dict:
    """Wan 2.1 original keys -> diffusers names, with diffusers' own single-file converter.

    That converter hard-codes the released decoder layout (4 levels of 3 resblocks + a
    resample, the 1x1 shortcut at block 4), so only the widths may differ from the real file.
    """
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    cfg = infer_wan_config(state_dict)
    if cfg["num_res_blocks"] != 2 or len(cfg["dim_mult"]) != 4:
        raise WanVAEConversionError(
            f"Wan 2.1 VAE with num_res_blocks={cfg['num_res_blocks']}, {len(cfg['dim_mult'])} levels: "
            "diffusers' converter supports only the released layout (2 res blocks, 4 levels)"
        )
    return convert_wan_vae_to_diffusers(dict(state_dict))


# Leaf renames inside one ResidualBlock: nn.Sequential indices -> diffusers attribute names
# (residual = [RMS_norm, SiLU, conv, RMS_norm, SiLU, Dropout, conv]).
_RESBLOCK_LEAVES = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight",
    "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight",
    "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight",
    "shortcut.bias": "conv_shortcut.bias",
}
# Resample (up/down sampler) and attention leaves keep their names in diffusers.
_RESAMPLE_LEAVES = {"resample.1.weight", "resample.1.bias", "time_conv.weight", "time_conv.bias"}
_ATTENTION_LEAVES = {"norm.gamma", "to_qkv.weight", "to_qkv.bias", "proj.weight", "proj.bias"}
# Whole-module renames, same in 2.1 and 2.2.
_FIXED = {
    "conv1": "quant_conv",
    "conv2": "post_quant_conv",
    "encoder.conv1": "encoder.conv_in",
    "decoder.conv1": "decoder.conv_in",
    "encoder.head.0": "encoder.norm_out",
    "encoder.head.2": "encoder.conv_out",
    "decoder.head.0": "decoder.norm_out",
    "decoder.head.2": "decoder.conv_out",
}
_MIDDLE = {"0": "mid_block.resnets.0", "1": "mid_block.attentions.0", "2": "mid_block.resnets.1"}
# encoder.downsamples.{i}.downsamples.{j}.<leaf> / decoder.upsamples.{i}.upsamples.{j}.<leaf>
_NESTED = re.compile(r"^(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\.(.+)$")
_NESTED_TARGET = {
    # original prefix: (diffusers block list, name of the block's single resampler)
    "encoder.downsamples": ("encoder.down_blocks", "downsampler"),
    "decoder.upsamples": ("decoder.up_blocks", "upsampler"),
}


def _rename_wan22(key: str) -> str | None:
    module, _, leaf = key.rpartition(".")
    if module in _FIXED:
        return f"{_FIXED[module]}.{leaf}"
    m = re.match(r"^(encoder|decoder)\.middle\.(\d)\.(.+)$", key)
    if m and m.group(2) in _MIDDLE:
        side, idx, rest = m.groups()
        if idx == "1" and rest in _ATTENTION_LEAVES:
            return f"{side}.{_MIDDLE[idx]}.{rest}"
        if idx != "1" and rest in _RESBLOCK_LEAVES:
            return f"{side}.{_MIDDLE[idx]}.{_RESBLOCK_LEAVES[rest]}"
        return None
    m = _NESTED.match(key)
    if m:
        prefix, level, j, rest = m.groups()
        blocks, sampler = _NESTED_TARGET[prefix]
        # The level's Sequential is [resblock x n, Resample]; diffusers splits it into
        # `resnets.{j}` and one `downsampler` / `upsampler` (the avg/dup shortcuts have no weights).
        if rest in _RESBLOCK_LEAVES:
            return f"{blocks}.{level}.resnets.{j}.{_RESBLOCK_LEAVES[rest]}"
        if rest in _RESAMPLE_LEAVES:
            return f"{blocks}.{level}.{sampler}.{rest}"
    return None


def convert_wan22_to_diffusers(state_dict) -> dict:
    """Wan 2.2 original (nested) keys -> diffusers names. Unknown keys are kept under their
    original name so that the strict check reports them as unexpected."""
    out = {}
    for key, value in state_dict.items():
        new = _rename_wan22(key)
        out[new if new is not None else key] = value
    return out


def convert_wan_state_dict(state_dict, source: str = "the Wan VAE weights") -> tuple[dict, dict, str]:
    """(diffusers state dict, diffusers config, version) for a Wan VAE in original key names."""
    version = detect_wan_version(state_dict)
    config = infer_wan_config(state_dict)
    try:
        convert = convert_wan22_to_diffusers if version == "2.2" else convert_wan21_to_diffusers
        converted = convert(state_dict)
    except WanVAEConversionError as e:
        raise WanVAEConversionError(f"{source} (Wan {version}): {e}") from None
    return converted, config, version


# --------------------------------------------------------------------------------------
# Building the diffusers model
# --------------------------------------------------------------------------------------


def build_diffusers_wan_vae(state_dict, dtype=None, device=None, source: str = "the Wan VAE weights"):
    """AutoencoderKLWan (eval, no grad) holding copies of these original-layout weights."""
    from diffusers import AutoencoderKLWan

    converted, config, version = convert_wan_state_dict(state_dict, source)
    if dtype is None:
        dtype = next(v.dtype for v in converted.values() if v.is_floating_point())
    if device is None:
        device = next(iter(converted.values())).device
    # copy=True: never share storage with ComfyUI's own model, which it moves and patches.
    weights = {k: v.to(device=device, dtype=dtype, copy=True) for k, v in converted.items()}
    geometry = {k: config[k] for k in ("base_dim", "decoder_base_dim", "z_dim", "dim_mult", "num_res_blocks")}
    model = build_strict(
        lambda: AutoencoderKLWan(**config),
        weights,
        f"{source} looks like a Wan {version} VAE ({geometry}) but does not load into diffusers' AutoencoderKLWan "
        "(keys in diffusers names)",
        f"Use an unmodified {EXPECTED_FILES}.",
        WanVAEConversionError,
    )
    left_on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left_on_meta:  # would mean diffusers grew state that the file does not carry
        raise WanVAEConversionError(f"tensors not loaded from {source}: {left_on_meta[:10]}")
    return model.eval().requires_grad_(False)


def _comfy_state_dict(vae):
    # comfy.sd.VAE.get_sd() is first_stage_model.state_dict(); an invalid VAE has None there.
    fsm = getattr(vae, "first_stage_model", None)
    if fsm is not None and callable(getattr(fsm, "state_dict", None)):
        return fsm.state_dict()
    if fsm is None and not hasattr(vae, "first_stage_model") and callable(getattr(vae, "get_sd", None)):
        return vae.get_sd()
    return None


def _describe(vae) -> str:
    fsm = getattr(vae, "first_stage_model", None)
    cls = f"{type(fsm).__module__}.{type(fsm).__qualname__}" if fsm is not None else "no model"
    return (
        f"a {type(vae).__name__} with first_stage_model={cls}, latent_channels={getattr(vae, 'latent_channels', '?')}"
    )


def diffusers_vae_from_comfy(vae, dtype=None, device=None):
    """diffusers AutoencoderKLWan equivalent to a ComfyUI VAE (what core VAELoader returns).

    dtype / device default to the ComfyUI VAE's own (`vae_dtype`, `device`), falling back to
    the weights'. The model is cached on the VAE object per (dtype, device): a second call with
    the same pair is free; a call with another pair replaces it (one copy of the weights only).
    """
    sd = _comfy_state_dict(vae)
    if not sd or _WAN_MARKER not in sd:
        raise WanVAEConversionError(
            f"This node decodes Wan latents and needs a Wan VAE; got {_describe(vae)}. "
            f"Load {EXPECTED_FILES} with Load VAE."
        )
    dtype = dtype or getattr(vae, "vae_dtype", None) or next(v.dtype for v in sd.values() if v.is_floating_point())
    device = torch.device(device or getattr(vae, "device", None) or next(iter(sd.values())).device)
    key = (dtype, str(device))
    cached = getattr(vae, CACHE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    setattr(vae, CACHE_ATTR, None)  # drop the old copy before building a new one
    model = build_diffusers_wan_vae(sd, dtype=dtype, device=device, source=f"the VAE input ({_describe(vae)})")
    setattr(vae, CACHE_ATTR, (key, model))
    return model


# --------------------------------------------------------------------------------------
# Facts the decode node needs
# --------------------------------------------------------------------------------------


def wan_version(dvae) -> str:
    return "2.2" if dvae.config.is_residual else "2.1"
