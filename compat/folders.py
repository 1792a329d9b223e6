"""ComfyUI's folders: the files and directories of its model folder kinds, and its output folder. Outside ComfyUI
there are none."""

from __future__ import annotations

from .comfyui import folder_paths


def _of_kind(reader: str, kind: str) -> list[str]:
    """ComfyUI's `folder_paths.<reader>(kind)` as a list; none outside ComfyUI."""
    if folder_paths is None:
        return []
    try:
        return list(getattr(folder_paths, reader)(kind))
    except KeyError:  # a kind this ComfyUI does not know
        return []


def model_file_list(kind: str) -> list[str]:
    """Files ComfyUI lists in one of its model folder kinds ('vae', 'diffusion_models', ...); none outside it."""
    return _of_kind("get_filename_list", kind)


def model_folder_roots(kind: str) -> list[str]:
    """The directories behind one of ComfyUI's model folder kinds (models/<kind> and extra_model_paths)."""
    return _of_kind("get_folder_paths", kind)


def output_directory() -> str:
    """ComfyUI's output folder. Outside ComfyUI there is none (never the working directory)."""
    if folder_paths is None:
        raise RuntimeError("there is no ComfyUI output folder outside ComfyUI; run the node inside ComfyUI")
    return folder_paths.get_output_directory()
