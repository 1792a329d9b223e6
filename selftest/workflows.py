"""The shipped API workflows (workflows/api/*.api.json) made runnable at small size on tiny random-weight models.

Shared by `python -m omnivideo.selftest` and the integration tests. Per family: the model and input files to write
into a ComfyUI base directory (`write_files`), the input overrides that shrink a graph (`*_SMALL`, applied by
`api_graph` to every node of a class) and what the saved video must then be (`Recipe`). The family of a workflow
follows from its loader nodes, so a new workflow of a known family needs nothing here.

The core Wan text-to-video graphs keep every node but the text encoder: ComfyUI builds UMT5-XXL (5.7B parameters)
at full size whatever the file holds, so CLIPLoader + CLIPTextEncode give way to a helper node that makes
UMT5-shaped random states (`text_stand_in`); the DiT is a tiny Wan 2.1 that core UNETLoader infers from its shapes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .tiny.h3 import FRAMES as H3_FRAMES
from .tiny.h3 import HEIGHT as H3_HEIGHT
from .tiny.h3 import WIDTH as H3_WIDTH
from .tiny.h3_qwen import LAYER as H3_TE_LAYER

PACK = Path(__file__).resolve().parents[1]
API_DIR = PACK / "workflows" / "api"

VAE_FILE = "wan_2.1_vae.safetensors"  # the shipped name: the full-size random Wan 2.1 VAE


def shipped() -> list[str]:
    """The names of the shipped API workflows (workflows/api/<name>.api.json)."""
    return sorted(p.name[: -len(".api.json")] for p in API_DIR.glob("*.api.json"))


def api_graph(name: str, overrides: dict | None = None) -> tuple[dict, str]:
    """workflows/api/<name>.api.json with `overrides` ({class_type: {input: value}}) applied to every node of
    that class, and SaveVideo writing under a fresh prefix; returns (graph, prefix)."""
    graph = json.loads((API_DIR / f"{name}.api.json").read_text(encoding="utf-8"))
    prefix = f"video/{name}_{uuid.uuid4().hex[:8]}"
    overrides = {**(overrides or {})}
    overrides["SaveVideo"] = {**overrides.get("SaveVideo", {}), "filename_prefix": prefix}
    for node in graph.values():
        node["inputs"].update(overrides.get(node["class_type"], {}))
    return graph, prefix


def write_video(python: str, path: Path, frames: int, width: int, height: int) -> None:
    """A random-noise H.264 mp4 (30 fps) written with PyAV by `python` (ComfyUI's interpreter has PyAV)."""
    code = (
        "import av, numpy as np, sys; c = av.open(sys.argv[1], 'w'); s = c.add_stream('libx264', rate=30); "
        f"s.width, s.height, s.pix_fmt = {width}, {height}, 'yuv420p'; rng = np.random.default_rng(0)\n"
        f"for i in range({frames}):\n"
        f"    img = rng.integers(0, 255, ({height}, {width}, 3), dtype=np.uint8)\n"
        "    [c.mux(p) for p in s.encode(av.VideoFrame.from_ndarray(img, format='rgb24'))]\n"
        "[c.mux(p) for p in s.encode()]; c.close()"
    )
    out = subprocess.run([python, "-c", code, str(path)], cwd=path.parent, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"could not write {path}: {out.stderr[-2000:]}")


def _random_image(path: Path, seed: int = 3) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8)).save(path)


# ---------------------------------------------------------------------------------------------------------------
# Wan: the VAE alone, and core's Wan 2.1 text-to-video graphs

DECODE_SMALL = {"EmptyHunyuanLatentVideo": {"width": 64, "height": 64, "length": 5}}  # latent [1, 16, 2, 8, 8]

WAN_DIT_FILE = "wan2.1_t2v_tiny.safetensors"
# 128x128x5: a patch grid of (2, 8, 8) = 128 rows, 8 RainFusion blocks of 16 (the first frame's 4 stay dense)
WAN_T2V_SMALL = {
    "UNETLoader": {"unet_name": WAN_DIT_FILE},
    "EmptyHunyuanLatentVideo": {"width": 128, "height": 128, "length": 5},
    "KSampler": {"steps": 2},
    "OmniVideoAttention": {"start_step": 0, "block_size": 16},
}


