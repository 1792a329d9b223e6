"""MiniMax-H3 over several processes: Ulysses sequence parallelism of the packed sequence (models/h3/attention.py).

Rank 0 (ComfyUI) sends the run (`H3Job`) to the workers, then every rank runs the same denoise loop on its share of
the sequence; the transformer gathers its outputs, so every rank steps the full latents and rank 0 decodes. Each step
starts at a shared interrupt point (`World.interrupt_point`). ComfyUI's progress bar is itself a cancel point (it
consumes the cancel flag), so rank 0 holds a cancel the bar saw and hands it on at the next step: every rank stops at
the same place.
Workers hold only the transformer; the VAEs stay on rank 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ... import compat
from ...attention.sequence_parallel import SequenceShard
from ...backends import PLATFORM, release_cached_memory
from ...models.h3.loader import load_transformer
from ...models.lora import merge_recipes
from ...parallel.ops import operation
from ...parallel.pool import WorkerPool, ensure_pool
from ...parallel.world import World, dtype_named
from .denoise import H3Job, denoise

KEY_PREFIX = "h3:"  # the keys of the H3 transformers a worker holds


def model_key(model) -> str:
    """Names the weights a worker holds: the files (with their modification times) and the dtypes."""
    return KEY_PREFIX + json.dumps(model.load_args, sort_keys=True)


def ensure_workers(model) -> WorkerPool:
    """The running workers of `model.world_size`, each holding this model's transformer (and no other H3 one)."""
    args = model.load_args
    if not args:
        raise ValueError("this H3 model has no load_args, so workers cannot load it: load it with OmniVideo H3 Loader")
    if args["weight_dtype"] != args["dtype"]:
        raise ValueError(
            f"parallel workers compute with plain torch layers, which cannot cast {args['weight_dtype']} weights: "
            "load MiniMax-H3 with dtype 'auto', 'bf16', 'fp16' or 'fp32' for a world size above 1"
        )
    pool = ensure_pool(model.world_size)
    pool.ensure_model(model_key(model), "h3.load", args)  # the workers drop another H3 one (see `load`)
    return pool


def sample_parallel(model, job: H3Job, bar) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's side of a parallel run -> (target video rows, audio rows), as `denoise` returns them."""
    # every rank checks it too (h3_attention); here it comes before any worker starts
    SequenceShard(0, model.world_size).check_heads(int(model.transformer.config.num_attention_heads))
    pool = ensure_workers(model)
    transformer = compat.loaded(model.patcher)
    args, tensors = job.message()
    held = _HeldCancel(bar)
    with pool.job() as world:
        world.send("h3.sample", {**args, "key": model_key(model)}, tensors)
        out = denoise(transformer, job, model.device, shard=world.shard, interrupt=held.step_point(world), bar=held)
    held.raise_if_cancelled()  # seen by the bar after the last step: the workers are done already
    return out


class _HeldCancel:
    """Rank 0's progress bar in a parallel run. A cancel its `update` raises is held (raising it there would stop
    rank 0 alone, with the workers waiting in the next collective) and handed to every rank by `step_point`."""

    def __init__(self, bar):
        self.bar, self.cancel = bar, None

    def update(self, n: int = 1) -> None:
        try:
            self.bar.update(n)
        except BaseException as exc:
            if not compat.is_interrupt(exc):
                raise
            self.cancel = exc

    def step_point(self, world: World):
        def step_point() -> None:
            cancel, self.cancel = self.cancel, None
            world.interrupt_point(pending=cancel)

        return step_point

    def raise_if_cancelled(self) -> None:
        if self.cancel is not None:
            cancel, self.cancel = self.cancel, None
            raise cancel


# ---------------------------------------------------------------------------- worker operations


@operation("h3.load")
def load(world: World, models: dict, args: dict, tensors: dict) -> None:
    for other in [k for k in models if k.startswith(KEY_PREFIX)]:
        del models[other]  # one H3 transformer per worker: rank 0 forgot the others (`WorkerPool.ensure_model`)
    release_cached_memory(PLATFORM)  # its memory back before the next one's weights arrive
    transformer = load_transformer(
        Path(args["folder"]), args["transformer_file"], dtype_named(args["dtype"]), args.get("partition", "transformer")
    )
    merge_recipes(transformer, "h3", args.get("loras", []))  # the LoRAs of OmniVideo LoRA, as rank 0 has them
    models[args["key"]] = transformer.to(world.device)


@operation("h3.sample")
def sample(world: World, models: dict, args: dict, tensors: dict) -> None:
    job = H3Job.from_message(args, tensors)
    denoise(models[args["key"]], job, world.device, shard=world.shard, interrupt=world.interrupt_point)
