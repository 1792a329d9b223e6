"""integration/video_file: a long video streamed to a new H.264 mp4 under the output folder, in constant memory."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av", reason="PyAV (the test extra, a ComfyUI requirement) writes and reads the mp4 files")

from omnivideo.integration import safe_paths  # noqa: E402
from omnivideo.integration.video_file import StreamingVideoWriter, exact_rate  # noqa: E402


def gradient(frames: int, height: int, width: int) -> torch.Tensor:
    """A smooth IMAGE [F, H, W, 3]: red across, green down, blue over time (so each frame differs from the next)."""
    x = torch.linspace(0, 1, width).view(1, 1, width).expand(frames, height, width)
    y = torch.linspace(0, 1, height).view(1, height, 1).expand(frames, height, width)
    t = torch.linspace(0, 1, frames).view(frames, 1, 1).expand(frames, height, width)
    return torch.stack([x, y, t], dim=-1).contiguous()


def read_video(path: str | Path) -> tuple[torch.Tensor, Fraction, str]:
    """(frames [F, H, W, 3] float in [0, 1], average rate, codec name) of an mp4, decoded by PyAV."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        rate, codec = Fraction(stream.average_rate), stream.codec_context.name
    if not frames:
        return torch.zeros(0, 0, 0, 3), rate, codec
    return torch.from_numpy(np.stack(frames)).float() / 255, rate, codec


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("fps", [30, 24, 30000 / 1001, 12.5])
def test_frames_written_in_several_calls_come_back_at_the_fps_size_and_colours(comfy_folders, fps):
    frames = gradient(13, 48, 80)
    with StreamingVideoWriter("omnidreams/stream", fps) as writer:
        for chunk in frames.split(5):  # 5 + 5 + 3
            writer.write(chunk)
        assert writer.frames_written == 13
    assert writer.path == str(comfy_folders.output / "omnidreams" / "stream.mp4")

    got, rate, codec = read_video(writer.path)
    assert codec == "h264"
    assert rate == exact_rate(fps) and rate == Fraction(fps).limit_denominator(1001)
    assert got.shape == frames.shape
    # H.264 and yuv420p are lossy: a few levels of 255 on average, per frame and channel (a swapped channel,
    # a dropped or reordered frame is off by 0.08 or more)
    error = (got - frames).abs().mean(dim=(1, 2))
    assert error.max() < 0.03, error


def test_any_float_dtype_a_strided_view_and_values_out_of_range_are_taken(comfy_folders):
    frames = gradient(6, 32, 64)
    with StreamingVideoWriter("dtypes", 30) as writer:
        writer.write(frames[:2].to(torch.bfloat16))
        writer.write(frames[2:4].transpose(1, 2).contiguous().transpose(1, 2))  # same values, not contiguous
        writer.write(torch.zeros(0, 32, 64, 3, dtype=torch.float16))  # no frames: nothing happens
        beyond = frames[4:] * 3 - 1  # below 0 and above 1: clamped, as core's SaveVideo does
        beyond[:, :4] = float("nan")  # NaN: black
        writer.write(beyond.to(torch.float16))
    expected = torch.cat([frames[:4], torch.nan_to_num(beyond, nan=0.0).clamp(0, 1)])
    got, _, _ = read_video(writer.path)
    assert got.shape == expected.shape
    assert (got - expected).abs().mean(dim=(1, 2)).max() < 0.03


def test_an_exception_inside_the_with_block_leaves_a_playable_file_with_the_frames_written(comfy_folders):
    frames = gradient(7, 32, 32)
    with pytest.raises(RuntimeError, match="sampler failed"):
        with StreamingVideoWriter("interrupted", 30) as writer:
            writer.write(frames[:4])
            writer.write(frames[4:])
            raise RuntimeError("sampler failed")
    got, rate, _ = read_video(writer.path)
    assert got.shape[0] == 7 and rate == 30
    assert (got - frames).abs().mean(dim=(1, 2)).max() < 0.03


