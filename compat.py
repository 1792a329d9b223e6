"""The one place that touches ComfyUI's modules.

Everything here degrades to a plain-torch behaviour when ComfyUI is absent, so the
core of the pack imports and runs under pytest or in a script.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("omnivideo")

try:  # ComfyUI is importable only inside a ComfyUI process (or with COMFYUI_PATH on sys.path)
    import comfy.model_management as _mm
    import comfy.utils as _comfy_utils
    import folder_paths as _folder_paths
except Exception:  # pragma: no cover - exercised when ComfyUI is missing
    _mm = _comfy_utils = _folder_paths = None

HAS_COMFY = _mm is not None


class _FallbackIO:
    """Just enough of `comfy_api.latest.io` to import, introspect and call our V3 nodes
    without ComfyUI (pytest, scripts). Inside ComfyUI the real module is used."""

    class Schema:
        def __init__(self, node_id, display_name=None, category="", inputs=(), outputs=(), description="", **flags):
            self.node_id, self.display_name, self.category = node_id, display_name, category
            self.inputs, self.outputs, self.description = list(inputs), list(outputs), description
            self.flags = flags

    class NodeOutput:
        def __init__(self, *args, ui=None, **_):
            self.args, self.ui = args, ui

        @property
        def result(self):
            return self.args or None

        def __getitem__(self, index):
            return self.args[index]

    class ComfyNode:
        @classmethod
        def define_schema(cls):
            raise NotImplementedError

        @classmethod
        def validate_inputs(cls, **kwargs):
            return True

    class ComfyExtension:
        async def on_load(self):
            pass

    class _Port:
        def __init__(self, io_type, id=None, optional=False, **options):
            self.io_type, self.id, self.optional, self.options = io_type, id, optional, options

    @staticmethod
    def Custom(io_type: str):
        class _Type:
            io_type: str

            @staticmethod
            def Input(id, **kw):
                return _FallbackIO._Port(io_type, id, **kw)

            @staticmethod
            def Output(id=None, **kw):
                return _FallbackIO._Port(io_type, id, **kw)

        _Type.io_type = io_type
        return _Type


for _name, _io_type in [
    ("Vae", "VAE"),
    ("Latent", "LATENT"),
    ("Image", "IMAGE"),
    ("Audio", "AUDIO"),
    ("Model", "MODEL"),
    ("Int", "INT"),
    ("Float", "FLOAT"),
    ("String", "STRING"),
    ("Boolean", "BOOLEAN"),
    ("Combo", "COMBO"),
]:
    setattr(_FallbackIO, _name, _FallbackIO.Custom(_io_type))

try:  # the V3 node API
    from comfy_api.latest import ComfyExtension, io
except Exception:  # pragma: no cover - exercised when ComfyUI is missing
    io, ComfyExtension = _FallbackIO, _FallbackIO.ComfyExtension


def search_aliases(*words: str) -> dict:
    """`search_aliases=[...]` for io.Schema where this ComfyUI's schema has the field (newer than 0.3.64, whose
    frontend searches node ids and display names only); nothing on older ones."""
    fields = getattr(io.Schema, "__dataclass_fields__", None)
    return {"search_aliases": list(words)} if fields is None or "search_aliases" in fields else {}


class ProcessingInterrupted(RuntimeError):
    """Raised by `check_interrupt` outside ComfyUI when `request_interrupt` was called."""


_interrupt_requested = False


def request_interrupt() -> None:
    """Standalone stand-in for ComfyUI's cancel button (tests use it)."""
    global _interrupt_requested
    _interrupt_requested = True


def check_interrupt() -> None:
    """A cancel point: raises if the user pressed cancel in ComfyUI."""
    global _interrupt_requested
    if HAS_COMFY:
        _mm.throw_exception_if_processing_interrupted()
    elif _interrupt_requested:
        _interrupt_requested = False
        raise ProcessingInterrupted("processing interrupted")


class ProgressBar:
    """ComfyUI's progress bar when running inside ComfyUI, else a no-op counter.

    Each `update` is also a cancel point, as in ComfyUI.
    """

    def __init__(self, total: int):
        self.total = total
        self.current = 0
        self._bar = _comfy_utils.ProgressBar(total) if HAS_COMFY else None

    def update(self, n: int = 1) -> None:
        self.current += n
        if self._bar is not None:
            self._bar.update(n)
        check_interrupt()


def comfy_torch_device() -> torch.device | None:
    """ComfyUI's chosen compute device, or None outside ComfyUI."""
    return _mm.get_torch_device() if HAS_COMFY else None


def intermediate_device(default: torch.device) -> torch.device:
    """Where ComfyUI keeps IMAGE/LATENT tensors between nodes (CPU by default)."""
    return _mm.intermediate_device() if HAS_COMFY else default


def free_memory() -> None:
    """Return cached allocator blocks after a heavy node."""
    if HAS_COMFY:
        _mm.soft_empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_file_list(kind: str) -> list[str]:
    """Files ComfyUI lists in one of its model folder kinds ('vae', 'diffusion_models', ...); none outside it."""
    if _folder_paths is None:
        return []
    try:
        return _folder_paths.get_filename_list(kind)
    except KeyError:  # a kind this ComfyUI does not know
        return []


def model_folder_roots(kind: str) -> list[str]:
    """The directories behind one of ComfyUI's model folder kinds (models/<kind> and extra_model_paths)."""
    if _folder_paths is None:
        return []
    try:
        return list(_folder_paths.get_folder_paths(kind))
    except KeyError:  # a kind this ComfyUI does not know
        return []


def output_directory() -> str:
    """ComfyUI's output folder. Outside ComfyUI there is none (never the working directory)."""
    if _folder_paths is None:
        raise RuntimeError("there is no ComfyUI output folder outside ComfyUI; run the node inside ComfyUI")
    return _folder_paths.get_output_directory()


def diffusion_model_wrapper_type() -> str:
    """ComfyUI's wrapper slot around the diffusion model's forward (WrappersMP.DIFFUSION_MODEL)."""
    try:
        from comfy.patcher_extension import WrappersMP

        return WrappersMP.DIFFUSION_MODEL
    except Exception:
        return "diffusion_model"


def attention_override_supported() -> bool:
    """Whether this ComfyUI honours transformer_options["optimized_attention_override"] (0.3.6x+)."""
    try:
        import comfy.ldm.modules.attention as attn

        return hasattr(attn, "wrap_attn")
    except Exception:
        return False
