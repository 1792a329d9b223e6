"""Wan files as ComfyUI reads them, with random weights: the full-size Wan 2.1 VAE file (VAELoader), a tiny Wan 2.1
text-to-video DiT file (UNETLoader; ComfyUI infers its dims from the tensor shapes), random weights for ComfyUI's
own Wan VAE classes, and the original Wan (ComfyUI) key names of diffusers' AutoencoderKLWan tensors (an inverse
mapping written independently of diffusers' converter, checked by a round trip through it)."""

from __future__ import annotations

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


# ---------------------------------------------------------------------------------------------
# Files: the full-size Wan 2.1 VAE, a tiny Wan 2.1 text-to-video DiT
# ---------------------------------------------------------------------------------------------


def write_random_wan21_vae(path, seed: int = 0) -> dict:
    """AutoencoderKLWan() (diffusers defaults = the Wan 2.1 config, ~127M parameters, random init), saved in
    bf16 (~250 MB) under the original Wan key names, as ComfyUI's VAELoader expects (it builds the released
    geometry whatever the tensors say, so the file is full size). The names come from `to_original_names`,
    checked here by a round trip through diffusers' own converter."""
    from pathlib import Path

    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = AutoencoderKLWan()
    sd = model.state_dict()
    original = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in to_original_names(sd, model.config.num_res_blocks, nested=False).items()
    }
    back = convert_wan_vae_to_diffusers(dict(original))  # round trip through diffusers' own converter
    if set(back) != set(sd) or any(back[k].shape != sd[k].shape for k in sd):
        raise AssertionError(f"inverse Wan VAE mapping is wrong: {sorted(set(back) ^ set(sd))[:10]}")
    if "decoder.middle.0.residual.0.gamma" not in original:  # the key ComfyUI recognises a Wan VAE by
        raise AssertionError("no decoder.middle.0.residual.0.gamma in the Wan VAE file")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(original, str(path))
    return {"tensors": len(original), "params": sum(v.numel() for v in original.values()), "bytes": path.stat().st_size}


# diffusers WanTransformer3DModel names -> the original Wan names (ComfyUI's WanModel): an independent inverse of
# diffusers' convert_wan_transformer_to_diffusers (its norm2/norm3 swap included), checked by a round trip.
_DIT_RENAMES = [
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    ("proj_out.", "head.head."),
]
# ComfyUI infers num_heads = dim // 128: one head of 128 channels is the smallest Wan it builds
TINY_WAN21_DIT = dict(
    num_attention_heads=2,  # two heads: OmniVideo Sequence Parallel's workflows split them over 2 ranks
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,  # ComfyUI's Wan always embeds 4096-wide UMT5 states
    freq_dim=256,
    ffn_dim=256,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)


def _original_dit_name(key: str) -> str:
    if key == "scale_shift_table":
        return "head.modulation"
    key = key.replace(".scale_shift_table", ".modulation")
    key = re.sub(r"\.norm2\.", ".norm3.", key)  # diffusers' norm2 is the cross-attention norm (original norm3)
    for new, old in _DIT_RENAMES:
        key = key.replace(new, old) if not new.startswith("proj_out") else re.sub(r"^proj_out\.", old, key)
    return key


def tiny_wan21_dit_state_dict(seed: int = 0) -> dict:
    """A random tiny Wan 2.1 text-to-video DiT (TINY_WAN21_DIT) under the original key names, fp32; every tensor
    random (norm weights near 1), so no layer is an identity."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**TINY_WAN21_DIT)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in model.state_dict().items():
        if "norm" in key and t.dim() == 1 and key.endswith("weight"):
            value = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif t.dim() > 1:
            value = 0.5 * torch.randn(t.shape, generator=g) / max(1, t[0].numel()) ** 0.5
        else:
            value = 0.05 * torch.randn(t.shape, generator=g)
        out[_original_dit_name(key)] = value.float().contiguous()
    back = convert_wan_transformer_to_diffusers(dict(out))
    want = model.state_dict()
    if set(back) != set(want) or any(back[k].shape != want[k].shape for k in want):
        raise AssertionError(f"inverse Wan DiT mapping is wrong: {sorted(set(back) ^ set(want))[:10]}")
    if "head.modulation" not in out:  # the key ComfyUI recognises a Wan 2.1 DiT by
        raise AssertionError("no head.modulation in the Wan DiT state dict")
    return out


def write_tiny_wan21_dit(path, seed: int = 0) -> dict:
    """`tiny_wan21_dit_state_dict` as a .safetensors file for core UNETLoader (diffusion_models)."""
    from pathlib import Path

    from safetensors.torch import save_file

    sd = tiny_wan21_dit_state_dict(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))
    return {"tensors": len(sd), "params": sum(v.numel() for v in sd.values())}
