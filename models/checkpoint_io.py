"""Reading weight files and small config files safely, with errors that name the file and say what to do.

Nothing here unpickles code: `.pt` files go through `torch.load(weights_only=True)` and a refusal of
ours (never torch's hint to retry with weights_only=False); `.safetensors` is preferred everywhere.
Header-only reads are bounded, so listing a models folder costs little time and memory.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from collections.abc import Callable
from typing import TypeVar

import torch

from .. import compat

MAX_HEADER_BYTES = 64 << 20  # a safetensors header larger than this is refused (real ones are < 10 MB)
MAX_CONFIG_BYTES = 1 << 20
ZIP_MAGIC = b"PK\x03\x04"  # torch.save since 1.6
PICKLE_PROTO = b"\x80"  # legacy torch.save starts with a pickle protocol opcode


LIST_LIMIT = 12  # keys named per category in a mismatch message


class CheckpointError(ValueError):
    """The file is not a usable checkpoint; the message names it and says what to do."""


def check_state_dict(
    expected: dict[str, tuple[int, ...]],
    found: dict[str, torch.Tensor],
    title: str,
    advice: str,
    error: type[Exception] = CheckpointError,
) -> None:
    """The one strict check of every loader: every expected key present, nothing extra, every shape right.
    Otherwise one error, `title`, then the missing / unexpected / wrong-shape keys (counted, the first few named)
    and `advice` (what to do)."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    wrong = sorted(
        f"{k} {tuple(found[k].shape)} (expected {tuple(expected[k])})"
        for k in expected.keys() & found.keys()
        if tuple(found[k].shape) != tuple(expected[k])
    )
    if not (missing or unexpected or wrong):
        return

    def listing(what: str, items: list[str]) -> str:
        more = f", ... (+{len(items) - LIST_LIMIT} more)" if len(items) > LIST_LIMIT else ""
        return f"\n  {what} ({len(items)}): {', '.join(items[:LIST_LIMIT])}{more}" if items else ""

    raise error(
        f"{title} ({len(expected)} keys expected, {len(found)} found):"
        + listing("missing", missing)
        + listing("unexpected", unexpected)
        + listing("wrong shape", wrong)
        + f"\n{advice}"
    )


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def build_strict(
    make: Callable[[], ModuleT],
    state_dict: dict[str, torch.Tensor],
    title: str,
    advice: str,
    error: type[Exception] = CheckpointError,
) -> ModuleT:
    """The one strict checkpoint load: `make()` on the meta device (no random init of billions of weights), the
    strict key/shape check with one message (`check_state_dict`), then the tensors assigned, not copied."""
    with torch.device("meta"):
        model = make()
    check_state_dict(expected_shapes(model), state_dict, title, advice, error)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a model's state dict (built once; works on the meta device)."""
    return {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}


# ComfyUI's model folders the pack's nodes pick files and folders from (integration/safe_paths resolves names there)
MODEL_KINDS = ("diffusers", "diffusion_models", "text_encoders")
SHOWN_PARTS = 3  # parts of a path outside ComfyUI's folders that a message shows (my_h3/vae/weights.safetensors)


def shown_name(path: str | os.PathLike) -> str:
    """How a message names a model file or folder: as the user picks it, relative to ComfyUI's folder for its kind
    (diffusers/my_h3/vae/diffusion_pytorch_model.safetensors). Never an absolute path: node errors and texts reach
    ComfyUI's /history. Outside ComfyUI's folders (standalone use, a torchrun worker): its last SHOWN_PARTS parts."""
    path = os.path.abspath(path)
    under = [(root, kind) for kind in MODEL_KINDS for root in map(os.path.abspath, compat.model_folder_roots(kind))]
    for root, kind in sorted(under, key=lambda rk: -len(rk[0])):  # the deepest root holding it
        if _is_under(path, root):
            return "/".join([kind, *_split(os.path.relpath(path, root))])
    return "/".join(_split(path)[-SHOWN_PARTS:])


def shown_in(text: str, path: str | os.PathLike) -> str:
    """Another library's message (transformers names the absolute folder) with `path` named as `shown_name` does."""
    return text.replace(os.path.abspath(path), shown_name(path))


def files_missing(what: str, folder: str | os.PathLike, exc: OSError) -> FileNotFoundError:
    """transformers' `from_pretrained` failing on a local folder, as an error that names the folder as picked."""
    return FileNotFoundError(f"{what} files missing under {shown_name(folder)}: {shown_in(str(exc), folder)}")


