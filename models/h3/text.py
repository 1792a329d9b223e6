"""Qwen3-VL text encoding for MiniMax-H3, from local files only.

The presentation is diffusers' (`MiniMaxH3TextEncoderStep` / `MiniMaxH3FL2VATextEncoderStep` /
`MiniMaxH3Ref2VATextEncoderStep`): the prompt verbatim, no chat template, no special tokens; with
keyframes, each is preceded by a "<Picture i>: " label and a vision block whose rows are tagged video;
with ref2va references, diffusers' own presentation builder labels them "<Picture i>: " + vision block,
"<Audio j>: " (a soundtrack before its video), "<Video k>: " + one timestamped vision block per merged
frame pair (Qwen3-VL's video processor, which needs torchvision). The encoder call
itself is diffusers' public `get_qwen3vl_prompt_embeds` (hidden_states[layer], default 50).
Embeddings can be saved to / loaded from .safetensors so the 32B encoder need not be loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep, get_qwen3vl_prompt_embeds
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_FPS,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
)

from ... import compat
from ..checkpoint_io import files_missing, read_json, shown_name
from ..embeddings import embedding_file_problem, read_embedding_file, save_embedding_file

DEFAULT_LAYER = 50  # MiniMaxH3ModularPipeline.text_encoder_layer
EMBEDDING_KEY, TAGS_KEY = "prompt_embeds", "text_token_tags"
VISION_TAG = MINIMAX_H3_VIDEO_TAG  # the row tag of keyframe vision-block tokens (diffusers' video tag)
MODEL_TYPE = "qwen3_vl"
REF2VA = MiniMaxH3Ref2VATextEncoderStep()  # its presentation helpers; reads a reference video at 2 fps


def vision_rows(tags: torch.Tensor) -> int:
    """How many embedding rows are keyframe vision tokens (0: the prompt was encoded without keyframes)."""
    return int((tags == VISION_TAG).sum())


@dataclass
class H3TextEncoder:
    patcher: Any  # ComfyUI's ModelPatcher of the Qwen3VLForConditionalGeneration (compat.manage)
    tokenizer: object
    processor: object  # Qwen3VLProcessor
    layer: int = DEFAULT_LAYER
    source: str = ""

    @property
    def model(self) -> torch.nn.Module:
        return self.patcher.model.module


def _parts(folder: Path) -> tuple[Path, Path, Path]:
    """(model, tokenizer, processor) folders: a plain Qwen3-VL folder, or an H3 root with text_encoder/ etc."""
    if (folder / "text_encoder" / "config.json").is_file():
        tok = folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder / "text_encoder"
        proc = folder / "processor" if (folder / "processor").is_dir() else tok
        return folder / "text_encoder", tok, proc
    return folder, folder, folder


def encoder_folder_problem(folder: str | os.PathLike) -> str | None:
    """None when `folder` holds a Qwen3-VL config (plain, or text_encoder/ of an H3 folder), else why not."""
    config = _parts(Path(folder))[0] / "config.json"
    if not config.is_file():
        return "it has no config.json (nor text_encoder/config.json)"
    model_type = read_json(str(config)).get("model_type")
    if model_type != MODEL_TYPE:
        return f"{config.relative_to(folder)} is a {model_type!r} model; H3 needs Qwen3-VL ({MODEL_TYPE!r})"
    return None


def load_text_encoder(
    folder: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    layer: int = DEFAULT_LAYER,
    device: torch.device | None = None,
) -> H3TextEncoder:
    """A local Qwen3-VL folder, handed to ComfyUI's model management (`device`: where it runs outside ComfyUI)."""
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    folder = Path(folder)
    problem = encoder_folder_problem(folder)
    if problem is not None:
        raise ValueError(
            f"{shown_name(folder)}: {problem}. Put the Qwen3-VL text encoder folder (config, *.safetensors, "
            "tokenizer and preprocessor files) under models/text_encoders/."
        )
    model_dir, tok_dir, proc_dir = _parts(folder)
    cfg = read_json(str(model_dir / "config.json"))
    n_layers = cfg.get("text_config", {}).get("num_hidden_layers", 0)
    if n_layers <= layer:
        raise ValueError(
            f"hidden layer {layer} needs more than {layer} decoder layers; {shown_name(model_dir)} has {n_layers}. "
            "Lower the layer input or use the full Qwen3-VL-32B encoder (64 layers, layer 50)."
        )
    try:
        model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        processor = Qwen3VLProcessor.from_pretrained(proc_dir, tokenizer=tokenizer, local_files_only=True)
    except OSError as exc:
        raise files_missing("Qwen3-VL", folder, exc) from None
    device = device or torch.device("cpu")
    compat.make_castable(model, compat.operations(dtype, dtype, device))
    patcher = compat.manage(model.eval().requires_grad_(False), "text_encoder", device)
    return H3TextEncoder(patcher, tokenizer, processor, layer, str(folder))


