"""Load MiniMax-H3 (transformer, video VAE, audio VAE, scheduler configs) from local files only.

Sources: a diffusers-format folder (`transformer/`, `vae/`, `audio_vae/`, `scheduler/`,
`audio_scheduler/`), optionally with the transformer taken from a single-file
checkpoint in any layout core ComfyUI reads (original keys converted with diffusers'
`convert_minimax_h3_transformer_checkpoint_to_diffusers`; core's pruned files through `adaln.py`).

We build each model on the meta device and assign the checkpoint tensors, instead of
`from_pretrained`: these classes declare `_keep_in_fp32_modules`, which makes
`from_pretrained` demand `accelerate`. The fp32 islands are applied here with
diffusers' own rule (a listed name equal to a component of the parameter path).
"""

from __future__ import annotations

import inspect
import logging
import os
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
    comfy_quant_layers,
    dequantize_comfy_quant,
    dequantize_scaled_fp8,
    read_json,
    read_safetensors,
    safetensors_keys,
    safetensors_metadata,
    shown_name,
)
from ..handles import H3Model
from . import adaln
from .geometry import H3Geometry

log = logging.getLogger("omnivideo")

CLASSES = {
    "transformer": MiniMaxH3Transformer3DModel,
    "transformer_ref": MiniMaxH3Transformer3DModel,
    "vae": AutoencoderKLMiniMaxH3,
    "audio_vae": AutoencoderKLMiniMaxH3Audio,
}
# The two transformer partitions of the HF repo: `transformer/` runs t2va and fl2va, `transformer_ref/` runs ref2va
# (diffusers' `MiniMaxH3Ref2VALoopDenoiser`); the same network class and config, other weights.
TRANSFORMER, TRANSFORMER_REF = "transformer", "transformer_ref"
PARTITIONS = (TRANSFORMER, TRANSFORMER_REF)
TASKS = {TRANSFORMER: "t2va/fl2va", TRANSFORMER_REF: "ref2va"}
LOADER_NODES = {TRANSFORMER: "OmniVideo H3 Loader", TRANSFORMER_REF: "OmniVideo H3 Ref2VA Loader"}
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


def check_folder(
    root: str | os.PathLike, *, need_transformer_weights: bool = True, partition: str = TRANSFORMER
) -> Path:
    """Raise a message naming what is wrong or missing in a diffusers-format H3 folder (`partition`: the transformer
    folder to load, transformer/ or transformer_ref/)."""
    root = Path(root)
    shown = shown_name(root)
    if not root.is_dir():
        raise H3LoadError(
            f"'{shown}' is not a folder. Put the diffusers-format MiniMax-H3 folder "
            "(transformer/, vae/, audio_vae/, scheduler/, audio_scheduler/) under models/diffusers/."
        )
    cfg = root / partition / "config.json"
    if cfg.is_file():
        name = _read_json(cfg).get("_class_name")
        if name != "MiniMaxH3Transformer3DModel":
            raise H3LoadError(
                f"'{shown}' holds a {name} transformer, not MiniMax-H3 (MiniMaxH3Transformer3DModel). "
                "Pick the MiniMax-H3 folder."
            )
    elif need_transformer_weights:
        other = next(p for p in PARTITIONS if p != partition)
        hint = (
            f" (it has {other}/: the {TASKS[other]} partition; load it with {LOADER_NODES[other]})"
            if (root / other / "config.json").is_file()
            else ""
        )
        raise H3LoadError(
            f"'{shown}' has no {partition}/config.json{hint}; this is not a diffusers-format "
            f"MiniMax-H3 folder with the {TASKS[partition]} partition, or choose a single-file transformer from "
            "diffusion_models."
        )
    missing = [sub for sub in ("vae", "audio_vae") if not (root / sub / "config.json").is_file()]
    if need_transformer_weights and not _weight_files(root / partition):
        missing.append(f"{partition} weights (*.safetensors)")
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
    also = getattr(model, "fp32_parameter", lambda name: False)  # a pruned model's AdaLN projections (adaln.py)
    for name, param in model.named_parameters():
        want = torch.float32 if any(k in name.split(".") for k in keep) or also(name) else dtype
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


