"""ComfyUI's modules that compat's other modules call, imported once, here.

Each is None outside a ComfyUI process (pytest, scripts) and in a parallel worker, which runs models only and never
ComfyUI (parallel/worker.py); `HAS_COMFY` says which case this process is in.
"""

from __future__ import annotations

import os

try:  # ComfyUI is importable only inside a ComfyUI process (or with COMFYUI_PATH on sys.path)
    if os.environ.get("OMNIVIDEO_WORKER"):  # a parallel worker runs models only, never ComfyUI (parallel/worker.py)
        raise ImportError("parallel worker")
    import comfy.lora as lora
    import comfy.model_management as mm
    import comfy.model_patcher as model_patcher
    import comfy.ops as ops
    import comfy.utils as comfy_utils
    import folder_paths
except Exception:  # pragma: no cover - exercised when ComfyUI is missing
    lora = mm = model_patcher = ops = comfy_utils = folder_paths = None

HAS_COMFY = mm is not None
