"""MiniMax-H3 nodes: loader, Qwen3-VL text encoder loader + text encode, keyframes, sampler, decode."""

from __future__ import annotations

from .. import compat
from ..backends import DTYPE_CHOICES, PLATFORM, WEIGHT_DTYPE_CHOICES, resolve_dtype
from ..compat import io
from ..integration import comfy_types, safe_paths
from ..models.h3.folder import TRANSFORMER, folder_problem
from ..models.h3.geometry import FPS, MAX_SECONDS
from ..models.h3.loader import load_h3
from ..models.h3.text import (
    H3TextEncoder,
    embedding_problem,
    encode_prompt,
    encoder_folder_problem,
    load_embedding,
    load_text_encoder,
    save_embedding,
    vision_rows,
)
from ..models.handles import H3Conditioning, check_family
from ..pipelines.h3.sampler import DEFAULT_STEPS, sample
from .input_checks import checks_inputs
from .sampling import run_sampler, sampler_inputs
from .types import (
    AttentionType,
    ConditioningType,
    H3AudioVaeType,
    H3ReferencesType,
    H3VaeType,
    KeyframesType,
    ModelType,
    TextEncoderType,
)

FROM_FOLDER = "(transformer/ of the folder)"
NO_EMBEDDING = ""  # embedding_file unset: run the text encoder (also what the shipped workflows hold)
WEIGHT_EXTS = (".safetensors",)
MAX_FRAMES = int(MAX_SECONDS * FPS)  # 15 s at 24 fps


def _h3_folder(name: str) -> str:
    return safe_paths.resolve_model_folder("diffusers", name, folder_problem, what="folder")


def _transformer_file(name: str) -> str:
    return safe_paths.resolve_model_file("diffusion_models", name, WEIGHT_EXTS, what="transformer_file")


def _encoder_folder(name: str) -> str:
    return safe_paths.resolve_model_folder("text_encoders", name, encoder_folder_problem, what="folder")


def _embedding_file(name: str) -> str:
    return safe_paths.resolve_model_file("text_encoders", name, WEIGHT_EXTS, embedding_problem, what="embedding_file")


def _chosen_embedding_file(name) -> None:
    if name:  # NO_EMBEDDING: the text encoder runs
        _embedding_file(name)


@checks_inputs(folder=_h3_folder, combos=("transformer_file", "dtype"))
class OmniVideoH3Loader(io.ComfyNode):
    PARTITION = TRANSFORMER  # t2va / fl2va; OmniVideo H3 Ref2VA Loader: transformer_ref

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3Loader",
            **compat.search_aliases("minimax", "video with audio"),
            display_name="OmniVideo H3 Loader",
            category="OmniVideo/H3",
            description=(
                "Loads MiniMax-H3 from a diffusers-format folder under models/diffusers (transformer/, vae/, "
                "audio_vae/, scheduler/, audio_scheduler/). Optionally the transformer comes from a single file in "
                "models/diffusion_models (ComfyUI / original keys, converted with diffusers' converter). Local files "
                "only. The fp32 islands diffusers keeps (patch projections, time MLP, output heads, RoPE) stay fp32; "
                "the audio VAE is always fp32. dtype 'fp8_e4m3fn' stores the block matrices in fp8 (about half the "
                "memory of bf16), computing in the 'auto' dtype; scaled-fp8 single files are read. ComfyUI places "
                "the weights and streams what does not fit in VRAM."
            ),
            inputs=[
                io.Combo.Input("folder", options=safe_paths.list_model_folders("diffusers", folder_problem)),
                io.Combo.Input(
                    "transformer_file",
                    default=FROM_FOLDER,
                    options=[FROM_FOLDER] + safe_paths.list_model_files("diffusion_models", WEIGHT_EXTS),
                ),
                io.Combo.Input("dtype", options=list(WEIGHT_DTYPE_CHOICES), default="auto"),
                AttentionType.Input(
                    "attention",
                    optional=True,
                    tooltip="From OmniVideo Attention; unconnected = auto (fastest exact backend).",
                ),
            ],
            outputs=[
                ModelType.Output(display_name="model"),
                H3VaeType.Output(display_name="vae"),
                H3AudioVaeType.Output(display_name="audio_vae"),
            ],
        )

    @classmethod
    def execute(cls, folder, transformer_file=FROM_FOLDER, dtype="auto", attention=None) -> io.NodeOutput:
        single = None if transformer_file in (None, "", FROM_FOLDER) else _transformer_file(transformer_file)
        model, vae, audio_vae = load_h3(
            _h3_folder(folder),
            dtype,
            transformer_file=single,
            device=PLATFORM.device,
            attention=attention,
            partition=cls.PARTITION,
        )
        return io.NodeOutput(model, vae, audio_vae)


