"""The workers' side of an OmniDreams context-parallel rollout (rank 0's side: `DrivenRollout` in omnidreams.py).

A worker holds the same DiT as rank 0 (loaded from the same file; one OmniDreams DiT at a time) and runs every step
rank 0 announces on its own share of the chunk's tokens, with a KV window of its heads only and the current prompt
only. Decoding stays on rank 0.
"""

from __future__ import annotations

from ..backends import PLATFORM, release_cached_memory
from ..models.lora import merge_recipes
from ..models.omnidreams.loader import load_omnidreams
from ..parallel.ops import operation
from ..parallel.world import dtype_named
from .omnidreams import FAMILY, ARSettings, Rollout


@operation("omnidreams.load")
def load(world, models: dict, args: dict, tensors: dict) -> None:
    for other in [k for k in models if k.startswith(FAMILY)]:
        del models[other]  # one OmniDreams DiT per worker: rank 0 forgot the others (`WorkerPool.ensure_model`)
    release_cached_memory(PLATFORM)  # its memory back before the next one's weights arrive
    dit = load_omnidreams(args["path"], dtype_named(args["dtype"]), dtype_named(args["weight_dtype"]))
    merge_recipes(dit, "omnidreams", args.get("loras", []))  # the LoRAs of OmniVideo LoRA, as rank 0 has them
    models[args["key"]] = dit.to(world.device).eval()


@operation("omnidreams.rollout")
def rollout(world, models: dict, args: dict, tensors: dict) -> None:
    model = models[args["key"]]
    settings = args["settings"]
    run = Rollout(
        model,
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
    cross: list = []  # the current prompt's K/V; rank 0 sends a prompt at the step where it switches in
    try:
        while True:
            op, _, step = world.receive()
            if op == "end":
                return
            if "text" in step:
                cross = []  # the previous prompt's K/V go first
                cross = model.cross_kv(step.pop("text").to(world.device))
            run.step(cross, step.get("hdmap"))
    finally:
        run.close()
