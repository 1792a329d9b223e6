"""MiniMax-H3 sampling: t2va, fl2va and ref2va over one packed sequence, two schedules, fp32 Euler.

Mirrors diffusers' modular `minimax_h3` denoise (checked to 1e-5 by tests/test_h3_parity.py and
tests/test_h3_ref2va.py): keyframe / reference noise first (one draw per visual condition, packed order), then
video noise, then audio noise, all from one CPU generator; keyframe / reference rows held at t = max(t, 0.999),
reference soundtracks clean at t = 1, none of them ever written; one forward per step (guidance-distilled).
ref2va runs on the transformer_ref partition. `steps` counts sigma grid points, so 50 steps = 49 forwards.

One loop (`denoise`) for one process and for a world of them (`model.world_size` > 1, pipelines/h3/parallel.py):
there every rank runs it on its share of the packed sequence and rank 0 decodes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.utils.torch_utils import randn_tensor

from ... import compat
from ...attention.config import AttentionConfig, normalize_config
from ...attention.sequence_parallel import SINGLE, SequenceShard
from ...models.h3.attention import h3_attention, uses_packing
from ...models.h3.geometry import AUDIO_CHANNELS, H3Geometry, resolve_shape
from ...models.handles import H3Conditioning, H3Model, check_family
from .layout import (
    KEYFRAME_T,
    PAD_MULTIPLE,
    ReferenceBlocks,
    ReferenceSlot,
    build_layout,
    patchify_video_latents,
    unpack_audio,
    unpatchify_video,
)

log = logging.getLogger("omnivideo")

DEFAULT_STEPS = 50  # sigma points incl. the terminal 0 -> 49 forwards; turbo LoRAs use 4-8
REF2VA_PARTITION = "transformer_ref"  # models.h3.loader.TRANSFORMER_REF (the layers point down only)


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


@dataclass
class H3Job:
    """One sampler run as every rank needs it; a parallel run sends it to the workers (`message`)."""

    seed: int
    steps: int
    frames: int
    width: int
    height: int
    anchors: tuple[str, ...]
    attention: AttentionConfig
    geometry: H3Geometry
    scheduler_config: dict
    audio_scheduler_config: dict
    text: torch.Tensor  # [1, Nt, text_dim]
    text_token_tags: torch.Tensor  # [Nt]
    keyframe_latents: tuple[torch.Tensor, ...] = ()
    references: ReferenceBlocks | None = None  # ref2va

    def message(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON args, named tensors) for `World.send`; `from_message` is the inverse."""
        args = {
            "seed": self.seed,
            "steps": self.steps,
            "frames": self.frames,
            "width": self.width,
            "height": self.height,
            "anchors": list(self.anchors),
            "attention": dataclasses.asdict(self.attention),
            "geometry": dataclasses.asdict(self.geometry),
            "scheduler_config": dict(self.scheduler_config),
            "audio_scheduler_config": dict(self.audio_scheduler_config),
            "keyframes": len(self.keyframe_latents),
            "references": None if self.references is None else [list(s) for s in self.references.slots],
        }
        tensors = {"text": self.text, "text_token_tags": self.text_token_tags}
        tensors.update({f"keyframe.{i}": lat for i, lat in enumerate(self.keyframe_latents)})
        if self.references is not None:
            tensors.update({f"reference.{i}": lat for i, lat in enumerate(self.references.latents)})
            tensors.update({f"reference_audio.{i}": rows for i, rows in enumerate(self.references.audio_rows)})
        return args, tensors

    @classmethod
    def from_message(cls, args: dict, tensors: dict[str, torch.Tensor]) -> H3Job:
        geometry = {**args["geometry"], "patch_size": tuple(args["geometry"]["patch_size"])}
        return cls(
            seed=args["seed"],
            steps=args["steps"],
            frames=args["frames"],
            width=args["width"],
            height=args["height"],
            anchors=tuple(args["anchors"]),
            attention=normalize_config(args["attention"]),
            geometry=H3Geometry(**geometry),
            scheduler_config=args["scheduler_config"],
            audio_scheduler_config=args["audio_scheduler_config"],
            text=tensors["text"],
            text_token_tags=tensors["text_token_tags"],
            keyframe_latents=tuple(tensors[f"keyframe.{i}"] for i in range(args["keyframes"])),
            references=_references_from(args.get("references"), tensors),
        )


def _references_from(slots: list | None, tensors: dict[str, torch.Tensor]) -> ReferenceBlocks | None:
    if slots is None:
        return None
    visual = sum(kind != "audio" for kind, _ in slots)
    audio = sum(bool(has_audio) for _, has_audio in slots)
    return ReferenceBlocks(
        tuple(ReferenceSlot(kind, bool(has_audio)) for kind, has_audio in slots),
        tuple(tensors[f"reference.{i}"] for i in range(visual)),
        tuple(tensors[f"reference_audio.{i}"] for i in range(audio)),
    )


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
            from .parallel import sample_parallel

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


