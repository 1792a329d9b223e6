"""Cosmos-Reason1 (Qwen2.5-VL) text encoding for OmniDreams, "full_concat" variant.

Chat template (system + user prompt, no generation prompt) -> pad/truncate to 512 tokens with
`pad_token_id or 0` -> the LM run WITHOUT an attention mask (the reference does so; a mask shifts
the padding tokens' states, which the DiT attends to) -> every layer's hidden states but the
embedding output, each normalised per token with the unbiased std -> concatenated:
[1, 512, layers * hidden] = [1, 512, 28 * 3584 = 100352] for the 7B encoder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ... import compat
from ..checkpoint_io import files_missing, read_json, shown_name
from ..embeddings import embedding_file_problem, read_embedding_file, save_embedding_file

SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."
MAX_TOKENS = 512
EMBEDDING_KEY = "omnidreams_text_embedding"
EMBEDDING_FORMAT = "omnidreams_full_concat"
MODEL_TYPE = "qwen2_5_vl"  # Cosmos-Reason1 is a Qwen2.5-VL model


@dataclass
class TextEncoder:
    patcher: Any  # ComfyUI's ModelPatcher of the Qwen2_5_VLForConditionalGeneration (compat.manage)
    tokenizer: object
    path: str

    @property
    def model(self) -> torch.nn.Module:
        return self.patcher.model.module


def encoder_folder_problem(folder: str) -> str | None:
    """None when `folder` looks like a Cosmos-Reason1 (Qwen2.5-VL) folder, else why not (reads config.json)."""
    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config):
        return "it has no config.json"
    model_type = read_json(config).get("model_type")
    if model_type != MODEL_TYPE:
        return f"its config.json is a {model_type!r} model, not Cosmos-Reason1 ({MODEL_TYPE!r})"
    return None


def load_text_encoder(
    folder: str, dtype: torch.dtype, device: torch.device, pinned: torch.device | None = None
) -> TextEncoder:
    """A local Cosmos-Reason1 / Qwen2.5-VL folder (config.json, weights, tokenizer); never the network.

    The model (~16 GB in bf16) is handed to ComfyUI's model management: `encode_prompt` has it loaded (fully or
    partially) for the forward pass and ComfyUI evicts it when the DiT needs the room. `device` is where it
    runs outside ComfyUI; `pinned` (the CPU): where it always runs, leaving the GPU to the DiT."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    problem = encoder_folder_problem(folder)
    if problem is not None:
        raise ValueError(
            f"{shown_name(folder)}: {problem}. Point the loader at a Cosmos-Reason1 (Qwen2.5-VL) folder under "
            "models/text_encoders/."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except OSError as exc:
        raise files_missing("Cosmos-Reason1", folder, exc) from None
    compat.make_castable(model, compat.operations(dtype, dtype, pinned or device))
    patcher = compat.manage(model.eval().requires_grad_(False), "text_encoder", device, pinned)
    return TextEncoder(patcher, tokenizer, folder)


def embedding_bytes(encoder: TextEncoder) -> int:
    """The size of one prompt's embedding, known before encoding: [1, MAX_TOKENS, layers * hidden] float32."""
    config: Any = encoder.model.config  # transformers' Qwen2_5_VLConfig: the language model's is its text config
    text = config.get_text_config()
    return MAX_TOKENS * text.num_hidden_layers * text.hidden_size * torch.float32.itemsize


def prompt_token_ids(tokenizer, prompt: str, max_tokens: int = MAX_TOKENS) -> torch.Tensor:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return torch.tensor([ids + [pad] * (max_tokens - len(ids))], dtype=torch.long)


def normalize_per_token(h: torch.Tensor) -> torch.Tensor:
    """(h - mean) / (std + 1e-8) over the hidden dim, unbiased std, in float32."""
    h = h.float()
    return (h - h.mean(dim=-1, keepdim=True)) / (h.std(dim=-1, keepdim=True, unbiased=True) + 1e-8)


@torch.no_grad()
def encode_prompt(encoder: TextEncoder, prompt: str) -> torch.Tensor:
    """-> [1, 512, num_layers * hidden] float32 on CPU, run where ComfyUI loads the encoder."""
    ids = prompt_token_ids(encoder.tokenizer, prompt)
    try:
        model = compat.loaded(encoder.patcher)
        # no attention_mask, on purpose; logits_to_keep=1: only hidden states are used, so the LM head
        # runs on one position instead of producing [512, vocab] logits (hidden states are unchanged)
        out = model(
            input_ids=ids.to(encoder.patcher.load_device), output_hidden_states=True, use_cache=False, logits_to_keep=1
        )
        states = out.hidden_states[1:]  # drop the embedding output: layers 1..L
        return torch.cat([normalize_per_token(h).cpu() for h in states], dim=-1)
    finally:
        out = states = None
        compat.free_memory()  # the activations, also on interrupt; the weights are ComfyUI's to evict


MADE_BY = "OmniDreams Text Encode"


def save_embedding(path: str, embedding: torch.Tensor, prompt: str) -> str:
    return save_embedding_file(path, {EMBEDDING_KEY: embedding.float()}, {"format": EMBEDDING_FORMAT, "prompt": prompt})


def embedding_problem(path: str) -> str | None:
    return embedding_file_problem(path, EMBEDDING_KEY, "OmniDreams", MADE_BY)


def load_embedding(path: str) -> torch.Tensor:
    """A precomputed embedding from `save_embedding` (or any file with that key) -> [1, 512, D] float32."""
    emb = read_embedding_file(path, EMBEDDING_KEY, MADE_BY)[EMBEDDING_KEY]
    if emb.dim() == 2:
        emb = emb[None]
    if emb.dim() != 3 or emb.shape[0] != 1 or emb.shape[1] != MAX_TOKENS:
        raise ValueError(f"{shown_name(path)}: embedding has shape {tuple(emb.shape)}, expected [1, {MAX_TOKENS}, D]")
    return emb.float()
