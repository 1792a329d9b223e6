"""OmniVideo Parallel: run a model's sampler over several devices (context / sequence parallel); OmniVideo Sequence
Parallel: the same for ComfyUI's own MODEL (Wan, MiniMax-H3), each forward split under core's samplers."""

from __future__ import annotations

from .. import compat
from ..attention.sequence_parallel import SequenceShard
from ..backends import PLATFORM, device_count
from ..compat import io
from ..integration.core_sequence_parallel import plan_for, split_model, unsplit_model
from ..models.handles import FAMILIES
from ..parallel.pool import describe_pool
from ..parallel.rendezvous import operator_ranks
from ..pipelines.h3.parallel import ensure_workers as h3_workers
from ..pipelines.omnidreams.parallel import ensure_workers as omnidreams_workers
from .types import ModelType

MAX_WORLD_SIZE = 16  # OmniDreams has 16 heads; Ulysses gives each rank whole heads
START_WORKERS = {"omnidreams": omnidreams_workers, "h3": h3_workers}


class OmniVideoParallel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoParallel",
            display_name="OmniVideo Parallel",
            category="OmniVideo/utils",
            description=(
                "Runs the model's sampler on world_size devices: this ComfyUI process is rank 0 and a worker process "
                "per extra device (started here, kept across queue runs, stopped by 'Unload models' or server exit) "
                "loads the same weights. Each step's tokens are split over the ranks and attention trades them for "
                "whole heads (Ulysses); OmniDreams' KV window is split by heads. Output equals one device's. "
                "world_size must divide the heads (OmniDreams: 16) and is at most the devices (on CPU: the cores). "
                "1 = this process only."
            ),
            inputs=[
                ModelType.Input("model"),
                io.Int.Input("world_size", default=2, min=1, max=MAX_WORLD_SIZE),
            ],
            outputs=[ModelType.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, world_size=2) -> io.NodeOutput:
        family = getattr(model, "family", None)
        if family not in FAMILIES:
            raise ValueError(f"OmniVideo Parallel needs an OmniVideo model, got {type(model).__name__}")
        config = model.transformer.config
        SequenceShard(0, world_size).check_heads(getattr(config, "num_heads", None) or config.num_attention_heads)
        devices = device_count(PLATFORM)
        if world_size > devices and not operator_ranks():
            unit = "cores" if PLATFORM.name == "cpu" else f"{PLATFORM.name} devices"
            raise ValueError(f"world_size {world_size} needs {world_size} {unit}; this machine has {devices}")
        parallel = model.replace(world_size=world_size)
        if world_size > 1:
            START_WORKERS[family](parallel)  # start now, so a missing file or device shows at this node
        return io.NodeOutput(parallel, ui={"text": [describe_pool()]})


MAX_DEVICES = 8


class OmniVideoSequenceParallel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoSequenceParallel",
            display_name="OmniVideo Sequence Parallel (MODEL)",
            category="OmniVideo/utils",
            description=(
                "Splits every forward of ComfyUI's own Wan 2.1 / 2.2 or MiniMax-H3 MODEL over several devices: each "
                "device holds the model (ComfyUI's own copy, with the same LoRAs and patches) and a slice of the "
                "token sequence; attention trades the slice for whole heads (Ulysses) and back; the output equals "
                "one device's. Put it after the loader, LoRA and attention-patch nodes, before the sampler: every "
                "core sampler, scheduler, CFG / guider and guide works above it. devices must divide the heads "
                "(Wan 14B: 40, 1.3B: 12, 5B: 24, H3: 56). On the CPU the ranks are threads sharing one copy "
                "(for testing: no faster). 1 = one device (a split MODEL is unsplit)."
            ),
            inputs=[
                io.Model.Input("model"),
                io.Int.Input("devices", default=2, min=1, max=MAX_DEVICES),
            ],
            outputs=[io.Model.Output(display_name="model")],
            **compat.search_aliases("multi gpu", "ulysses", "sequence parallel", "several GPUs"),
        )

    @classmethod
    def execute(cls, model, devices=2) -> io.NodeOutput:
        if devices == 1:
            plan = plan_for(model.model.diffusion_model, 1)  # still refuses a model it could never split
            return io.NodeOutput(unsplit_model(model), ui={"text": [f"{plan.name} on one device"]})
        split, sequence = split_model(model, devices)
        where = ", ".join(str(d) for d in sequence.devices)
        return io.NodeOutput(split, ui={"text": [f"{sequence.plan.name} split over {devices} ranks: {where}"]})
