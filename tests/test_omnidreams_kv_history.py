"""FlashDreams' early short history (PR #566, `early_short_history_block_count`) as the loader's kv_history option:
the first N DiT blocks keep the sink and the current chunk only, the others the whole window. Checked on a tiny
random-weight DiT against a reference written from the rule (every chunk's K/V kept, each block's visible latent
frames picked by frame index), bit for bit; the uniform setting unchanged; the rule on the other blocks gives another
video; per-block buffers of constant size; and a saved state resumes only with the setting it was saved with. And the
loader's kv_finalize (FlashDreams' skip_finalize_kv_cache; its rule call by call: test_omnidreams_sampler)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo.models.handles import OmniDreamsConditioning
from omnivideo.models.omnidreams.kv_cache import RollingKVCache, window_state_problem
from omnivideo.models.omnidreams.loader import build_dit
from omnivideo.nodes import omnidreams as nodes
from omnivideo.pipelines import omnidreams as pipe
from omnivideo.pipelines.omnidreams import autoregressive
from omnivideo.pipelines.omnidreams.stream_state import check_state, state_metadata

H, W = 4, 6  # 2x3 tokens per latent frame with the 2x2 patch
CPU = torch.device("cpu")
FRAME_TOKENS = (H // 2) * (W // 2)
THREE = dataclasses.replace(TINY, num_blocks=3)  # one more block, so the first 1 or 2 can be the short ones
CHUNKS = 6  # the 3-slot window rolls from chunk 3, a short block's from chunk 1


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return build_dit(stored_state_dict(THREE, seed=1), torch.float32)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(3)
    text = torch.randn(1, 16, THREE.text_in_dim, generator=g)
    first = torch.randn(1, 16, 1, H, W, generator=g)
    hdmap = torch.randn(1, 16, 2 * CHUNKS, H, W, generator=g)
    return text, first, hdmap


def _rollout(model, inputs, settings, num_chunks=CHUNKS):
    text, first, hdmap = inputs
    return pipe.rollout(
        model, text, num_chunks=num_chunks, latent_hw=(H, W), seed=5, first_frame=first, hdmap=hdmap,
        settings=settings, device=CPU,
    )  # fmt: skip


def flashdreams_reference(settings: pipe.ARSettings, short_blocks):
    """A cache stand-in written from the rule, not from the slot arithmetic: it keeps every finished chunk's K/V (the
    last call's) per block and gives block b the latent frames f < sink_frames and f >= end - window_b of the full
    history, end = the current chunk's last frame + 1, window_b = len_t for b in `short_blocks` (FlashDreams' window
    of one chunk) and window_frames - sink_frames for the others (FlashDreams' window_size_t: after the sink)."""

    class Reference:
        def __init__(self, *, num_blocks, chunk_tokens, **_):
            self.tokens_per_frame = chunk_tokens // settings.len_t
            self.past = [[] for _ in range(num_blocks)]  # per block: finished chunks' (k, v)
            self.current = [None] * num_blocks
            self.chunk = -1

        def begin_chunk(self):
            if self.chunk >= 0:
                for b, kv in enumerate(self.current):
                    self.past[b].append(kv)
            self.current = [None] * len(self.current)
            self.chunk += 1

        def block(self, index):
            return _View(self, index)

        def visible(self, b, k, v):
            self.current[b] = (k, v)
            ks = torch.cat([*(kv[0] for kv in self.past[b]), k], dim=1)
            vs = torch.cat([*(kv[1] for kv in self.past[b]), v], dim=1)
            end = (self.chunk + 1) * settings.len_t
            window = settings.len_t if b in short_blocks else settings.window_frames - settings.sink_frames
            frame = torch.arange(end).repeat_interleave(self.tokens_per_frame)
            keep = (frame < settings.sink_frames) | (frame >= end - window)
            return ks[:, keep], vs[:, keep]

        def free(self):
            self.past.clear()

    return Reference


class _View:
    def __init__(self, cache, index):
        self.cache, self.index = cache, index

    def update(self, k, v):
        return self.cache.visible(self.index, k, v)


@pytest.mark.parametrize("sink_frames, short", [(0, 1), (0, 2), (2, 1)])
def test_early_short_history_equals_flashdreams_rule_bit_for_bit(model, inputs, monkeypatch, sink_frames, short):
    settings = pipe.ARSettings(window_frames=6 + sink_frames, sink_frames=sink_frames, short_history_blocks=short)
    ours = _rollout(model, inputs, settings)
    monkeypatch.setattr(autoregressive, "RollingKVCache", flashdreams_reference(settings, range(short)))
    ref = _rollout(model, inputs, settings)
    # the same K/V in the same order reach the same attention call: equal, not just close
    assert torch.equal(ours, ref)
    # the negative control: the short window on the last blocks instead of the first is another video
    monkeypatch.setattr(autoregressive, "RollingKVCache", flashdreams_reference(settings, range(3 - short, 3)))
    swapped = _rollout(model, inputs, settings)
    assert torch.equal(swapped[:, :, :2], ours[:, :, :2])  # chunk 0 has no history to drop
    assert (swapped[:, :, 2:] - ours[:, :, 2:]).abs().max() > 1e-4


def test_the_rule_changes_the_video_and_all_blocks_short_is_a_one_chunk_window(model, inputs):
    uniform = _rollout(model, inputs, pipe.ARSettings())
    mixed = _rollout(model, inputs, pipe.ARSettings(short_history_blocks=1))
    assert torch.equal(uniform[:, :, :2], mixed[:, :, :2]) and (uniform - mixed).abs().max() > 1e-4
    all_short = _rollout(model, inputs, pipe.ARSettings(short_history_blocks=3))
    assert torch.equal(all_short, _rollout(model, inputs, pipe.ARSettings(window_frames=2)))


def test_uniform_setting_is_todays_cache(model, inputs, monkeypatch):
    """short_history_blocks 0 builds the cache it always built (one window for every block) and equals the
    explicit rule with no short block."""
    assert pipe.ARSettings().block_window_chunks(3) is None
    built = []

    class Kept(RollingKVCache):
        def __init__(self, **kw):
            super().__init__(**kw)
            built.append(kw)

    monkeypatch.setattr(autoregressive, "RollingKVCache", Kept)
    ours = _rollout(model, inputs, pipe.ARSettings())
    assert built[0]["block_window_chunks"] is None and built[0]["window_chunks"] == 3
    monkeypatch.setattr(autoregressive, "RollingKVCache", flashdreams_reference(pipe.ARSettings(), ()))
    assert torch.equal(ours, _rollout(model, inputs, pipe.ARSettings()))


def test_short_blocks_hold_only_their_slots_and_memory_stays_constant(model, inputs, monkeypatch):
    seen = []

    class Watched(RollingKVCache):
        def begin_chunk(self):
            seen.append((self.nbytes, [t.data_ptr() for t in (*self.k, *self.v)], [w.roll.slot for w in self.windows]))
            return super().begin_chunk()

    monkeypatch.setattr(autoregressive, "RollingKVCache", Watched)
    _rollout(model, inputs, pipe.ARSettings(window_frames=8, sink_frames=2, short_history_blocks=2))
    chunk_bytes = 2 * FRAME_TOKENS * THREE.model_channels * 4
    assert seen[0][0] == 2 * chunk_bytes * (2 * (1 + 1) + 1 * (1 + 3))  # k and v; sink + 1 twice, sink + 3 once
    assert all(s[0] == seen[0][0] and s[1] == seen[0][1] for s in seen)  # one allocation for the whole rollout
    # slots at each chunk's start (before it takes one): the short blocks keep [sink | current] from chunk 1 on
    assert [s[2] for s in seen] == [[-1, -1, -1], [0, 0, 0], [1, 1, 1], [1, 1, 2], [1, 1, 3], [1, 1, 3]]


def test_settings_are_checked_and_travel_to_parallel_workers():
    with pytest.raises(ValueError, match="at most the model's 3 blocks"):
        pipe.ARSettings(short_history_blocks=4).block_window_chunks(3)
    with pytest.raises(ValueError, match="short_history_blocks=-1"):
        pipe.ARSettings(short_history_blocks=-1).slots()
    assert pipe.ARSettings(window_frames=8, sink_frames=2, short_history_blocks=2).block_window_chunks(3) == [1, 1, 3]
    # as DrivenRollout sends them (dataclasses.asdict over JSON) and the worker's operation rebuilds them
    settings = pipe.ARSettings(window_frames=4, short_history_blocks=9)
    sent = json.loads(json.dumps({"settings": dataclasses.asdict(settings)}))["settings"]
    assert pipe.ARSettings(**{**sent, "denoise": tuple(sent["denoise"])}) == settings


def _run(model, text, settings):
    return pipe.Rollout(model, text=text, latent_hw=(H, W), seed=11, device=CPU, settings=settings)


def test_mixed_state_resumes_bit_for_bit_and_only_with_its_setting(model, inputs):
    text, first, hdmap = inputs
    hd = lambda k: hdmap[:, :, 2 * k : 2 * k + 2]  # noqa: E731
    mixed = pipe.ARSettings(short_history_blocks=2)
    whole = _run(model, text, mixed)
    want = torch.cat([whole.step(hd(k)) for k in range(5)], dim=2)
    part = _run(model, text, mixed)
    head = [part.step(hd(k)) for k in range(4)]
    state = {k: v.clone() for k, v in part.state_dict().items()}
    assert [state[f"kv.k.{b}"].shape[1] // (2 * FRAME_TOKENS) for b in range(3)] == [1, 1, 3]
    resumed = _run(model, text, mixed)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([*head, resumed.step(hd(4))], dim=2), want)

    uniform = _run(model, text, pipe.ARSettings())
    for k in range(4):
        uniform.step(hd(k))
    with pytest.raises(ValueError, match=r"3 blocks of \[1, 12, 2, 32\] float32; .* need 3 blocks of \[1, 36, 2, 32\]"):
        uniform.load_state_dict(state)  # a mixed state, a uniform run
    with pytest.raises(ValueError, match=r"3 blocks of \[1, 36, 2, 32\] float32; .* need 3 blocks of \[1, 12, 2, 32\]"):
        _run(model, text, mixed).load_state_dict(uniform.state_dict())
    with pytest.raises(ValueError, match=r"block 1 of \[1, 12, 2, 32\] float32; .* block 1 of \[1, 36, 2, 32\]"):
        _run(model, text, pipe.ARSettings(short_history_blocks=1)).load_state_dict(state)  # 2 short blocks, 1 wanted

    # a stream state names its setting: the other one is refused from its metadata, before any tensor
    saved = state_metadata(11, (H, W), mixed)
    with pytest.raises(ValueError, match=r"short_history_blocks 2 \(this run: 0\).*kv_history"):
        check_state(saved, state_metadata(11, (H, W), pipe.ARSettings()))
    check_state(saved, state_metadata(11, (H, W), mixed))
    older = {k: v for k, v in state_metadata(11, (H, W), pipe.ARSettings()).items() if k != "short_history_blocks"}
    check_state(older, state_metadata(11, (H, W), pipe.ARSettings()))  # saved before the option: uniform

    # the header check knows each block's window from the settings
    entries = {k[3:]: (v.dtype, tuple(v.shape)) for k, v in state.items() if k.startswith("kv.")}
    read = lambda key: state[f"kv.{key}"]  # noqa: E731
    assert window_state_problem(entries, read, 3, lambda n: [1, 1, 3]) is None
    assert "whole chunks of one size" in window_state_problem(entries, read, 3)


def test_loader_option(comfy_folders):
    torch.save(stored_state_dict(THREE, seed=2), comfy_folders.models("diffusion_models") / "omnidreams_three.pt")
    load = nodes.OmniDreamsModelLoader.execute
    assert load("omnidreams_three.pt", "fp32", 4, 0)[0].short_history_blocks == 0  # a workflow saved before it
    assert load("omnidreams_three.pt", "fp32", 4, 0, "uniform", 2)[0].short_history_blocks == 0
    assert load("omnidreams_three.pt", "fp32", 4, 0, "early_short_history", 2)[0].short_history_blocks == 2
    with pytest.raises(ValueError, match="at most the model's 3 blocks: lower short_history_blocks"):
        load("omnidreams_three.pt", "fp32", 4, 0, "early_short_history", 9)
    with pytest.raises(ValueError, match="kv_history 'mixed' is not one of uniform, early_short_history"):
        load("omnidreams_three.pt", "fp32", 4, 0, "mixed", 9)
    inputs = {i.id: i for i in nodes.OmniDreamsModelLoader.define_schema().inputs}
    assert list(inputs)[4:6] == ["kv_history", "short_history_blocks"]  # widgets after sink_frames


def test_skip_finalize_resumes_bit_for_bit_and_only_with_its_setting(model, inputs):
    """kv_finalize "skip" (2 DiT calls a chunk): k chunks, saved, then the rest equal one run; a state names the
    mode, and a run in the other mode is refused from the metadata (a state saved before the option: the released
    context write)."""
    text, first, hdmap = inputs
    hd = lambda k: hdmap[:, :, 2 * k : 2 * k + 2]  # noqa: E731
    skip = pipe.ARSettings.for_kv_finalize("skip")
    assert skip.denoise == (1000, 100) and pipe.ARSettings.for_kv_finalize("context_noise") == pipe.ARSettings()
    whole = _run(model, text, skip)
    want = torch.cat([whole.step(hd(k)) for k in range(5)], dim=2)
    part = _run(model, text, skip)
    head = [part.step(hd(k)) for k in range(3)]
    resumed = _run(model, text, skip)
    resumed.load_state_dict({k: v.clone() for k, v in part.state_dict().items()})
    assert torch.equal(torch.cat([*head, resumed.step(hd(3)), resumed.step(hd(4))], dim=2), want)

    saved = state_metadata(11, (H, W), skip)
    with pytest.raises(ValueError, match=r"kv_finalize skip \(this run: context_noise\)"):
        check_state(saved, state_metadata(11, (H, W), pipe.ARSettings()))
    older = {k: v for k, v in state_metadata(11, (H, W), pipe.ARSettings()).items() if k != "kv_finalize"}
    check_state(older, state_metadata(11, (H, W), pipe.ARSettings()))
    with pytest.raises(ValueError, match="kv_finalize 'finalize' is not one of context_noise, skip"):
        pipe.ARSettings.for_kv_finalize("finalize")


def test_loader_kv_finalize_and_kv_dtype_options(comfy_folders):
    """The loader's kv_finalize and kv_dtype reach the rollout's settings; absent (a workflow saved before them): the
    released context write and the compute dtype. They are its last widgets: older workflows' values stay put."""
    torch.save(stored_state_dict(THREE, seed=2), comfy_folders.models("diffusion_models") / "omnidreams_three.pt")
    load = nodes.OmniDreamsModelLoader.execute
    older = load("omnidreams_three.pt", "fp32", 4, 0)[0]
    skip = load("omnidreams_three.pt", "fp32", 4, 0, kv_finalize="skip")[0]
    cond = OmniDreamsConditioning(text=torch.zeros(1, 4, THREE.text_in_dim))
    assert pipe.rollout_plan(older, cond, 64, 64)[1] == pipe.ARSettings(window_frames=4)
    assert pipe.rollout_plan(skip, cond, 64, 64)[1] == pipe.ARSettings.for_kv_finalize("skip", window_frames=4)
    with pytest.raises(ValueError, match="kv_finalize 'none' is not one of context_noise, skip"):
        load("omnidreams_three.pt", "fp32", 4, 0, kv_finalize="none")
    fp8 = load("omnidreams_three.pt", "fp32", 4, 0, kv_dtype="fp8_e4m3fn")[0]  # the fp8 window: test_omnidreams_kv_fp8
    assert pipe.rollout_plan(fp8, cond, 64, 64)[1] == pipe.ARSettings(window_frames=4, kv_dtype="fp8_e4m3fn")
    widgets = [i.id for i in nodes.OmniDreamsModelLoader.define_schema().inputs if i.id != "attention"]
    assert widgets[-2:] == ["kv_finalize", "kv_dtype"]