def test_frames_reach_the_file_while_writing_not_only_at_close(comfy_folders):
    writer = StreamingVideoWriter("live", 30)
    chunk = torch.rand(10, 128, 128, 3)  # noise: big packets (~10 kB a frame), well past x264's lookahead
    for _ in range(20):
        writer.write(chunk)
    assert os.path.getsize(writer.path) > 2**19  # the muxer writes in blocks of 256 kB
    writer.close()
    assert read_video(writer.path)[0].shape[0] == 200


def test_close_is_idempotent_and_writing_after_close_is_refused(comfy_folders):
    writer = StreamingVideoWriter("closed", 30)
    writer.write(gradient(2, 16, 16))
    writer.close()
    size = os.path.getsize(writer.path)
    writer.close()
    writer.__exit__(None, None, None)
    assert os.path.getsize(writer.path) == size
    with pytest.raises(ValueError, match="already closed"):
        writer.write(gradient(1, 16, 16))
    assert read_video(writer.path)[0].shape[0] == 2


def test_a_second_writer_with_the_same_name_gets_a_counter_and_the_first_file_is_untouched(comfy_folders):
    with StreamingVideoWriter("omnidreams/run", 30) as first:
        first.write(gradient(3, 32, 32))
    before = Path(first.path).read_bytes()
    with StreamingVideoWriter("omnidreams/run", 30) as second:
        second.write(torch.rand(5, 32, 32, 3))
    assert first.path == str(comfy_folders.output / "omnidreams" / "run.mp4")
    assert second.path == str(comfy_folders.output / "omnidreams" / "run_00001.mp4")
    assert Path(first.path).read_bytes() == before
    assert read_video(first.path)[0].shape[0] == 3 and read_video(second.path)[0].shape[0] == 5

    # a file that is not ours is not replaced either, even before its writer got a frame
    (comfy_folders.output / "mine.mp4").write_bytes(b"not a video")
    with StreamingVideoWriter("mine.mp4", 30) as third:  # ".mp4" is not doubled
        assert third.path.endswith("mine_00001.mp4")
        third.write(gradient(1, 16, 16))
    assert (comfy_folders.output / "mine.mp4").read_bytes() == b"not a video"


@pytest.mark.parametrize(
    "name, why",
    [
        ("../escape", "'..' is not accepted"),
        ("omnidreams/../../escape", "'..' is not accepted"),
        ("/tmp/absolute", "absolute paths are not accepted"),
        ("C:/absolute", "absolute paths are not accepted"),
        ("line\nbreak", "control characters"),
        ("nul\x00byte", "control characters"),
        ("  ", "no name was given"),
    ],
)
def test_names_outside_the_output_folder_are_refused_before_any_file_is_made(comfy_folders, name, why):
    with pytest.raises(safe_paths.PathRefused, match=why) as refused:
        StreamingVideoWriter(name, 30)
    assert "filename_prefix" in str(refused.value) and "relative to ComfyUI's output folder" in str(refused.value)
    assert files_under(comfy_folders.base) == []


