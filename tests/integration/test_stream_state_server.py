"""A crafted OmniDreams Stream state sent to a real ComfyUI as any client can: uploaded into the output folder through
/upload/image?type=output, then named in resume_from. /prompt refuses it (the header is checked, nothing runs) with
one message naming resume_from, the file and what is wrong; the genuine state it was made from is accepted.
Skipped unless COMFYUI_PATH is set (see conftest.py)."""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_omnidreams_stream_server import follow, stream_graph
from test_safe_inputs_server import one_refusal

pytestmark = pytest.mark.integration


def upload_output(comfy_server, name: str, data: bytes, subfolder: str) -> dict:
    """POST /upload/image with type=output (multipart, as ComfyUI's front end sends it)."""
    boundary = uuid.uuid4().hex
    fields = {"type": "output", "subfolder": subfolder, "overwrite": "true"}
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()
    )
    body += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode() + data
    body += f"\r\n--{boundary}--\r\n".encode()
    request = urllib.request.Request(
        comfy_server.url + "/upload/image",
        data=body,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_an_uploaded_crafted_state_is_refused_at_prompt(comfy_server, stream_files, tmp_path, report):
    tag = uuid.uuid4().hex[:6]
    state = f"omnidreams/state_{tag}"
    made = follow(comfy_server, stream_graph(stream_files, f"omnidreams/s_{tag}", chunks=1, save_state_as=state))[0]
    assert made[-1][0] == "execution_success", made[-1]
    real = comfy_server.output_dir / (state + ".safetensors")
    tensors = load_file(str(real))
    from safetensors import safe_open

    with safe_open(str(real), framework="pt") as f:
        metadata = f.metadata()
    cache = next(k for k in sorted(tensors) if k.startswith("decode.") and k.split(".")[1].isdigit())
    crafted = {
        "no_generator": ({k: v for k, v in tensors.items() if k != "generator"}, "its 'generator' entry is missing"),
        "chunk_minus_one": ({**tensors, "chunk": torch.tensor(-1)}, "its chunk index is -1"),
        "vae_400_frames": (
            {**tensors, cache: tensors[cache][:, :, :1].repeat(1, 1, 400, 1, 1)},
            "with T from 1 to 2 frames",
        ),
    }
    graph = lambda name: stream_graph(stream_files, f"omnidreams/x_{tag}", chunks=1, resume_from=name)  # noqa: E731
    for case, (state_dict, what) in crafted.items():
        save_file(state_dict, str(tmp_path / "crafted.safetensors"), metadata)
        file = f"{case}_{tag}.safetensors"
        answer = upload_output(comfy_server, file, (tmp_path / "crafted.safetensors").read_bytes(), "uploads")
        assert answer["type"] == "output" and (comfy_server.output_dir / "uploads" / file).is_file(), answer
        errors = comfy_server.node_errors(graph(f"uploads/{file}"))
        assert list(errors) == ["4"], errors
        kind, details = one_refusal(errors["4"], "resume_from")
        assert kind == "custom_validation_failed" and details.startswith("resume_from - "), errors
        message = details.split(" - ", 1)[1]  # ComfyUI puts the input's name before our message
        assert message.startswith(f"resume_from 'uploads/{file}' is not a usable OmniDreams stream state"), message
        assert what in message and "save_state_as" in message and str(comfy_server.root) not in message, message
    comfy_server.run(graph(state + ".safetensors"), timeout=600)  # the genuine one is accepted and resumes
    report.append(f"stream state: {len(crafted)} crafted uploads refused at /prompt, e.g. {message}")


@pytest.fixture
def stream_files(comfy_server, vae_file) -> str:
    from test_omnidreams_stream_server import write_tiny_files

    write_tiny_files(comfy_server.root)
    return vae_file
