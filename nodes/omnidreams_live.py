"""OmniVideo OmniDreams Live: OmniDreams Stream steered while it runs — prompts, HD-map frames, pause / resume / stop
and more chunks over HTTP (integration/live_routes), its frames to the browser panel (web/omnidreams_live.js) and any
MJPEG player as they are decoded, its events recorded next to the video for OmniDreams Stream's replay."""

from __future__ import annotations

import os
import secrets

from .. import compat
from ..compat import io
from ..integration import live_routes, safe_paths
from ..integration.live_frames import FrameHub
from ..pipelines.omnidreams.events import check_key_hash
from ..pipelines.omnidreams.live import LiveSession
from ..pipelines.omnidreams.record import write_record
from .omnidreams_stream import (
    CHECKS_STREAM_INPUTS,
    CUDA_GRAPH_INPUT,
    FPS,
    HDMAP_INPUT,
    MAX_CHUNKS,
    STATE_EXT,
    StreamRun,
    _in_output,
    pixel_size,
    prompt_encoder,
    rollout_inputs,
    state_inputs,
    video_inputs,
)
from .types import TextEncoderType

DEFAULT_MAX_CHUNKS = 900  # 2 minutes at 30 fps
MAX_IDLE_TIMEOUT = 3600
DEFAULT_MAX_WAIT = 600
# The server's owner lowers the most a session may spend paused or waiting (max_wait's maximum, which ComfyUI enforces
# at /prompt) with this variable, in seconds.
MAX_WAIT_VARIABLE = "OMNIVIDEO_LIVE_MAX_WAIT"
EVENT = "omnivideo.live"  # the websocket message that tells the queuing client its session started (nothing secret)


def max_wait_limit() -> int:
    """max_wait's maximum: OMNIVIDEO_LIVE_MAX_WAIT seconds (5 to MAX_IDLE_TIMEOUT), MAX_IDLE_TIMEOUT when unset."""
    try:
        return max(5, min(MAX_IDLE_TIMEOUT, int(os.environ.get(MAX_WAIT_VARIABLE, MAX_IDLE_TIMEOUT))))
    except ValueError:
        return MAX_IDLE_TIMEOUT


