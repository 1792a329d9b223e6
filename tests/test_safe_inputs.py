"""Hostile names for every file and folder input, in-process (tests/integration/test_safe_inputs_server.py sends
the same through a real ComfyUI over /prompt).

Each input gets an absolute path, a '../' path and a path through a symbolic link, all aimed at a bait outside
ComfyUI's folders that the node *would* accept if it reached it. Every one must be refused by validate_inputs
and by execute, with the same message whether or not the bait exists, and nothing outside may be opened
(Python's audit hook sees every open() by Python code, torch.load included).
"""

from __future__ import annotations

import inspect
import json
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from omnivideo.integration import safe_paths
from omnivideo.models.checkpoint_io import CheckpointError, read_safetensors, read_torch_file, safetensors_keys
from omnivideo.nodes import h3 as h3_nodes
from omnivideo.nodes import omnidreams as od_nodes
from omnivideo.nodes import omnidreams_text as od_text_nodes

_OPENED: list[str] | None = None


def _audit(event, args):
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # hooks cannot be removed; this one only records while a test asks it to


@pytest.fixture
def opened():
    global _OPENED
    _OPENED = []
    yield _OPENED
    _OPENED = None


def _bait_file(path, keys=("omnidreams_text_embedding", "prompt_embeds")):
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".pt":
        torch.save({"x_embedder.proj.1.weight": torch.zeros(2, 2)}, path)
    else:
        save_file({k: torch.zeros(1, 512, 4) for k in keys}, str(path))
    return path


def _bait_folder(path, model_type):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def _bait_h3_folder(path):
    for sub, cls in (
        ("transformer", "MiniMaxH3Transformer3DModel"),
        ("vae", "AutoencoderKLMiniMaxH3"),
        ("audio_vae", "AutoencoderKLMiniMaxH3Audio"),
    ):
        (path / sub).mkdir(parents=True, exist_ok=True)
        (path / sub / "config.json").write_text(json.dumps({"_class_name": cls}))
        save_file({"w": torch.zeros(1)}, str(path / sub / "diffusion_pytorch_model.safetensors"))
    return path


# node, input, ComfyUI folder kind, bait maker(outside dir) -> bait path, other inputs for execute
INPUTS = [
    (
        od_text_nodes.OmniDreamsLoadTextEmbedding,
        "embedding",
        "text_encoders",
        lambda d: _bait_file(d / "bait.safetensors"),
        {},
    ),
    (
        h3_nodes.OmniVideoH3TextEncode,
        "embedding_file",
        "text_encoders",
        lambda d: _bait_file(d / "bait.safetensors"),
        {"prompt": "a fox"},
    ),
    (od_nodes.OmniDreamsModelLoader, "ckpt_name", "diffusion_models", lambda d: _bait_file(d / "bait.pt"), {}),
    (h3_nodes.OmniVideoH3Loader, "folder", "diffusers", lambda d: _bait_h3_folder(d / "bait_h3"), {}),
    (
        h3_nodes.OmniVideoH3Loader,
        "transformer_file",
        "diffusion_models",
        lambda d: _bait_file(d / "bait.safetensors"),
        {"folder": "MiniMax-H3"},
    ),
    (
        od_text_nodes.OmniDreamsTextEncoderLoader,
        "folder",
        "text_encoders",
        lambda d: _bait_folder(d / "bait_cosmos", "qwen2_5_vl"),
        {},
    ),
    (
        h3_nodes.OmniVideoH3TextEncoderLoader,
        "folder",
        "text_encoders",
        lambda d: _bait_folder(d / "bait_qwen3", "qwen3_vl"),
        {},
    ),
]
IDS = [f"{node.__name__}.{name}" for node, name, *_ in INPUTS]


def _attacks(folders, kind, bait):
    """(case, name) pairs aimed at `bait` from ComfyUI's folder for `kind`."""
    root = folders.models(kind)
    link = root / "escape"
    if not link.exists():  # an administrator's link from the models folder to a folder beside the bait
        (bait.parent / "linked").mkdir()
        link.symlink_to(bait.parent / "linked", target_is_directory=True)
    return [
        ("absolute", str(bait)),
        ("dotdot", os.path.relpath(bait, root)),
        ("dotdot-backslash", os.path.relpath(bait, root).replace("/", "\\")),
        ("through-link-dotdot", f"escape/../{bait.name}"),  # escape/.. is the bait's folder
        ("absolute-missing", str(bait.parent / "missing" / bait.name)),
    ]


