"""OmniVideo: ComfyUI node pack (also importable as the `omnivideo` package)."""

from __future__ import annotations

from .compat import ComfyExtension
from .nodes import NODES

__version__ = "0.1.0"


_SCHEMAS = [(node, node.define_schema()) for node in NODES]  # once: loaders scan model folders
NODE_CLASS_MAPPINGS = {schema.node_id: node for node, schema in _SCHEMAS}
NODE_DISPLAY_NAME_MAPPINGS = {schema.node_id: schema.display_name for _, schema in _SCHEMAS}


class OmniVideoExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint() -> OmniVideoExtension:
    return OmniVideoExtension()


__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint"]
