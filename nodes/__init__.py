"""Thin ComfyUI node classes. Each module holds the nodes of one feature."""

from __future__ import annotations

from .backend_info import OmniVideoBackendInfo
from .wan_vae_decode import OmniVideoWanVAEDecode

NODES = [
    OmniVideoBackendInfo,
    OmniVideoWanVAEDecode,
]