@checks_inputs(folder=_encoder_folder, combos=("dtype",))
class OmniVideoH3TextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3TextEncoderLoader",
            display_name="OmniVideo H3 Text Encoder Loader",
            category="OmniVideo/H3",
            description=(
                "Loads Qwen3-VL (H3's text encoder) from a Hugging Face folder under models/text_encoders, "
                "local files only. H3 conditions on hidden_states[layer] (50 for the released model)."
            ),
            inputs=[
                io.Combo.Input(
                    "folder", options=safe_paths.list_model_folders("text_encoders", encoder_folder_problem)
                ),
                io.Combo.Input("dtype", options=list(DTYPE_CHOICES), default="auto"),
                io.Int.Input("layer", default=50, min=1, max=512, tooltip="hidden_states index H3 reads."),
            ],
            outputs=[TextEncoderType.Output(display_name="text_encoder")],
        )

    @classmethod
    def execute(cls, folder, dtype="auto", layer=50) -> io.NodeOutput:
        device = PLATFORM.device
        return io.NodeOutput(
            load_text_encoder(_encoder_folder(folder), resolve_dtype(dtype, device), int(layer), device)
        )


class OmniVideoH3Keyframes(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3Keyframes",
            display_name="OmniVideo H3 Keyframes",
            category="OmniVideo/H3",
            description=(
                "First and/or last frame for fl2va (image-to-video is a first frame alone). The first image "
                "is stretched onto width x height, a last image cover-cropped, each encoded as one frame with "
                "the H3 video VAE. Connect to H3 Text Encode (the keyframes are also shown to Qwen3-VL); "
                "use the same width/height on the sampler."
            ),
            inputs=[
                H3VaeType.Input("vae"),
                io.Int.Input("width", default=1344, min=32, max=8192, step=32),
                io.Int.Input("height", default=768, min=32, max=8192, step=32),
                io.Image.Input("first_image", optional=True),
                io.Image.Input("last_image", optional=True),
            ],
            outputs=[KeyframesType.Output(display_name="keyframes")],
        )

    @classmethod
    def execute(cls, vae, width=1344, height=768, first_image=None, last_image=None) -> io.NodeOutput:
        from ..pipelines.h3.keyframes import encode_keyframes, image_to_pil

        if width % 32 or height % 32:
            raise ValueError(f"width and height must be multiples of 32, got {width}x{height}")

        first = image_to_pil(first_image) if first_image is not None else None
        last = image_to_pil(last_image) if last_image is not None else None
        try:
            keyframes = encode_keyframes(compat.loaded(vae), first, last, int(width), int(height), vae.load_device)
        finally:
            compat.free_memory()
        return io.NodeOutput(keyframes)


@checks_inputs(embedding_file=_chosen_embedding_file)  # save_as is checked first thing when the node runs
class OmniVideoH3TextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3TextEncode",
            display_name="OmniVideo H3 Text Encode",
            category="OmniVideo/H3",
            description=(
                "Encodes the prompt verbatim with Qwen3-VL (no chat template, no special tokens); with keyframes, "
                "each gets a '<Picture i>: ' label and a vision block, as diffusers' pipeline does; with ref2va "
                "references (OmniVideo H3 References), each gets its '<Picture i>' / '<Audio j>' / '<Video k>' label "
                "and vision blocks, as diffusers' ref2va pipeline does. Or loads a "
                "precomputed embedding (.safetensors, prompt_embeds + text_token_tags) instead of running the "
                "encoder; save_as writes one. The keyframes ride along in the conditioning to the sampler."
            ),
            inputs=[
                io.String.Input("prompt", multiline=True, default=""),
                TextEncoderType.Input("text_encoder", optional=True),
                KeyframesType.Input("keyframes", optional=True),
                H3ReferencesType.Input("references", optional=True, tooltip="ref2va: from OmniVideo H3 References."),
                io.Combo.Input(
                    "embedding_file",
                    options=[NO_EMBEDDING]
                    + safe_paths.list_model_files("text_encoders", WEIGHT_EXTS, embedding_problem),
                    default=NO_EMBEDDING,
                    optional=True,
                    tooltip="A saved H3 embedding (.safetensors in models/text_encoders) to use instead "
                    "of the encoder; empty = run the encoder.",
                ),
                io.String.Input(
                    "save_as",
                    default="",
                    optional=True,
                    tooltip="File name under ComfyUI's output folder to save the embedding to "
                    "(.safetensors; an existing file is kept and a numbered name used "
                    "instead; move it to models/text_encoders to reuse it); "
                    "empty = do not save.",
                ),
            ],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(
        cls, prompt, text_encoder=None, keyframes=None, embedding_file=NO_EMBEDDING, save_as="", references=None
    ) -> io.NodeOutput:
        if keyframes and references:
            raise ValueError("H3 runs keyframes (fl2va) or references (ref2va), not both: connect one of them.")
        save = bool(save_as and save_as.strip())
        if save:
            safe_paths.output_file_path(save_as, ".safetensors")  # a bad name fails before the heavy encode
        if embedding_file:
            embeds, tags = load_embedding(_embedding_file(embedding_file))
        else:
            if not isinstance(text_encoder, H3TextEncoder):
                raise ValueError(
                    "OmniVideo H3 Text Encode needs a text_encoder from OmniVideo H3 Text Encoder Loader "
                    "(or an embedding_file)."
                )
            images = keyframes["images"] if keyframes else []
            try:
                embeds, tags = encode_prompt(
                    text_encoder, prompt, images, references.references if references else None
                )
            finally:
                compat.free_memory()
        if (keyframes or references) and vision_rows(tags) == 0:
            what = "keyframes" if keyframes else "references"
            raise ValueError(
                f"{embedding_file or 'the embedding'} was made without {what}; re-encode the prompt "
                f"with the {what} connected."
            )
        if save:
            count = len(keyframes["anchors"]) if keyframes else 0
            refs = len(references.references) if references else 0
            path = safe_paths.write_output_file(
                save_as, ".safetensors", lambda tmp: save_embedding(tmp, embeds, tags, keyframes=count, references=refs)
            )
            compat.log.info("OmniVideo H3: saved the prompt embedding to %s", path)
        attached = {k: keyframes[k] for k in ("latents", "anchors", "width", "height")} if keyframes else None
        return io.NodeOutput(
            H3Conditioning(text=embeds, text_token_tags=tags, keyframes=attached, references=references)
        )