def _is_under(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # another drive (Windows)
        return False


def _split(path: str) -> list[str]:
    return [p for p in path.replace(os.sep, "/").split("/") if p not in ("", ".")]


def _damaged(path: str, kind: str, err: BaseException | str) -> CheckpointError:
    detail = err if isinstance(err, str) else (str(err).splitlines() or [type(err).__name__])[0][:200]
    return CheckpointError(
        f"{shown_name(path)} cannot be read as {kind} ({detail}). The file is damaged or "
        "incomplete (an interrupted download or copy?): download it again."
    )


def safetensors_keys(path: str) -> list[str]:
    """Tensor names from a .safetensors header, reading only the header (bounded)."""
    return [k for k in _safetensors_header(path) if k != "__metadata__"]


def check_safetensors(path: str) -> None:
    """Raise if the header does not describe the whole file (a truncated download), reading only the header:
    a cheap check to run on every file before loading any."""
    header = _safetensors_header(path)
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, ValueError, IndexError):
        raise _damaged(path, ".safetensors", "the header's data_offsets are malformed") from None
    data = os.path.getsize(path) - 8 - _header_size(path)
    if end != data:
        raise _damaged(path, ".safetensors", f"the header describes {end} bytes of tensors, the file holds {data}")


def _header_size(path: str) -> int:
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise _damaged(path, ".safetensors", "shorter than its 8-byte header length")
    return struct.unpack("<Q", head)[0]


def _safetensors_header(path: str) -> dict:
    size = _header_size(path)
    with open(path, "rb") as f:
        f.seek(8)
        if size > MAX_HEADER_BYTES or size > os.fstat(f.fileno()).st_size - 8:
            raise _damaged(path, ".safetensors", f"header length {size} does not fit the file")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _damaged(path, ".safetensors", f"header is not JSON: {err}") from None
    if not isinstance(header, dict) or not all(
        isinstance(v, dict) and "data_offsets" in v for k, v in header.items() if k != "__metadata__"
    ):
        raise _damaged(path, ".safetensors", "header is not a safetensors tensor table")
    return header


def safetensors_metadata(path: str) -> dict[str, str]:
    """The free-form `__metadata__` strings of a .safetensors header (bounded read)."""
    meta = _safetensors_header(path).get("__metadata__")
    return meta if isinstance(meta, dict) else {}


def read_safetensors(path: str, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file on CPU: all, or those whose name `keep` accepts (the others are never
    read, so taking the transformer out of an all-in-one checkpoint costs only its own bytes)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        if keep is None:
            return load_file(str(path), device="cpu")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep(k)}
    except FileNotFoundError:
        raise CheckpointError(f"{shown_name(path)} does not exist (any more).") from None
    except (SafetensorError, OSError) as err:
        raise _damaged(str(path), ".safetensors", err) from None


