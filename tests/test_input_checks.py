"""Combo values (issue 17): ComfyUI 0.3.x checks no V3 combo value at /prompt; where core does not, each node's
validate_inputs (nodes/input_checks.py) does."""

from __future__ import annotations

import inspect

import pytest
import torch
from safetensors.torch import save_file

from omnivideo.nodes import h3 as h3_nodes
from omnivideo.nodes import input_checks


def _combos():
    from omnivideo.nodes import node_classes

    return [
        (node, port.id, input_checks._choices(port))
        for node in node_classes().values()
        for port in node.define_schema().inputs
        if input_checks._choices(port) is not None
    ]


def test_every_combo_value_is_checked_where_core_does_not(comfy_folders):
    """Without ComfyUI (the stand-in io), as under 0.3.64: each combo input is named by its node's validate_inputs,
    an off-list value is refused with the input, the value and the choices; every listed one passes."""
    if input_checks.CORE_CHECKS_V3_COMBOS:
        pytest.skip("this ComfyUI checks V3 combo values itself (tests/integration/test_combo_validation_server.py)")
    save_file({"w": torch.zeros(1)}, str(comfy_folders.models("diffusion_models") / "h3_transformer.safetensors"))
    combos = _combos()
    names = {(node.__name__, name) for node, name, _ in combos}
    for expected in [
        ("OmniDreamsModelLoader", "dtype"),
        ("OmniDreamsTextEncoderLoader", "dtype"),
        ("OmniVideoH3Loader", "dtype"),
        ("OmniVideoH3Loader", "transformer_file"),
        ("OmniVideoH3TextEncoderLoader", "dtype"),
        ("OmniVideoAttention", "backend"),
        ("OmniDreamsStream", "fusion"),
        ("OmniVideoWanVAEDecode", "fusion"),
    ]:
        assert expected in names, expected
    for node, name, choices in combos:
        assert name in inspect.signature(node.validate_inputs).parameters, (node.__name__, name)
        bad = "hidden-not-an-option.bin"
        problem = node.validate_inputs(**{name: bad})
        assert isinstance(problem, str) and name in problem and repr(bad) in problem, (node.__name__, name, problem)
        for choice in choices:  # the models folders are empty: file inputs list nothing but their "none" entry
            assert node.validate_inputs(**{name: choice}) is True, (node.__name__, name, choice)
        assert node.validate_inputs(**{name: None}) is True  # linked: checked when the node runs


def test_combo_refusal_names_input_value_and_choices():
    problem = input_checks.validated_choices(h3_nodes.OmniVideoH3TextEncoderLoader, dtype="fp64")
    assert problem.startswith("dtype 'fp64' was refused: it is not in the list; the choices are 'auto', ")
    assert "fp32" in problem and "bf16" in problem
    both = input_checks.validated_choices(h3_nodes.OmniVideoH3Loader, transformer_file="x.bin", dtype="fp64")
    assert "transformer_file 'x.bin' was refused" in both and "dtype 'fp64' was refused" in both  # each problem


def test_dynamic_file_combo_follows_the_current_list(comfy_folders):
    node = h3_nodes.OmniVideoH3Loader
    weights = comfy_folders.models("diffusion_models") / "later.safetensors"
    assert "not in the list" in input_checks.validated_choices(node, transformer_file="later.safetensors")
    save_file({"w": torch.zeros(1)}, str(weights))
    assert input_checks.validated_choices(node, transformer_file="later.safetensors") is True
    assert input_checks.validated_choices(node, transformer_file=h3_nodes.FROM_FOLDER) is True
    weights.unlink()
    assert "not in the list" in input_checks.validated_choices(node, transformer_file="later.safetensors")


def test_combo_refusal_is_bounded(monkeypatch):
    """A huge value and a long list give a short message, quickly; other JSON values are refused, not crashed on."""
    import time

    from omnivideo.compat import io

    class Many(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id="Many", inputs=[io.Combo.Input("pick", options=[f"file_{i:04d}" for i in range(5000)])]
            )

    t0 = time.perf_counter()
    problem = input_checks.validated_choices(Many, pick="x" * 50_000_000)
    assert time.perf_counter() - t0 < 1.0
    assert len(problem) < 1200 and "and 4988 more" in problem and "'file_0000'" in problem and "pick 'xxx" in problem
    for odd in (3, 2.5, True, {"a": list(range(10**5))}, ["1", 0, 2]):
        assert "pick" in input_checks.validated_choices(Many, pick=odd)
    assert input_checks.validated_choices(Many, pick="file_4999") is True
    with pytest.raises(TypeError, match="no combo input 'other'"):
        input_checks.validated_choices(Many, other="x")
    assert input_checks.refusals(True, "One.", True, "Two.") == "One. Two." and input_checks.refusals(True) is True
