"""A diffusers-format MiniMax-H3 folder (`transformer/` or `transformer_ref/`, `vae/`, `audio_vae/`, `scheduler/`,
`audio_scheduler/`): its partitions, what is wrong or missing in it, its weight files and its configs.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

from diffusers import MiniMaxH3Transformer3DModel

from ..checkpoint_io import CheckpointError, read_json, shown_name

log = logging.getLogger("omnivideo")

# The two transformer partitions of the HF repo: `transformer/` runs t2va and fl2va, `transformer_ref/` runs ref2va
# (diffusers' `MiniMaxH3Ref2VALoopDenoiser`); the same network class and config, other weights.
TRANSFORMER, TRANSFORMER_REF = "transformer", "transformer_ref"
PARTITIONS = (TRANSFORMER, TRANSFORMER_REF)
TASKS = {TRANSFORMER: "t2va/fl2va", TRANSFORMER_REF: "ref2va"}
LOADER_NODES = {TRANSFORMER: "OmniVideo H3 Loader", TRANSFORMER_REF: "OmniVideo H3 Ref2VA Loader"}


class H3LoadError(ValueError):
    """What is wrong with the files an H3 load was given; the message names the file and what to do."""


def read_config(path: Path) -> dict:
    """A JSON file of the folder (config.json, a shard index, scheduler_config.json); H3LoadError when missing."""
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
        name = read_config(cfg).get("_class_name")
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
    if need_transformer_weights and not weight_files(root / partition):
        missing.append(f"{partition} weights (*.safetensors)")
    missing += [
        f"{sub} weights (*.safetensors)"
        for sub in ("vae", "audio_vae")
        if (root / sub / "config.json").is_file() and not weight_files(root / sub)
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


def weight_files(folder: Path) -> list[Path]:
    """A component folder's safetensors: the shards its index lists (all present), else every *.safetensors."""
    if not folder.is_dir():
        return []
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        names = sorted(set(read_config(index[0])["weight_map"].values()))
        absent = [n for n in names if not (folder / n).is_file()]
        if absent:
            raise H3LoadError(
                f"{shown_name(folder)} lists shards that are not there: {', '.join(absent[:3])}"
                f"{'…' if len(absent) > 3 else ''}. Finish the download."
            )
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def transformer_config(root: Path | None, partition: str = TRANSFORMER) -> dict:
    """The partition's config.json in the folder when present (else transformer/config.json: both partitions are the
    same network), else the released model's (the class defaults)."""
    defaults = {
        n: p.default
        for n, p in inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.items()
        if n != "self"
    }
    for sub in dict.fromkeys((partition, TRANSFORMER)):
        if root is not None and (root / sub / "config.json").is_file():
            return {**defaults, **read_config(root / sub / "config.json")}
    return defaults


def scheduler_configs(root: Path) -> tuple[dict, dict]:
    """(video, audio) scheduler configs; a missing one is the released shift."""
    out = []
    for sub, default in (("scheduler", 12.0), ("audio_scheduler", 3.0)):
        path = root / sub / "scheduler_config.json"
        if path.is_file():
            out.append(read_config(path))
        else:
            log.info("omnivideo h3: %s missing, using shift %.1f", path, default)
            out.append({"shift": default})
    return out[0], out[1]
