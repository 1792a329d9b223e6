"""The rollout's chunk on static buffers (`cuda_graph`; pipelines/omnidreams/static_step.py), run eagerly on the CPU:
bit for bit the eager rollout (a prompt switched in while it runs, both kv_finalize modes, the fp8 window), every
buffer the step reads or writes at the same address from chunk 2 on (so a captured graph stays valid), a resume
frame for frame; and the capture itself where a CUDA device is here (gpu_checks.sh)."""

from __future__ import annotations

import pytest
import torch
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo.backends import graphs
from omnivideo.models.omnidreams.loader import build_dit
from omnivideo.pipelines import omnidreams as pipe

H, W = 4, 6
CHUNKS = 8  # the 3-slot window is full from chunk 2; a prompt switches in at chunk 4 (6 on CUDA: after the capture)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return build_dit(stored_state_dict(TINY, seed=1), torch.float32)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(3)
    texts = [torch.randn(1, 16, TINY.text_in_dim, generator=g) for _ in range(2)]
    return texts, torch.randn(1, 16, 1, H, W, generator=g), torch.randn(1, 16, 2 * CHUNKS, H, W, generator=g)


def _roll(model, inputs, settings=None, chunks=CHUNKS, state=None, **kw):
    """(latent, the rollout) over `chunks` chunks from `state` (None: chunk 0), the second prompt from chunk 4."""
    (text, later), first, hdmap = inputs
    settings = settings or pipe.ARSettings()
    run = pipe.Rollout(
        model, text=text, latent_hw=(H, W), seed=5, first_frame=first, settings=settings, device=CPU, **kw
    )
    if state is not None:
        run.load_state_dict(state)
    out = []
    for _ in range(chunks):
        if run.chunk == 4:
            run.switch_prompt(4, later)
        out.append(run.step(hdmap[:, :, 2 * run.chunk : 2 * run.chunk + 2]))
    return torch.cat(out, dim=2), run


@pytest.mark.parametrize(
    "settings",
    [
        pipe.ARSettings(),
        pipe.ARSettings.for_kv_finalize("skip"),
        pipe.ARSettings(kv_dtype="fp8_e4m3fn"),
        pipe.ARSettings(window_frames=2),  # one slot: full at chunk 0, whose first frame is pinned (eager)
    ],
    ids=["context_noise", "skip", "fp8 window", "one-slot window"],
)
def test_the_static_step_is_the_eager_rollout_bit_for_bit(model, inputs, settings):
    eager, _ = _roll(model, inputs, settings)
    static, run = _roll(model, inputs, settings, cuda_graph=True)
    first_static = max(1, settings.slots()[1] - 1)  # the window full, chunk 0 pinned
    assert run.static.chunks == CHUNKS - first_static  # these chunks ran on the static buffers
    differ = [
        k for k in range(CHUNKS) if not torch.equal(static[:, :, 2 * k : 2 * k + 2], eager[:, :, 2 * k : 2 * k + 2])
    ]
    assert not differ, f"chunks {differ} differ; max |diff| {float((static - eager).abs().max()):.3g}"


def test_every_buffer_keeps_its_storage_from_chunk_2_on(model, inputs):
    (text, later), first, hdmap = inputs
    run = pipe.Rollout(model, text=text, latent_hw=(H, W), seed=5, first_frame=first, device=CPU, cuda_graph=True)
    seen = []
    for k in range(CHUNKS):
        if k == 4:
            run.switch_prompt(4, later)  # a new prompt's K/V are copied into the same storage
        run.step(hdmap[:, :, 2 * k : 2 * k + 2])
        if k >= 2:
            seen.append([(t.data_ptr(), t.shape, t.dtype) for t in run.static.buffers()])
    assert (
        len(seen[0]) == 3 + 3 + 1 + 2 + 1 + 2 * TINY.num_blocks * 2
    )  # noise, times, out, rope, hdmap, prompt K/V, window
    moved = [k + 2 for k, addresses in enumerate(seen) if addresses != seen[0]]
    assert not moved, f"buffers moved at chunks {moved}"


def test_a_static_rollout_resumes_frame_for_frame(model, inputs):
    whole, _ = _roll(model, inputs, cuda_graph=True)
    head, part = _roll(model, inputs, chunks=3, cuda_graph=True)
    tail, _ = _roll(model, inputs, chunks=CHUNKS - 3, state=part.state_dict(), cuda_graph=True)
    assert torch.equal(torch.cat([head, tail], dim=2), whole)


def test_a_static_rollout_reads_an_hdmap_at_every_chunk_or_none(model, inputs):
    (text, _), first, hdmap = inputs
    run = pipe.Rollout(model, text=text, latent_hw=(H, W), seed=5, first_frame=first, device=CPU, cuda_graph=True)
    for k in range(3):
        run.step(hdmap[:, :, 2 * k : 2 * k + 2])
    with pytest.raises(ValueError, match="reads an HD-map at every chunk or at none"):
        run.step(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device captures the graph (gpu_checks.sh)")
def test_the_step_is_captured_and_replayed_on_cuda():
    calls, out = [], torch.zeros(4, device="cuda")
    source = torch.ones(4, device="cuda")

    def step():
        calls.append(1)
        out.copy_(source * 2)

    weights = [1]  # what the replay reads besides the step's own storage (the DiT's weights' addresses)
    replayed = graphs.ReplayedStep(step, torch.device("cuda"), lambda: list(weights))
    for value in range(1, 6):
        source.fill_(value)
        replayed()
        assert out.tolist() == [2.0 * value] * 4
    assert replayed.captured and len(calls) == graphs.WARMUP_CALLS + 1  # warm-ups, then one capture, replays after
    weights[0] = 2  # ComfyUI moved the weights: warm up and capture again
    for value in range(6, 10):
        source.fill_(value)
        replayed()
        assert out.tolist() == [2.0 * value] * 4
    assert replayed.captured and len(calls) == 2 * (graphs.WARMUP_CALLS + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device captures the graph (gpu_checks.sh)")
def test_the_captured_rollout_is_the_eager_rollout_on_cuda(inputs):
    cuda = torch.device("cuda")
    model = build_dit(stored_state_dict(TINY, seed=1), torch.float32).to(cuda)
    (text, later), first, hdmap = inputs

    def roll(**kw):
        run = pipe.Rollout(model, text=text, latent_hw=(H, W), seed=5, first_frame=first, device=cuda, **kw)
        out = []
        for k in range(CHUNKS):
            if k == 6:
                run.switch_prompt(6, later)
            out.append(run.step(hdmap[:, :, 2 * k : 2 * k + 2]))
        return torch.cat(out, dim=2), run

    eager, _ = roll()
    graphed, run = roll(cuda_graph=True)  # warm-ups at chunks 2-3, the capture at 4, replays (a new prompt at 6)
    assert run.static.replayed.captured
    assert torch.equal(graphed, eager), f"max |diff| {float((graphed - eager).abs().max()):.3g}"


def test_cuda_graph_is_refused_for_a_parallel_rollout(model, inputs):
    from omnivideo import compat
    from omnivideo.models.handles import OmniDreamsModel

    handle = OmniDreamsModel(patcher=compat.manage(model, "diffusion", CPU), dtype=torch.float32, world_size=2)
    (text, _), first, _ = inputs
    with pytest.raises(ValueError, match="cuda_graph runs one device's rollout"):
        pipe.open_rollout(handle, text=text, latent_hw=(H, W), seed=5, first_frame=first, cuda_graph=True)
