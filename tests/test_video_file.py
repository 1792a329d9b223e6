"""integration/video_file: a long video streamed to a new H.264 mp4 under the output folder, in constant memory."""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from support.children import CHILD_CWD

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
        "from comfy_api.latest import InputImpl\n"
        "c = InputImpl.VideoFromFile(sys.argv[2]).get_components()\n"
        "print('PROBE_RESULT ' + json.dumps({'shape': list(c.images.shape), 'rate': str(c.frame_rate), "
        "'images': c.images.flatten().tolist()}))\n"
    )
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run(
        [python, "-c", script, str(comfyui_path), writer.path],
        cwd=CHILD_CWD,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out, err = proc.stdout[-2000:], proc.stderr[-3000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")), None)
    assert line is not None, f"VideoFromFile failed (rc {proc.returncode}):\n{out}\n{err}"
    result = json.loads(line.split(" ", 1)[1])
    assert result["shape"] == [9, 48, 64, 3]
    assert Fraction(result["rate"]) == 30
    images = torch.tensor(result["images"]).view(9, 48, 64, 3)
    assert (images - frames).abs().mean(dim=(1, 2)).max() < 0.03


def distinct_frames(frames: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """Frames each unlike every other (a flat random colour over a gradient): a wrong or shifted frame is off by
    ~0.15 on average, a right one by H.264's ~0.01."""
    colours = torch.rand(frames, 1, 1, 3, generator=torch.Generator().manual_seed(seed))
    return (0.6 * colours + 0.4 * gradient(frames, height, width)).contiguous()


def assert_frames_are(got: torch.Tensor, given: torch.Tensor) -> None:
    """Frame i of `got` is frame i of `given` (within H.264's loss) and closer to it than to any other."""
    error = (got[:, None] - given[None]).abs().mean(dim=(2, 3, 4))  # [decoded, given]
    right = error[torch.arange(len(got)), torch.arange(len(got))]
    assert right.max() < 0.03, right
    assert torch.equal(error.argmin(dim=1), torch.arange(len(got))), error.argmin(dim=1)


def test_the_file_is_complete_after_every_write_not_only_at_close(comfy_folders, tmp_path):
    """Each write() ends with its frames in a complete fragment of the file: a copy taken then plays them all."""
    frames = distinct_frames(21, 32, 48)
    with StreamingVideoWriter("growing", 30) as writer:
        done = 0
        for end in (5, 13, 21):  # 5 + 8 + 8, as OmniDreams writes its chunks
            writer.write(frames[done:end])
            done = end
            copy = tmp_path / f"after_{end}.mp4"
            shutil.copyfile(writer.path, copy)
            got, rate, codec = read_video(copy)
            assert got.shape[0] == end and rate == 30 and codec == "h264"
            assert_frames_are(got, frames[:end])
    with av.open(writer.path) as container:  # the finished file: its duration is that of its frames
        assert Fraction(container.duration, av.time_base) == Fraction(21, 30)
        assert [int(p.pts) for p in container.demux(video=0) if p.size] == [512 * i for i in range(21)]


def test_a_link_put_at_the_path_after_the_file_was_made_is_not_followed(comfy_folders, tmp_path):
    """The writer writes through the descriptor that made the file: a symlink swapped in at its path is neither
    written through nor removed, and the frames go to the file that was made."""
    target = tmp_path / "not_ours.mp4"
    target.write_bytes(b"someone else's")
    frames = distinct_frames(6, 32, 32)
    writer = StreamingVideoWriter("swapped", 30)
    made = tmp_path / "made.mp4"
    os.link(writer.path, made)  # a second name for the file the writer made
    os.unlink(writer.path)
    os.symlink(target, writer.path)
    writer.write(frames[:3])
    writer.write(frames[3:])
    writer.close()
    assert target.read_bytes() == b"someone else's" and os.readlink(writer.path) == str(target)
    got, _, _ = read_video(made)
    assert_frames_are(got, frames)

    empty = StreamingVideoWriter("swapped_empty", 30)  # no frame: close() removes the file only if it is ours
    os.unlink(empty.path)
    os.symlink(target, empty.path)
    empty.close()
    assert os.path.islink(empty.path) and target.read_bytes() == b"someone else's"


class _DiskFullOnce:
    """The writer's file, whose next write of `after` bytes or more stores only half of them and fails (ENOSPC);
    `snapshot` gets a copy of the file as it is then: what a process killed mid-write leaves."""

    def __init__(self, file, after: int, path: str, snapshot: Path):
        self.file, self.after, self.path, self.snapshot = file, after, path, snapshot

    def write(self, data) -> int:
        if self.after and len(data) >= self.after:
            self.after = 0
            self.file.write(data[: len(data) // 2])
            shutil.copyfile(self.path, self.snapshot)
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_fragment_cut_off_midway_leaves_the_earlier_ones_playable_and_a_failed_write_is_undone(
    comfy_folders, tmp_path
):
    frames = distinct_frames(13, 32, 32)
    writer = StreamingVideoWriter("full_disk", 30)
    writer.write(frames[:5])
    size = os.path.getsize(writer.path)
    cut = tmp_path / "cut.mp4"
    writer._file.file = _DiskFullOnce(writer._file.file, 100, writer.path, cut)
    with pytest.raises(OSError, match="No space left"):
        writer.write(frames[5:])
    assert os.path.getsize(cut) > size  # half a fragment (a free box until it is complete): readers skip it
    got, _, _ = read_video(cut)
    assert_frames_are(got, frames[:5])
    assert os.path.getsize(writer.path) == size  # the failed write is undone
    writer.close()  # the disk has room again: the frames still held are written
    got, _, _ = read_video(writer.path)
    assert_frames_are(got, frames)


KILLED_WRITER = """
import sys
import torch
from omnivideo import compat

compat.output_directory = lambda: sys.argv[1]
from omnivideo.integration.video_file import StreamingVideoWriter

chunks = torch.load(sys.argv[2])
writer = StreamingVideoWriter("killed", 30)  # never closed: the process is killed while writing
print(writer.path, flush=True)
for index, chunk in enumerate(chunks):
    writer.write(chunk)
    print(index, flush=True)
"""


def test_a_killed_process_leaves_a_file_with_every_finished_chunk(comfy_folders, tmp_path):
    """kill -9 while a long stream is being written: the file plays every chunk whose write() had returned."""
    frames = distinct_frames(5 + 8 * 199, 48, 64)
    chunks = [frames[:5], *frames[5:].split(8)]
    torch.save(chunks, tmp_path / "chunks.pt")
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(comfy_folders.output), str(tmp_path / "chunks.pt")],
        cwd=CHILD_CWD,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        path = child.stdout.readline().strip()
        finished = [child.stdout.readline().strip() for _ in range(3)]
        assert finished == ["0", "1", "2"], (finished, child.stderr.read()[-3000:] if child.poll() else "")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
        finished += child.stdout.read().split()  # chunks the process reported before the kill landed
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert len(finished) < len(chunks), "the process finished before it was killed"
    got, rate, _ = read_video(path)
    reported = 5 + 8 * (len(finished) - 1)
    assert reported <= got.shape[0] <= reported + 8 and rate == 30  # and at most the chunk being written
    assert_frames_are(got, frames[: got.shape[0]])


def test_the_subfolder_is_relative_to_a_linked_output_folder(tmp_path, monkeypatch):
    """ComfyUI's output folder may be a link (output -> ../outtest/omnidreams): the subfolder /view gets is the
    file's folder inside it, not a path that climbs out of the link."""
    from omnivideo import compat

    real = tmp_path / "outtest" / "omnidreams"
    real.mkdir(parents=True)
    (tmp_path / "comfyui").mkdir()
    linked = tmp_path / "comfyui" / "output"
    linked.symlink_to(Path("..") / "outtest" / "omnidreams", target_is_directory=True)
    monkeypatch.setattr(compat, "output_directory", lambda: str(linked))
    with StreamingVideoWriter("runs/day1/stream", 30) as nested, StreamingVideoWriter("top", 30) as top:
        nested.write(gradient(1, 16, 16))
        top.write(gradient(1, 16, 16))
    assert (nested.subfolder, os.path.basename(nested.path)) == (os.path.join("runs", "day1"), "stream.mp4")
    assert (top.subfolder, os.path.basename(top.path)) == ("", "top.mp4")
    assert (linked / nested.subfolder / "stream.mp4").is_file() and (real / "top.mp4").is_file()
