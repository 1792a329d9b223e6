"""Load MiniMax-H3 (transformer, video VAE, audio VAE, scheduler configs) from local files only.

Sources: a diffusers-format folder (folder.py), optionally with the transformer taken from a single-file checkpoint
(single_file.py); each network is built from its config and tensors by build.py. A parallel worker loads the same
transformer from `weights_recipe`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

from ... import compat
from ...backends import PLATFORM, resolve_weight_dtype
from ..checkpoint_io import check_safetensors, read_safetensors, shown_name
from ..handles import H3Model
from . import adaln
from .build import build_component, store_blocks_in
from .folder import (
    PARTITIONS,
    TRANSFORMER,
    H3LoadError,
    check_folder,
    read_config,
    scheduler_configs,
    transformer_config,
    weight_files,
)
from .geometry import H3Geometry
from .single_file import convert_single_file

CLASSES = {
    "transformer": MiniMaxH3Transformer3DModel,
    "transformer_ref": MiniMaxH3Transformer3DModel,
    "vae": AutoencoderKLMiniMaxH3,
    "audio_vae": AutoencoderKLMiniMaxH3Audio,
}


def _read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    sd = {}
    for f in files:
        sd.update(read_safetensors(str(f)))
    return sd


def load_component(root: Path, sub: str, dtype: torch.dtype):
    """The folder's component `sub` (transformer, transformer_ref, vae or audio_vae), built in `dtype`."""
    config = read_config(root / sub / "config.json")
    files = weight_files(root / sub)
    if not files:
        raise H3LoadError(f"{shown_name(root / sub)} has no *.safetensors weights.")
    return build_component(CLASSES[sub], config, _read_state_dict(files), dtype, shown_name(root / sub))


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
    files = [f for sub in subs for f in weight_files(root / sub)] + ([transformer_file] if transformer_file else [])
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
    config = transformer_config(root, partition)
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
    files = [Path(transformer_file)] if transformer_file is not None else weight_files(root / partition)
    return {
        "folder": str(root),
        "transformer_file": None if transformer_file is None else str(transformer_file),
        "partition": partition,
        "mtime_ns": [os.stat(f).st_mtime_ns for f in files],
        "dtype": str(dtype),
        "weight_dtype": str(weight_dtype),
    }
