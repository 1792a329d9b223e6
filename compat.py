"""The one place that touches ComfyUI's modules.

Everything here degrades to a plain-torch behaviour when ComfyUI is absent, so the
core of the pack imports and runs under pytest or in a script.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

log = logging.getLogger("omnivideo")

try:  # ComfyUI is importable only inside a ComfyUI process (or with COMFYUI_PATH on sys.path)
    if os.environ.get("OMNIVIDEO_WORKER"):  # a parallel worker runs models only, never ComfyUI (parallel/worker.py)
        raise ImportError("parallel worker")
    import comfy.lora as _lora
    import comfy.model_management as _mm
    import comfy.model_patcher as _model_patcher
    import comfy.ops as _ops
    import comfy.utils as _comfy_utils
    import folder_paths as _folder_paths
except Exception:  # pragma: no cover - exercised when ComfyUI is missing
    _lora = _mm = _model_patcher = _ops = _comfy_utils = _folder_paths = None

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
    ("Video", "VIDEO"),
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


def is_interrupt(exc: BaseException) -> bool:
    """Whether `exc` is a cancel (ComfyUI's, or `request_interrupt`'s outside it), not a failure."""
    if HAS_COMFY and isinstance(exc, _mm.InterruptProcessingException):
        return True
    return isinstance(exc, ProcessingInterrupted)


def show_text(text: str) -> None:
    """Text on the running node in ComfyUI's UI (and in the log); only the log outside ComfyUI."""
    log.info(text)
    try:
        from comfy_execution.utils import get_executing_context
        from server import PromptServer

        context = get_executing_context()
        if context is not None:
            PromptServer.instance.send_progress_text(text, context.node_id)
    except Exception:  # outside ComfyUI or an older one: the log line is enough
        pass


def _prompt_server():
    try:
        from server import PromptServer

        return getattr(PromptServer, "instance", None)
    except Exception:  # outside ComfyUI
        return None


def add_routes(install) -> bool:
    """`install(routes)` on ComfyUI's route table (aiohttp's RouteTableDef; call it before the server starts, e.g. from
    comfy_entrypoint). False outside a ComfyUI server."""
    server = _prompt_server()
    if server is None:
        return False
    install(server.routes)
    return True


def running_node() -> tuple[str, str] | None:
    """(prompt id, node id) of the node ComfyUI is running now, None outside one."""
    try:
        from comfy_execution.utils import get_executing_context

        context = get_executing_context()
    except Exception:
        return None
    return None if context is None else (str(context.prompt_id), str(context.node_id))


def queued_prompts() -> list[tuple[str, dict]]:
    """(prompt id, API graph) of every prompt running or waiting in ComfyUI's queue; [] outside ComfyUI."""
    queue = getattr(_prompt_server(), "prompt_queue", None)
    try:
        running, pending = queue.get_current_queue_volatile()  # type: ignore[union-attr]
    except Exception:
        return []
    return [(str(item[1]), item[2]) for item in (*running, *pending) if len(item) > 2 and isinstance(item[2], dict)]


def tell_client(event: str, data: dict) -> bool:
    """A websocket message to the client that queued the running prompt only (never a broadcast: what it carries may
    be that client's alone); False when there is none (queued without a client_id, or outside ComfyUI)."""
    server = _prompt_server()
    client = getattr(server, "client_id", None)
    if server is None or client is None:
        return False
    server.send_sync(event, data, client)
    return True


def check_interrupt() -> None:
    """A cancel point: raises if the user pressed cancel in ComfyUI."""
    global _interrupt_requested
    if HAS_COMFY:
        _mm.throw_exception_if_processing_interrupted()
    elif _interrupt_requested:
        _interrupt_requested = False
        raise ProcessingInterrupted("processing interrupted")


@contextlib.contextmanager
def cancel_at_shared_points():
    """Inside: a cancel that ComfyUI's cast layers see (0.33 checks the flag in every layer forward,
    comfy.ops.run_every_op) stays pending instead of raising, until the next `check_interrupt`. A parallel job (rank 0)
    runs inside this, so a cancel stops every rank together at its shared interrupt point rather than rank 0 alone
    between two collectives (the workers would wait in the next one). Nothing changes outside ComfyUI or on 0.3.64."""
    check = getattr(_ops, "run_every_op", None)
    if check is None or getattr(check, "omnivideo_deferring", False):
        yield
        return

    def run_every_op():
        try:
            check()
        except _mm.InterruptProcessingException:
            _mm.interrupt_current_processing(True)  # the check consumed the flag: set it again for the shared point

    run_every_op.omnivideo_deferring = True  # type: ignore[attr-defined]
    _ops.run_every_op = run_every_op
    try:
        yield
    finally:
        _ops.run_every_op = check