def text_stand_in(graph: dict) -> dict:
    """CLIPLoader + CLIPTextEncode -> OmniVideoTestTextStandIn (random UMT5-shaped states, seeded by node id)."""
    graph = {nid: {**node, "inputs": dict(node["inputs"])} for nid, node in graph.items()}
    dropped = {nid for nid, node in graph.items() if node["class_type"] == "CLIPLoader"}
    for nid in dropped:
        del graph[nid]
    for nid, node in graph.items():
        if node["class_type"] == "CLIPTextEncode":
            seed = int(nid) if nid.isdigit() else len(nid)
            graph[nid] = {"class_type": "OmniVideoTestTextStandIn", "inputs": {"seed": seed, "tokens": 8}}
    for nid, node in graph.items():
        for value in node["inputs"].values():
            if isinstance(value, list) and value and value[0] in dropped:
                raise ValueError(f"node {nid} ({node['class_type']}) still reads the dropped text encoder")
    return graph


def write_wan_vae(root: Path, python: str) -> None:
    from .tiny.wan import write_random_wan21_vae

    path = root / "models" / "vae" / VAE_FILE
    if not path.exists():
        write_random_wan21_vae(path)


def write_wan_dit(root: Path, python: str) -> None:
    from .tiny.wan import write_tiny_wan21_dit

    write_tiny_wan21_dit(root / "models" / "diffusion_models" / WAN_DIT_FILE)


# ---------------------------------------------------------------------------------------------------------------
# OmniDreams

OD_CKPT, OD_TE_FOLDER = "omnidreams_tiny.pt", "cosmos_reason1_tiny"
OD_IMAGE, OD_HDMAP = "omnidreams_first_frame.png", "omnidreams_hdmap.mp4"
OD_WIDTH, OD_HEIGHT, OD_FRAMES = 64, 48, 13  # 13 = 1 + (2*2 - 1) * 4: two chunks

OMNIDREAMS_SMALL = {
    "OmniDreamsModelLoader": {"ckpt_name": OD_CKPT, "dtype": "fp32"},
    "OmniDreamsTextEncoderLoader": {"folder": OD_TE_FOLDER, "dtype": "fp32"},
    "OmniDreamsTextEncode": {"prompt": "a car drives down the street"},
    "OmniDreamsEncodeFirstFrame": {"width": OD_WIDTH, "height": OD_HEIGHT},
    "OmniDreamsEncodeHDMap": {"width": OD_WIDTH, "height": OD_HEIGHT},
    "OmniDreamsSampler": {"frames": OD_FRAMES},
    "OmniVideoSampler": {"frames": OD_FRAMES},
    "OmniDreamsStream": {"chunks": 2, "width": OD_WIDTH, "height": OD_HEIGHT},  # 2 chunks = OD_FRAMES frames
    "OmniDreamsLive": {"chunks": 2, "max_chunks": 2, "width": OD_WIDTH, "height": OD_HEIGHT},  # ends at its cap
    "LoadImage": {"image": OD_IMAGE},
    "LoadVideo": {"file": OD_HDMAP},
}


def write_omnidreams_files(root: Path, python: str) -> None:
    """A tiny OmniDreams checkpoint (.pt, released layout) whose text width is the tiny Cosmos-Reason1's
    full_concat, that encoder's folder, a first-frame image and an HD-map video, under the base folder `root`."""
    import torch

    from .tiny.omnidreams import TEXT_HIDDEN, TEXT_LAYERS, TINY, stored_state_dict, write_tiny_cosmos_reason1

    models = root / "models"
    cfg = dataclasses.replace(TINY, text_in_dim=TEXT_LAYERS * TEXT_HIDDEN)  # full_concat of the tiny encoder
    torch.save(stored_state_dict(cfg, seed=3), models / "diffusion_models" / OD_CKPT)
    write_tiny_cosmos_reason1(models / "text_encoders" / OD_TE_FOLDER)
    _random_image(root / "input" / OD_IMAGE)
    write_video(python, root / "input" / OD_HDMAP, OD_FRAMES + 2, OD_WIDTH, OD_HEIGHT)


