"""OmniDreams text nodes: the Cosmos-Reason1 text encoder loader, text encode, the prompt schedule and a precomputed
embedding; each gives the OmniDreams conditioning the sampler and stream nodes read."""

from __future__ import annotations

from functools import partial

from .. import compat
from ..backends import DTYPE_CHOICES, PLACEMENT_CHOICES, PLATFORM, placement_device, resolve_dtype
from ..compat import io
from ..integration import safe_paths
from ..models.handles import OmniDreamsConditioning, check_family
from ..models.omnidreams.text import (
    TextEncoder,
    embedding_bytes,
    embedding_problem,
    encode_prompt,
    encoder_folder_problem,
    load_embedding,
    load_text_encoder,
    save_embedding,
)
from ..pipelines.omnidreams import MAX_PROMPT_SCHEDULE_BYTES, encode_prompt_schedule, parse_prompt_schedule
from .input_checks import checks_inputs, unless_blank
from .types import ConditioningType, TextEncoderType

EMBEDDING_EXTS = (".safetensors",)


def _encoder_folder(name: str) -> str:
    return safe_paths.resolve_model_folder("text_encoders", name, encoder_folder_problem, what="folder")


def _embedding(name: str) -> str:
    return safe_paths.resolve_model_file("text_encoders", name, EMBEDDING_EXTS, embedding_problem, what="embedding")


def _check_encoder(text_encoder, node: str) -> None:
    if not isinstance(text_encoder, TextEncoder):
        raise ValueError(
            f"{node} needs the OmniDreams Text Encoder Loader's output (Cosmos-Reason1), got "
            f"{type(text_encoder).__name__}"
        )


def check_conditioning(conditioning) -> None:
    """An OmniDreams conditioning, or a clear error naming the nodes that make one."""
    check_family(conditioning, "omnidreams", "conditioning", "use OmniDreams Text Encode or Load Text Embedding")


@checks_inputs(folder=_encoder_folder, combos=("dtype", "device"))
class OmniDreamsTextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsTextEncoderLoader",
            display_name="OmniVideo OmniDreams Text Encoder Loader",
            category="OmniVideo/OmniDreams",
            description=(
                "Loads Cosmos-Reason1 (Qwen2.5-VL, 7B) from a folder under models/text_encoders "
                "(config.json, weights, tokenizer files). Heavy: precompute embeddings once and use "
                "OmniDreams Load Text Embedding when memory is short, or run it on the CPU (device 'cpu', dtype "
                "bf16: ~16 GB of RAM instead of GPU memory; a prompt takes seconds there)."
            ),
            inputs=[
                io.Combo.Input(
                    "folder", options=safe_paths.list_model_folders("text_encoders", encoder_folder_problem)
                ),
                io.Combo.Input("dtype", options=list(DTYPE_CHOICES), default="auto"),
                io.Combo.Input(
                    "device",
                    options=list(PLACEMENT_CHOICES),
                    default="default",
                    optional=True,  # absent in workflows saved before it: where ComfyUI puts text encoders
                    tooltip="default: where ComfyUI puts text encoders. cpu: it stays on the CPU, the GPU is the "
                    "DiT's (24-32 GB cards; 'auto' dtype is fp32 there, bf16 halves the RAM).",
                ),
            ],
            outputs=[TextEncoderType.Output(display_name="text_encoder")],
        )

    @classmethod
    def execute(cls, folder, dtype="auto", device="default") -> io.NodeOutput:
        path, pinned = _encoder_folder(folder), placement_device(device)
        runs_on = pinned or PLATFORM.device
        return io.NodeOutput(load_text_encoder(path, resolve_dtype(dtype, runs_on), PLATFORM.device, pinned))


