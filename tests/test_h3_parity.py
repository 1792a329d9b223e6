"""Our H3 sampler and decode vs diffusers' modular minimax_h3 pipeline, tiny random weights, fp32."""

from __future__ import annotations

import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from support.h3_tiny import (
    FRAMES,
    HEIGHT,
    WIDTH,
    keyframe_images,
    make_models,
    reference_pipeline,
    text_inputs,
    write_folder,
)

from omnivideo.models.h3.loader import load_h3
from omnivideo.models.handles import H3Conditioning
from omnivideo.nodes.h3 import OmniVideoH3Shift
from omnivideo.pipelines.h3 import sample
from omnivideo.pipelines.h3.decode import decode_audio, decode_video
from omnivideo.pipelines.h3.keyframes import encode_keyframes

STEPS, SEED, TOL = 4, 7, 1e-5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    transformer, vae, audio_vae = make_models()
    root = write_folder(tmp_path_factory.mktemp("h3") / "MiniMax-H3-tiny", transformer, vae, audio_vae)
    model, our_vae, our_audio_vae = load_h3(root, "fp32", device=CPU)
    return model, our_vae.model.module, our_audio_vae.model.module, reference_pipeline(transformer, vae, audio_vae)


def _normalise(model, latent):
    n = model.latent_norm
    vm, vs = (torch.tensor(n[k]).view(1, -1, 1, 1, 1) for k in ("video_mean", "video_std"))
    am, ast = (torch.tensor(n[k]).view(1, -1, 1) for k in ("audio_mean", "audio_std"))
    return (latent.video - vm) / vs, (latent.audio - am) / ast


def _max_diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _reference(pipe, emb, tags, **kw):
    return pipe(
        prompt_embeds=emb,
        text_token_tags=tags,
        num_frames=FRAMES,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
        output=["latents", "audio_latents", "videos", "audio"],
        **kw,
    )


def test_t2va_matches_modular_pipeline(h3):
    model, vae, audio_vae, pipe = h3
    emb, tags = text_inputs()
    ref = _reference(pipe, emb, tags)
    cond = H3Conditioning(text=emb, text_token_tags=tags)
    ticks = []

    class Bar:  # the node contract: progress(total) -> object with update(n)
        def __init__(self, total):
            self.total, self.done = total, 0

        def update(self, n=1):
            self.done += n
            ticks.append((self.done, self.total))

    out = sample(model, cond, seed=SEED, frames=FRAMES, steps=STEPS, width=WIDTH, height=HEIGHT, progress=Bar)
    video, audio = _normalise(model, out)
    assert ticks == [(i, STEPS - 1) for i in range(1, STEPS)]  # steps = sigma points: N steps -> N-1 forwards
    assert _max_diff(video, ref["latents"]) <= TOL
    assert _max_diff(audio, ref["audio_latents"]) <= TOL
    assert video.abs().max() > 0.1  # not a trivially zero latent

    frames = decode_video(vae, out.video, CPU)  # [1, 3, F, H, W] in [0, 1]; diffusers' videos are [1, F, 3, H, W]
    assert frames.shape == (1, 3, FRAMES, HEIGHT, WIDTH)
    assert _max_diff(frames[0].permute(1, 0, 2, 3), ref["videos"][0]) <= TOL
    wave = decode_audio(audio_vae, out.audio, CPU)
    assert wave.shape[:2] == (1, 2)
    assert _max_diff(wave, ref["audio"]) <= TOL


def test_shift_node_matches_the_pipeline_with_those_shifts(h3):
    """OmniVideo H3 Shift (a turbo recipe's shifts) = diffusers' pipeline with schedulers of those shifts; the
    released shifts leave the model as loaded."""
    model, _, _, pipe = h3
    emb, tags = text_inputs()
    cond = H3Conditioning(text=emb, text_token_tags=tags)
    pipe.update_components(scheduler=MiniMaxH3Scheduler(shift=5.0), audio_scheduler=MiniMaxH3Scheduler(shift=1.5))
    try:
        ref = _reference(pipe, emb, tags)
    finally:
        pipe.update_components(scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    shifted = OmniVideoH3Shift.execute(model, video_shift=5.0, audio_shift=1.5).args[0]
    out = sample(shifted, cond, seed=SEED, frames=FRAMES, steps=STEPS, width=WIDTH, height=HEIGHT)
    video, audio = _normalise(model, out)
    assert _max_diff(video, ref["latents"]) <= TOL and _max_diff(audio, ref["audio_latents"]) <= TOL
    released = OmniVideoH3Shift.execute(model, video_shift=12.0, audio_shift=3.0).args[0]
    assert released.scheduler_config == model.scheduler_config
    assert released.audio_scheduler_config == model.audio_scheduler_config


def test_fl2va_first_and_last_keyframes_match(h3):
    model, vae, audio_vae, pipe = h3
    first, last = keyframe_images()
    emb, tags = text_inputs(n_vision_blocks=2)
    ref = _reference(pipe, emb, tags, image=first, last_image=last)
    keyframes = encode_keyframes(vae, first, last, WIDTH, HEIGHT, CPU)
    assert keyframes["anchors"] == ("first", "last")
    cond = H3Conditioning(text=emb, text_token_tags=tags, keyframes=keyframes)
    out = sample(model, cond, seed=SEED, frames=FRAMES, steps=STEPS, width=WIDTH, height=HEIGHT, progress=None)
    video, audio = _normalise(model, out)
    assert _max_diff(video, ref["latents"]) <= TOL
    assert _max_diff(audio, ref["audio_latents"]) <= TOL
    # the keyframes change the result (they are really in the sequence)
    plain = sample(
        model,
        H3Conditioning(text=emb, text_token_tags=tags),
        seed=SEED,
        frames=FRAMES,
        steps=STEPS,
        width=WIDTH,
        height=HEIGHT,
    )
    assert _max_diff(plain.video, out.video) > 1e-3


def test_keyframe_canvas_mismatch_is_explained(h3):
    model, vae, _, _ = h3
    first, _ = keyframe_images()
    emb, tags = text_inputs(n_vision_blocks=1)
    keyframes = encode_keyframes(vae, first, None, WIDTH, HEIGHT, CPU)
    cond = H3Conditioning(text=emb, text_token_tags=tags, keyframes=keyframes)
    with pytest.raises(ValueError, match="encoded for 96x64"):
        sample(model, cond, seed=0, frames=FRAMES, steps=2, width=128, height=64)