# ---------------------------------------------------------------------------------------------------------------
# MiniMax-H3

H3_FOLDER, H3_TE_FOLDER, H3_IMAGE = "MiniMax-H3-tiny", "qwen3vl-tiny", "h3_first_frame.png"
H3_LORA = "h3_tiny_lora.safetensors"
H3_SMALL = {
    "OmniVideoH3Loader": {"folder": H3_FOLDER, "dtype": "fp32"},
    "OmniVideoH3Ref2VALoader": {"folder": H3_FOLDER, "dtype": "fp32"},
    "OmniVideoH3References": {"width": H3_WIDTH, "height": H3_HEIGHT, "frames": H3_FRAMES},
    "OmniVideoH3TextEncoderLoader": {"folder": H3_TE_FOLDER, "dtype": "fp32", "layer": H3_TE_LAYER},
    "OmniVideoH3Sampler": {"frames": H3_FRAMES, "steps": 3, "width": H3_WIDTH, "height": H3_HEIGHT},
    "OmniVideoH3Keyframes": {"width": H3_WIDTH, "height": H3_HEIGHT},
    "LoadImage": {"image": H3_IMAGE},
    "OmniVideoLoRA": {"lora_name": H3_LORA},
}


def write_h3_files(root: Path, python: str) -> None:
    """A tiny diffusers-format H3 folder, a LoRA for it, a tiny Qwen3-VL folder and a first-frame image under `root`."""
    from .tiny.h3 import make_models, write_folder, write_lora
    from .tiny.h3_qwen import tiny_qwen3vl, write_text_encoder_folder

    models = root / "models"
    transformer, vae, audio_vae = make_models(seed=5)
    write_folder(  # both partitions, as the HF repo: transformer/ and transformer_ref/ (ref2va)
        models / "diffusers" / H3_FOLDER, transformer, vae, audio_vae, transformer_ref=make_models(seed=6)[0]
    )
    write_lora(models / "loras" / H3_LORA, transformer)
    write_text_encoder_folder(models / "text_encoders" / H3_TE_FOLDER, *tiny_qwen3vl())
    _random_image(root / "input" / H3_IMAGE)


# ---------------------------------------------------------------------------------------------------------------
# Core's own MiniMax-H3 graphs (ComfyUI 0.33+): core's nodes throughout; the text encoder (Qwen3-VL-32B) and the
# video / audio VAEs (2.6B / 0.15B parameters) exist in core at full size only, so their nodes give way to the
# helper pack's stand-ins; the DiT is the tiny H3 in core's single-file layout, 4096-wide text as the stand-in's.

H3_CORE_FILE = "minimax_h3_tiny_core.safetensors"
H3_CORE_SMALL = {
    "UNETLoader": {"unet_name": H3_CORE_FILE},
    "EmptyMiniMaxH3LatentAV": {"width": 64, "height": 64, "length": 5},  # video latent (2, 4, 4): 2 frames
    "KSampler": {"steps": 2},
}


def write_h3_core_file(root: Path, python: str) -> None:
    from safetensors.torch import save_file

    from .tiny.h3 import core_keys, make_models

    sd = core_keys(make_models(seed=7, text_dim=4096)[0])
    save_file(
        {"model.diffusion_model." + k: v.contiguous() for k, v in sd.items()},
        str(root / "models" / "diffusion_models" / H3_CORE_FILE),
    )


def vae_stand_in(graph: dict) -> dict:
    """VAELoader + VAE Decode / VAE Decode Audio -> OmniVideoTestFramesStandIn / OmniVideoTestAudioStandIn."""
    graph = text_stand_in(graph)
    stand_ins = {"VAEDecode": "OmniVideoTestFramesStandIn", "VAEDecodeAudio": "OmniVideoTestAudioStandIn"}
    for nid in [nid for nid, n in graph.items() if n["class_type"] == "VAELoader"]:
        del graph[nid]
    for node in graph.values():
        if node["class_type"] in stand_ins:
            node["class_type"] = stand_ins[node["class_type"]]
            node["inputs"] = {"samples": node["inputs"]["samples"]}
    return graph


# ---------------------------------------------------------------------------------------------------------------
# One recipe per family


