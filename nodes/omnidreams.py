"""OmniDreams nodes: model loader, text encoder loader, text encode / precomputed embedding,
first-frame and HD-map conditioning. Sampling is the shared OmniVideo Sampler node."""

from __future__ import annotations

import os

from .. import compat
from ..backends import DTYPE_CHOICES, PLATFORM, resolve_dtype
from ..compat import io
from ..models.handles import OmniVideoConditioning, OmniVideoModel
from ..models.omnidreams_loader import load_omnidreams
from ..models.omnidreams_text import TextEncoder, encode_prompt, load_embedding, load_text_encoder, save_embedding
from ..pipelines.omnidreams import ARSettings, encode_first_frame, encode_hdmap
from .types import AttentionType, ConditioningType, ModelType, TextEncoderType

FAMILY = "omnidreams"


def _files(folder: str, *exts: str) -> list[str]:
    return [f for f in compat.model_file_list(folder) if f.lower().endswith(exts)]


def _text_encoder_folders() -> list[str]:
    """Sub-folders of models/text_encoders holding a config.json (Hugging Face layout)."""
    return sorted({os.path.dirname(f).replace(os.sep, "/") for f in compat.model_file_list("text_encoders")
                   if os.path.basename(f) == "config.json" and os.path.dirname(f)})


def _check_family(conditioning) -> None:
    if conditioning.family != FAMILY:
        raise ValueError(f"this conditioning is for {conditioning.family}; OmniDreams nodes need OmniDreams "
                         f"conditioning (OmniDreams Text Encode or Load Text Embedding)")


class OmniDreamsModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsModelLoader",
            display_name="OmniDreams Model Loader",
            category="OmniVideo/OmniDreams",
            description=(
                "Loads the OmniDreams (Cosmos-Predict2.5 2B, AR-distilled) DiT from models/diffusion_models "
                "(.pt read with weights_only, or .safetensors). The size is inferred from the weights; every "
                "key and shape is checked. dtype 'auto' = bf16 on GPU/NPU, fp32 on CPU. window/sink set the "
                "rolling KV cache in latent frames (released: 6 and 0)."
            ),
            inputs=[
                io.Combo.Input("ckpt_name", options=_files("diffusion_models", ".pt", ".pth", ".safetensors")),
                io.Combo.Input("dtype", options=list(DTYPE_CHOICES), default="auto"),
                io.Int.Input("window_frames", default=6, min=2, max=64, step=2),
                io.Int.Input("sink_frames", default=0, min=0, max=62, step=2),
                AttentionType.Input("attention", optional=True,
                                    tooltip="From OmniVideo Attention; unconnected = the fastest exact backend (auto)."),
            ],
            outputs=[ModelType.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, window_frames=None, sink_frames=None, **_):
        if window_frames is None or sink_frames is None:  # linked: checked when the node runs
            return True
        try:
            ARSettings(window_frames=window_frames, sink_frames=sink_frames).slots()
        except ValueError as err:
            return str(err)
        return True

    @classmethod
    def execute(cls, ckpt_name, dtype="auto", window_frames=6, sink_frames=0, attention=None) -> io.NodeOutput:
        path = compat.model_file_path("diffusion_models", ckpt_name)
        device = PLATFORM.device
        torch_dtype = resolve_dtype(dtype, device)
        dit = load_omnidreams(path, torch_dtype, device)
        model = OmniVideoModel(FAMILY, dit, torch_dtype, device, attention,
                               extras={"config": dit.config,
                                       "ar": {"window_frames": window_frames, "sink_frames": sink_frames}})
        return io.NodeOutput(model)


class OmniDreamsTextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsTextEncoderLoader",
            display_name="OmniDreams Text Encoder Loader",
            category="OmniVideo/OmniDreams",
            description=("Loads Cosmos-Reason1 (Qwen2.5-VL, 7B) from a folder under models/text_encoders "
                         "(config.json, weights, tokenizer files). Heavy: precompute embeddings once and use "
                         "OmniDreams Load Text Embedding when memory is short."),
            inputs=[
                io.Combo.Input("folder", options=_text_encoder_folders()),
                io.Combo.Input("dtype", options=list(DTYPE_CHOICES), default="auto"),
            ],
            outputs=[TextEncoderType.Output(display_name="text_encoder")],
        )

    @classmethod
    def execute(cls, folder, dtype="auto") -> io.NodeOutput:
        path = os.path.dirname(compat.model_file_path("text_encoders", folder + "/config.json"))
        device = PLATFORM.device
        return io.NodeOutput(load_text_encoder(path, resolve_dtype(dtype, device), device))


class OmniDreamsTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsTextEncode",
            display_name="OmniDreams Text Encode",
            category="OmniVideo/OmniDreams",
            description=("Cosmos-Reason1 'full_concat' prompt embedding [1, 512, 100352]. save_as: if set, also "
                         "writes it as .safetensors under ComfyUI's output folder (absolute paths and names leading "
                         "out of it with '..' are refused); move it to models/text_encoders for OmniDreams Load "
                         "Text Embedding."),
            inputs=[
                TextEncoderType.Input("text_encoder"),
                io.String.Input("prompt", multiline=True, default=""),
                io.String.Input("save_as", default="", tooltip="Optional file name, e.g. my_prompt.safetensors."),
            ],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, text_encoder, prompt, save_as="") -> io.NodeOutput:
        if not isinstance(text_encoder, TextEncoder):
            raise ValueError("OmniDreams Text Encode needs the OmniDreams Text Encoder Loader's output "
                             f"(Cosmos-Reason1), got {type(text_encoder).__name__}")
        path = _embedding_save_path(save_as) if save_as.strip() else None  # checked before the heavy encode
        embedding = encode_prompt(text_encoder, prompt)
        if path is not None:
            save_embedding(path, embedding, prompt)
            compat.log.info("OmniDreams: saved the prompt embedding to %s", path)
        return io.NodeOutput(OmniVideoConditioning(FAMILY, embedding))


def _embedding_save_path(save_as: str) -> str:
    """save_as -> a path under ComfyUI's output folder (sub-folders allowed, '.safetensors' appended).
    Absolute paths and names that lead out of the output folder ('..') are refused."""
    name = save_as.strip()
    name = name if name.endswith(".safetensors") else name + ".safetensors"
    output_dir = os.path.realpath(compat.output_directory())
    if os.path.isabs(name) or os.path.splitdrive(name)[0]:
        raise ValueError(f"save_as must be a file name relative to ComfyUI's output folder ({output_dir}), "
                         f"not an absolute path: {save_as!r}")
    path = os.path.realpath(os.path.join(output_dir, name))
    if os.path.commonpath([output_dir, path]) != output_dir or path == output_dir:
        raise ValueError(f"save_as {save_as!r} leads outside ComfyUI's output folder ({output_dir}); use a plain "
                         f"name such as my_prompt.safetensors or a sub-folder like prompts/my_prompt")
    return path


class OmniDreamsLoadTextEmbedding(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsLoadTextEmbedding",
            display_name="OmniDreams Load Text Embedding",
            category="OmniVideo/OmniDreams",
            description=("A precomputed prompt embedding (.safetensors from OmniDreams Text Encode's save_as) "
                         "from models/text_encoders, instead of running the 7B encoder."),
            inputs=[io.Combo.Input("embedding", options=_files("text_encoders", ".safetensors"))],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, embedding) -> io.NodeOutput:
        path = compat.model_file_path("text_encoders", embedding)
        return io.NodeOutput(OmniVideoConditioning(FAMILY, load_embedding(path)))


def _size_inputs() -> list:
    return [io.Int.Input("width", default=1280, min=16, max=8192, step=16),
            io.Int.Input("height", default=704, min=16, max=8192, step=16)]


def _size_ok(width, height):
    if width is None or height is None:  # linked: checked when the node runs
        return True
    return True if width % 16 == 0 and height % 16 == 0 else f"width/height must be multiples of 16: {width}x{height}"


class OmniDreamsEncodeFirstFrame(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsEncodeFirstFrame",
            display_name="OmniDreams Encode First Frame",
            category="OmniVideo/OmniDreams",
            description=("Resizes the first image (no crop) to width x height, encodes it with the Wan 2.1 VAE "
                         "(posterior mean, normalised) and attaches it: the video starts from this frame and its "
                         "size fixes the output size. Native size 1280x704."),
            inputs=[ConditioningType.Input("conditioning"), io.Vae.Input("vae"), io.Image.Input("image"),
                    *_size_inputs()],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def validate_inputs(cls, width=None, height=None, **_):
        return _size_ok(width, height)

    @classmethod
    def execute(cls, conditioning, vae, image, width=1280, height=704) -> io.NodeOutput:
        _check_family(conditioning)
        return io.NodeOutput(conditioning.with_extras(first_frame=encode_first_frame(vae, image, width, height)))


class OmniDreamsEncodeHDMap(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsEncodeHDMap",
            display_name="OmniDreams Encode HD-Map",
            category="OmniVideo/OmniDreams",
            description=("Optional. Encodes an HD-map video (IMAGE frames, resized to width x height) with the Wan "
                         "2.1 VAE in one causal pass; chunk 0 uses frames [0,5), each later chunk the next 8. "
                         "Needs at least as many frames as the video. Without this node the HD-map input is "
                         "zeros (plain image-to-video)."),
            inputs=[ConditioningType.Input("conditioning"), io.Vae.Input("vae"), io.Image.Input("hdmap"),
                    *_size_inputs()],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def validate_inputs(cls, width=None, height=None, **_):
        return _size_ok(width, height)

    @classmethod
    def execute(cls, conditioning, vae, hdmap, width=1280, height=704) -> io.NodeOutput:
        _check_family(conditioning)
        return io.NodeOutput(conditioning.with_extras(hdmap=encode_hdmap(vae, hdmap, width, height)))


NODES = [OmniDreamsModelLoader, OmniDreamsTextEncoderLoader, OmniDreamsTextEncode, OmniDreamsLoadTextEmbedding,
         OmniDreamsEncodeFirstFrame, OmniDreamsEncodeHDMap]
