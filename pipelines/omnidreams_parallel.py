"""The workers' side of an OmniDreams context-parallel rollout (rank 0's side: `DrivenRollout` in omnidreams.py).

A worker holds the same DiT as rank 0 (loaded from the same file) and runs every step rank 0 announces on its own
share of the chunk's tokens, with a KV window of its heads only. Decoding stays on rank 0.
"""

from __future__ import annotations

from ..models.omnidreams.loader import load_omnidreams
from ..parallel.ops import operation
from ..parallel.world import dtype_named
from .omnidreams import ARSettings, PromptCross, Rollout


@operation("omnidreams.load")
def load(world, models: dict, args: dict, tensors: dict) -> None:
    dit = load_omnidreams(args["path"], dtype_named(args["dtype"]), dtype_named(args["weight_dtype"]))
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
    texts = [tensors[f"text.{i}"] for i in range(len(args["starts"]))]
    prompts = PromptCross(model, texts[0], list(zip(args["starts"][1:], texts[1:])), world.device)
    try:
        while True:
            op, _, step = world.receive()
            if op == "end":
                return
            run.step(prompts.at(run.chunk), step.get("hdmap"))
    finally:
        run.close()