@checks_inputs(save_as=unless_blank(partial(safe_paths.output_file_path, ext=".safetensors")))
class OmniDreamsTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsTextEncode",
            display_name="OmniVideo OmniDreams Text Encode",
            category="OmniVideo/OmniDreams",
            description=(
                "Cosmos-Reason1 'full_concat' prompt embedding [1, 512, 100352]. save_as: if set, also "
                "writes it as .safetensors under ComfyUI's output folder (absolute paths and '..' are "
                "refused; an existing file is kept and a numbered name used instead); move it to "
                "models/text_encoders for OmniDreams Load Text Embedding."
            ),
            inputs=[
                TextEncoderType.Input("text_encoder"),
                io.String.Input("prompt", multiline=True, default=""),
                io.String.Input("save_as", default="", tooltip="Optional file name, e.g. my_prompt.safetensors."),
            ],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, text_encoder, prompt, save_as="") -> io.NodeOutput:
        _check_encoder(text_encoder, "OmniDreams Text Encode")
        save = bool(save_as and save_as.strip())
        if save:
            safe_paths.output_file_path(save_as, ".safetensors")  # a bad name fails before the heavy encode
        embedding = encode_prompt(text_encoder, prompt)
        if save:
            path = safe_paths.write_output_file(
                save_as, ".safetensors", lambda tmp: save_embedding(tmp, embedding, prompt)
            )
            compat.log.info("OmniDreams: saved the prompt embedding to %s", path)
        return io.NodeOutput(OmniDreamsConditioning(text=embedding))


@checks_inputs(schedule=parse_prompt_schedule)
class OmniDreamsPromptSchedule(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsPromptSchedule",
            **compat.search_aliases("prompt travel", "prompt schedule"),
            display_name="OmniVideo OmniDreams Prompt Schedule",
            category="OmniVideo/OmniDreams",
            description=(
                "Switches the prompt during the rollout: '0: a car at dusk, 40: rain starts' uses the first prompt for "
                "chunks 0-39 and the second from chunk 40 on (a chunk is 8 frames, 0.27 s at 30 fps). An entry starts "
                "with '<chunk>:' at the beginning, after a comma or on a new line. Each distinct prompt is encoded "
                f"once (at most {MAX_PROMPT_SCHEDULE_BYTES // 2**30} GiB of embeddings: 20 distinct prompts of "
                "Cosmos-Reason1 7B); the first frame and HD-map of the conditioning are kept."
            ),
            inputs=[
                ConditioningType.Input("conditioning"),
                TextEncoderType.Input("text_encoder"),
                io.String.Input("schedule", multiline=True, default="0: "),
            ],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, conditioning, text_encoder, schedule) -> io.NodeOutput:
        check_conditioning(conditioning)
        _check_encoder(text_encoder, "OmniDreams Prompt Schedule")
        entries = parse_prompt_schedule(schedule)
        texts = encode_prompt_schedule(entries, partial(encode_prompt, text_encoder), embedding_bytes(text_encoder))
        first = texts.pop(0)[1] if texts[0][0] == 0 else conditioning.text
        return io.NodeOutput(conditioning.replace(text=first, prompt_schedule=tuple(texts)))


@checks_inputs(embedding=_embedding)
class OmniDreamsLoadTextEmbedding(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsLoadTextEmbedding",
            display_name="OmniVideo OmniDreams Load Text Embedding",
            category="OmniVideo/OmniDreams",
            description=(
                "A precomputed prompt embedding (.safetensors from OmniDreams Text Encode's save_as) "
                "from models/text_encoders, instead of running the 7B encoder."
            ),
            inputs=[
                io.Combo.Input(
                    "embedding", options=safe_paths.list_model_files("text_encoders", EMBEDDING_EXTS, embedding_problem)
                )
            ],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, embedding) -> io.NodeOutput:
        return io.NodeOutput(OmniDreamsConditioning(text=load_embedding(_embedding(embedding))))


NODES = [OmniDreamsTextEncoderLoader, OmniDreamsTextEncode, OmniDreamsPromptSchedule, OmniDreamsLoadTextEmbedding]
