"""ComfyUI's model management: the networks we hand it (a ModelPatcher each, LoRA patches, per-device copies), their
loading onto the device it picks, its devices and cached memory, and its "Unload models". Outside ComfyUI a stand-in
patcher keeps the same calls working with plain `.to`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .comfyui import HAS_COMFY, mm, model_patcher
from .comfyui import lora as comfy_lora

log = logging.getLogger("omnivideo")


def comfy_torch_device() -> torch.device | None:
    """ComfyUI's chosen compute device, or None outside ComfyUI."""
    return mm.get_torch_device() if HAS_COMFY else None


def intermediate_device(default: torch.device) -> torch.device:
    """Where ComfyUI keeps IMAGE/LATENT tensors between nodes (CPU by default)."""
    return mm.intermediate_device() if HAS_COMFY else default


def free_memory() -> None:
    """Return cached allocator blocks after a heavy node."""
    if HAS_COMFY:
        mm.soft_empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


_unload_callbacks: list = []


def on_unload_models(callback) -> None:
    """Call `callback()` whenever ComfyUI unloads all models ("Unload models" in the UI, `/free` with
    unload_models): what we hold outside its model list (parallel workers) goes too. ComfyUI has no hook for this, so
    its `unload_all_models` is wrapped once."""
    _unload_callbacks.append(callback)
    if not HAS_COMFY or getattr(mm.unload_all_models, "omnivideo_wrapped", False):
        return
    original = mm.unload_all_models

    def unload_all_models(*args, **kwargs):
        for hook in list(_unload_callbacks):
            try:
                hook()
            except Exception:
                log.exception("OmniVideo: an unload hook failed")
        return original(*args, **kwargs)

    unload_all_models.omnivideo_wrapped = True  # type: ignore[attr-defined]
    mm.unload_all_models = unload_all_models


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
        "diffusion": (mm.get_torch_device, mm.unet_offload_device),
        "text_encoder": (mm.text_encoder_device, mm.text_encoder_offload_device),
        "vae": (mm.vae_device, mm.vae_offload_device),
    }[kind]
    return load(), offload()


def manage(module: torch.nn.Module, kind: str, default_device: torch.device, pinned: torch.device | None = None):
    """Hand `module` to ComfyUI's model management: returns its ModelPatcher (`.model.module` is `module`).

    `kind` ('diffusion', 'text_encoder' or 'vae') picks ComfyUI's devices for it; `default_device` is where
    it runs outside ComfyUI; `pinned`: it loads and offloads there instead (core's loaders' device 'cpu'). The module
    should be on the offload device (CPU) already.
    """
    load, offload = (pinned, pinned) if pinned is not None else _devices(kind, default_device)
    holder = ManagedModule(module)
    if HAS_COMFY:
        return model_patcher.ModelPatcher(holder, load_device=load, offload_device=offload)
    return _StandalonePatcher(holder, load, offload)


def add_lora(patcher, lora: dict, key_map: dict, strength: float):
    """A clone of ComfyUI's `patcher` with a LoRA's patches added at `strength`, as core's LoraLoaderModelOnly does
    (`comfy.lora.load_lora` reads `lora` through `key_map`: LoRA name -> the patcher's state dict key). Unmerged:
    ComfyUI applies them whenever it loads the weights. Raises when a key reaches no weight."""
    patches = comfy_lora.load_lora(lora, key_map, log_missing=False)
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
        mm.load_models_gpu(patchers, memory_required=memory_required)
        return
    for patcher in patchers:
        patcher.model.to(patcher.load_device)


def loaded(patcher, memory_required: int = 0) -> Any:
    """The network of `patcher` (whatever class it is), brought to `patcher.load_device` through ComfyUI (see
    `load_models`)."""
    load_models([patcher], memory_required)
    return patcher.model.module
