"""OmniVideo OmniDreams Stream: the rollout decoded and written to a video file chunk by chunk (any length, constant
memory), each chunk previewed as it finishes, resumable from a saved state."""

from __future__ import annotations

import os
from functools import partial

from .. import compat
from ..compat import io
from ..integration import safe_paths
from ..integration.video_file import StreamingVideoWriter
from ..models.omnidreams.text import TextEncoder, encode_prompt
from ..pipelines.omnidreams.latents import VAE_SPATIAL
from ..pipelines.omnidreams.record import Replay, read_record
from ..pipelines.omnidreams.stream import stream
from ..pipelines.omnidreams.stream_state import SavedState, StreamState, read_state_file
from ..pipelines.wan_decode import FUSIONS
from .input_checks import checks_inputs, unless_blank
from .sampling import SEED_MAX
from .types import ConditioningType, ModelType, TextEncoderType

FPS = 30
MAX_CHUNKS = 100_000  # ~7.4 hours at 30 fps; memory does not grow with it
STATE_EXT = ".safetensors"


def _state_file(name: str) -> str:
    return safe_paths.resolve_output_file(name, STATE_EXT, what="resume_from")


def read_state(name: str) -> SavedState:
    """resume_from's file, checked from its header (the tensors are loaded once the run has checked them too)."""
    return read_state_file(_state_file(name), f"resume_from {name!r}")


def save_state(name: str, state: StreamState) -> str:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in state.tensors.items()}  # cache slices are views
    return safe_paths.write_output_file(
        name, STATE_EXT, lambda tmp: save_file(tensors, tmp, metadata=state.metadata), what="save_state_as"
    )


def _in_output(path: str) -> str:
    """A written file's name as texts show it, relative to the output folder (as resume_from takes it): the texts
    reach the UI and errors /history, where no absolute path belongs."""
    output = os.path.realpath(compat.output_directory())  # the written paths are resolved (a linked output folder)
    return os.path.relpath(os.path.realpath(path), output).replace(os.sep, "/")


def rollout_inputs() -> list:
    """The first inputs of the stream nodes: what the rollout is made of."""
    return [
        ModelType.Input("model"),
        ConditioningType.Input("conditioning"),
        io.Vae.Input("vae", tooltip="The Wan 2.1 VAE (wan_2.1_vae.safetensors) from Load VAE."),
        io.Int.Input("seed", default=42, min=0, max=SEED_MAX, control_after_generate=True),
    ]


def video_inputs(filename_prefix: str) -> list:
    """The stream nodes' video: its size (without a first frame), its file and the decode's fusion."""
    return [
        io.Int.Input("width", default=1280, min=16, max=8192, step=16, tooltip="Without a first frame."),
        io.Int.Input("height", default=704, min=16, max=8192, step=16, tooltip="Without a first frame."),
        io.String.Input("filename_prefix", default=filename_prefix),
        io.Combo.Input("fusion", options=list(FUSIONS), default="auto"),
    ]


HDMAP_INPUT = io.Video.Input("hdmap", optional=True, tooltip="HD-map video (Load Video), read chunk by chunk.")
# the last widget of both stream nodes (absent in workflows saved before it: the eager step)
CUDA_GRAPH_INPUT = io.Boolean.Input(
    "cuda_graph",
    default=False,
    optional=True,
    tooltip="Once the KV window is full (chunk 2 on), each chunk runs on static buffers, captured as a CUDA graph "
    "and replayed (FlashDreams' recipe for frame rate); eagerly where there is no CUDA. Cancel acts between chunks. "
    "One device only (world size 1).",
)


def state_inputs() -> list:
    """The stream nodes' saved state: continue one, save this one's."""
    return [
        io.String.Input(
            "resume_from", default="", optional=True, tooltip="A state file in the output folder to continue."
        ),
        io.String.Input(
            "save_state_as", default="", optional=True, tooltip="Save the final state, e.g. drive.safetensors"
        ),
    ]


# The stream nodes' validate_inputs. ComfyUI reports a failure under every input it names, so it names one:
# resume_from, the file inside the output folder and a stream state by its header (bounded: nothing else is read);
# replay and the names to write are checked first thing in execute.
CHECKS_STREAM_INPUTS = checks_inputs(resume_from=unless_blank(read_state), combos=("fusion",))


