"""What a worker can be asked to do: operations registered by the pipelines, looked up by the name rank 0 sends.

A handler runs on a worker as `handler(world, models, args, tensors)`; `models` is the worker's models by key
(kept across runs). Inside a job it may receive more messages (`world.receive()`), mirroring what rank 0 sends.
An operation is named '<family>.<what>'; the family's module registers it and is imported on first use (a worker
that only runs OmniDreams never imports diffusers).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

OPS: dict[str, Callable] = {}
FAMILY_MODULES = {"omnidreams": "..pipelines.omnidreams.parallel", "h3": "..pipelines.h3.parallel"}


def operation(name: str):
    def register(handler: Callable) -> Callable:
        OPS[name] = handler
        return handler

    return register


def handler(name: str) -> Callable:
    if name not in OPS:
        family = name.split(".", 1)[0]
        if family not in FAMILY_MODULES:
            raise KeyError(f"unknown operation {name!r}")
        importlib.import_module(FAMILY_MODULES[family], __package__)
    return OPS[name]
