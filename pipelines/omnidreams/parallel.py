"""OmniDreams over several processes (context parallel): rank 0's `DrivenRollout`, the workers it starts and
their side of the rollout.

A worker holds the same DiT as rank 0 (loaded from the same file; one OmniDreams DiT at a time) and runs every step
rank 0 announces on its own share of the chunk's tokens, with a KV window of its heads only and the current prompt
only. Decoding stays on rank 0.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from ... import compat
from ...attention.config import normalize_config
from ...backends import PLATFORM, release_cached_memory
from ...models.lora import merge_recipes
from ...models.omnidreams.dit import OmniDreamsDiT
from ...models.omnidreams.loader import load_omnidreams
from ...parallel.ops import operation
from ...parallel.pool import WorkerPool, ensure_pool
from ...parallel.world import dtype_named
from .autoregressive import Rollout
from .schedule import ARSettings


class DrivenRollout(Rollout):
    """Rank 0 of a context-parallel rollout. The workers mirror it (the operation `rollout` below): they get the
    rollout's inputs once, then each step's HD-map latent (and the prompt, in the compute dtype, at the steps where
    the rollout's own prompt switch says it switches in), and run the same steps on their share of the tokens; the
    DiT gathers every chunk on every rank.
    A cancel inside a step stops all ranks at one interrupt point; anywhere else the workers are waiting for the next
    message and `close` ends their rollout."""

    def __init__(self, pool, dit: OmniDreamsDiT, *, model_key: str, **kwargs):
        world = pool.world
        # local only: a setting that does not fit (heads, window) fails here, before the workers hear of the run
        super().__init__(dit, shard=world.shard, interrupt=world.interrupt_point, **kwargs)
        self._job = pool.job()
        self.world = self._job.__enter__()
        try:
            self.world.send(
                "omnidreams.rollout",
                {
                    "key": model_key,
                    "latent_hw": list(self.shape[-2:]),
                    "seed": int(kwargs["seed"]),
                    "settings": dataclasses.asdict(self.settings),
                    "attention": dataclasses.asdict(normalize_config(self.attention_config)),
                    "compiled": self.compiled,
                },
                {"first_frame": self.first_frame},
            )
        except BaseException as exc:
            self._end(exc)
            raise

    def step(self, hdmap: torch.Tensor | None = None) -> torch.Tensor:
        try:
            # the workers keep only the prompt that holds: it is sent at the step where it switches in
            self.world.send("step", tensors={"hdmap": hdmap, "text": self._next_prompt()})
            return self._chunk(hdmap)
        except BaseException as exc:
            self._end(exc)  # inside a step: the workers stopped with us (a cancel) or the pool is gone
            raise

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise ValueError("saving the rollout state needs world size 1: each rank holds only its heads' KV window")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise ValueError("resuming a rollout needs world size 1: each rank holds only its heads' KV window")

    def close(self) -> None:
        super().close()
        if self._job is None:
            return
        try:
            self.world.send("end")
        except BaseException as exc:
            self._end(exc)
            raise
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        if exc is None:
            job.__exit__(None, None, None)
        else:
            job.__exit__(type(exc), exc, exc.__traceback__)  # raises WorkerError if a worker died


KEY_PREFIX = "omnidreams:"  # the keys of the OmniDreams DiTs a worker holds


def ensure_workers(model) -> WorkerPool:
    """The running workers of `model.world_size`, each holding this model (and no other OmniDreams one)."""
    if model.load_args.get("weight_dtype") != model.load_args.get("dtype"):
        raise ValueError(
            "parallel workers compute with plain torch layers, which cannot cast fp8 weights: load the model with "
            "dtype 'auto', 'bf16', 'fp16' or 'fp32' for a world size above 1"
        )
    pool = ensure_pool(model.world_size)
    pool.ensure_model(model_key(model), "omnidreams.load", model.load_args)
    return pool


def model_key(model) -> str:
    """Names the weights a worker holds: the file (with its modification time) and the dtypes."""
    return KEY_PREFIX + json.dumps(model.load_args, sort_keys=True)


def open_rollout(model, **kwargs) -> Rollout:
    """The rollout of a model handle (`models.handles.OmniDreamsModel`): in this process, or across its world
    (`model.world_size` > 1). kwargs: `Rollout`'s, less the DiT, its device and attention."""
    dit = compat.loaded(model.patcher)  # ComfyUI places the weights (all, or what fits: the rest stream)
    kwargs.update(attention_config=model.attention, device=model.device)
    if model.world_size == 1:
        return Rollout(dit, **kwargs)
    if kwargs.get("cuda_graph"):
        raise ValueError(
            "cuda_graph runs one device's rollout: turn it off or set OmniVideo Parallel's world_size to 1"
        )
    pool = ensure_workers(model)
    return DrivenRollout(pool, dit, model_key=model_key(model), **kwargs)


# ---------------------------------------------------------------------------- worker operations


@operation("omnidreams.load")
def load(world, models: dict, args: dict, tensors: dict) -> None:
    for other in [k for k in models if k.startswith(KEY_PREFIX)]:
        del models[other]  # one OmniDreams DiT per worker: rank 0 forgot the others (`WorkerPool.ensure_model`)
    release_cached_memory(PLATFORM)  # its memory back before the next one's weights arrive
    dit = load_omnidreams(args["path"], dtype_named(args["dtype"]), dtype_named(args["weight_dtype"]))
    merge_recipes(dit, "omnidreams", args.get("loras", []))  # the LoRAs of OmniVideo LoRA, as rank 0 has them
    models[args["key"]] = dit.to(world.device).eval()


@operation("omnidreams.rollout")
def rollout(world, models: dict, args: dict, tensors: dict) -> None:
    dit = models[args["key"]]
    settings = args["settings"]
    run = Rollout(
        dit,
        text=None,  # rank 0 sends each prompt at the step where it switches in
        latent_hw=tuple(args["latent_hw"]),
        seed=args["seed"],
        first_frame=tensors.get("first_frame"),
        settings=ARSettings(**{**settings, "denoise": tuple(settings["denoise"])}),
        attention_config=args["attention"],
        device=world.device,
        compiled=args["compiled"],
        shard=world.shard,
        interrupt=world.interrupt_point,
    )
    try:
        while True:
            op, _, step = world.receive()
            if op == "end":
                return
            if "text" in step:
                run.switch_prompt(run.chunk, step["text"])
            run.step(step.get("hdmap"))
    finally:
        run.close()
