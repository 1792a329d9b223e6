"""H3 sequence parallelism (Ulysses) across processes on the CPU (gloo): the sampler over 2 and 4 ranks equals the
single-process sampler; the packed sequence's length is not a multiple of the world size (uneven slices)."""

from __future__ import annotations

import pytest
import torch
from support.h3_tiny import FRAMES, HEIGHT, WIDTH, keyframe_images, make_models, text_inputs, write_folder

from omnivideo.attention.config import AttentionConfig
from omnivideo.models.h3.geometry import resolve_shape
from omnivideo.models.h3.loader import load_h3
from omnivideo.models.handles import H3Conditioning
from omnivideo.parallel import pool as pool_mod
from omnivideo.pipelines.h3 import sample
from omnivideo.pipelines.h3.keyframes import encode_keyframes
from omnivideo.pipelines.h3.layout import build_layout

STEPS, SEED, TOL = 3, 5, 1e-5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    transformer, vae, audio_vae = make_models(seed=3, num_attention_heads=4)  # 4 heads: world sizes 2 and 4
    root = write_folder(tmp_path_factory.mktemp("h3p") / "MiniMax-H3-tiny", transformer, vae, audio_vae)
    model, our_vae, _ = load_h3(root, "fp32", device=CPU)
    yield model, our_vae.model.module
    pool_mod.stop_pool()


def _run(model, cond, **kw):
    return sample(model, cond, seed=SEED, frames=FRAMES, steps=STEPS, width=WIDTH, height=HEIGHT, **kw)


def _max_diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _packed_len(model, tags, anchors=(), pad_to=None):
    shape = resolve_shape(FRAMES, WIDTH, HEIGHT, model.geometry)
    return build_layout(tags, shape, model.geometry, anchors, pad_to=pad_to).total_len


@pytest.mark.parametrize("world_size", [2, 4])
def test_t2va_equals_single_process(h3, world_size):
    model, _ = h3
    emb, tags = text_inputs(n_text=9)
    assert _packed_len(model, tags) % world_size  # uneven slices: the first ranks hold one row more
    cond = H3Conditioning(text=emb, text_token_tags=tags)
    single = _run(model, cond)
    rows = []  # what rank 0's blocks see: its slice of the sequence
    hook = model.transformer.transformer_blocks[1].register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[1]))
    try:
        parallel = _run(model.replace(world_size=world_size), cond)
    finally:
        hook.remove()
    assert pool_mod.current_pool().size == world_size
    total = _packed_len(model, tags)
    assert set(rows) == {-(-total // world_size)}  # rank 0 holds ceil(S / N) rows
    video, audio = _max_diff(parallel.video, single.video), _max_diff(parallel.audio, single.audio)
    print(f"world {world_size}: max |video diff| {video:.2e}, max |audio diff| {audio:.2e}")
    assert video <= TOL and audio <= TOL
    assert single.video.abs().max() > 0.1  # not a trivially zero latent


def test_fl2va_and_packed_padding_equal_single_process(h3):
    """Keyframe rows in the sequence, and a packed varlen backend: the [real | pad] sequence padded to 128 rows is
    split as it is (pad rows on the last ranks) and attention sees the same padded layout after the all-to-all."""
    model, vae = h3
    first, last = keyframe_images()
    emb, tags = text_inputs(n_vision_blocks=2)
    keyframes = encode_keyframes(vae, first, last, WIDTH, HEIGHT, CPU)
    cond = H3Conditioning(text=emb, text_token_tags=tags, keyframes=keyframes)
    packed = model.replace(attention=AttentionConfig(backend="flash_varlen"))
    assert _packed_len(model, tags, ("first", "last")) % 128  # there is padding
    single = _run(packed, cond)
    parallel = _run(packed.replace(world_size=2), cond)
    assert _max_diff(parallel.video, single.video) <= TOL
    assert _max_diff(parallel.audio, single.audio) <= TOL


def test_cancel_stops_every_rank_and_the_pool_stays_up(h3):
    """ComfyUI's progress bar is a cancel point: a cancel it sees on rank 0 stops all ranks at the next step, and
    the workers wait for the next run (which then still equals the single-process one)."""
    from omnivideo import compat

    model, _ = h3
    emb, tags = text_inputs(n_text=9)
    cond = H3Conditioning(text=emb, text_token_tags=tags)
    parallel = model.replace(world_size=2)

    class CancelAtFirstUpdate:
        def __init__(self, total):
            pass

        def update(self, n=1):
            compat.request_interrupt()
            compat.check_interrupt()

    with pytest.raises(compat.ProcessingInterrupted):
        _run(parallel, cond, progress=CancelAtFirstUpdate)
    pool = pool_mod.current_pool()
    assert pool is not None and pool.alive()
    assert _max_diff(_run(parallel, cond).video, _run(model, cond).video) <= TOL


def test_heads_must_divide_over_the_world(h3):
    model, _ = h3
    emb, tags = text_inputs(n_text=9)
    pool_mod.stop_pool()
    with pytest.raises(ValueError, match="divides 4"):
        _run(model.replace(world_size=3), H3Conditioning(text=emb, text_token_tags=tags))
    assert pool_mod.current_pool() is None  # refused before any worker started


def test_fp8_weights_are_refused_for_workers(h3):
    model, _ = h3
    fp8 = model.replace(world_size=2, load_args={**model.load_args, "weight_dtype": "torch.float8_e4m3fn"})
    emb, tags = text_inputs(n_text=9)
    with pytest.raises(ValueError, match="cannot cast"):
        _run(fp8, H3Conditioning(text=emb, text_token_tags=tags))


@pytest.mark.parametrize("single_file", [False, True])
def test_load_args_load_the_same_transformer(h3, tmp_path, single_file):
    """What the loader records is what a worker's h3.load needs: the same weights, folder or single file."""
    from safetensors.torch import save_file

    from omnivideo.parallel.world import World
    from omnivideo.pipelines.h3 import parallel

    model, _ = h3
    if single_file:
        path = tmp_path / "h3_transformer.safetensors"
        save_file({k: v.contiguous() for k, v in model.transformer.state_dict().items()}, str(path))
        model, _, _ = load_h3(model.source, "fp32", transformer_file=path, device=CPU)
        assert model.load_args["transformer_file"] == str(path)
    models = {"h3:old": object()}
    parallel.load(World(1, 2, 1, CPU), models, {**model.load_args, "key": "h3:new"}, {})
    assert list(models) == ["h3:new"]  # one H3 transformer per worker
    ours, theirs = model.transformer.state_dict(), models["h3:new"].state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