def presentation(tokenizer, processor, prompt: str, keyframes: list) -> tuple[list[int], list[int], dict]:
    """Token ids, H3 row tags and Qwen3-VL vision inputs for the prompt plus keyframes (PIL, already on canvas)."""
    token_ids, tags, vision = [], [], {}
    if keyframes:
        feats = processor.image_processor(images=list(keyframes), return_tensors="pt")
        vision = {"pixel_values": feats["pixel_values"], "image_grid_thw": feats["image_grid_thw"]}
        merge = processor.image_processor.merge_size**2
        start, pad, end = (
            tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
        )
        for i, grid in enumerate(feats["image_grid_thw"]):
            label = tokenizer(f"<Picture {i + 1}>: ", add_special_tokens=False)["input_ids"]
            block = [start] + [pad] * (int(grid.prod()) // merge) + [end]
            token_ids += label + block
            tags += [MINIMAX_H3_TEXT_TAG] * len(label) + [MINIMAX_H3_VIDEO_TAG] * len(block)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return token_ids + ids, tags + [MINIMAX_H3_TEXT_TAG] * len(ids), vision


def ref2va_presentation(tokenizer, processor, prompt: str, references: list) -> tuple[list[int], list[int], dict]:
    """Token ids, H3 row tags and vision inputs of a ref2va request (`references`: normalised, packed order)."""
    if any(r.kind == "video" for r in references) and getattr(processor, "video_processor", None) is None:
        raise ValueError(
            "A reference video is shown to Qwen3-VL through its video processor, which this processor lacks "
            "(transformers builds it only with torchvision installed). Install torchvision or use image references."
        )
    vision, image_counts, video_counts, timestamps = REF2VA._gather_vision_features(
        processor, references, MINIMAX_H3_FPS
    )
    token_ids, tags = REF2VA._build_presentation(
        tokenizer, prompt, references, image_counts, video_counts, timestamps, MINIMAX_H3_TEXT_TAG, MINIMAX_H3_VIDEO_TAG
    )
    return token_ids, tags, vision


@torch.no_grad()
def encode_prompt(
    te: H3TextEncoder, prompt: str, keyframes: list | tuple = (), references: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (embeds [1, N, text_dim] in the encoder's dtype on CPU, tags [N] long), run where ComfyUI loads it.
    `keyframes` (fl2va, PIL on the canvas) or `references` (ref2va, normalised) or neither."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("The H3 prompt must be a non-empty string.")
    if references:
        token_ids, tags, vision = ref2va_presentation(te.tokenizer, te.processor, prompt, references)
    else:
        token_ids, tags, vision = presentation(te.tokenizer, te.processor, prompt, list(keyframes))
    model = compat.loaded(te.patcher)
    embeds = get_qwen3vl_prompt_embeds(
        model,
        te.processor,
        token_ids,
        vision,
        text_encoder_layer=te.layer,
        device=te.patcher.load_device,
        dtype=model.dtype,
    )
    return embeds.cpu(), torch.tensor(tags, dtype=torch.long)


MADE_BY = "OmniVideo H3 Text Encode"


def save_embedding(path: str, embeds: torch.Tensor, tags: torch.Tensor, **meta) -> str:
    return save_embedding_file(path, {EMBEDDING_KEY: embeds, TAGS_KEY: tags}, {"omnivideo": "h3_text", **meta})


def embedding_problem(path: str) -> str | None:
    return embedding_file_problem(path, EMBEDDING_KEY, "H3", MADE_BY)


def load_embedding(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [1, N, D], row tags [N]) from `save_embedding` (tags default to text rows)."""
    name = shown_name(path)
    tensors = read_embedding_file(str(path), EMBEDDING_KEY, MADE_BY)
    emb = tensors[EMBEDDING_KEY]
    if emb.ndim == 2:
        emb = emb[None]
    if emb.ndim != 3 or emb.shape[0] != 1:
        raise ValueError(f"{name}: '{EMBEDDING_KEY}' must be [1, N, D], got {list(emb.shape)}.")
    tags = tensors.get(TAGS_KEY)
    if tags is None:
        tags = torch.full((emb.shape[1],), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    if tags.numel() != emb.shape[1]:
        raise ValueError(f"{name}: {tags.numel()} tags for {emb.shape[1]} embedding rows.")
    return emb, tags.long()
