"""ComfyUI's folders in a temp dir, as `compat` reports them inside ComfyUI: models/<kind> (one root per
kind, listed recursively and following symlinks as folder_paths does) and output/."""

from __future__ import annotations

import os
from pathlib import Path


def patch_comfy_folders(monkeypatch, base: Path):
    from types import SimpleNamespace

    from omnivideo import compat

    def roots(kind):
        folder = base / "models" / kind
        folder.mkdir(parents=True, exist_ok=True)
        return [str(folder)]

    def file_list(kind):
        root = roots(kind)[0]
        return sorted(
            os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
            for d, _, files in os.walk(root, followlinks=True)
            for f in files
        )

    output = base / "output"
    output.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(compat, "model_folder_roots", roots)
    monkeypatch.setattr(compat, "model_file_list", file_list)
    monkeypatch.setattr(compat, "output_directory", lambda: str(output))
    return SimpleNamespace(base=base, output=output, models=lambda kind: Path(roots(kind)[0]))
