"""OmniVideo: ComfyUI node pack (also importable as the `omnivideo` package).

Registered through the V3 entry point only: ComfyUI calls `comfy_entrypoint` and asks the extension for
its node classes (there is deliberately no NODE_CLASS_MAPPINGS, which would send ComfyUI down the V1 path).
"""

from __future__ import annotations

from . import compat
from .compat import ComfyExtension
from .integration import live_routes
from .nodes import NODES

__version__ = "0.1.0"
WEB_DIRECTORY = "./web"  # the OmniDreams Live panel (ComfyUI serves it under /extensions/<pack folder>/)


class OmniVideoExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint() -> OmniVideoExtension:
    compat.add_routes(live_routes.install)  # before ComfyUI's server adds its route table to the app
    return OmniVideoExtension()


__all__ = ["comfy_entrypoint"]
