"""Contracts every node must keep with ComfyUI, checked on all registered nodes."""

import inspect

import pytest

from omnivideo import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

NODES = sorted(NODE_CLASS_MAPPINGS.items())


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
    assert NODE_DISPLAY_NAME_MAPPINGS[node_id] and schema.description
    assert len({i.id for i in schema.inputs}) == len(schema.inputs)


def test_attention_node_checks_values_when_known():
    node = NODE_CLASS_MAPPINGS["OmniVideoAttention"]
    assert "sparsity" in node.validate_inputs(backend="rainfusion", sparsity=1.5, start_step=0, skip_layers="",
                                              block_size=128)
    with pytest.raises(ValueError, match="skip_layers|malformed|layer"):
        node.execute(backend="rainfusion", sparsity=0.8, start_step=0, skip_layers="0-x", block_size=128)