@CHECKS_STREAM_INPUTS
class OmniDreamsStream(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsStream",
            **compat.search_aliases("stream", "long video", "world model", "autoregressive video"),
            display_name="OmniVideo OmniDreams Stream",
            category="OmniVideo/OmniDreams",
            is_output_node=True,
            description=(
                "Rolls OmniDreams out chunk by chunk and writes each chunk's frames to an H.264 video in the output "
                "folder as soon as it is decoded (30 fps; 5 frames for the first chunk, 8 for each after it), so any "
                "length runs in constant memory. Each chunk shows up as a preview while it runs; on cancel or error "
                "the file keeps every finished chunk. save_state_as writes the state at the end (KV window, noise, "
                "VAE caches) to the output folder; resume_from continues it in a later run, frame for frame as if "
                "it had never stopped. An HD-map video is read chunk by chunk. replay: an OmniDreams Live session's "
                "record (its prompts need text_encoder), the session's video bit for bit."
            ),
            inputs=[
                *rollout_inputs(),
                io.Int.Input("chunks", default=8, min=1, max=MAX_CHUNKS, tooltip="Chunks to make in this run."),
                *video_inputs("omnidreams/stream"),
                io.Boolean.Input(
                    "compile",
                    default=False,
                    optional=True,
                    tooltip="torch.compile the DiT blocks (the first chunks compile).",
                ),
                HDMAP_INPUT,
                *state_inputs(),
                TextEncoderType.Input(
                    "text_encoder", optional=True, tooltip="For a replay whose session switched prompts."
                ),
                io.String.Input(
                    "replay",
                    default="",
                    optional=True,
                    tooltip="An OmniDreams Live record (…events.safetensors in the output folder): its prompts and "
                    "HD-map frames at their chunks, the same video again.",
                ),
                CUDA_GRAPH_INPUT,
            ],
            outputs=[io.Video.Output(display_name="video")],
        )

    @classmethod
    def execute(
        cls,
        model,
        conditioning,
        vae,
        seed=42,
        chunks=8,
        width=1280,
        height=704,
        filename_prefix="omnidreams/stream",
        fusion="auto",
        compile=False,
        hdmap=None,
        resume_from="",
        save_state_as="",
        text_encoder=None,
        replay="",
        cuda_graph=False,
    ) -> io.NodeOutput:
        script, encode = None, None
        if replay.strip():
            record = read_record(_record_file(replay), f"replay {replay!r}")
            size = pixel_size(conditioning, width, height)
            record.check_run(seed=seed, size=size, chunks=chunks, video=hdmap is not None)
            if record.prompts:
                encode = prompt_encoder(text_encoder, "replay: its record switches prompts")
            script = Replay(record, chunks)
        run = StreamRun(model, filename_prefix, save_state_as, resume_from)
        result = run.stream(
            conditioning,
            vae,
            seed=seed,
            chunks=chunks,
            width=width,
            height=height,
            fusion=fusion,
            hdmap=hdmap,
            compiled=compile,
            cuda_graph=cuda_graph,
            script=script,
            encode=encode,
        )
        return run.output(f"{result.frames} frames ({result.chunks} chunks)", result.state)


def _record_file(name: str) -> str:
    return safe_paths.resolve_output_file(name, STATE_EXT, what="replay")


def pixel_size(conditioning, width: int, height: int) -> tuple[int, int]:
    """(width, height) of the video: the first frame's (if encoded), else the inputs'."""
    first = getattr(conditioning, "first_frame", None)
    if first is None:
        return width, height
    return int(first.shape[-1]) * VAE_SPATIAL, int(first.shape[-2]) * VAE_SPATIAL


def prompt_encoder(text_encoder, need: str):
    """prompt text -> embedding with the connected OmniDreams text encoder; a clear error when there is none."""
    if not isinstance(text_encoder, TextEncoder):
        raise ValueError(f"{need}: connect the OmniDreams Text Encoder Loader to text_encoder")
    return partial(encode_prompt, text_encoder)


class StreamRun:
    """One run of a stream node: its names checked before anything heavy, its video file, and what is said and kept
    when it ends (on cancel or error the file keeps every finished chunk)."""

    def __init__(self, model, filename_prefix: str, save_state_as: str, resume_from: str):
        if (save_state_as.strip() or resume_from.strip()) and getattr(model, "world_size", 1) > 1:
            raise ValueError(
                "save_state_as and resume_from need world size 1 (each parallel rank holds only its heads' KV "
                "window): clear them or set OmniVideo Parallel's world_size to 1"
            )
        if save_state_as.strip():
            safe_paths.output_file_path(save_state_as, STATE_EXT, "save_state_as")  # a bad name fails first
        self.model, self.save_state_as = model, save_state_as
        self.resume = read_state(resume_from) if resume_from.strip() else None
        self.writer = StreamingVideoWriter(filename_prefix, FPS)  # reserves the file: a bad name fails here

    def stream(self, conditioning, vae, *, write=None, **kwargs):
        writer = self.writer
        try:
            with writer:
                return stream(self.model, conditioning, vae, write=write or writer.write, resume=self.resume, **kwargs)
        except BaseException as exc:  # ComfyUI 0.33's cancel is a BaseException, 0.3.64's an Exception
            if writer.frames_written == 0 or not (isinstance(exc, Exception) or compat.is_interrupt(exc)):
                raise
            kept = (
                f"{writer.frames_written} frames kept in {_in_output(writer.path)} in the output folder "
                "(every finished chunk; it plays)"
            )
            if compat.is_interrupt(exc):
                compat.show_text(f"OmniDreams Stream cancelled: {kept}")
                raise
            raise RuntimeError(f"{exc} -- {kept}") from exc

    def output(self, made: str, state, extra: str = "") -> io.NodeOutput:
        """The node's VIDEO and its preview; `made` says what was made, then where it went."""
        writer = self.writer
        text = f"{made} in {_in_output(writer.path)} in the output folder{extra}"
        if self.save_state_as.strip() and state is not None:  # None only in a parallel run (refused above)
            text += f"; state saved as {_in_output(save_state(self.save_state_as, state))} (for resume_from)"
        compat.show_text(text)
        file = {"filename": os.path.basename(writer.path), "subfolder": writer.subfolder, "type": "output"}
        preview = {"images": [file], "animated": (True,)}
        return io.NodeOutput(compat.video_from_file(writer.path), ui=preview)


NODES = [OmniDreamsStream]
