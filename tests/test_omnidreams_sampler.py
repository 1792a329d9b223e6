"""OmniDreams AR rollout: the clean first-frame context write (regression test for the known
blur bug), the rolling KV cache against an explicit-window reference, RoPE time offsets,
determinism and the sampler entry."""

from __future__ import annotations

import types

import pytest
import torch
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo import compat
from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel
from omnivideo.models.omnidreams import dit as omnidreams_dit
from omnivideo.models.omnidreams.kv_cache import RollingKVCache
from omnivideo.models.omnidreams.loader import build_dit
from omnivideo.pipelines import omnidreams as pipe
from omnivideo.pipelines.omnidreams import autoregressive

H, W = 4, 6  # latent size: 2x3 tokens per frame with the 2x2 patch
CPU = torch.device("cpu")
FRAME_TOKENS = (H // 2) * (W // 2)
CHUNK_TOKENS = 2 * FRAME_TOKENS


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return build_dit(stored_state_dict(TINY, seed=1), torch.float32)


@pytest.fixture(scope="module")
def text():
    return torch.randn(1, 16, TINY.text_in_dim, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def first_frame():
    return torch.randn(1, 16, 1, H, W, generator=torch.Generator().manual_seed(4))


def _rollout(model, text, first_frame=None, num_chunks=1, seed=42, **kw):
    return pipe.rollout(
        model, text, num_chunks=num_chunks, latent_hw=(H, W), seed=seed, first_frame=first_frame, device=CPU, **kw
    )


def observe_cache(monkeypatch, observe):
    """Call observe(k, cache) after chunk k's context write: the rollout's cache, watched from outside."""

    class Observed(RollingKVCache):
        chunk = -1

        def begin_chunk(self):
            if self.chunk >= 0:
                observe(self.chunk, self)
            self.chunk += 1
            return super().begin_chunk()

        def free(self):
            if self.chunk >= 0:
                observe(self.chunk, self)
            super().free()

    monkeypatch.setattr(autoregressive, "RollingKVCache", Observed)


def without_context_reinjection(monkeypatch):
    """The known port bug: no clean first frame before the context-noise call."""
    monkeypatch.setattr(autoregressive, "_pin_context", lambda xc, image, inject: xc)


# ------------------------------------------------------------------ the clean context write


class _BlockViews:
    """The `block(i)` window a cache gives the DiT, for the test caches below (keyed by block index)."""

    def block(self, index):
        return types.SimpleNamespace(update=lambda k, v: self.update(index, k, v))


class _Recorder(_BlockViews):
    """Cache stand-in that keeps what each block wrote and attends to this chunk only."""

    def __init__(self):
        self.kv = {}

    def update(self, block, k, v):
        self.kv[block] = (k.clone(), v.clone())
        return k, v


def _frame0_kv(model, text, x, mask):
    rec = _Recorder()
    model(x, 128.0, model.cross_kv(text), cond_mask=mask, t_offset=0, kv_cache=rec)
    return [(k[:, :FRAME_TOKENS], v[:, :FRAME_TOKENS]) for k, v in (rec.kv[b] for b in range(TINY.num_blocks))]


def context_write_check(model, text, first_frame, monkeypatch, seed=42):
    """Run chunk 0 and compare the cached frame-0 K/V of every block with K/V recomputed
    independently from the clean-injected and from the noisy context latent.
    Returns (max |cached - clean|, min over blocks of max |cached - noisy|)."""
    cached = {}

    def observe(k, cache):
        if k == 0:
            cached.update(
                {b: tuple(t[:, :FRAME_TOKENS].clone() for t in cache.slot_kv(b, 0)) for b in range(TINY.num_blocks)}
            )

    observe_cache(monkeypatch, observe)
    x0 = _rollout(model, text, first_frame, seed=seed)
    # replay the generator: draws 1, 2, 3 of chunk 0; the third is the context noise
    gen = torch.Generator("cpu").manual_seed(seed)
    noise = [torch.randn(1, 16, 2, H, W, generator=gen) for _ in range(3)][2]
    sched = pipe.released_schedule()
    noisy = (1 - sched.context_sigma) * x0 + sched.context_sigma * noise
    clean = noisy.clone()
    clean[:, :, 0] = first_frame[:, :, 0]
    mask = torch.zeros(1, 1, 2, H, W)
    mask[:, :, 0] = 1
    kv_clean, kv_noisy = _frame0_kv(model, text, clean, mask), _frame0_kv(model, text, noisy, mask)
    to_clean = max(float((c - r).abs().max()) for b in range(TINY.num_blocks) for c, r in zip(cached[b], kv_clean[b]))
    to_noisy = min(
        max(float((c - r).abs().max()) for c, r in zip(cached[b], kv_noisy[b])) for b in range(TINY.num_blocks)
    )
    return to_clean, to_noisy


def test_cached_frame0_kv_come_from_the_clean_context_latent(model, text, first_frame, monkeypatch):
    to_clean, to_noisy = context_write_check(model, text, first_frame, monkeypatch)
    assert to_clean < 1e-5, "the cache holds frame-0 K/V that were not computed from the clean first frame"
    assert to_noisy > 1e-2, "clean and noisy K/V coincide: the check could not tell the bug apart"


def test_check_detects_a_sampler_without_the_second_reinjection(model, text, first_frame, monkeypatch):
    """The known port bug: no re-injection before the context-noise call."""
    without_context_reinjection(monkeypatch)
    to_clean, to_noisy = context_write_check(model, text, first_frame, monkeypatch)
    assert to_clean > 1e-2  # the regression test above would fail on this sampler
    assert to_noisy < 1e-5  # ... because the cache holds the noise-corrupted frame 0


def test_first_frame_is_emitted_exactly(model, text, first_frame):
    z = _rollout(model, text, first_frame, num_chunks=2)
    assert torch.equal(z[:, :, 0], first_frame[:, :, 0])
    assert not torch.equal(z[:, :, 2], first_frame[:, :, 0])


# ------------------------------------------------------------------ KV cache


class ExplicitWindowCache(_BlockViews):
    """Reference: keeps every chunk's final K/V in a list and concatenates the window explicitly."""

    def __init__(self, *, num_blocks, chunk_tokens, window_chunks, sink_chunks, **_):
        self.sink, self.total = sink_chunks, sink_chunks + window_chunks
        self.history: list[list] = []  # per finished chunk: per block (k, v)
        self.current: list | None = None
        self.num_blocks = num_blocks

    def begin_chunk(self):
        if self.current is not None:
            self.history.append(self.current)
        self.current = [None] * self.num_blocks

    def update(self, block, k, v):
        self.current[block] = (k, v)
        c = len(self.history)
        keep = self.total - 1  # past chunks visible beside the current one
        if c <= keep:
            past = self.history
        else:
            recent = keep - self.sink
            past = self.history[: self.sink] + (self.history[c - recent :] if recent else [])
        ks = [h[block][0] for h in past] + [k]
        vs = [h[block][1] for h in past] + [v]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    def free(self):
        self.history.clear()


@pytest.mark.parametrize("sink_frames", [0, 2])
def test_rolling_cache_equals_explicit_window_reference(model, text, first_frame, sink_frames, monkeypatch):
    settings = pipe.ARSettings(sink_frames=sink_frames)
    ours = _rollout(model, text, first_frame, num_chunks=5, settings=settings)
    monkeypatch.setattr(autoregressive, "RollingKVCache", ExplicitWindowCache)
    ref = _rollout(model, text, first_frame, num_chunks=5, settings=settings)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_full_window_differs_from_a_longer_one(model, text, first_frame):
    """The window matters: a cache keeping 8 frames sees chunk 0 at chunk 3 and gives another video."""
    ours = _rollout(model, text, first_frame, num_chunks=4)
    longer = _rollout(model, text, first_frame, num_chunks=4, settings=pipe.ARSettings(window_frames=8))
    torch.testing.assert_close(ours[:, :, :6], longer[:, :, :6], rtol=0, atol=1e-5)
    assert (ours[:, :, 6:] - longer[:, :, 6:]).abs().max() > 1e-4


def test_window_shifts_exactly_at_chunk_3_and_memory_stays_constant(model, text, first_frame, monkeypatch):
    log = []

    def observe(k, cache):
        log.append(
            {
                "slot": cache.slot,
                "visible": cache.visible_tokens,
                "bytes": cache.nbytes,
                "ptrs": [t.data_ptr() for t in (*cache.k, *cache.v)],
                "slots": [cache.slot_kv(0, s)[0].clone() for s in range(3)],
            }
        )

    observe_cache(monkeypatch, observe)
    _rollout(model, text, first_frame, num_chunks=6)
    assert [e["slot"] for e in log] == [0, 1, 2, 2, 2, 2]
    assert [e["visible"] // CHUNK_TOKENS for e in log] == [1, 2, 3, 3, 3, 3]
    # no shift before chunk 3: slots hold chunks 0, 1, 2 as written
    assert torch.equal(log[2]["slots"][0], log[0]["slots"][0])
    assert torch.equal(log[2]["slots"][1], log[1]["slots"][1])
    # chunk 3 shifted by exactly one chunk: slots hold chunks 1, 2, 3
    assert torch.equal(log[3]["slots"][0], log[1]["slots"][1])
    assert torch.equal(log[3]["slots"][1], log[2]["slots"][2])
    assert not torch.equal(log[3]["slots"][2], log[2]["slots"][2])
    assert torch.equal(log[5]["slots"][0], log[3]["slots"][2])
    # one allocation for the whole rollout
    assert len({e["bytes"] for e in log}) == 1 and all(e["ptrs"] == log[0]["ptrs"] for e in log)
    assert log[0]["bytes"] == 2 * TINY.num_blocks * 3 * CHUNK_TOKENS * TINY.model_channels * 4


def test_cache_is_freed_at_the_end_and_on_interrupt(model, text, first_frame, monkeypatch):
    caches = []

    class Kept(RollingKVCache):
        def __init__(self, **kw):
            super().__init__(**kw)
            caches.append(self)

    monkeypatch.setattr(autoregressive, "RollingKVCache", Kept)
    _rollout(model, text, first_frame, num_chunks=2)
    assert caches[-1].k == [] and caches[-1].v == []

    calls = {"n": 0}

    def interrupt_on_fifth():
        calls["n"] += 1
        if calls["n"] == 5:
            raise compat.ProcessingInterrupted("cancelled")

    monkeypatch.setattr(compat, "check_interrupt", interrupt_on_fifth)
    with pytest.raises(compat.ProcessingInterrupted):
        _rollout(model, text, first_frame, num_chunks=3)
    assert calls["n"] == 5 and caches[-1].k == []  # interrupted in chunk 1, between calls


def test_rope_time_offset_grows_per_chunk(model, text, first_frame, monkeypatch):
    offsets, angles = [], []
    real_forward, real_rope = model.forward, omnidreams_dit.rope_cos_sin

    def spy_forward(*args, **kw):
        offsets.append(kw["t_offset"])
        return real_forward(*args, **kw)

    def spy_rope(cfg, t, h, w, t_offset=0, device=None):
        angles.append(t_offset)
        return real_rope(cfg, t, h, w, t_offset=t_offset, device=device)

    monkeypatch.setattr(model, "forward", spy_forward)
    monkeypatch.setattr(omnidreams_dit, "rope_cos_sin", spy_rope)
    model._rope_memo = None
    _rollout(model, text, first_frame, num_chunks=4)
    assert offsets == [0] * 3 + [2] * 3 + [4] * 3 + [6] * 3  # three calls per chunk, ar_idx * len_t
    assert angles == [0, 2, 4, 6]  # computed once per chunk


def test_three_draws_per_chunk_from_one_generator(model, text, monkeypatch):
    shapes = []
    real = torch.randn

    def spy(*args, **kw):
        if "generator" in kw:
            shapes.append(tuple(args[0]))
        return real(*args, **kw)

    monkeypatch.setattr(autoregressive.torch, "randn", spy)
    _rollout(model, text, None, num_chunks=3)
    assert shapes == [(1, 16, 2, H, W)] * 9


# ------------------------------------------------------------------ determinism and the entry


def test_same_seed_same_latents_different_seed_different(model, text, first_frame):
    a = _rollout(model, text, first_frame, num_chunks=2, seed=7)
    b = _rollout(model, text, first_frame, num_chunks=2, seed=7)
    c = _rollout(model, text, first_frame, num_chunks=2, seed=8)
    assert torch.equal(a, b)
    assert (a[:, :, 1:] - c[:, :, 1:]).abs().max() > 1e-3


def test_hdmap_changes_the_video(model, text, first_frame):
    hd = torch.randn(1, 16, 4, H, W, generator=torch.Generator().manual_seed(5))
    plain = _rollout(model, text, first_frame, num_chunks=2)
    with_map = _rollout(model, text, first_frame, num_chunks=2, hdmap=hd)
    zeros = _rollout(model, text, first_frame, num_chunks=2, hdmap=torch.zeros_like(hd))
    assert torch.equal(plain, zeros)  # absent = zeros
    assert (plain - with_map).abs().max() > 1e-3


def _handle(model, ar=None):
    patcher = compat.manage(model, "diffusion", torch.device("cpu"))
    return OmniDreamsModel(patcher=patcher, dtype=torch.float32, **(ar or {}))


def test_sample_returns_raw_wan_latent(model, text, first_frame):
    cond = OmniDreamsConditioning(text=text, first_frame=first_frame)
    bars = []

    class Bar:
        def __init__(self, total):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

    out = pipe.sample(_handle(model), cond, seed=42, frames=13, steps=0, width=64, height=64, progress=Bar)
    z = out
    assert z.shape == (1, 16, 4, H, W)  # 13 frames = 2 chunks, size from the first frame
    assert bars[0].total == 2 and bars[0].n == 2
    ref = _rollout(model, text, first_frame, num_chunks=2)
    torch.testing.assert_close(pipe.normalize_latent(z), ref, rtol=1e-5, atol=1e-5)
    mean = torch.tensor(pipe.LATENT_MEAN).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(z[:, :, :1], first_frame * torch.tensor(pipe.LATENT_STD).view(1, 16, 1, 1, 1) + mean)


def test_sample_rejects_bad_inputs(model, text, first_frame):
    cond = OmniDreamsConditioning(text=text, first_frame=first_frame)
    with pytest.raises(ValueError, match="2 steps"):
        pipe.sample(_handle(model), cond, seed=0, frames=5, steps=4, width=64, height=64)
    bad_text = OmniDreamsConditioning(text=torch.zeros(1, 512, 7), first_frame=first_frame)
    with pytest.raises(ValueError, match="text embedding"):
        pipe.sample(_handle(model), bad_text, seed=0, frames=5, steps=0, width=64, height=64)
    short_map = cond.replace(hdmap=torch.zeros(1, 16, 2, H, W))
    with pytest.raises(ValueError, match="HD-map"):
        pipe.sample(_handle(model), short_map, seed=0, frames=13, steps=0, width=64, height=64)
    with pytest.raises(ValueError, match="multiple of the chunk"):
        pipe.sample(_handle(model, {"window_frames": 5}), cond, seed=0, frames=5, steps=0, width=64, height=64)


def test_frames_to_chunks():
    assert [pipe.num_chunks_for_frames(f) for f in (1, 5, 6, 13, 61, 62)] == [1, 1, 2, 2, 8, 9]
    assert [pipe.pixel_frames(n) for n in (1, 2, 8)] == [5, 13, 61]
    for len_t in (1, 2, 3, 4):  # the smallest N whose pixel_frames(N, len_t) covers the request
        for frames in range(1, 60):
            n = pipe.num_chunks_for_frames(frames, len_t)
            assert pipe.pixel_frames(n, len_t) >= frames and (n == 1 or pipe.pixel_frames(n - 1, len_t) < frames)


def test_sample_uses_the_chunk_length_of_the_settings(model, text, first_frame):
    cond = OmniDreamsConditioning(text=text, first_frame=first_frame)
    z = pipe.sample(_handle(model, {"chunk_frames": 1}), cond, seed=0, frames=9, steps=0, width=64, height=64)
    assert z.shape == (1, 16, 3, H, W)  # 9 frames = 1 + (3 - 1) * 4: three 1-frame chunks, not 2 x 2


def test_sample_frees_memory_also_on_interrupt(model, text, first_frame, monkeypatch):

    freed = []
    monkeypatch.setattr(compat, "free_memory", lambda: freed.append(1))
    cond = OmniDreamsConditioning(text=text, first_frame=first_frame)
    pipe.sample(_handle(model), cond, seed=0, frames=5, steps=0, width=64, height=64)
    assert freed == [1]

    def interrupt():
        raise compat.ProcessingInterrupted("cancelled")

    monkeypatch.setattr(compat, "check_interrupt", interrupt)
    with pytest.raises(compat.ProcessingInterrupted):
        pipe.sample(_handle(model), cond, seed=0, frames=5, steps=0, width=64, height=64)
    assert freed == [1, 1]


# ------------------------------------------------------------------ the per-chunk pseudo-code, call by call


class _StubDiT:
    """Stands in for the DiT: records every call's inputs; its flow is a fixed, simple function of
    x, t and the HD-map slice (so a wrong input also changes the output)."""

    config = TINY
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self):
        self.calls = []

    def cross_kv(self, text):
        return [None] * TINY.num_blocks

    def __call__(self, x, t, cross, *, cond_mask=None, hdmap=None, t_offset=0, kv_cache=None, **_):
        self.calls.append(
            {
                "x": x.clone(),
                "t": t,
                "mask": None if cond_mask is None else cond_mask.clone(),
                "hd": None if hdmap is None else hdmap.clone(),
                "offset": t_offset,
            }
        )
        return _stub_flow(x, t, hdmap)


def _stub_flow(x, t, hd):
    return torch.tanh(x) * 0.3 + 0.01 * t / 1000 + (0 if hd is None else 0.1 * hd)


class _NullCache:
    def __init__(self, **_):
        pass

    def begin_chunk(self):
        return 0

    def free(self):
        pass


def _warp(s):
    return 5 * s / (1 + 4 * s)


def _spec_replay(num_chunks, first_frame, hd, seed, kv_finalize="context_noise"):
    """The spec's per-chunk pseudo-code, literally: returns (emitted latent, the DiT calls it makes). kv_finalize
    "skip": FlashDreams' skip_finalize_kv_cache as its code reads (timesteps [1000, 100]; the context noise still
    drawn, no context call)."""
    g = torch.Generator("cpu").manual_seed(seed)
    shape = (1, 16, 2, H, W)
    inject = torch.zeros(1, 1, 2, H, W)
    inject[:, :, 0] = 1
    image = torch.zeros(shape)
    image[:, :, :1] = first_frame
    sigma_ctx = _warp(0.029)  # table index 971 (t 128 snapped)
    sigma2 = _warp(0.45) if kv_finalize == "context_noise" else _warp(0.1)  # table index 550 (t 450) / 900 (t 100)
    calls, emitted = [], []
    for k in range(num_chunks):
        pin = k == 0
        hd_k = hd[:, :, 2 * k : 2 * k + 2]

        def F(x, t):
            if pin:
                x = x * (1 - inject) + image * inject
            calls.append({"x": x.clone(), "t": t, "mask": inject if pin else None, "hd": hd_k, "offset": 2 * k})
            return _stub_flow(x, t, hd_k)

        x = torch.randn(shape, generator=g)  # draw 1
        x0 = x - 1.0 * F(x, 1000.0)  # call 1
        x = (1 - sigma2) * x0 + sigma2 * torch.randn(shape, generator=g)  # draw 2
        x0 = x - sigma2 * F(x, 1000 * sigma2)  # call 2
        if pin:
            x0 = x0 * (1 - inject) + image * inject
        xc = (1 - sigma_ctx) * x0 + sigma_ctx * torch.randn(shape, generator=g)  # draw 3
        if pin:
            xc = xc * (1 - inject) + image * inject  # before the K/V write
        if kv_finalize == "context_noise":
            F(xc, 128.0)  # call 3: output discarded
        emitted.append(x0)
    return torch.cat(emitted, 2), calls


def _rollout_vs_spec_replay(first_frame, monkeypatch, num_chunks=4, seed=42, kv_finalize="context_noise"):
    """Mismatches between pipe.rollout (with the stub DiT) and the spec replay; [] = identical."""
    hd = torch.randn(1, 16, 2 * num_chunks + 2, H, W, generator=torch.Generator().manual_seed(10))  # 2 spare
    stub = _StubDiT()
    monkeypatch.setattr(autoregressive, "RollingKVCache", _NullCache)
    out = pipe.rollout(
        stub,
        torch.zeros(1, 4, TINY.text_in_dim),
        num_chunks=num_chunks,
        latent_hw=(H, W),
        seed=seed,
        first_frame=first_frame,
        hdmap=hd,
        device=CPU,
        settings=pipe.ARSettings.for_kv_finalize(kv_finalize),
    )
    want, ref_calls = _spec_replay(num_chunks, first_frame, hd, seed, kv_finalize)
    calls_per_chunk = len(ref_calls) // num_chunks
    problems = []
    if len(stub.calls) != len(ref_calls):
        return [f"{len(stub.calls)} DiT calls, the spec makes {len(ref_calls)}"]
    for i, (got, ref) in enumerate(zip(stub.calls, ref_calls)):
        chunk, call = divmod(i, calls_per_chunk)
        where = f"chunk {chunk} call {call + 1}"
        if not torch.allclose(got["x"], ref["x"], rtol=0, atol=1e-6):
            problems.append(f"{where}: x differs by {float((got['x'] - ref['x']).abs().max()):.3g}")
        if got["t"] != pytest.approx(ref["t"], rel=1e-12):
            problems.append(f"{where}: t {got['t']} != {ref['t']}")
        if got["offset"] != ref["offset"]:
            problems.append(f"{where}: time offset {got['offset']} != {ref['offset']}")
        if ref["mask"] is None:
            if got["mask"] is not None and got["mask"].any():
                problems.append(f"{where}: a condition mask on an unpinned chunk")
        elif got["mask"] is None or not torch.equal(got["mask"], ref["mask"]):
            problems.append(f"{where}: condition mask is not 1 on frame 0 only")
        if got["hd"] is None or not torch.equal(got["hd"], ref["hd"]):
            problems.append(f"{where}: HD-map slice is not latent frames [{2 * chunk}, {2 * chunk + 2})")
        if chunk == 0 and not torch.equal(got["x"][:, :, 0], first_frame[:, :, 0]):
            problems.append(f"{where}: frame 0 is not the clean first-frame latent")
    if not torch.allclose(out, want, rtol=0, atol=1e-6):
        problems.append(f"emitted latent differs by {float((out - want).abs().max()):.3g}")
    return problems


@pytest.mark.parametrize("kv_finalize", ["context_noise", "skip"])
def test_rollout_replays_the_spec_pseudo_code_call_by_call(first_frame, monkeypatch, kv_finalize):
    """Every DiT call (x, timestep, condition mask, time offset, HD-map slice) and the emitted latent
    equal a literal replay of the spec's per-chunk pseudo-code with the same stub network; with kv_finalize "skip"
    the replay of FlashDreams' skip_finalize_kv_cache (2 calls a chunk)."""
    assert _rollout_vs_spec_replay(first_frame, monkeypatch, kv_finalize=kv_finalize) == []


def test_skip_finalize_keeps_the_last_denoising_calls_kv_and_the_clean_frame0(model, text, first_frame, monkeypatch):
    """With kv_finalize "skip" chunk 0's slot holds the K/V of its last denoising call, whose input has the clean
    first frame at frame 0 (FlashDreams pins every call); and the video differs from the three-call schedule's."""
    settings = pipe.ARSettings.for_kv_finalize("skip")
    cached = {}

    def observe(k, cache):
        if k == 0:
            cached.update({b: tuple(t.clone() for t in cache.slot_kv(b, 0)) for b in range(TINY.num_blocks)})

    observe_cache(monkeypatch, observe)
    skipped = _rollout(model, text, first_frame, settings=settings)
    # chunk 0 again from its first two draws: the input of its last denoising call, frame 0 pinned
    sched, gen = pipe.released_schedule(settings.denoise), torch.Generator("cpu").manual_seed(42)
    mask = torch.zeros(1, 1, 2, H, W)
    mask[:, :, 0] = 1
    image = torch.cat([first_frame, torch.zeros_like(first_frame)], dim=2)
    pin = lambda x: x * (1 - mask) + image * mask  # noqa: E731
    x = pin(torch.randn(1, 16, 2, H, W, generator=gen))
    x0 = x - sched.sigmas[0] * model(x, sched.timesteps[0], model.cross_kv(text), cond_mask=mask, t_offset=0)
    x = pin((1 - sched.sigmas[1]) * x0 + sched.sigmas[1] * torch.randn(1, 16, 2, H, W, generator=gen))
    rec = _Recorder()
    model(x, sched.timesteps[1], model.cross_kv(text), cond_mask=mask, t_offset=0, kv_cache=rec)
    diffs = [float((c - r).abs().max()) for b in range(TINY.num_blocks) for c, r in zip(cached[b], rec.kv[b])]
    assert max(diffs) < 1e-5, f"the slot is not the last denoising call's K/V: max |diff| per tensor {diffs}"
    assert not torch.equal(skipped, _rollout(model, text, first_frame))


def test_spec_replay_catches_the_missing_context_reinjection(first_frame, monkeypatch):
    """The replay is sharp: the known port bug (no pin before the context call) shows up there."""
    without_context_reinjection(monkeypatch)
    problems = _rollout_vs_spec_replay(first_frame, monkeypatch)
    assert problems and all(p.startswith("chunk 0 call 3") or p.startswith("emitted") for p in problems)
    assert any("clean first-frame" in p for p in problems)