class ProgressBar:
    """ComfyUI's progress bar when running inside ComfyUI, else a no-op counter.

    Each `update` is also a cancel point, as in ComfyUI.
    """

    def __init__(self, total: int):
        self.total = total
        self.current = 0
        self._bar = _comfy_utils.ProgressBar(total) if HAS_COMFY else None

    PREVIEW_MAX_SIZE = 512  # longest side of a preview, as core's latent previews

    def update(self, n: int = 1, preview=None) -> None:
        """Advance by `n`; `preview` (a PIL image) is shown on the running node and sent to websocket clients."""
        self.current += n
        if self._bar is not None:
            self._bar.update_absolute(
                self.current, self.total, None if preview is None else ("JPEG", preview, self.PREVIEW_MAX_SIZE)
            )
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


_unload_callbacks: list = []


def on_unload_models(callback) -> None:
    """Call `callback()` whenever ComfyUI unloads all models ("Unload models" in the UI, `/free` with
    unload_models): what we hold outside its model list (parallel workers) goes too. ComfyUI has no hook for this, so
    its `unload_all_models` is wrapped once."""
    _unload_callbacks.append(callback)
    if not HAS_COMFY or getattr(_mm.unload_all_models, "omnivideo_wrapped", False):
        return
    original = _mm.unload_all_models

    def unload_all_models(*args, **kwargs):
        for hook in list(_unload_callbacks):
            try:
                hook()
            except Exception:
                log.exception("OmniVideo: an unload hook failed")
        return original(*args, **kwargs)

    unload_all_models.omnivideo_wrapped = True  # type: ignore[attr-defined]
    _mm.unload_all_models = unload_all_models


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


def video_from_file(path: str):
    """Core's VIDEO value for a video file (what Load Video gives), so Save Video / Get Video Components take it.
    Through the public `comfy_api.latest.InputImpl` (0.3.64 and newer), not the internal module behind it."""
    from comfy_api.latest import InputImpl

    return InputImpl.VideoFromFile(path)


def diffusion_model_wrapper_type() -> str:
    """ComfyUI's wrapper slot around the diffusion model's forward (WrappersMP.DIFFUSION_MODEL)."""
    try:
        from comfy.patcher_extension import WrappersMP

        return WrappersMP.DIFFUSION_MODEL
    except Exception:
        return "diffusion_model"


def outer_sample_wrapper_type() -> str:
    """ComfyUI's wrapper slot around a whole sampling run (WrappersMP.OUTER_SAMPLE: its executor's class_obj is the
    guider, with the run's conds)."""
    try:
        from comfy.patcher_extension import WrappersMP

        return WrappersMP.OUTER_SAMPLE
    except Exception:
        return "outer_sample"


def attention_override_supported() -> bool:
    """Whether this ComfyUI honours transformer_options["optimized_attention_override"] (0.3.6x+)."""
    try:
        import comfy.ldm.modules.attention as attn

        return hasattr(attn, "wrap_attn")
    except Exception:
        return False


# ------------------------------------------------------------------ model management


class ManagedModule(torch.nn.Module):
    """What a ModelPatcher holds for us: ComfyUI writes bookkeeping attributes (`device`, `model_lowvram`, ...)
    on its model, which diffusers and transformers models would refuse (their `device` is a property), so the
    network sits one level down, under `module`."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


class _StandalonePatcher:
    """ModelPatcher's part we use, outside ComfyUI (scripts, unit tests): loading is a plain `.to`."""

    def __init__(self, model: ManagedModule, load_device: torch.device, offload_device: torch.device):
        self.model, self.load_device, self.offload_device = model, load_device, offload_device


def _devices(kind: str, default: torch.device) -> tuple[torch.device, torch.device]:
    """(load, offload) device ComfyUI assigns to a model of `kind` (its --cpu/--gpu-only/... flags included)."""
    if not HAS_COMFY:
        return default, torch.device("cpu")
    load, offload = {
        "diffusion": (_mm.get_torch_device, _mm.unet_offload_device),
        "text_encoder": (_mm.text_encoder_device, _mm.text_encoder_offload_device),
        "vae": (_mm.vae_device, _mm.vae_offload_device),
    }[kind]
    return load(), offload()


def manage(module: torch.nn.Module, kind: str, default_device: torch.device):
    """Hand `module` to ComfyUI's model management: returns its ModelPatcher (`.model.module` is `module`).

    `kind` ('diffusion', 'text_encoder' or 'vae') picks ComfyUI's devices for it; `default_device` is where
    it runs outside ComfyUI. The module should be on the offload device (CPU) already.
    """
    load, offload = _devices(kind, default_device)
    holder = ManagedModule(module)
    if HAS_COMFY:
        return _model_patcher.ModelPatcher(holder, load_device=load, offload_device=offload)
    return _StandalonePatcher(holder, load, offload)


