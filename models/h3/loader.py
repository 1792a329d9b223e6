"""Load MiniMax-H3 (transformer, video VAE, audio VAE, scheduler configs) from local files only.

Sources: a diffusers-format folder (`transformer/`, `vae/`, `audio_vae/`, `scheduler/`,
`audio_scheduler/`), optionally with the transformer taken from a single-file
checkpoint (ComfyUI / original keys, converted with diffusers'
`convert_minimax_h3_transformer_checkpoint_to_diffusers`).

We build each model on the meta device and assign the checkpoint tensors, instead of
`from_pretrained`: these classes declare `_keep_in_fp32_modules`, which makes
`from_pretrained` demand `accelerate`. The fp32 islands are applied here with
diffusers' own rule (a listed name equal to a component of the parameter path).
"""

from __future__ import annotations

import inspect
import logging
import os
import types
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import MiniMaxH3VideoRotaryPosEmbed
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormModulation,
    MiniMaxH3RotaryPosEmbed,
)

from ... import compat
from ...backends import PLATFORM, resolve_weight_dtype
from ..checkpoint_io import (
    CheckpointError,
    build_strict,
    check_safetensors,
    dequantize_scaled_fp8,
    read_json,
    read_safetensors,
    shown_name,
)
from ..handles import H3Model
from .geometry import H3Geometry

log = logging.getLogger("omnivideo")

CLASSES = {
    "transformer": MiniMaxH3Transformer3DModel,
    "vae": AutoencoderKLMiniMaxH3,
    "audio_vae": AutoencoderKLMiniMaxH3Audio,
}
ORIGINAL_KEY = "token_refiner.blocks.0.attn.qkv_proj.weight"  # diffusers' marker of an original H3 checkpoint
COMFY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


class H3LoadError(ValueError):
    pass


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise H3LoadError(f"{shown_name(path)} is missing.")
    try:
        return read_json(str(path))
    except CheckpointError as exc:
        raise H3LoadError(str(exc)) from None


def check_folder(root: str | os.PathLike, *, need_transformer_weights: bool = True) -> Path:
    """Raise a message naming what is wrong or missing in a diffusers-format H3 folder."""
    root = Path(root)
    shown = shown_name(root)
    if not root.is_dir():
        raise H3LoadError(
            f"'{shown}' is not a folder. Put the diffusers-format MiniMax-H3 folder "
            "(transformer/, vae/, audio_vae/, scheduler/, audio_scheduler/) under models/diffusers/."
        )
    cfg = root / "transformer" / "config.json"
    if cfg.is_file():
        name = _read_json(cfg).get("_class_name")
        if name != "MiniMaxH3Transformer3DModel":
            raise H3LoadError(
                f"'{shown}' holds a {name} transformer, not MiniMax-H3 (MiniMaxH3Transformer3DModel). "
                "Pick the MiniMax-H3 folder."
            )
    elif need_transformer_weights:
        hint = (
            " (it has transformer_ref/ only: that is the ref2va partition, not supported here)"
            if (root / "transformer_ref").is_dir()
            else ""
        )
        raise H3LoadError(
            f"'{shown}' has no transformer/config.json{hint}; this is not a diffusers-format "
            "MiniMax-H3 folder, or choose a single-file transformer from diffusion_models."
        )
    missing = [sub for sub in ("vae", "audio_vae") if not (root / sub / "config.json").is_file()]
    if need_transformer_weights and not _weight_files(root / "transformer"):
        missing.append("transformer weights (*.safetensors)")
    missing += [
        f"{sub} weights (*.safetensors)"
        for sub in ("vae", "audio_vae")
        if (root / sub / "config.json").is_file() and not _weight_files(root / sub)
    ]
    if missing:
        raise H3LoadError(
            f"'{shown}' is missing: {', '.join(missing)}. Download the complete MiniMax-H3 "
            "diffusers folder (MiniMaxAI/MiniMax-H3) into models/diffusers/."
        )
    return root


def folder_problem(root: str | os.PathLike) -> str | None:
    """None when `root` is a diffusers-format MiniMax-H3 folder (the transformer may come from a single file)."""
    try:
        check_folder(root, need_transformer_weights=False)
    except H3LoadError as err:
        return str(err)
    return None


def _weight_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        names = sorted(set(_read_json(index[0])["weight_map"].values()))
        absent = [n for n in names if not (folder / n).is_file()]
        if absent:
            raise H3LoadError(
                f"{shown_name(folder)} lists shards that are not there: {', '.join(absent[:3])}"
                f"{'…' if len(absent) > 3 else ''}. Finish the download."
            )
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def _read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    sd = {}
    for f in files:
        sd.update(read_safetensors(str(f)))
    return sd


def _cast_with_islands(model: torch.nn.Module, dtype: torch.dtype) -> None:
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        want = torch.float32 if any(k in name.split(".") for k in keep) else dtype
        if param.dtype != want:
            param.data = param.data.to(want)