def denoise(
    transformer,
    job: H3Job,
    device: torch.device,
    *,
    shard: SequenceShard = SINGLE,
    interrupt=None,
    bar=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The denoise loop -> (target video rows [N, C*p], packed audio rows), normalised model space.

    Every rank of a parallel run calls it with the same job: the noise comes from one CPU generator, so all ranks
    draw the same; the transformer splits the sequence over `shard` and gathers its outputs, so every rank steps the
    full latents. `interrupt()` (default: `compat.check_interrupt`) is called by every rank at the start of each
    step: a parallel run's shared cancel point."""
    interrupt = interrupt or compat.check_interrupt
    geo = job.geometry
    shape = resolve_shape(job.frames, job.width, job.height, geo)
    config = job.attention
    # Packed varlen backends pad the sequence to a multiple of 128 ([real | pad]). With sequence parallelism the
    # padding is the same: the ranks split the padded sequence, and attention sees all of it again after the
    # all-to-all, with the same layout.
    pad_to = PAD_MULTIPLE if uses_packing(config) else None
    layout = build_layout(job.text_token_tags, shape, geo, job.anchors, pad_to=pad_to, references=job.references)
    layout = layout.to(device)

    video_sched = MiniMaxH3Scheduler.from_config(job.scheduler_config)
    audio_sched = MiniMaxH3Scheduler.from_config(job.audio_scheduler_config)
    video_sched.set_timesteps(job.steps)
    audio_sched.set_timesteps(job.steps)

    # Draw order is part of what the seed reproduces: keyframe / reference noise, video noise, audio noise.
    generator = torch.Generator("cpu").manual_seed(job.seed)
    conditions = job.keyframe_latents if job.references is None else job.references.latents
    reference_audio = () if job.references is None else job.references.audio_rows
    rows = []
    for lat in conditions:
        noise = randn_tensor(lat.shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
        rows.append(patchify_video_latents(video_sched.scale_noise(lat.float(), KEYFRAME_T, noise), geo.patch_size))
    video_noise = randn_tensor(
        (1, geo.latent_channels, shape.num_latent_frames, shape.latent_height, shape.latent_width),
        generator=generator,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    rows.append(patchify_video_latents(video_noise, geo.patch_size))
    latents = torch.cat(rows).to(device)
    audio_noise = randn_tensor(
        (shape.num_audio_latents * AUDIO_CHANNELS, geo.audio_latent_channels),
        generator=generator,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    audio = torch.cat([*(r.float() for r in reference_audio), audio_noise]).to(device)  # reference soundtracks first
    n_cond, n_cond_audio = layout.num_condition_video_rows, layout.num_condition_audio_rows
    if latents.shape[0] - n_cond != layout.grid[0] * layout.grid[1] * layout.grid[2]:
        raise ValueError(
            "keyframe / reference latents do not match the canvas; re-run OmniVideo H3 Keyframes or References at "
            "this size."
        )

    forward_kwargs = layout.forward_kwargs()
    text = job.text.to(device)
    with torch.no_grad(), h3_attention(transformer, config, shard) as attn_state:
        attn_state.expected = layout
        for i, t in enumerate(video_sched.timesteps):
            interrupt()
            attn_state.step = i
            ta = audio_sched.timesteps[i]  # the two schedules have the same length (set_timesteps(steps))
            unique_t, t_index = layout.row_timesteps(float(t), float(ta))
            v_pred, a_pred = transformer(
                hidden_states=latents[None],
                audio_hidden_states=audio[None],
                encoder_hidden_states=text,
                timestep=unique_t.to(device),
                timestep_indices=t_index.to(device),
                return_dict=False,
                **forward_kwargs,
            )
            latents[n_cond:] = video_sched.step(v_pred[0, n_cond:].float(), t, latents[n_cond:], return_dict=False)[0]
            audio[n_cond_audio:] = audio_sched.step(
                a_pred[0, n_cond_audio:].float(), ta, audio[n_cond_audio:], return_dict=False
            )[0]
            del v_pred, a_pred
            if bar is not None:
                bar.update(1)
    return latents[n_cond:], audio[n_cond_audio:]


def denormalize(model: H3Model, video: torch.Tensor, audio: torch.Tensor):
    """Normalised model space -> the VAEs' raw latent space (per-channel mean/std from the VAE configs)."""
    norm = model.latent_norm
    vm = torch.tensor(norm["video_mean"], device=video.device).view(1, -1, 1, 1, 1)
    vs = torch.tensor(norm["video_std"], device=video.device).view(1, -1, 1, 1, 1)
    am = torch.tensor(norm["audio_mean"], device=audio.device).view(1, -1, 1)
    ast = torch.tensor(norm["audio_std"], device=audio.device).view(1, -1, 1)
    return video * vs + vm, audio * ast + am