def test_a_symlink_out_of_the_output_folder_is_refused(comfy_folders, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (comfy_folders.output / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(safe_paths.PathRefused, match="leads outside ComfyUI's output folder"):
        StreamingVideoWriter("link/video", 30, what="save_as")
    assert list(outside.iterdir()) == []


def test_a_size_change_mid_stream_is_refused_before_anything_is_written(comfy_folders):
    frames = gradient(3, 32, 48)
    with StreamingVideoWriter("resized", 30) as writer:
        writer.write(frames)
        with pytest.raises(ValueError, match=r"frames of 64x32 cannot follow the 48x32 frames"):
            writer.write(gradient(2, 32, 64))
        with pytest.raises(ValueError, match=r"IMAGE tensor \[frames, height, width, 3\]; got \(32, 48, 3\)"):
            writer.write(frames[0])
        with pytest.raises(ValueError, match=r"got \(1, 32, 48, 4\)"):
            writer.write(torch.rand(1, 32, 48, 4))
        assert writer.frames_written == 3
    got, _, _ = read_video(writer.path)
    assert got.shape == frames.shape


@pytest.mark.parametrize("height, width", [(31, 48), (32, 47), (1, 2)])
def test_odd_sizes_are_refused_with_what_to_do_and_leave_no_file(comfy_folders, height, width):
    with StreamingVideoWriter("odd", 30) as writer:
        with pytest.raises(ValueError, match=rf"even width and height.*{width}x{height}.*Crop or scale"):
            writer.write(torch.rand(2, height, width, 3))
        assert writer.frames_written == 0
    assert files_under(comfy_folders.output) == []


def test_a_writer_that_never_got_a_frame_leaves_no_file(comfy_folders):
    writer = StreamingVideoWriter("nothing/here", 30)
    assert os.path.isfile(writer.path) and os.path.getsize(writer.path) == 0  # reserved at once
    writer.write(torch.zeros(0, 16, 16, 3))
    writer.close()
    assert not os.path.exists(writer.path)

    with pytest.raises(KeyError):
        with StreamingVideoWriter("nothing/here", 30) as failed:
            raise KeyError("before the first frame")
    assert failed.path == writer.path  # the name was free again
    assert files_under(comfy_folders.output) == []


@pytest.mark.parametrize("fps", [0, -30, float("nan"), float("inf"), "30", True, None])
def test_a_bad_fps_is_refused_before_a_name_is_reserved(comfy_folders, fps):
    with pytest.raises(ValueError, match="fps"):
        StreamingVideoWriter("rate", fps)
    assert files_under(comfy_folders.output) == []


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc (Linux)")
def test_memory_stays_flat_while_writing_many_frames(comfy_folders):
    """300 frames of 256x256 are 59 MB as uint8 (236 MB as float): kept in Python, they would show. Encoded as they
    come, the process grows only by x264's fixed pipeline (its lookahead and frame threads: ~20 MB at this size,
    reached by frame 50), so from frame 60 to frame 360 it stays flat."""
    chunk = torch.rand(10, 256, 256, 3)  # one chunk, written again and again: the test holds no frames itself
    with StreamingVideoWriter("long", 30) as writer:
        for _ in range(6):
            writer.write(chunk)
        gc.collect()
        after_60 = peak = _rss_bytes()
        for _ in range(30):
            writer.write(chunk)
            peak = max(peak, _rss_bytes())
        assert writer.frames_written == 360
    growth = peak - after_60
    assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB while writing frames 60..360"
    with av.open(writer.path) as container:
        assert sum(1 for packet in container.demux(video=0) if packet.size) == 360


def test_the_file_opens_as_comfyuis_video(comfy_folders, comfyui_path):
    """core's VideoFromFile (what compat.video_from_file returns) reads every frame at the exact rate."""
    frames = gradient(9, 48, 64)
    with StreamingVideoWriter("omnidreams/for_comfy", 30) as writer:
        writer.write(frames[:4])
        writer.write(frames[4:])
    script = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from comfy_api.input_impl import VideoFromFile\n"
        "c = VideoFromFile(sys.argv[2]).get_components()\n"
        "print('PROBE_RESULT ' + json.dumps({'shape': list(c.images.shape), 'rate': str(c.frame_rate), "
        "'images': c.images.flatten().tolist()}))\n"
    )
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run(
        [python, "-c", script, str(comfyui_path), writer.path], capture_output=True, text=True, timeout=300
    )
    out, err = proc.stdout[-2000:], proc.stderr[-3000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")), None)
    assert line is not None, f"VideoFromFile failed (rc {proc.returncode}):\n{out}\n{err}"
    result = json.loads(line.split(" ", 1)[1])
    assert result["shape"] == [9, 48, 64, 3]
    assert Fraction(result["rate"]) == 30
    images = torch.tensor(result["images"]).view(9, 48, 64, 3)
    assert (images - frames).abs().mean(dim=(1, 2)).max() < 0.03
