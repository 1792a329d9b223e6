"""The MiniMax-H3 denoise loop every rank runs (`denoise`) and the run it is given (`H3Job`: what a parallel run
sends the workers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.utils.torch_utils import randn_tensor

from ... import compat
from ...attention.config import AttentionConfig, normalize_config
from ...attention.sequence_parallel import SINGLE, SequenceShard
from ...models.h3.attention import h3_attention, uses_packing
from ...models.h3.geometry import AUDIO_CHANNELS, H3Geometry, resolve_shape
from .layout import (
    KEYFRAME_T,
    PAD_MULTIPLE,
    ReferenceBlocks,
    ReferenceSlot,
    build_layout,
    patchify_video_latents,
)


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
    if latents.shape[0] - n_cond != layout.rows_of("video"):
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