@pytest.mark.parametrize("node, name, kind, make_bait, others", INPUTS, ids=IDS)
def test_hostile_names_are_refused_and_nothing_outside_is_opened(
    node, name, kind, make_bait, others, tmp_path, comfy_folders, opened
):
    bait = make_bait(tmp_path / "outside")
    attacks = _attacks(comfy_folders, kind, bait)
    opened.clear()  # making the bait opened it
    messages = {}
    for case, value in attacks:
        if name in inspect.signature(node.validate_inputs).parameters:
            problem = node.validate_inputs(**{name: value})
            assert isinstance(problem, str) and "refused" in problem, (case, problem)
        with pytest.raises(safe_paths.PathRefused) as err:
            node.execute(**{**others, name: value})
        messages[case] = str(err.value).replace(repr(value), "<name>")
    assert not [p for p in opened if str(tmp_path / "outside") in os.path.realpath(p)], opened
    # an existing and a missing target outside get the same message: the error is no existence oracle
    assert messages["absolute"] == messages["absolute-missing"]
    assert "absolute paths are not accepted" in messages["absolute"]
    assert all("'..' is not accepted" in messages[c] for c in ("dotdot", "dotdot-backslash", "through-link-dotdot"))
    assert not list(comfy_folders.output.iterdir())  # nothing written


def test_a_link_placed_in_a_models_folder_is_followed_as_core_does(tmp_path, comfy_folders):
    """An administrator's link (models/text_encoders/shared -> a disk elsewhere) works, as in core; what it
    leads to is still checked like any entry."""
    outside = tmp_path / "disk"
    _bait_file(outside / "prompt.safetensors", keys=("omnidreams_text_embedding",))
    save_file({"weight": torch.zeros(2)}, str(outside / "weights.safetensors"))
    (comfy_folders.models("text_encoders") / "shared").symlink_to(outside, target_is_directory=True)
    listed = od_text_nodes.OmniDreamsLoadTextEmbedding.define_schema().inputs[0].options["options"]
    assert listed == ["shared/prompt.safetensors"]
    assert od_text_nodes.OmniDreamsLoadTextEmbedding.validate_inputs(embedding="shared/prompt.safetensors") is True
    assert "not an OmniDreams prompt embedding" in od_text_nodes.OmniDreamsLoadTextEmbedding.validate_inputs(
        embedding="shared/weights.safetensors"
    )


@pytest.mark.parametrize(
    "bad, why",
    [
        ("", "no name"),
        ("  ", "no name"),
        ("a\x00b", "control characters"),
        ("x" * 2000, "characters long"),
        ("/".join(["a"] * 20), "folder levels"),
        ("C:evil.pt", "absolute"),
        ("\\\\server\\share\\x.pt", "absolute"),
        ("a/" + "b" * 300 + ".pt", "longer than 255 bytes"),
    ],
)
def test_name_rules(bad, why):
    assert why in safe_paths.name_problem(bad)


def test_names_that_stay_inside_are_fine():
    for ok in ("model.pt", "sub/dir/model.safetensors", "./model.pt", "a//b.pt", "name with spaces.pt"):
        assert safe_paths.name_problem(ok) is None, ok


# ------------------------------------------------------------------------------------------------------------
# dropdowns list exactly the valid choices