def read_torch_file(path: str):
    """A torch.save file (zip or legacy), weights only: a pickle that would run code is refused, not run."""
    name = shown_name(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head != ZIP_MAGIC and head[:1] != PICKLE_PROTO:
        raise CheckpointError(
            f"{name} is not a PyTorch checkpoint: it starts with {head!r}, not a torch.save "
            "archive. Use the released .pt file or a .safetensors file."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=head == ZIP_MAGIC)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{name}: refused to load. The file holds Python objects other than tensors (a pickle that could "
            "run code), so it was not unpickled. Use the released .pt or a .safetensors file."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, struct.error) as err:
        raise _damaged(path, "a PyTorch checkpoint", type(err).__name__) from None


def read_json(path: str) -> dict:
    """A small JSON object (config.json); refuses files over MAX_CONFIG_BYTES."""
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise CheckpointError(
            f"{shown_name(path)} is larger than {MAX_CONFIG_BYTES >> 20} MiB; it is not a config file."
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{shown_name(path)} is not valid JSON ({err}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{shown_name(path)} does not hold a JSON object.")
    return data


SCALED_FP8_MARKER = "scaled_fp8"  # ComfyUI's scaled-fp8 checkpoints: fp8 weights + per-layer `scale_weight`


def dequantize_scaled_fp8(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A scaled-fp8 state dict (as core's loaders read it: `<layer>.weight` in fp8, `<layer>.scale_weight`, an
    optional `<layer>.scale_input`, the `scaled_fp8` marker) -> plain weights in `dtype`; other dicts as they are.
    Our layers may fuse or re-lay out weights, so the scale is folded in once, at load."""
    if SCALED_FP8_MARKER not in sd:
        return sd
    out = {}
    for key, tensor in sd.items():
        if key == SCALED_FP8_MARKER or key.endswith((".scale_weight", ".scale_input")):
            continue
        scale = sd.get(key[: -len("weight")] + "scale_weight") if key.endswith(".weight") else None
        out[key] = (tensor.to(torch.float32) * scale.to(torch.float32)).to(dtype) if scale is not None else tensor
    return out


COMFY_QUANT_SUFFIX = ".comfy_quant"  # core's mixed-precision checkpoints: a per-layer JSON config as uint8 bytes
COMFY_QUANT_METADATA = "_quantization_metadata"  # ... or all layers' configs in the header's metadata
PER_TENSOR_FLOAT8 = {"float8_e4m3fn", "float8_e5m2"}


def comfy_quant_layers(sd: dict[str, torch.Tensor], metadata: dict[str, str], source: str) -> dict[str, dict]:
    """Layer name -> quantization config of a core mixed-precision checkpoint (empty for any other file)."""
    try:
        if COMFY_QUANT_METADATA in metadata:
            layers = json.loads(metadata[COMFY_QUANT_METADATA])["layers"]
        else:
            layers = {
                k[: -len(COMFY_QUANT_SUFFIX)]: json.loads(bytes(v.tolist()))
                for k, v in sd.items()
                if k.endswith(COMFY_QUANT_SUFFIX)
            }
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as err:
        raise _damaged(
            source, "a quantized checkpoint", f"its layer quantization configs do not parse ({err})"
        ) from None
    if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
        raise _damaged(source, "a quantized checkpoint", "its layer quantization configs are not objects")
    return layers


def dequantize_comfy_quant(
    sd: dict[str, torch.Tensor], layers: dict[str, dict], dtype: torch.dtype, source: str
) -> dict[str, torch.Tensor]:
    """Core's mixed-precision checkpoint (`comfy_quant_layers`) -> plain weights in `dtype`, the way core's own
    per-tensor fp8 layout dequantizes (weight · weight_scale, here in fp32 then cast once). Block-scaled and integer
    formats (nvfp4, mxfp8, int8, w4a4/w4a8) are refused by name: our layers fuse and re-lay out weights at load."""
    if not layers:
        return sd
    other = sorted({str(c.get("format")) for c in layers.values()} - PER_TENSOR_FLOAT8)
    if other:
        layer = next(k for k, c in layers.items() if str(c.get("format")) in other)
        raise CheckpointError(
            f"{shown_name(source)} is quantized as {', '.join(other)} (layer {layer}, ...); OmniVideo reads only "
            "bf16 / fp16 / fp32 files and fp8 ones with per-tensor scales (float8_e4m3fn, float8_e5m2). Use that "
            "file of the model (e.g. the bf16 or fp8_scaled one), or core's Load Diffusion Model for this one."
        )
    out = {}
    for key, tensor in sd.items():
        if key.endswith((COMFY_QUANT_SUFFIX, ".weight_scale", ".input_scale")) and key.rsplit(".", 1)[0] in layers:
            continue
        layer = key.removesuffix(".weight")
        if key.endswith(".weight") and layer in layers:
            scale = sd.get(f"{layer}.weight_scale")
            if scale is None or scale.numel() != 1:
                raise _damaged(source, "a quantized checkpoint", f"{layer}.weight_scale is missing or not one value")
            tensor = (tensor.to(torch.float32) * scale.to(torch.float32)).to(dtype)
        out[key] = tensor
    return out


def store_weights(
    sd: dict[str, torch.Tensor], weight_dtype: torch.dtype, compute_dtype: torch.dtype, quantized: Callable[[str], bool]
) -> dict[str, torch.Tensor]:
    """Cast a state dict for storage: the matrices `quantized(key)` selects go to `weight_dtype` (fp8 storage),
    everything else (norms, biases, the layers at the model's edges) to `compute_dtype`."""
    low = weight_dtype != compute_dtype
    return {
        k: v.to(weight_dtype if low and v.dim() == 2 and quantized(k) else compute_dtype)
        if v.is_floating_point()
        else v
        for k, v in sd.items()
    }