@dataclass(frozen=True)
class Recipe:
    """How a shipped workflow runs small: its family, the files it needs, the overrides, the video it must save."""

    family: str
    files: tuple[str, ...]  # keys of WRITERS
    overrides: dict
    frames: int
    width: int
    height: int
    fps: float
    audio: bool = False
    rewrite: Callable[[dict], dict] | None = None  # a graph change beyond input values (the text stand-in)
    note: str = ""


WRITERS: dict[str, Callable[[Path, str], None]] = {
    "wan_vae": write_wan_vae,
    "wan_dit": write_wan_dit,
    "omnidreams": write_omnidreams_files,
    "h3": write_h3_files,
    "h3_core": write_h3_core_file,
}


def _recipes() -> dict[str, Recipe]:
    return {
        "h3": Recipe("h3", ("h3",), H3_SMALL, H3_FRAMES, H3_WIDTH, H3_HEIGHT, 24.0, audio=True),
        "omnidreams": Recipe(
            "omnidreams", ("omnidreams", "wan_vae"), OMNIDREAMS_SMALL, OD_FRAMES, OD_WIDTH, OD_HEIGHT, 30.0
        ),
        "wan_t2v": Recipe(
            "wan_t2v",
            ("wan_dit", "wan_vae"),
            WAN_T2V_SMALL,
            5,
            128,
            128,
            16.0,
            rewrite=text_stand_in,
            note="text encoder: random UMT5-shaped stand-in",
        ),
        "wan_decode": Recipe("wan_decode", ("wan_vae",), DECODE_SMALL, 5, 64, 64, 16.0),
        "h3_core": Recipe(
            "h3_core",
            ("h3_core",),
            H3_CORE_SMALL,
            2,
            64,
            64,
            24.0,
            audio=True,
            rewrite=vae_stand_in,
            note="text encoder and VAEs: stand-ins (core builds them at full size only)",
        ),
    }


def family_of(graph: dict) -> str | None:
    """The family a graph belongs to, from its loaders (None: no recipe knows it)."""
    classes = {node["class_type"] for node in graph.values()}
    if classes & {"OmniVideoH3Loader", "OmniVideoH3Ref2VALoader"}:
        return "h3"
    if "OmniDreamsModelLoader" in classes:
        return "omnidreams"
    if "EmptyMiniMaxH3LatentAV" in classes:
        return "h3_core"
    if "UNETLoader" in classes:
        return "wan_t2v"
    if classes & {"OmniVideoWanVAEDecode", "VAEDecode"} and "VAELoader" in classes:
        return "wan_decode"
    return None


def world_size(graph: dict) -> int:
    """The largest world an OmniVideo Parallel node of the graph asks for (1 without one)."""
    sizes = [int(n["inputs"].get("world_size", 1)) for n in graph.values() if n["class_type"] == "OmniVideoParallel"]
    return max(sizes, default=1)


def small_graph(name: str) -> tuple[dict, str, Recipe]:
    """The shipped workflow `name` at small size: (graph, SaveVideo prefix, recipe); KeyError without a recipe."""
    shipped_graph, _ = api_graph(name)
    family = family_of(shipped_graph)
    if family is None:
        raise KeyError(f"no small-size recipe for workflow {name} (omnivideo/selftest/workflows.py)")
    recipe = _recipes()[family]
    graph, prefix = api_graph(name, recipe.overrides)
    if recipe.rewrite is not None:
        graph = recipe.rewrite(graph)
    return graph, prefix, recipe


def write_files(root: Path, python: str, kinds, quiet: bool = False) -> None:
    """Write each kind of WRITERS once into the ComfyUI base folder `root`; `quiet`: the libraries' warnings and
    progress bars go to <root>/models.log instead of the terminal."""
    import contextlib

    with contextlib.ExitStack() as stack:
        if quiet:
            from transformers.utils import logging as hf_logging

            log = stack.enter_context(open(root / "models.log", "w", encoding="utf-8"))
            stack.enter_context(contextlib.redirect_stdout(log))
            stack.enter_context(contextlib.redirect_stderr(log))
            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            stack.callback(hf_logging.set_verbosity, level)
        for kind in dict.fromkeys(kinds):
            WRITERS[kind](root, python)