def test_dropdowns_list_exactly_what_the_nodes_accept(comfy_folders):
    encoders = comfy_folders.models("text_encoders")
    _bait_folder(encoders / "Cosmos-Reason1-7B", "qwen2_5_vl")
    save_file({"w": torch.zeros(1)}, str(encoders / "Cosmos-Reason1-7B" / "model.safetensors"))
    _bait_folder(encoders / "Qwen3-VL-32B-Instruct", "qwen3_vl")
    _bait_folder(encoders / "vendor" / "qwen3", "qwen3_vl")  # two levels down
    (encoders / "not_a_model").mkdir()
    _bait_file(encoders / "night.safetensors", keys=("omnidreams_text_embedding",))
    _bait_file(encoders / "fox.safetensors", keys=("prompt_embeds", "text_token_tags"))
    diffusion = comfy_folders.models("diffusion_models")
    _bait_file(diffusion / "omnidreams.pt")
    (diffusion / "notes.txt").write_text("not a model")
    _bait_h3_folder(comfy_folders.models("diffusers") / "MiniMax-H3")
    (comfy_folders.models("diffusers") / "Wan2.1" / "vae").mkdir(parents=True)  # another family's folder
    (comfy_folders.models("diffusers") / "Wan2.1" / "vae" / "config.json").write_text("{}")
    _bait_folder(encoders / "broken", "qwen3_vl")
    (encoders / "broken" / "config.json").write_text("{not json")  # listed nowhere, breaks nothing

    def options(node, name):
        return {i.id: i for i in node.define_schema().inputs}[name].options["options"]

    assert options(od_text_nodes.OmniDreamsTextEncoderLoader, "folder") == ["Cosmos-Reason1-7B"]
    assert options(h3_nodes.OmniVideoH3TextEncoderLoader, "folder") == ["Qwen3-VL-32B-Instruct", "vendor/qwen3"]
    assert options(od_text_nodes.OmniDreamsLoadTextEmbedding, "embedding") == ["night.safetensors"]
    assert options(h3_nodes.OmniVideoH3TextEncode, "embedding_file") == ["", "fox.safetensors"]
    assert options(od_nodes.OmniDreamsModelLoader, "ckpt_name") == ["omnidreams.pt"]
    assert options(h3_nodes.OmniVideoH3Loader, "folder") == ["MiniMax-H3"]
    # and each listed entry passes the node's own check, each unlisted one fails it
    assert od_text_nodes.OmniDreamsTextEncoderLoader.validate_inputs(folder="Cosmos-Reason1-7B") is True
    assert "qwen3_vl" in od_text_nodes.OmniDreamsTextEncoderLoader.validate_inputs(folder="Qwen3-VL-32B-Instruct")
    assert "no config.json" in h3_nodes.OmniVideoH3TextEncoderLoader.validate_inputs(folder="not_a_model")
    assert "MiniMax-H3" in h3_nodes.OmniVideoH3Loader.validate_inputs(folder="Wan2.1")
    assert "only .pt" in od_nodes.OmniDreamsModelLoader.validate_inputs(ckpt_name="notes.txt")
    assert "not valid JSON" in h3_nodes.OmniVideoH3TextEncoderLoader.validate_inputs(folder="broken")


# ------------------------------------------------------------------------------------------------------------
# item 5: unreadable files get an error that names the file and says what to do


def test_text_file_named_pt(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("hello, this is not a checkpoint")
    with pytest.raises(CheckpointError, match="notes.pt is not a PyTorch checkpoint.*Use the released .pt"):
        read_torch_file(str(path))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/omnivideo_pwned",))


@pytest.mark.parametrize("fmt", ["zip", "legacy", "raw-pickle"])
def test_pickles_with_code_are_refused_with_our_message(tmp_path, fmt):
    import pickle

    path = tmp_path / f"evil_{fmt}.pt"
    if fmt == "raw-pickle":
        path.write_bytes(pickle.dumps({"w": _Evil()}, protocol=2))
    else:
        torch.save({"w": _Evil()}, path, _use_new_zipfile_serialization=fmt == "zip")
    with pytest.raises(CheckpointError) as err:
        read_torch_file(str(path))
    text = str(err.value)
    assert f"evil_{fmt}.pt: refused to load" in text and "weights_only=False" not in text
    assert not os.path.exists("/tmp/omnivideo_pwned")


@pytest.mark.parametrize("cut", [4, 100, -10])
def test_truncated_safetensors_names_the_file(tmp_path, cut):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(64), "b": torch.ones(64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=r"model.safetensors cannot be read as .safetensors .*download it again"):
        read_safetensors(str(path))
    if cut == 4:
        with pytest.raises(CheckpointError, match="model.safetensors cannot be read"):
            safetensors_keys(str(path))


def test_huge_safetensors_header_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes((10 << 30).to_bytes(8, "little") + b"{}")  # claims a 10 GiB header
    with pytest.raises(CheckpointError, match="header length"):
        safetensors_keys(str(path))


def test_encode_first_frame_checks_the_vae_before_encoding():
    class SD15VAE:  # what comfy.sd.VAE looks like for an image VAE
        latent_channels, latent_dim = 4, 2

        def encode(self, pixels):
            raise AssertionError("encoded with the wrong VAE")

    from omnivideo.models.handles import OmniDreamsConditioning

    cond = OmniDreamsConditioning(text=torch.zeros(1, 512, 8))
    with pytest.raises(ValueError, match="needs the Wan 2.1 VAE.*4 latent channels"):
        od_nodes.OmniDreamsEncodeFirstFrame.execute(cond, SD15VAE(), torch.rand(1, 32, 32, 3), 32, 32)


def test_truncated_h3_vae_names_the_file(tmp_path):
    from support.h3_tiny import make_models, write_folder

    from omnivideo.models.h3.loader import load_h3

    root = write_folder(tmp_path / "MiniMax-H3", *make_models(seed=0))
    weights = root / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(
        CheckpointError,
        match=r"vae/diffusion_pytorch_model.safetensors cannot be read .*header "
        r"describes \d+ bytes of tensors, the file holds \d+.*again",
    ):
        load_h3(root, "fp32")  # found by the header check, before the transformer is loaded