@CHECKS_STREAM_INPUTS  # key_hash is checked first thing in execute (one named input at most)
class OmniDreamsLive(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsLive",
            **compat.search_aliases("live", "interactive", "world model", "realtime"),
            display_name="OmniVideo OmniDreams Live",
            category="OmniVideo/OmniDreams",
            is_output_node=True,
            description=(
                "OmniDreams Stream that you steer while it runs: the panel on this node plays the frames as they are "
                "decoded (30 fps) and sends a new prompt (from the next chunk, with the connected text encoder), "
                "pause, resume, stop and more chunks; a simulator can push HD-map frames over HTTP (hdmap_pushed). "
                "It makes `chunks` chunks, then waits for more, up to max_chunks. It holds ComfyUI's queue while it "
                "runs: it ends by itself after idle_timeout seconds without events (and, while it runs, without a "
                "viewer) and once it has been paused or waiting for max_wait seconds in all, and Cancel ends it "
                "within about a second; the video keeps every finished chunk. Only the holder of the session's key "
                "steers or watches it (the panel makes one for each run; key_hash carries its SHA-256). record "
                "saves the events next to the video, for OmniDreams Stream's replay."
            ),
            inputs=[
                *rollout_inputs(),
                io.Int.Input("chunks", default=8, min=1, max=MAX_CHUNKS, tooltip="Chunks before it waits for more."),
                io.Int.Input(
                    "max_chunks", default=DEFAULT_MAX_CHUNKS, min=1, max=MAX_CHUNKS, tooltip="The most it makes."
                ),
                io.Int.Input(
                    "idle_timeout",
                    default=60,
                    min=5,
                    max=MAX_IDLE_TIMEOUT,
                    tooltip="Seconds without events (and, while it runs, without a viewer) before it ends.",
                ),
                *video_inputs("omnidreams/live"),
                TextEncoderType.Input("text_encoder", optional=True, tooltip="Encodes the prompts sent while it runs."),
                HDMAP_INPUT,
                io.Boolean.Input(
                    "hdmap_pushed",
                    default=False,
                    optional=True,
                    tooltip="The HD-map comes as frames pushed over HTTP; each chunk waits for its frames.",
                ),
                io.Boolean.Input(
                    "record", default=True, optional=True, tooltip="Save the events next to the video, for replay."
                ),
                *state_inputs(),
                io.Int.Input(
                    "max_wait",
                    default=min(DEFAULT_MAX_WAIT, max_wait_limit()),
                    min=5,
                    max=max_wait_limit(),
                    optional=True,
                    tooltip="Seconds it may spend paused or waiting (for more chunks, for HD-map frames) in all before "
                    f"it ends: other users' prompts wait meanwhile. The server's owner caps it ({MAX_WAIT_VARIABLE}).",
                ),
                io.String.Input(
                    "key_hash",
                    default="",
                    optional=True,
                    tooltip="SHA-256 (64 hex digits) of the session's key; the panel fills it in for each run and "
                    "keeps the key. A program makes its own key and sends it in the X-OmniVideo-Live-Key header. "
                    "Empty: nobody can steer or watch the session; it makes its chunks and ends.",
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
        max_chunks=DEFAULT_MAX_CHUNKS,
        idle_timeout=60,
        width=1280,
        height=704,
        filename_prefix="omnidreams/live",
        fusion="auto",
        text_encoder=None,
        hdmap=None,
        hdmap_pushed=False,
        record=True,
        resume_from="",
        save_state_as="",
        max_wait=DEFAULT_MAX_WAIT,
        key_hash="",
        cuda_graph=False,
    ) -> io.NodeOutput:
        if (problem := check_key_hash(key_hash)) is not None:
            raise ValueError(problem)
        if hdmap_pushed and hdmap is not None:
            raise ValueError("hdmap_pushed takes the HD-map from pushed frames: disconnect the hdmap video or unset it")
        if not key_hash and hdmap_pushed:
            raise ValueError("hdmap_pushed needs a key_hash: frames can be pushed only with the session's key")
        if key_hash:
            live_routes.claim(key_hash)
        encode = None if text_encoder is None else prompt_encoder(text_encoder, "OmniDreams Live's text_encoder")
        run = StreamRun(model, unlisted_prefix(filename_prefix), save_state_as, resume_from)
        hub = FrameHub()
        session = LiveSession(
            chunks=chunks,
            max_chunks=max_chunks if key_hash else min(chunks, max_chunks),  # without a key nobody asks for more
            idle_timeout=idle_timeout,
            prompts=encode is not None,
            key_hash=key_hash,
            max_wait=min(max_wait, max_wait_limit()),
            hdmap_pushed=hdmap_pushed,
            viewers=lambda: hub.viewers,
        )
        size = pixel_size(conditioning, width, height)
        live_routes.open_session(session, hub, FPS, *size)
        prompt_id, node_id = compat.running_node() or ("", "")
        about = {"node": node_id, "prompt_id": prompt_id, "session": session.session_id if key_hash else None}
        compat.tell_client(
            EVENT,
            {
                **about,
                "state": "running",
                "fps": FPS,
                "width": size[0],
                "height": size[1],
                "chunks": chunks,
                "max_chunks": max_chunks,
                "idle_timeout": idle_timeout,
            },
        )

        def write(images):
            run.writer.write(images)
            hub.publish(images, session.chunk)

        result, reason = None, "error"
        try:
            result = run.stream(
                conditioning,
                vae,
                write=write,
                seed=seed,
                chunks=max_chunks,
                width=width,
                height=height,
                fusion=fusion,
                hdmap=hdmap,
                cuda_graph=cuda_graph,
                script=session,
                encode=encode,
                previews=False,  # the panel plays every frame
            )
            reason = session.reason or "finished"
        except BaseException as exc:
            reason = "cancelled" if compat.is_interrupt(exc) else "error"
            raise
        finally:
            session.end(reason)
            live_routes.close_session(session.session_id)
            kept = _save_record(run, session, seed, size, hdmap) if record else None  # never raises
            session.forget()
            compat.tell_client(
                EVENT,
                {
                    **about,
                    "state": "ended",
                    "reason": reason,
                    "frames": run.writer.frames_written,
                    "chunks": session.made,
                    "record": kept,
                },
            )
            session.frames_used.close()
        if run.writer.frames_written == 0:  # ended before its first chunk: no video for Save Video to take
            raise RuntimeError(
                f"OmniDreams Live ended before its first chunk ({reason}): no video was made. Queue it again and "
                "steer it from its panel (or with its key) within idle_timeout."
            )
        made = f"{run.writer.frames_written} frames ({session.made} chunks, {reason})"
        return run.output(made, result.state if result else None, f"; events in {kept}" if kept else "")


def unlisted_prefix(prefix: str) -> str:
    """Where a session's video and record go: a name nobody finds while it runs — a random part (/view serves any
    output file by its name; /history shows the name once the prompt has ended) and a subfolder (ComfyUI lists the
    output folder's top-level files to anyone at /internal/files/output), `omnidreams/` for a prefix without one."""
    folder = os.path.dirname(prefix.replace("\\", "/"))
    return f"{prefix if folder else 'omnidreams/' + prefix}_{secrets.token_hex(8)}"


def _save_record(run: StreamRun, session: LiveSession, seed: int, size, hdmap) -> str | None:
    """The session's record next to its video (nothing when no chunk was made); its name, as resume_from takes it."""
    if run.writer.frames_written == 0:
        return None
    source = "pushed" if session.hdmap_pushed else "video" if hdmap is not None else "none"
    info = {
        "seed": str(seed),
        "width": str(size[0]),
        "height": str(size[1]),
        "hdmap": source,
        "chunks": str(session.made),
    }
    try:  # in the node's `finally`: a failure here must not hide how the session ended
        path = safe_paths.reserve_output_file(_in_output(run.writer.path).removesuffix(".mp4") + ".events", STATE_EXT)
        write_record(path, session.events, session.frames_used, info)
    except Exception:
        compat.log.exception("OmniDreams Live: the session's record could not be saved")
        return None
    return _in_output(path)


NODES = [OmniDreamsLive]
