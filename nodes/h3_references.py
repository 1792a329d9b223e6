"""MiniMax-H3 ref2va nodes: chain image / video / audio references (in the order the model reads them), then put
them on the request's canvas and encode them (OmniVideo H3 References) for H3 Text Encode and the sampler."""

from __future__ import annotations

import numpy as np
import torch

from .. import compat
from ..compat import io
from ..models.h3.folder import TRANSFORMER_REF
from ..models.h3.geometry import snap_frames
from ..models.h3.loader import geometry_of
from ..pipelines.h3.keyframes import image_to_pil
from ..pipelines.h3.references import (
    IMAGE_SIZES,
    EncodedReferences,
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
    check_counts,
    encode_references,
    normalize_references,
)
from .h3 import MAX_FRAMES, OmniVideoH3Loader
from .input_checks import checks_inputs
from .types import H3AudioVaeType, H3ReferenceListType, H3ReferencesType, H3VaeType

CHAIN_TIP = "References chained before this one; the model reads them in chain order (<Picture i>, <Video k>, …)."


def _chain(references, added: list) -> io.NodeOutput:
    """The chain so far plus `added`, checked against diffusers' limits at once (a cheap node, before any encode)."""
    chained = [*(references or []), *added]
    check_counts(chained)
    return io.NodeOutput(chained)


def _waveform(audio: dict, what: str) -> tuple[torch.Tensor, int]:
    """A ComfyUI AUDIO ({"waveform": [B, C, n], "sample_rate"}) -> its first item [C, n] and its rate."""
    wave = audio["waveform"]
    if wave.ndim != 3 or wave.shape[1] not in (1, 2) or wave.shape[-1] == 0:
        raise ValueError(f"{what}: H3 takes mono or stereo audio, got a waveform of shape {list(wave.shape)}.")
    return wave[0].float().cpu(), int(audio["sample_rate"])


def _uint8_frames(images: torch.Tensor) -> np.ndarray:
    """IMAGE [T, H, W, C] float 0..1 -> [T, H, W, 3] uint8 (the rounding of H3 Keyframes)."""
    return (images[..., :3].float().clamp(0, 1) * 255.0).round().to(torch.uint8).cpu().numpy()


class OmniVideoH3Ref2VALoader(OmniVideoH3Loader):
    """OmniVideo H3 Loader for the ref2va partition: the same inputs, checks and loading, transformer_ref/'s weights
    (a node of its own, so the t2va / fl2va loader and the workflows saved with it stay as they are)."""

    PARTITION = TRANSFORMER_REF

    @classmethod
    def define_schema(cls):
        loader = OmniVideoH3Loader.define_schema()
        return io.Schema(
            node_id="OmniVideoH3Ref2VALoader",
            **compat.search_aliases("minimax", "reference to video", "ref2va"),
            display_name="OmniVideo H3 Ref2VA Loader",
            category="OmniVideo/H3/ref2va",
            description=(
                "Loads MiniMax-H3's ref2va partition: transformer_ref/ of a diffusers-format folder under "
                "models/diffusers (or a single-file ref2va transformer from models/diffusion_models, with the folder's "
                "config), plus the folder's video and audio VAEs; otherwise as OmniVideo H3 Loader. Its model runs "
                "references only (OmniVideo H3 References → H3 Text Encode → H3 Sampler)."
            ),
            inputs=loader.inputs,
            outputs=loader.outputs,
        )


class OmniVideoH3ReferenceImage(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3ReferenceImage",
            display_name="OmniVideo H3 Reference Image",
            category="OmniVideo/H3/ref2va",
            description=(
                "A subject, style or scene reference for ref2va (at most 9 images): every image of the batch is "
                "one reference, <Picture i> in the prompt. Chain references, then OmniVideo H3 References."
            ),
            inputs=[io.Image.Input("image"), H3ReferenceListType.Input("references", optional=True, tooltip=CHAIN_TIP)],
            outputs=[H3ReferenceListType.Output(display_name="references")],
        )

    @classmethod
    def execute(cls, image, references=None) -> io.NodeOutput:
        return _chain(references, [MiniMaxH3ImageReference(image_to_pil(frame)) for frame in image])


