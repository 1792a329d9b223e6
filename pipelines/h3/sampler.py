"""MiniMax-H3 sampling: t2va, fl2va and ref2va over one packed sequence, two schedules, fp32 Euler.

Mirrors diffusers' modular `minimax_h3` denoise (to 1e-5 in tests/test_h3_parity.py, bit for bit in
tests/test_h3_ref2va.py): keyframe / reference noise first (one draw per visual condition, packed order), then
video noise, then audio noise, all from one CPU generator; keyframe / reference rows held at t = max(t, 0.999),
reference soundtracks clean at t = 1, none of them ever written; one forward per step (guidance-distilled).
ref2va runs on the transformer_ref partition. `steps` counts sigma grid points, so 50 steps = 49 forwards.

One loop (`denoise`, pipelines/h3/denoise.py) for one process and for a world of them (`model.world_size` > 1,
pipelines/h3/parallel.py): there every rank runs it on its share of the packed sequence and rank 0 decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import compat
from ...attention.config import normalize_config
from ...models.h3.geometry import resolve_shape
from ...models.handles import H3Conditioning, H3Model, check_family
from .denoise import H3Job, denoise
from .layout import unpack_audio, unpatchify_video
from .parallel import sample_parallel

DEFAULT_STEPS = 50  # sigma points incl. the terminal 0 -> 49 forwards; turbo LoRAs use 4-8
REF2VA_PARTITION = "transformer_ref"  # models.h3.folder.TRANSFORMER_REF (the layers point down only)


def _progress_bar(progress, total: int):
    """The node contract: `progress` is a factory, progress(total) -> an object with update(n);
    None = compat.ProgressBar (ComfyUI's bar inside ComfyUI)."""
    return (progress or compat.ProgressBar)(total)


@dataclass
class H3Latents:
    """What the H3 sampler makes, in the VAEs' raw (denormalised) latent space."""

    video: torch.Tensor  # [1, 24, T, H/16, W/16]
    audio: torch.Tensor  # [2, 32, N]: the stereo channels as the mono audio VAE's batch
    num_frames: int
    sample_rate: int


def sample(
    model: H3Model,
    conditioning: H3Conditioning,
    *,
    seed: int,
    frames: int,
    steps: int,
    width: int,
    height: int,
    progress=None,
) -> H3Latents:
    job = plan_job(model, conditioning, seed=seed, frames=frames, steps=steps, width=width, height=height)
    shape = resolve_shape(job.frames, job.width, job.height, job.geometry)
    bar = _progress_bar(progress, job.steps - 1)
    video = audio = None
    try:
        if model.world_size > 1:
            video, audio = sample_parallel(model, job, bar)
        else:
            # ComfyUI places the weights (all, or what fits: the rest stream)
            transformer = compat.loaded(model.patcher)
            video, audio = denoise(transformer, job, model.device, bar=bar)
        video_lat = unpatchify_video(video, shape, job.geometry)
        audio_lat = unpack_audio(audio, shape)
        video_lat, audio_lat = denormalize(model, video_lat, audio_lat)
        out = compat.intermediate_device(torch.device("cpu"))
        return H3Latents(video_lat.to(out), audio_lat.to(out), shape.num_frames, job.geometry.audio_sample_rate)
    finally:
        del video, audio
        compat.free_memory()  # the activations, also on interrupt; the weights are ComfyUI's to evict


def plan_job(
    model: H3Model, conditioning: H3Conditioning, *, seed: int, frames: int, steps: int, width: int, height: int
) -> H3Job:
    """Check a request against the model and gather what every rank needs to run it."""
    check_family(model, "h3", "model", "load it with OmniVideo H3 Loader")
    check_family(conditioning, "h3", "conditioning", "use OmniVideo H3 Text Encode")
    steps = int(steps) or DEFAULT_STEPS
    if steps < 2:
        raise ValueError(f"steps={steps}: H3 needs at least 2 (the schedule includes its terminal 0; 2 = 1 forward).")
    text_dim = getattr(model.transformer.config, "text_dim", None)
    if text_dim is not None and conditioning.text.shape[-1] != int(text_dim):
        raise ValueError(
            f"The H3 text embedding is {conditioning.text.shape[-1]} wide but this transformer expects text_dim="
            f"{text_dim}; encode the prompt with the text encoder that belongs to this model (or re-save the "
            "embedding file with it)."
        )
    keyframes = conditioning.keyframes
    tags = conditioning.text_token_tags
    if tags.numel() != conditioning.text.shape[1]:
        raise ValueError(f"text_token_tags has {tags.numel()} rows but the embedding {conditioning.text.shape[1]}.")
    anchors: tuple[str, ...] = ()
    if keyframes:
        anchors = tuple(keyframes["anchors"])
        if (keyframes["width"], keyframes["height"]) != (width, height):
            raise ValueError(
                f"The keyframes were encoded for {keyframes['width']}x{keyframes['height']} but the sampler asks for "
                f"{width}x{height}; set the same width and height on OmniVideo H3 Keyframes and the sampler."
            )
    shape = resolve_shape(frames, width, height, model.geometry)  # the size checks, before any work
    references = _check_references(model, conditioning, shape.num_frames, int(width), int(height))
    return H3Job(
        seed=int(seed),
        steps=steps,
        frames=shape.num_frames,  # snapped once, here
        width=int(width),
        height=int(height),
        anchors=anchors,
        attention=normalize_config(model.attention),
        geometry=model.geometry,
        scheduler_config=model.scheduler_config,
        audio_scheduler_config=model.audio_scheduler_config,
        text=conditioning.text,
        text_token_tags=tags,
        keyframe_latents=tuple((keyframes or {}).get("latents", [])),
        references=references,
    )


def _check_references(model: H3Model, conditioning: H3Conditioning, frames: int, width: int, height: int):
    """ref2va <-> the transformer_ref partition, and references encoded for this request: the layout's blocks."""
    refs = conditioning.references
    ref2va_model = getattr(model, "partition", "transformer") == REF2VA_PARTITION
    if refs is None:
        if ref2va_model:
            raise ValueError(
                "This H3 model is the ref2va partition (transformer_ref), which needs references: connect OmniVideo "
                "H3 References to H3 Text Encode, or load the t2va/fl2va transformer with OmniVideo H3 Loader for text "
                "or keyframes alone."
            )
        return None
    if not ref2va_model:
        raise ValueError(
            "The conditioning carries ref2va references but this H3 model is the t2va/fl2va transformer: load the "
            "transformer_ref weights with OmniVideo H3 Ref2VA Loader."
        )
    if conditioning.keyframes:
        raise ValueError("H3 runs keyframes (fl2va) or references (ref2va), not both: connect one to H3 Text Encode.")
    if (refs.width, refs.height, refs.frames) != (width, height, frames):
        raise ValueError(
            f"The references were prepared for {refs.width}x{refs.height}, {refs.frames} frames but the sampler asks "
            f"for {width}x{height}, {frames} frames (after snapping to 17n+5); set the same width, height and frames "
            "on OmniVideo H3 References and the sampler."
        )
    return refs.blocks()


def denormalize(model: H3Model, video: torch.Tensor, audio: torch.Tensor):
    """Normalised model space -> the VAEs' raw latent space (per-channel mean/std from the VAE configs)."""
    norm = model.latent_norm
    vm = torch.tensor(norm["video_mean"], device=video.device).view(1, -1, 1, 1, 1)
    vs = torch.tensor(norm["video_std"], device=video.device).view(1, -1, 1, 1, 1)
    am = torch.tensor(norm["audio_mean"], device=audio.device).view(1, -1, 1)
    ast = torch.tensor(norm["audio_std"], device=audio.device).view(1, -1, 1)
    return video * vs + vm, audio * ast + am