def _rebuild_computed_buffers(model: torch.nn.Module) -> None:
    """Non-persistent buffers are computed in __init__, so after a meta build they are empty: recompute them."""
    cfg: Any = model.config  # a diffusers FrozenDict
    for module in model.modules():
        if isinstance(module, MiniMaxH3RotaryPosEmbed) and module.inv_freq.is_meta:
            fresh: torch.nn.Module = MiniMaxH3RotaryPosEmbed(module.rope_freq_dim, cfg.rope_theta)
            module.register_buffer("inv_freq", fresh.inv_freq, persistent=False)
        elif isinstance(module, MiniMaxH3VideoRotaryPosEmbed) and module.inv_freq.is_meta:
            fresh = MiniMaxH3VideoRotaryPosEmbed(
                int(cfg.decoder_attention_head_dim * cfg.decoder_rope_dim_ratio), theta=cfg.decoder_rope_theta
            )
            module.register_buffer("inv_freq", fresh.inv_freq, persistent=False)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise H3LoadError(
            f"{type(model).__name__}: no values for {', '.join(left[:5])}; "
            "the checkpoint does not match this diffusers version."
        )


def build_component(cls, config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, source: str):
    model = build_strict(
        lambda: cls.from_config(config),
        state_dict,
        f"{source} does not fit {cls.__name__} with its config",
        "Check that config.json belongs to these weights.",
        H3LoadError,
    )
    _rebuild_computed_buffers(model)
    _cast_with_islands(model, dtype)
    return model.eval().requires_grad_(False)


def load_component(root: Path, sub: str, dtype: torch.dtype):
    config = _read_json(root / sub / "config.json")
    files = _weight_files(root / sub)
    if not files:
        raise H3LoadError(f"{shown_name(root / sub)} has no *.safetensors weights.")
    return build_component(CLASSES[sub], config, _read_state_dict(files), dtype, shown_name(root / sub))