class OmniVideoH3ReferenceVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3ReferenceVideo",
            display_name="OmniVideo H3 Reference Video",
            category="OmniVideo/H3/ref2va",
            description=(
                "A motion and camera reference for ref2va (at most 3 videos), <Video k> in the prompt: a VIDEO (its "
                "frame rate and soundtrack come along) or IMAGE frames at fps. Its soundtrack (audio, else the "
                "VIDEO's own) is conditioned on with it as <Audio j>, labelled before the video. Resampled to "
                "24 fps, at least 22 frames."
            ),
            inputs=[
                io.Video.Input("video", optional=True),
                io.Image.Input("frames", optional=True, tooltip="Frames instead of a VIDEO."),
                io.Float.Input("fps", default=24.0, min=1.0, max=240.0, step=0.001, tooltip="The rate of frames."),
                io.Audio.Input("audio", optional=True, tooltip="The video's soundtrack (instead of the VIDEO's own)."),
                H3ReferenceListType.Input("references", optional=True, tooltip=CHAIN_TIP),
            ],
            outputs=[H3ReferenceListType.Output(display_name="references")],
        )

    @classmethod
    def execute(cls, video=None, frames=None, fps=24.0, audio=None, references=None) -> io.NodeOutput:
        if (video is None) == (frames is None):
            raise ValueError("OmniVideo H3 Reference Video needs a video or frames (one of them).")
        if video is not None:
            parts = video.get_components()
            frames, fps, audio = parts.images, float(parts.frame_rate), audio or parts.audio
        wave, rate = _waveform(audio, "audio") if audio is not None else (None, None)
        reference = MiniMaxH3VideoReference(_uint8_frames(frames), fps=float(fps), audio=wave, sample_rate=rate)
        return _chain(references, [reference])


class OmniVideoH3ReferenceAudio(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3ReferenceAudio",
            display_name="OmniVideo H3 Reference Audio",
            category="OmniVideo/H3/ref2va",
            description=(
                "A voice or music reference for ref2va (at most 3), <Audio j> in the prompt; never alone: chain it "
                "with at least one image or video reference. Resampled to the audio VAE's rate."
            ),
            inputs=[io.Audio.Input("audio"), H3ReferenceListType.Input("references", optional=True, tooltip=CHAIN_TIP)],
            outputs=[H3ReferenceListType.Output(display_name="references")],
        )

    @classmethod
    def execute(cls, audio, references=None) -> io.NodeOutput:
        wave, rate = _waveform(audio, "audio")
        return _chain(references, [MiniMaxH3AudioReference(wave, sample_rate=rate)])


@checks_inputs(combos=("ref_image_size",))
class OmniVideoH3References(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoH3References",
            display_name="OmniVideo H3 References",
            category="OmniVideo/H3/ref2va",
            description=(
                "Puts the chained ref2va references on MiniMax-H3's rates and sizes for this request and encodes them "
                "(video VAE for images and videos, audio VAE for soundtracks), as diffusers' ref2va pipeline does. "
                "Connect to H3 Text Encode (the references are also shown to Qwen3-VL) and use the same width, "
                "height and frames on the sampler, whose model comes from OmniVideo H3 Ref2VA Loader."
            ),
            inputs=[
                H3VaeType.Input("vae"),
                H3AudioVaeType.Input("audio_vae"),
                H3ReferenceListType.Input("references"),
                io.Int.Input("width", default=1344, min=32, max=8192, step=32),
                io.Int.Input("height", default=768, min=32, max=8192, step=32),
                io.Int.Input("frames", default=209, min=1, max=MAX_FRAMES, tooltip="The sampler's frames."),
                io.Combo.Input(
                    "ref_image_size",
                    options=list(IMAGE_SIZES),
                    default="diffusers",
                    tooltip="Image references: 'diffusers' = 2048 px short edge, up or down (diffusers' pipeline); "
                    "'max' = core's: 2048 px short edge, only down; 'match' = core's: down to the video's pixel "
                    "area (fewer rows, faster).",
                ),
            ],
            outputs=[H3ReferencesType.Output(display_name="references")],
        )

    @classmethod
    def execute(cls, vae, audio_vae, references, width=1344, height=768, frames=209, ref_image_size="diffusers"):
        if width % 32 or height % 32:
            raise ValueError(f"width and height must be multiples of 32, got {width}x{height}")
        # every check (limits, sizes, frame counts) before ComfyUI loads a VAE
        geo = geometry_of(None, vae.model.module, audio_vae.model.module)
        frames = snap_frames(int(frames), geo)
        normalized = normalize_references(
            references, width=int(width), height=int(height), frames=frames, geo=geo, ref_image_size=ref_image_size
        )
        try:
            latents, audio_rows = encode_references(
                compat.loaded(vae), compat.loaded(audio_vae), normalized, geo, vae.load_device, audio_vae.load_device
            )
        finally:
            compat.free_memory()
        return io.NodeOutput(EncodedReferences(normalized, latents, audio_rows, int(width), int(height), frames))


NODES = [
    OmniVideoH3Ref2VALoader,
    OmniVideoH3ReferenceImage,
    OmniVideoH3ReferenceVideo,
    OmniVideoH3ReferenceAudio,
    OmniVideoH3References,
]
