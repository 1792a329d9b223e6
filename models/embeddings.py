"""Prompt embeddings as .safetensors files, one format for every family: named tensors plus string metadata.
A family names the tensor that marks its embeddings (`key`) and the node that makes them (`made_by`)."""

from __future__ import annotations

import torch

from .checkpoint_io import read_safetensors, safetensors_keys, shown_name


def save_embedding_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write the tensors to `path` (callers choose a path that replaces nothing: safe_paths.write_output_file)."""
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(path),
        metadata={k: str(v) for k, v in metadata.items()},
    )
    return str(path)


def embedding_file_problem(path: str, key: str, family: str, made_by: str) -> str | None:
    """None when `path` holds a `family` prompt embedding (reads the header only), else why not."""
    if key not in safetensors_keys(path):
        article = "an" if family[:1] in "AEIOUH" else "a"  # an OmniDreams, an H3
        return (
            f"it holds no '{key}' tensor, so it is not {article} {family} prompt embedding; make one with "
            f"{made_by}'s save_as"
        )
    return None


def read_embedding_file(path: str, key: str, made_by: str) -> dict[str, torch.Tensor]:
    """Every tensor of an embedding file that holds `key`; a clear error naming the file otherwise."""
    tensors = read_safetensors(str(path))
    if key not in tensors:
        shown = ", ".join(list(tensors)[:5]) + (", ..." if len(tensors) > 5 else "")
        raise ValueError(
            f"{shown_name(path)} holds no '{key}' tensor (keys: {shown}); make it with {made_by}'s save_as."
        )
    return tensors