def add_lora(patcher, lora: dict, key_map: dict, strength: float):
    """A clone of ComfyUI's `patcher` with a LoRA's patches added at `strength`, as core's LoraLoaderModelOnly does
    (`comfy.lora.load_lora` reads `lora` through `key_map`: LoRA name -> the patcher's state dict key). Unmerged:
    ComfyUI applies them whenever it loads the weights. Raises when a key reaches no weight."""
    patches = _lora.load_lora(lora, key_map, log_missing=False)
    clone = patcher.clone()
    added = set(clone.add_patches(patches, strength))
    missing = sorted(set(key_map.values()) - added)
    if missing:
        raise ValueError(f"ComfyUI's model patcher has no weight for {', '.join(missing[:8])}")
    return clone


def device_clones(patcher, devices: list) -> dict:
    """{device: diffusion model} of ComfyUI's own copies of a MODEL on other devices (core >= 0.33:
    `deepclone_multigpu` rebuilds the weights from the loader's own factory). They sit in the MODEL's "multigpu"
    additional models, so ComfyUI loads them with it, gives them the MODEL's patches before each run
    (`match_multigpu_clones`: LoRAs loaded after this too) and unloads them with it; they are not MultiGPU *base*
    clones, so core's CFG split stays off. Raises where this ComfyUI cannot copy a MODEL per device."""
    if not hasattr(patcher, "deepclone_multigpu"):
        raise ValueError(
            "this ComfyUI cannot copy a model to other devices (ModelPatcher.deepclone_multigpu came with ComfyUI "
            "0.33's comfy/multigpu.py): update ComfyUI to split a model over several GPUs"
        )
    clones = list(patcher.get_additional_models_with_key("multigpu"))
    if any(getattr(c, "is_multigpu_base_clone", False) for c in clones):
        raise ValueError("this MODEL already went through ComfyUI's MultiGPU CFG Split: use that or this node")
    have = {c.load_device for c in clones}
    clones += [patcher.deepclone_multigpu(new_load_device=d) for d in devices if d not in have]
    patcher.set_additional_models("multigpu", clones)
    patcher.match_multigpu_clones()
    return {c.load_device: c.model.diffusion_model for c in patcher.get_additional_models_with_key("multigpu")}


def load_models(patchers: list, memory_required: int = 0) -> None:
    """Bring models to their load device through ComfyUI (evicting others, loading partially if the budget
    says so); `memory_required` is the activation memory the caller's run needs beside the weights."""
    if HAS_COMFY:
        _mm.load_models_gpu(patchers, memory_required=memory_required)
        return
    for patcher in patchers:
        patcher.model.to(patcher.load_device)


def loaded(patcher, memory_required: int = 0) -> Any:
    """The network of `patcher` (whatever class it is), brought to `patcher.load_device` through ComfyUI (see
    `load_models`)."""
    load_models([patcher], memory_required)
    return patcher.model.module


def operations(weight_dtype: torch.dtype, compute_dtype: torch.dtype, load_device: torch.device):
    """The layer classes a model is built with (`operations=`): ComfyUI's, so its model management can
    leave some weights on the offload device and cast them per forward; torch.nn outside ComfyUI."""
    if HAS_COMFY:
        return _ops.pick_operations(weight_dtype, compute_dtype, load_device=load_device)
    if weight_dtype != compute_dtype:
        raise RuntimeError(
            f"storing weights in {weight_dtype} and computing in {compute_dtype} needs ComfyUI's cast layers; "
            "run inside ComfyUI or pick the compute dtype"
        )
    return torch.nn


_CASTABLE = ("Linear", "Conv1d", "Conv2d", "Conv3d", "GroupNorm", "LayerNorm", "RMSNorm", "Embedding")


def make_castable(module: torch.nn.Module, ops) -> int:
    """Give a model built by another library (diffusers, transformers) ComfyUI's cast layers in place: each
    plain torch layer becomes the same-named class of `ops` (a subclass of it: same parameters, same
    forward until ComfyUI asks for casting). Returns how many layers changed; nothing happens outside ComfyUI."""
    if ops is torch.nn or not HAS_COMFY:
        return 0
    swaps = {getattr(torch.nn, name): getattr(ops, name) for name in _CASTABLE}
    changed = 0
    for sub in module.modules():
        cls = swaps.get(type(sub))
        if cls is not None:
            sub.__class__ = cls
            if not hasattr(sub, "bias"):  # torch's RMSNorm / Embedding have none; the cast path reads it
                sub.register_parameter("bias", None)
            changed += 1
    return changed