def convert_single_file(
    path: str | os.PathLike, config: dict, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """A single-file H3 transformer (ComfyUI / original keys, or already diffusers keys; plain or ComfyUI's
    scaled fp8, dequantized to `dtype`) -> diffusers keys."""
    sd = read_safetensors(str(path))
    for prefix in COMFY_PREFIXES:
        if any(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in sd.items()}
    sd = dequantize_scaled_fp8(sd, dtype)
    if "adaln_t_table" in sd:
        raise H3LoadError(
            f"{shown_name(path)} is a pruned MiniMax-H3 checkpoint: it stores adaln_t_table "
            f"{tuple(sd['adaln_t_table'].shape)} "
            "instead of the time_embedder, which diffusers' MiniMaxH3Transformer3DModel cannot run. "
            "Use the unpruned single file (Comfy-Org/MiniMax-H3) or the MiniMaxAI/MiniMax-H3 diffusers folder."
        )
    if ORIGINAL_KEY in sd:
        sd = convert_minimax_h3_transformer_checkpoint_to_diffusers(sd, config)
    elif "transformer_blocks.0.attn.to_q.weight" not in sd:
        raise H3LoadError(
            f"{shown_name(path)} is not a MiniMax-H3 transformer (no {ORIGINAL_KEY} or diffusers block keys)."
        )
    return sd


def _transformer_config(root: Path | None) -> dict:
    """transformer/config.json of the folder when present, else the released model's (the class defaults)."""
    defaults = {
        n: p.default
        for n, p in inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.items()
        if n != "self"
    }
    if root is not None and (root / "transformer" / "config.json").is_file():
        return {**defaults, **_read_json(root / "transformer" / "config.json")}
    return defaults


def geometry_of(transformer, vae, audio_vae) -> H3Geometry:
    pt, ph, pw = transformer.config.patch_size
    return H3Geometry(
        spatial_ratio=int(vae.spatial_compression_ratio),
        frames_per_chunk=int(vae.config.clip_length),
        latents_per_chunk=int(vae.tokens_chunk_size),
        latent_channels=int(vae.config.latent_channels),
        audio_latent_channels=int(audio_vae.config.latent_channels),
        audio_sample_rate=int(audio_vae.config.sampling_rate),
        patch_size=(int(pt), int(ph), int(pw)),
    )


def latent_norm_of(vae, audio_vae, audio_config: str = "audio_vae/config.json") -> dict:
    """`audio_config`: how an error names the audio VAE's config.json."""
    if audio_vae.config.latents_mean is None or audio_vae.config.latents_std is None:
        raise H3LoadError(f"{audio_config} has no latents_mean / latents_std; the H3 audio VAE needs both.")
    return {
        "video_mean": list(vae.config.latents_mean),
        "video_std": list(vae.config.latents_std),
        "audio_mean": list(audio_vae.config.latents_mean),
        "audio_std": list(audio_vae.config.latents_std),
    }


def scheduler_configs(root: Path) -> tuple[dict, dict]:
    out = []
    for sub, default in (("scheduler", 12.0), ("audio_scheduler", 3.0)):
        path = root / sub / "scheduler_config.json"
        if path.is_file():
            out.append(_read_json(path))
        else:
            log.info("omnivideo h3: %s missing, using shift %.1f", path, default)
            out.append({"shift": default})
    return out[0], out[1]


def load_h3(
    folder: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    transformer_file: str | os.PathLike | None = None,
    device: torch.device | None = None,
    attention=None,
):
    """-> (H3Model, video VAE, audio VAE): each network held by a ComfyUI ModelPatcher, its weights on the CPU
    until ComfyUI loads them. `dtype` may be 'fp8_e4m3fn' (block matrices stored in fp8, computing in the 'auto'
    dtype); `device` is where they run outside ComfyUI (default: the backend registry's)."""
    device = device or PLATFORM.device
    weight_dtype, dtype = resolve_weight_dtype(dtype, device)
    root = check_folder(folder, need_transformer_weights=transformer_file is None)
    subs = ("vae", "audio_vae") if transformer_file is not None else ("transformer", "vae", "audio_vae")
    files = [f for sub in subs for f in _weight_files(root / sub)] + ([transformer_file] if transformer_file else [])
    for file in files:  # every file's header first: a truncated download fails before any heavy load
        check_safetensors(str(file))
    transformer = load_transformer(root, transformer_file, dtype)
    if weight_dtype != dtype:
        store_blocks_in(transformer, weight_dtype, dtype)
    compat.make_castable(transformer, compat.operations(weight_dtype, dtype, device))
    vae_dtype = torch.float32 if dtype == torch.float32 else dtype
    vae = load_component(root, "vae", vae_dtype)
    audio_vae = load_component(root, "audio_vae", torch.float32)  # the audio VAE stays fp32
    for net, net_dtype in ((vae, vae_dtype), (audio_vae, torch.float32)):
        compat.make_castable(net, compat.operations(net_dtype, net_dtype, device))
    video_cfg, audio_cfg = scheduler_configs(root)
    model = H3Model(
        patcher=compat.manage(transformer, "diffusion", device),
        dtype=dtype,
        attention=attention,
        geometry=geometry_of(transformer, vae, audio_vae),
        latent_norm=latent_norm_of(vae, audio_vae, shown_name(root / "audio_vae" / "config.json")),
        scheduler_config=video_cfg,
        audio_scheduler_config=audio_cfg,
        source=str(root),
        load_args=weights_recipe(root, transformer_file, dtype, weight_dtype),
    )
    return model, compat.manage(vae, "vae", device), compat.manage(audio_vae, "vae", device)


def load_transformer(
    root: Path, transformer_file: str | os.PathLike | None, dtype: torch.dtype
) -> MiniMaxH3Transformer3DModel:
    """The transformer of a checked folder, or from a single file (with the folder's config), in `dtype`."""
    if transformer_file is None:
        return load_component(root, "transformer", dtype)
    config = _transformer_config(root)
    return build_component(
        MiniMaxH3Transformer3DModel,
        config,
        convert_single_file(transformer_file, config, dtype),
        dtype,
        shown_name(transformer_file),
    )


def weights_recipe(
    root: Path, transformer_file: str | os.PathLike | None, dtype: torch.dtype, weight_dtype: torch.dtype
) -> dict:
    """What a parallel worker needs to load the same transformer (`load_transformer`), JSON; the files' modification
    times tell a replaced file from the one a worker already holds."""
    files = [Path(transformer_file)] if transformer_file is not None else _weight_files(root / "transformer")
    return {
        "folder": str(root),
        "transformer_file": None if transformer_file is None else str(transformer_file),
        "mtime_ns": [os.stat(f).st_mtime_ns for f in files],
        "dtype": str(dtype),
        "weight_dtype": str(weight_dtype),
    }


def store_blocks_in(transformer: MiniMaxH3Transformer3DModel, weight_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """fp8 weights: every matrix of the token refiner and the block stack (AdaLN projections included: all but ~1%
    of the weights) is stored in `weight_dtype`; ComfyUI's cast layers compute with it in `dtype`."""
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith(("transformer_blocks.", "token_refiner.")):
            module.weight.data = module.weight.data.to(weight_dtype)
        elif isinstance(module, MiniMaxH3AdaLayerNormModulation):
            module.compute_dtype = dtype
            module.forward = types.MethodType(_modulation_forward, module)


def _modulation_forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Copied from diffusers' MiniMaxH3AdaLayerNormModulation.forward, casting to the compute dtype instead of its
    # projection's parameter dtype (fp8 storage is not a dtype to compute in).
    temb = self.linear(torch.nn.functional.silu(temb).to(self.compute_dtype))
    temb = temb.view(-1, 6 * self.hidden_size)
    return temb.chunk(6, dim=-1)
