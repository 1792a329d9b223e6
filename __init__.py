"""OmniVideo: ComfyUI node pack (also importable as the `omnivideo` package)."""

from __future__ import annotations

from .compat import ComfyExtension
from .nodes import NODES

__version__ = "0.1.0"


def _schema(node):
    return node.define_schema()


NODE_CLASS_MAPPINGS = {_schema(n).node_id: n for n in NODES}
NODE_DISPLAY_NAME_MAPPINGS = {_schema(n).node_id: _schema(n).display_name for n in NODES}


class OmniVideoExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint() -> OmniVideoExtension:
    return OmniVideoExtension()


__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint"]