def build_component(
    cls, config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, source: str, adapt=lambda m: m
):
    """`adapt`: what turns the freshly built (meta) model into the checkpoint's layout before its weights arrive."""
    model = build_strict(
        lambda: adapt(cls.from_config(config)),
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
    """A single-file H3 transformer as core ComfyUI reads it -> diffusers keys in `dtype`: original keys (or already
    diffusers keys), with or without core's `model.diffusion_model.` / `diffusion_model.` prefix (an all-in-one
    checkpoint: only the prefixed transformer is read), plain, scaled fp8 or core's per-tensor fp8 mixed precision."""
    keys = safetensors_keys(str(path))
    prefix = next((p for p in COMFY_PREFIXES if any(k.startswith(p) for k in keys)), "")
    sd = read_safetensors(str(path), keep=(lambda k: k.startswith(prefix)) if prefix else None)
    sd = {k[len(prefix) :]: v for k, v in sd.items()}
    layers = {
        k.removeprefix(prefix): c for k, c in comfy_quant_layers(sd, safetensors_metadata(str(path)), str(path)).items()
    }
    sd = dequantize_comfy_quant(dequantize_scaled_fp8(sd, dtype), layers, dtype, str(path))
    table = sd.pop(adaln.TABLE_KEY, None)  # core's pruned layout: diffusers' converter refuses it, we run it
    if ORIGINAL_KEY in sd:
        check_rope(sd.get("rope.inv_freq"), config, path)
        sd = convert_minimax_h3_transformer_checkpoint_to_diffusers(sd, config)
    elif "transformer_blocks.0.attn.to_q.weight" not in sd:
        raise H3LoadError(
            f"{shown_name(path)} is not a MiniMax-H3 transformer (no {ORIGINAL_KEY} or diffusers block keys)."
        )
    if table is not None:
        sd[adaln.OUR_TABLE_KEY] = table
    return sd


def check_rope(inv_freq: torch.Tensor | None, config: dict, path: str | os.PathLike) -> None:
    """Core runs a single file with the `rope.inv_freq` it stores, diffusers recomputes it from the config: refuse a
    file whose stored frequencies the config would not reproduce (a config from another model)."""
    if inv_freq is None:
        return
    ours = MiniMaxH3RotaryPosEmbed(config["rope_freq_dim"], config["rope_theta"]).inv_freq
    if inv_freq.shape != ours.shape or not torch.allclose(inv_freq.float(), ours, rtol=1e-5, atol=0):
        raise H3LoadError(
            f"{shown_name(path)}: rope.inv_freq {tuple(inv_freq.shape)} differs from the frequencies of the folder's "
            f"transformer config (rope_freq_dim={config['rope_freq_dim']}, rope_theta={config['rope_theta']}). "
            "Pick the MiniMax-H3 folder whose transformer/config.json belongs to this file."
        )


def _transformer_config(root: Path | None, partition: str = TRANSFORMER) -> dict:
    """The partition's config.json in the folder when present (else transformer/config.json: both partitions are the
    same network), else the released model's (the class defaults)."""
    defaults = {
        n: p.default
        for n, p in inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.items()
        if n != "self"
    }
    for sub in dict.fromkeys((partition, TRANSFORMER)):
        if root is not None and (root / sub / "config.json").is_file():
            return {**defaults, **_read_json(root / sub / "config.json")}
    return defaults


def geometry_of(transformer, vae, audio_vae) -> H3Geometry:
    """`transformer` None: the released patch (what the ref2va reference encoder, which has only the VAEs, uses)."""
    pt, ph, pw = H3Geometry.patch_size if transformer is None else transformer.config.patch_size
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
    partition: str = TRANSFORMER,
):
    """-> (H3Model, video VAE, audio VAE): each network held by a ComfyUI ModelPatcher, its weights on the CPU
    until ComfyUI loads them. `dtype` may be 'fp8_e4m3fn' (block matrices stored in fp8, computing in the 'auto'
    dtype); `device` is where they run outside ComfyUI (default: the backend registry's); `partition`: transformer
    (t2va/fl2va) or transformer_ref (ref2va), the folder's or, with `transformer_file`, that file's weights."""
    device = device or PLATFORM.device
    weight_dtype, dtype = resolve_weight_dtype(dtype, device)
    if partition not in PARTITIONS:
        raise H3LoadError(f"partition {partition!r}: H3 has {' and '.join(PARTITIONS)}.")
    root = check_folder(folder, need_transformer_weights=transformer_file is None, partition=partition)
    subs = ("vae", "audio_vae") if transformer_file is not None else (partition, "vae", "audio_vae")
    files = [f for sub in subs for f in _weight_files(root / sub)] + ([transformer_file] if transformer_file else [])
    for file in files:  # every file's header first: a truncated download fails before any heavy load
        check_safetensors(str(file))
    transformer = load_transformer(root, transformer_file, dtype, partition)
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
        partition=partition,
        load_args=weights_recipe(root, transformer_file, dtype, weight_dtype, partition),
    )
    return model, compat.manage(vae, "vae", device), compat.manage(audio_vae, "vae", device)


