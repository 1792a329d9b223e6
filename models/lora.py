"""LoRA files on our transformers: read, mapped to our module names, applied the way ComfyUI applies them.

A LoRA adds `strength * alpha / rank * up @ down` to a Linear's weight. Files are safetensors (never a pickle).
- H3: our transformer is diffusers' `MiniMaxH3Transformer3DModel`, so diffusers' own reader converts every format
  (ComfyUI / reference `blocks.N`, ai-toolkit `diffusion_model.`, musubi-tuner `lora_unet_`, DiffSynth's per-head
  interleaved QKV, kohya down/up + alpha, diffusers / peft files); a `__metadata__` alpha is honoured as diffusers does.
- OmniDreams: our DiT's module names are its checkpoint's (Cosmos-Predict2.5), which is what its LoRAs name: with or
  without ComfyUI's `diffusion_model.` / the checkpoint's `net.` / peft's `base_model.model.` prefix, peft's
  `lora_A`/`lora_B` (`.default.` infix too), kohya's `lora_down`/`lora_up` + alpha or its flattened `lora_unet_` names;
  the two layers the loader re-lays (the patch embedder's padding-mask columns, the final layer's rows) get the same.
Inside ComfyUI a LoRA becomes ModelPatcher patches (unmerged: applied when ComfyUI loads the weights, fp8 and partial
loading included); outside it, and on parallel workers, `merge` adds the same float32 sums to the weights.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from dataclasses import dataclass, field

import torch

from .. import compat
from .checkpoint_io import read_safetensors, safetensors_metadata, shown_name
from .omnidreams.loader import final_rows_to_model

log = logging.getLogger("omnivideo")

EXTS = (".safetensors",)
SHOWN_KEYS = 8  # unmatched keys a message names
_PAIR = re.compile(r"^(.*?)\.(lora_A|lora_B|lora_down|lora_up)(?:\.default)?\.weight$|^(.*?)\.(alpha)$")
_DOWN = ("lora_A", "lora_down")
_AI_TOOLKIT = "diffusion_model."  # a prefix diffusers' H3 converter takes off
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "net.")  # OmniDreams' producers


class LoraError(ValueError):
    pass


@dataclass(frozen=True)
class LowRank:
    down: torch.Tensor  # [rank, in]
    up: torch.Tensor  # [out, rank]
    alpha: float  # the delta is scaled by alpha / rank


@dataclass
class Lora:
    name: str  # the file as the user picked it
    weights: dict[str, LowRank]  # by the transformer's parameter name ("transformer_blocks.0.attn.to_q.weight")
    unmatched: list[str] = field(default_factory=list)  # the file's keys that name nothing in the model

    def describe(self) -> str:
        text = f"LoRA {self.name}: {len(self.weights)} weights"
        if self.unmatched:
            text += f"; {len(self.unmatched)} keys match nothing in the model: {_some(self.unmatched)}"
        return text


def _some(keys: list[str]) -> str:
    more = len(keys) - SHOWN_KEYS
    return ", ".join(sorted(keys)[:SHOWN_KEYS]) + (f" … and {more} more" if more > 0 else "")


def read(path: str, family: str, transformer: torch.nn.Module) -> Lora:
    """The LoRA file at `path` on `transformer` of `family` ('h3' / 'omnidreams'). Refuses a file none of whose keys
    fit the model, or whose shapes do not; leftovers are logged by name (and listed by `Lora.describe`)."""
    name = shown_name(path)
    if not str(path).lower().endswith(EXTS):
        raise LoraError(f"{name}: only .safetensors LoRA files are read")
    sd = read_safetensors(str(path))
    metadata = safetensors_metadata(str(path))
    modules, unmatched = (_h3_modules if family == "h3" else _omnidreams_modules)(sd, metadata, transformer)
    weights = {}
    for module, low_rank in modules.items():
        target = _linear_weight(transformer, module)
        if target is None:
            unmatched.append(module)
            continue
        weights[module + ".weight"] = _fitted(low_rank, target, module, name)
    if not weights:
        raise LoraError(
            f"{name} is not a LoRA for this {family} model: none of its {len(sd)} keys names one of its layers "
            f"({_some(unmatched or list(sd))}). Pick a LoRA trained for {family}."
        )
    lora = Lora(name, weights, sorted(unmatched))
    if lora.unmatched:
        log.warning("OmniVideo: %s", lora.describe())
    return lora


def _linear_weight(transformer: torch.nn.Module, module: str) -> torch.Tensor | None:
    try:
        weight = transformer.get_submodule(module).weight
    except AttributeError:
        return None
    return weight if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None


def _fitted(low_rank: LowRank, weight: torch.Tensor, module: str, name: str) -> LowRank:
    down, up = low_rank.down, low_rank.up
    if down.ndim != 2 or up.ndim != 2 or (up.shape[0], down.shape[1]) != tuple(weight.shape):
        raise LoraError(
            f"{name}: the LoRA of {module} (up {tuple(up.shape)}, down {tuple(down.shape)}) does not fit its weight "
            f"{tuple(weight.shape)}; the LoRA was trained for another model size or variant."
        )
    return low_rank


def _groups(sd: dict[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """The file's keys by the module they adapt; keys that are no LoRA factor or alpha come back apart."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    other = []
    for key, value in sd.items():
        m = _PAIR.match(key)
        if m is None:
            other.append(key)
        else:
            groups.setdefault(m.group(1) or m.group(3), {})[key] = value
    return groups, other