class OmniVideoH3Decode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3Decode",
            display_name="OmniVideo H3 Decode",
            category="OmniVideo/H3",
            description=(
                "Decodes an H3 LATENT: video with the H3 video VAE (tiled, as diffusers by default) to IMAGE "
                "frames at 24 fps, audio with the fp32 audio VAE to AUDIO (stereo, 32 kHz). Connect both to "
                "core CreateVideo (fps 24) and SaveVideo."
            ),
            inputs=[H3VaeType.Input("vae"), H3AudioVaeType.Input("audio_vae"), io.Latent.Input("samples")],
            outputs=[io.Image.Output(display_name="images"), io.Audio.Output(display_name="audio")],
        )

    @classmethod
    def execute(cls, vae, audio_vae, samples) -> io.NodeOutput:
        from ..pipelines.h3.decode import decode

        video, audio, rate = comfy_types.h3_latents(samples)
        frames, wave = decode(vae, audio_vae, video, audio, progress=compat.ProgressBar)
        rate = rate or audio_vae.model.module.config.sampling_rate
        return io.NodeOutput(comfy_types.image_from_video(frames), comfy_types.audio(wave, rate))


class OmniVideoH3Sampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3Sampler",
            **compat.search_aliases("minimax", "video with audio", "text to video audio"),
            display_name="OmniVideo H3 Sampler",
            category="OmniVideo/H3",
            description=(
                "MiniMax-H3 flow-matching sampler over the packed video + audio + text sequence (Euler, the model's "
                "shifts: 12 / 3, or OmniVideo H3 Shift's). Frames snap up to 17n+5 at 24 fps (5-15 s); width/height "
                "multiples of 32 (the keyframes' size when connected). The LATENT holds video and audio latents for "
                "OmniVideo H3 Decode."
            ),
            inputs=sampler_inputs(
                frames=209,
                max_frames=MAX_FRAMES,
                frames_tip="Pixel frames at 24 fps (5-15 s; snaps up to 17n+5).",
                max_steps=200,
                steps_tip=f"0 = {DEFAULT_STEPS} (49 forwards); turbo LoRAs use 4-8.",
                size_step=32,
                width=1344,
                height=768,
                size_tip="Output size (multiples of 32).",
            ),
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def execute(cls, model, conditioning, seed=42, frames=209, steps=0, width=1344, height=768) -> io.NodeOutput:
        result = run_sampler(sample, 32, model, conditioning, seed, frames, steps, width, height)
        return io.NodeOutput(
            comfy_types.h3_latent(result.video, result.audio, result.num_frames, FPS, result.sample_rate)
        )


class OmniVideoH3Shift(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3Shift",
            **compat.search_aliases("sigma shift", "flow shift", "turbo", "minimax shift"),
            display_name="OmniVideo H3 Shift",
            category="OmniVideo/H3",
            description=(
                "Sets the flow shifts of the H3 sampler's two schedules (the released model: video 12, audio 3, "
                "from its scheduler configs). A turbo / distill LoRA's recipe gives its shifts here and its steps "
                "on the sampler."
            ),
            inputs=[
                ModelType.Input("model"),
                io.Float.Input("video_shift", default=12.0, min=0.01, max=100.0, step=0.01),
                io.Float.Input("audio_shift", default=3.0, min=0.01, max=100.0, step=0.01),
            ],
            outputs=[ModelType.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, video_shift=12.0, audio_shift=3.0) -> io.NodeOutput:
        check_family(model, "h3", "model", "load it with OmniVideo H3 Loader")
        return io.NodeOutput(
            model.replace(
                scheduler_config={**model.scheduler_config, "shift": float(video_shift)},
                audio_scheduler_config={**model.audio_scheduler_config, "shift": float(audio_shift)},
            )
        )


NODES = [
    OmniVideoH3Loader,
    OmniVideoH3TextEncoderLoader,
    OmniVideoH3Keyframes,
    OmniVideoH3TextEncode,
    OmniVideoH3Decode,
    OmniVideoH3Sampler,
    OmniVideoH3Shift,
]
