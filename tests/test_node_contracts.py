"""Contracts every node must keep with ComfyUI, checked on all registered nodes."""

import asyncio
import inspect

import pytest

import omnivideo
from omnivideo.nodes import node_classes

NODES = sorted(node_classes().items())


@pytest.mark.parametrize("node_id, node", NODES, ids=[n for n, _ in NODES])
def test_validate_inputs_accepts_linked_inputs(node_id, node):
    """ComfyUI validates before running upstream nodes: linked inputs arrive as None."""
    schema = node.define_schema()
    params = inspect.signature(node.validate_inputs).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = {i.id: None for i in schema.inputs if takes_all or i.id in params}
    assert node.validate_inputs(**args) is True


@pytest.mark.parametrize("node_id, node", NODES, ids=[n for n, _ in NODES])
def test_schema_is_namespaced_and_documented(node_id, node):
    schema = node.define_schema()
    assert schema.category.startswith("OmniVideo/")
    assert schema.display_name and schema.description
    assert len({i.id for i in schema.inputs}) == len(schema.inputs)


@pytest.mark.parametrize("node_id, node", NODES, ids=[n for n, _ in NODES])
def test_validate_inputs_keeps_comfyuis_own_checks(node_id, node):
    """ComfyUI skips its min/max and list checks for every input a validate_inputs names, for all inputs when it
    takes **kwargs, and reports a failure once per named input (the same message under each). So ours name one
    input at most besides combos (checked against their own list where ComfyUI does not: 0.3.64, and outside
    ComfyUI, input_checks.CORE_CHECKS_V3_COMBOS), never one with declared limits, and never take **kwargs."""
    from omnivideo.nodes import input_checks

    if "validate_inputs" not in vars(node):
        return  # the base class's: ComfyUI treats it as absent
    params = inspect.signature(node.validate_inputs).parameters
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values()), node_id
    combos = {
        i.id for i in node.define_schema().inputs if str(getattr(i, "io_type", None) or i.get_io_type()) == "COMBO"
    }
    named = list(params) if input_checks.CORE_CHECKS_V3_COMBOS else [p for p in params if p not in combos]
    assert len(named) <= 1, f"{node_id}.validate_inputs names {list(params)}: one input at most besides combos"
    limited = {
        i.id
        for i in node.define_schema().inputs
        if {"min", "max"} & set(getattr(i, "options", {}) or {})
        or getattr(i, "min", None) is not None
        or getattr(i, "max", None) is not None
    }
    assert not limited & set(params), f"{node_id}.validate_inputs would switch off ComfyUI's limits of {limited}"


def test_attention_node_checks_values_when_known():
    node = node_classes()["OmniVideoAttention"]
    assert "skip_layers" in node.validate_inputs(skip_layers="0-30000000")
    with pytest.raises(ValueError, match="sparsity"):
        node.execute(backend="rainfusion", sparsity=1.5, start_step=0, skip_layers="", block_size=128)
    with pytest.raises(ValueError, match="skip_layers|malformed|layer"):
        node.execute(backend="rainfusion", sparsity=0.8, start_step=0, skip_layers="0-x", block_size=128)


def test_registration_is_v3_only():
    """ComfyUI takes the V1 path whenever a pack exports NODE_CLASS_MAPPINGS; ours goes through comfy_entrypoint."""
    assert not hasattr(omnivideo, "NODE_CLASS_MAPPINGS") and not hasattr(omnivideo, "NODE_DISPLAY_NAME_MAPPINGS")
    listed = asyncio.run(asyncio.run(omnivideo.comfy_entrypoint()).get_node_list())
    assert {n.define_schema().node_id for n in listed} == set(node_classes()) and len(listed) == len(node_classes())


def test_search_aliases_where_comfyui_has_them():
    """Newer ComfyUI searches `search_aliases` too; 0.3.64's schema has no such field and gets none."""
    from omnivideo import compat

    schema = node_classes()["OmniVideoAttention"].define_schema()
    aliases = (getattr(schema, "flags", None) or {}).get("search_aliases") or getattr(schema, "search_aliases", None)
    if "search_aliases" in (getattr(compat.io.Schema, "__dataclass_fields__", None) or {"search_aliases": 1}):
        assert aliases and "rainfusion" in aliases and "sparse attention" in aliases
    assert all(
        s.display_name.startswith(("OmniVideo", "OmniDreams"))
        for s in map(lambda c: c.define_schema(), node_classes().values())
    )
