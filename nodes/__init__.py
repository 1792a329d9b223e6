"""Thin ComfyUI node classes. Each module holds the nodes of one feature."""

from __future__ import annotations

from typing import Any

from .attention import OmniVideoAttention, OmniVideoPatchModelAttention
from .backend_info import OmniVideoBackendInfo
from .h3 import NODES as H3_NODES
from .h3_references import NODES as H3_REFERENCE_NODES
from .lora import OmniVideoLoRA
from .omnidreams import NODES as OMNIDREAMS_NODES
from .omnidreams_live import NODES as LIVE_NODES
from .omnidreams_stream import NODES as STREAM_NODES
from .omnidreams_text import NODES as OMNIDREAMS_TEXT_NODES
from .parallel import OmniVideoParallel, OmniVideoSequenceParallel
from .sampler import OmniVideoSampler
from .wan_vae_decode import OmniVideoWanVAEDecode

NODES: list[Any] = [
    OmniVideoBackendInfo,
    OmniVideoWanVAEDecode,
    OmniVideoAttention,
    OmniVideoPatchModelAttention,
    OmniVideoSampler,
    OmniVideoParallel,
    OmniVideoSequenceParallel,
    OmniVideoLoRA,
    *OMNIDREAMS_NODES,
    *OMNIDREAMS_TEXT_NODES,
    *STREAM_NODES,
    *LIVE_NODES,
    *H3_NODES,
    *H3_REFERENCE_NODES,
]


def node_classes() -> dict[str, type]:
    """node_id -> class, as ComfyUI registers them through `comfy_entrypoint`."""
    return {node.define_schema().node_id: node for node in NODES}