def _h3_modules(sd, metadata, transformer) -> tuple[dict[str, LowRank], list[str]]:
    """diffusers' MiniMax-H3 reader on the file's LoRA keys; when it refuses some (it converts all or nothing), module
    by module, so what it cannot convert is named rather than fatal."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin  # here: OmniDreams never imports diffusers

    groups, unmatched = _groups(sd)
    network_alpha = _metadata_alpha(metadata) if not any(k.endswith(".alpha") for k in sd) else None
    try:
        return _low_ranks(MiniMaxH3LoraLoaderMixin.lora_state_dict(_flat(groups)), network_alpha), unmatched
    except (ValueError, KeyError):  # only its converter of the original names raises: this is such a file
        pass
    out: dict[str, LowRank] = {}
    for keys in groups.values():
        try:  # the prefix keeps a lone module of the original names (condition_proj) read as one
            converted = MiniMaxH3LoraLoaderMixin.lora_state_dict(
                {k if k.startswith(_AI_TOOLKIT) else _AI_TOOLKIT + k: v for k, v in keys.items()}
            )
        except (ValueError, KeyError):
            unmatched += keys
            continue
        out.update(_low_ranks(converted, network_alpha))
    return out, unmatched


def _flat(groups: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: v for keys in groups.values() for k, v in keys.items()}


def _low_ranks(converted: dict[str, torch.Tensor], network_alpha: float | None) -> dict[str, LowRank]:
    """diffusers' `transformer.<module>.lora_A/B.weight` pairs by module. The reader folds per-module alphas into the
    factors: alpha = rank, unless the file states one network alpha."""
    out = {}
    for key, down in converted.items():
        if ".lora_A." in key:
            up = converted[key.replace(".lora_A.", ".lora_B.")]
            module = key.split(".lora_A.")[0].removeprefix("transformer.")
            out[module] = LowRank(down, up, float(down.shape[0]) if network_alpha is None else network_alpha)
    return out


def _metadata_alpha(metadata: dict) -> float | None:
    """The network alpha some H3 files record in `__metadata__` (diffusers' `lora_state_dict` honours it)."""
    try:
        return float(metadata["alpha"])
    except (KeyError, ValueError):
        return None


def _omnidreams_modules(sd, metadata, transformer) -> tuple[dict[str, LowRank], list[str]]:
    groups, unmatched = _groups(sd)
    flat = {name.replace(".", "_"): name for name, _ in transformer.named_modules() if name}
    out: dict[str, LowRank] = {}
    for base, keys in groups.items():
        module = base
        for prefix in _PREFIXES:
            module = module.removeprefix(prefix)
        if module.startswith("lora_unet_"):
            module = flat.get(module.removeprefix("lora_unet_"), module)
        factors = {_PAIR.match(k).group(2): v for k, v in keys.items() if not k.endswith(".alpha")}  # type: ignore[union-attr]
        down = next((factors[r] for r in _DOWN if r in factors), None)
        up = factors.get("lora_B", factors.get("lora_up"))
        if down is None or up is None:
            unmatched += keys
            continue
        alpha = keys.get(base + ".alpha")
        down, up = _omnidreams_layout(module, down, up, transformer.config)
        out[module] = LowRank(down, up, float(down.shape[0]) if alpha is None else alpha.item())
    return out, unmatched


def _omnidreams_layout(module: str, down: torch.Tensor, up: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's two re-laid layers (models/omnidreams/loader.fuse_state_dict), for their LoRA factors."""
    if module == "x_embedder.proj.1" and down.shape[1] == cfg.x_embed_in + cfg.patch_volume:
        down = down[:, : cfg.x_embed_in]  # the padding-mask columns: their input is always zero
    if module == "final_layer.linear":
        up = final_rows_to_model(up, cfg)
    return down, up


# ---------------------------------------------------------------------------------------------------------- applying


def patched(patcher, lora: Lora, strength: float):
    """A patcher of the same network with `lora` at `strength` added; `patcher` is left as it was. ComfyUI's: a clone
    holding unmerged patches. Outside ComfyUI: a merged copy of the network (scripts and tests only)."""
    if compat.HAS_COMFY:
        return compat.add_lora(patcher, *comfy_lora(lora), strength)
    module = copy.deepcopy(patcher.model.module)
    merge(module, [(lora, strength)])
    return compat.manage(module, "diffusion", patcher.load_device)


def comfy_lora(lora: Lora) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(a LoRA state dict in core's own kohya names, core's key map onto the patcher's state dict keys), what
    `comfy.lora.load_lora` reads. The alpha is float64, so its `.item()` is the float `merge` uses."""
    state, key_map = {}, {}
    for weight, low_rank in lora.weights.items():
        base = weight.removesuffix(".weight")
        state[f"{base}.lora_up.weight"] = low_rank.up
        state[f"{base}.lora_down.weight"] = low_rank.down
        state[f"{base}.alpha"] = torch.tensor(low_rank.alpha, dtype=torch.float64)
        key_map[base] = f"module.{weight}"  # compat.ManagedModule holds the network under `module`
    return state, key_map


@torch.no_grad()
def merge(module: torch.nn.Module, loras: list[tuple[Lora, float]]) -> None:
    """Add each LoRA at its strength to `module`'s weights, with ComfyUI's math (`LoRAAdapter.calculate_weight`: the
    weight in float32, each `(strength * alpha / rank) * up @ down` added, one cast back at the end)."""
    touched = {weight for lora, strength in loras if strength for weight in lora.weights}
    for weight_name in sorted(touched):
        param = module.get_parameter(weight_name)
        total = param.data.to(torch.float32, copy=True)
        for lora, strength in loras:
            low_rank = lora.weights.get(weight_name)
            if low_rank is None or not strength:
                continue
            diff = torch.mm(low_rank.up.to(total.device, torch.float32), low_rank.down.to(total.device, torch.float32))
            total += ((strength * (low_rank.alpha / low_rank.down.shape[0])) * diff).type(torch.float32)
        param.data = total.to(param.dtype)


def recipe(path: str, strength: float) -> dict:
    """A LoRA in a model's `load_args` (JSON), for the parallel workers; the modification time tells a replaced file."""
    return {"path": path, "mtime_ns": os.stat(path).st_mtime_ns, "strength": strength}


def merge_recipes(module: torch.nn.Module, family: str, recipes: list[dict]) -> None:
    """A parallel worker's side: the LoRAs of `load_args["loras"]` merged into its freshly loaded transformer."""
    merge(module, [(read(r["path"], family, module), float(r["strength"])) for r in recipes])