def load_transformer(
    root: Path, transformer_file: str | os.PathLike | None, dtype: torch.dtype, partition: str = TRANSFORMER
) -> MiniMaxH3Transformer3DModel:
    """The transformer of a checked folder (its `partition`), or from a single file (with the folder's config), in
    `dtype`."""
    if transformer_file is None:
        return load_component(root, partition, dtype)
    config = _transformer_config(root, partition)
    sd = convert_single_file(transformer_file, config, dtype)
    table = sd.get(adaln.OUR_TABLE_KEY)
    if table is None:
        return build_component(MiniMaxH3Transformer3DModel, config, sd, dtype, shown_name(transformer_file))
    grid, width = table.shape
    return build_component(
        MiniMaxH3Transformer3DModel,
        {**config, "time_embed_dim": width},  # the AdaLN projections read the table's k columns
        sd,
        dtype,
        shown_name(transformer_file),
        adapt=lambda model: adaln.adopt_curve_adaln(model, grid, dtype),
    )


def weights_recipe(
    root: Path,
    transformer_file: str | os.PathLike | None,
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    partition: str = TRANSFORMER,
) -> dict:
    """What a parallel worker needs to load the same transformer (`load_transformer`), JSON; the files' modification
    times tell a replaced file from the one a worker already holds."""
    files = [Path(transformer_file)] if transformer_file is not None else _weight_files(root / partition)
    return {
        "folder": str(root),
        "transformer_file": None if transformer_file is None else str(transformer_file),
        "partition": partition,
        "mtime_ns": [os.stat(f).st_mtime_ns for f in files],
        "dtype": str(dtype),
        "weight_dtype": str(weight_dtype),
    }


def store_blocks_in(transformer: MiniMaxH3Transformer3DModel, weight_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """fp8 weights: every matrix of the token refiner and the block stack (AdaLN projections included: all but ~1%
    of the weights; a pruned model's tiny fp32 ones excepted) is stored in `weight_dtype`; ComfyUI's cast layers
    compute with it in `dtype`."""
    fp32 = getattr(transformer, "fp32_parameter", lambda name: False)
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith(("transformer_blocks.", "token_refiner.")):
            if not fp32(f"{name}.weight"):
                module.weight.data = module.weight.data.to(weight_dtype)
        elif isinstance(module, MiniMaxH3AdaLayerNormModulation) and not hasattr(module, "compute_dtype"):
            adaln.install_modulation(module, dtype, dtype)
