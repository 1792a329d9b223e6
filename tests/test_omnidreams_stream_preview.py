"""OmniVideo OmniDreams Stream's preview: the file it names is the one written, also when ComfyUI's output folder
is a link (the rollout itself is replaced: this is about the node's last lines)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("av", reason="PyAV (the test extra, a ComfyUI requirement) writes the mp4 file")

from omnivideo import compat  # noqa: E402
from omnivideo.nodes import omnidreams_stream  # noqa: E402
from omnivideo.pipelines.omnidreams.stream import StreamResult  # noqa: E402


def test_the_preview_names_the_file_inside_a_linked_output_folder(tmp_path, monkeypatch):
    real = tmp_path / "outtest" / "omnidreams"
    real.mkdir(parents=True)
    (tmp_path / "comfyui").mkdir()
    linked = tmp_path / "comfyui" / "output"  # ComfyUI's output -> ../outtest/omnidreams
    linked.symlink_to(Path("..") / "outtest" / "omnidreams", target_is_directory=True)
    monkeypatch.setattr(compat, "output_directory", lambda: str(linked))
    monkeypatch.setattr(compat, "video_from_file", lambda path: ("VIDEO", path))
    shown: list[str] = []
    monkeypatch.setattr(compat, "show_text", shown.append)

    def one_chunk(model, conditioning, vae, *, write, **_):
        write(torch.rand(5, 16, 32, 3))
        return StreamResult(chunks=1, frames=5, state=None)

    monkeypatch.setattr(omnidreams_stream, "stream", one_chunk)
    node = omnidreams_stream.OmniDreamsStream
    out = node.execute(SimpleNamespace(world_size=1), None, None, chunks=1, filename_prefix="runs/day1/stream")
    (image,) = out.ui["images"]
    assert image == {"filename": "stream.mp4", "subfolder": os.path.join("runs", "day1"), "type": "output"}
    assert (linked / image["subfolder"] / image["filename"]).is_file()  # where ComfyUI's /view looks
    assert out.args[0] == ("VIDEO", str(real / "runs" / "day1" / "stream.mp4"))
    assert shown == ["5 frames (1 chunks) in runs/day1/stream.mp4 in the output folder"]  # relative, no "../"
