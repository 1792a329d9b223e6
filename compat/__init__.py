"""The one place that touches ComfyUI's modules: the rest of the pack calls `compat.X`, never ComfyUI itself.

Everything here degrades to a plain-torch behaviour when ComfyUI is absent, so the core of the pack imports and runs
under pytest or in a script; a parallel worker never imports ComfyUI (`comfyui.py`). One module per part of ComfyUI:

    comfyui           ComfyUI's modules, imported once (None outside ComfyUI and in a parallel worker); HAS_COMFY
    v3                the V3 node API (`io`, `ComfyExtension`) or its stand-in; search aliases; core's VIDEO value
    interrupts        the cancel button, and a parallel job's cancel at the point every rank shares
    prompt_server     our routes on ComfyUI's server, the running node and the queue, text and websocket messages
    progress          the progress bar on the running node (a cancel point)
    folders           ComfyUI's model folders and output folder
    model_management  the networks we hand to ComfyUI's model management, their loading, devices and memory
    model_hooks       ComfyUI's wrapper slots on a model, and whether its attention takes an override
    cast_ops          ComfyUI's cast layers for the models we build or adopt
"""

from __future__ import annotations

import logging
import sys
import types

from . import cast_ops, comfyui, folders, interrupts, model_hooks, model_management, progress, prompt_server, v3
from .cast_ops import make_castable, operations
from .comfyui import HAS_COMFY
from .folders import model_file_list, model_folder_roots, output_directory
from .interrupts import (
    ProcessingInterrupted,
    cancel_at_shared_points,
    check_interrupt,
    is_interrupt,
    request_interrupt,
)
from .model_hooks import attention_override_supported, wrapper_type
from .model_management import (
    ManagedModule,
    add_lora,
    comfy_torch_device,
    device_clones,
    free_memory,
    intermediate_device,
    load_models,
    loaded,
    manage,
    on_unload_models,
)
from .progress import ProgressBar
from .prompt_server import add_routes, queued_prompts, running_node, show_text, tell_client
from .v3 import ComfyExtension, io, search_aliases, video_from_file

log = logging.getLogger("omnivideo")  # the pack's log, in ComfyUI's console

__all__ = [
    "HAS_COMFY",
    "ComfyExtension",
    "ManagedModule",
    "ProcessingInterrupted",
    "ProgressBar",
    "add_lora",
    "add_routes",
    "attention_override_supported",
    "cancel_at_shared_points",
    "check_interrupt",
    "comfy_torch_device",
    "device_clones",
    "free_memory",
    "intermediate_device",
    "io",
    "is_interrupt",
    "load_models",
    "loaded",
    "log",
    "make_castable",
    "manage",
    "model_file_list",
    "model_folder_roots",
    "on_unload_models",
    "operations",
    "output_directory",
    "queued_prompts",
    "request_interrupt",
    "running_node",
    "search_aliases",
    "show_text",
    "tell_client",
    "video_from_file",
    "wrapper_type",
]

_PARTS = (cast_ops, comfyui, folders, interrupts, model_hooks, model_management, progress, prompt_server, v3)


class _Package(types.ModuleType):
    """compat as one namespace, as when it was one module: a name replaced on the package (a test's monkeypatch of
    `compat.load_models`, a probe keeping a partial load) is replaced in each of its modules that holds it too, so the
    calls inside compat (`loaded` -> `load_models`, `ProgressBar.update` -> `check_interrupt`) see it as callers
    outside do."""

    def __setattr__(self, name: str, value) -> None:
        if name in __all__:
            for part in _PARTS:
                if name in vars(part):
                    setattr(part, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
