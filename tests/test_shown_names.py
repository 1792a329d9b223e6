"""Errors and texts name a file inside a model folder as the user picks it (the folder relative to ComfyUI's folder
for its kind, then the file), never by an absolute path: node errors and UI texts reach ComfyUI's /history."""

from __future__ import annotations

import json

import pytest
from support.h3_tiny import make_models, write_folder

from omnivideo.models.checkpoint_io import CheckpointError, shown_in, shown_name
from omnivideo.models.handles import describe_weights
from omnivideo.nodes import h3 as h3_nodes
from omnivideo.nodes import omnidreams_text as omnidreams_text_nodes

H3_NAME = "MiniMax-H3-tiny"
DAMAGED = f"diffusers/{H3_NAME}/vae/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def h3_parts():
    return make_models(seed=6)


@pytest.fixture
def h3_folder(comfy_folders, h3_parts):
    return write_folder(comfy_folders.models("diffusers") / H3_NAME, *h3_parts)


def test_a_damaged_file_in_an_h3_folder_is_named_with_its_folder(comfy_folders, h3_folder):
    weights = h3_folder / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # an interrupted download
    assert h3_nodes.OmniVideoH3Loader.validate_inputs(folder=H3_NAME) is True  # the header is read when loading
    with pytest.raises(CheckpointError) as err:
        h3_nodes.OmniVideoH3Loader.execute(H3_NAME, dtype="fp32")
    message = str(err.value)
    assert DAMAGED in message and "download it again" in message, message
    assert str(comfy_folders.base) not in message


def test_a_damaged_config_in_a_model_folder_is_named_with_its_folder(comfy_folders, h3_folder):
    (h3_folder / "transformer" / "config.json").write_text("{not json")
    refused = h3_nodes.OmniVideoH3Loader.validate_inputs(folder=H3_NAME)
    assert f"diffusers/{H3_NAME}/transformer/config.json is not valid JSON" in refused, refused
    encoder = comfy_folders.models("text_encoders") / "cosmos" / "reason1"
    encoder.mkdir(parents=True)
    (encoder / "config.json").write_text(json.dumps([1]))
    refused = omnidreams_text_nodes.OmniDreamsTextEncoderLoader.validate_inputs(folder="cosmos/reason1")
    assert "text_encoders/cosmos/reason1/config.json does not hold a JSON object" in refused, refused
    assert str(comfy_folders.base) not in refused + shown_in(f"Can't load '{encoder}' here", encoder)


def test_outside_comfyuis_folders_a_name_keeps_its_last_parts(comfy_folders, tmp_path):
    assert shown_name(tmp_path / "elsewhere" / "my_h3" / "vae" / "w.safetensors") == "my_h3/vae/w.safetensors"
    nested = comfy_folders.models("diffusion_models") / "omnidreams" / "dit.pt"
    assert shown_name(nested) == "diffusion_models/omnidreams/dit.pt"


def test_a_model_is_described_without_paths_or_modification_times(comfy_folders):
    path = comfy_folders.models("diffusion_models") / "omnidreams" / "dit.safetensors"
    args = {"path": str(path), "mtime_ns": 17123456789, "dtype": "torch.float32", "weight_dtype": "torch.float32"}
    assert describe_weights("omnidreams", args) == "omnidreams diffusion_models/omnidreams/dit.safetensors (float32)"
    folder = comfy_folders.models("diffusers") / H3_NAME
    single = comfy_folders.models("diffusion_models") / "h3.safetensors"
    h3 = {"folder": str(folder), "transformer_file": str(single), "mtime_ns": [1], "dtype": "torch.bfloat16"}
    described = describe_weights("h3", {**h3, "weight_dtype": "torch.float8_e4m3fn"})
    assert described == f"h3 diffusers/{H3_NAME} + diffusion_models/h3.safetensors (bfloat16, float8_e4m3fn weights)"
