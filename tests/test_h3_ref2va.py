"""ref2va: our references, layout and sampler on the transformer_ref partition vs diffusers' modular ref2va
pipeline (tiny random weights, fp32, the t2va/fl2va tolerance), the ref2va presentation vs diffusers' builder, and
the refusals (diffusers' limits and ordering rules, partition and canvas mismatches)."""

from __future__ import annotations

import pytest
import torch
from support.h3_tiny import (
    FRAMES,
    HEIGHT,
    REF_IMAGE_EDGE,
    WIDTH,
    make_models,
    reference_media,
    reference_ref2va_pipeline,
    text_inputs,
    write_folder,
)

from omnivideo import compat
from omnivideo.models.h3.folder import H3LoadError
from omnivideo.models.h3.geometry import resolve_shape
from omnivideo.models.h3.loader import load_h3
from omnivideo.models.handles import H3Conditioning
from omnivideo.pipelines.h3 import sample
from omnivideo.pipelines.h3.denoise import denoise
from omnivideo.pipelines.h3.layout import unpack_audio, unpatchify_video
from omnivideo.pipelines.h3.references import (
    EncodedReferences,
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
    check_references,
    encode_references,
    image_reference_size,
    normalize_references,
)
from omnivideo.pipelines.h3.sampler import plan_job

STEPS, SEED = 3, 7
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    transformer, vae, audio_vae = make_models()
    transformer_ref = make_models(seed=1)[0]  # other weights than transformer/: the partition really is chosen
    root = write_folder(
        tmp_path_factory.mktemp("h3") / "MiniMax-H3-tiny", transformer, vae, audio_vae, transformer_ref=transformer_ref
    )
    model, our_vae, our_audio_vae = load_h3(root, "fp32", device=CPU, partition="transformer_ref")
    t2va_model = load_h3(root, "fp32", device=CPU)[0]
    pipe = reference_ref2va_pipeline(transformer_ref, vae, audio_vae)
    return model, t2va_model, our_vae.model.module, our_audio_vae.model.module, pipe, root


def _encode(model, vae, audio_vae, references) -> EncodedReferences:
    normalized = normalize_references(
        references, width=WIDTH, height=HEIGHT, frames=FRAMES, geo=model.geometry, image_short_edge=REF_IMAGE_EDGE
    )
    latents, audio_rows = encode_references(vae, audio_vae, normalized, model.geometry, CPU, CPU)
    return EncodedReferences(normalized, latents, audio_rows, WIDTH, HEIGHT, FRAMES)


def _max_diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _cases():
    image, frames, soundtrack, clip = reference_media()
    video = MiniMaxH3VideoReference(frames=frames, fps=24.0, audio=soundtrack, sample_rate=32000)
    audio = MiniMaxH3AudioReference(audio=clip, sample_rate=32000)
    return {
        "image": [MiniMaxH3ImageReference(image)],
        "video_with_audio": [video],
        "audio_and_image": [audio, MiniMaxH3ImageReference(image)],
        "mixed": [
            MiniMaxH3ImageReference(image),
            video,
            audio,
            MiniMaxH3VideoReference(frames=frames[:, :, :48], fps=30.0),  # square, silent, resampled to 24 fps
        ],
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_ref2va_matches_modular_pipeline(h3, case):
    model, _, vae, audio_vae, pipe, _ = h3
    references = _cases()[case]
    encoded = _encode(model, vae, audio_vae, references)
    visual = sum(r.kind != "audio" for r in references)
    emb, tags = text_inputs(n_vision_blocks=visual)
    ref = pipe(
        references=references,
        prompt_embeds=emb,
        text_token_tags=tags,
        num_frames=FRAMES,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
        output=["latents", "audio_latents"],
    )
    cond = H3Conditioning(text=emb, text_token_tags=tags, references=encoded)
    # bit for bit in the model's normalised space (the sampler's denormalisation is t2va's, checked to 1e-5 by
    # tests/test_h3_parity.py); a tolerance would hide a reference soundtrack held at 0.999 instead of 1 (~2e-6 here)
    job = plan_job(model, cond, seed=SEED, frames=FRAMES, steps=STEPS, width=WIDTH, height=HEIGHT)
    rows, audio_rows = denoise(compat.loaded(model.patcher), job, CPU)
    shape = resolve_shape(FRAMES, WIDTH, HEIGHT, model.geometry)
    video = unpatchify_video(rows, shape, model.geometry)
    assert torch.equal(video, ref["latents"])
    assert torch.equal(unpack_audio(audio_rows, shape), ref["audio_latents"])
    assert video.abs().max() > 0.1
    out = sample(model, cond, seed=SEED, frames=FRAMES, steps=STEPS, width=WIDTH, height=HEIGHT)
    # the reference audio rows are really in the sequence: without them the result changes
    if case == "audio_and_image":
        fewer = _encode(model, vae, audio_vae, references[1:])
        other = sample(
            model,
            H3Conditioning(text=emb, text_token_tags=tags, references=fewer),
            seed=SEED,
            frames=FRAMES,
            steps=STEPS,
            width=WIDTH,
            height=HEIGHT,
        )
        assert _max_diff(other.video, out.video) > 1e-3


def test_ref2va_presentation_matches_diffusers(h3):
    """Labels and vision blocks of images and audio (a reference video needs Qwen3-VL's video processor, i.e.
    torchvision: tests/integration runs one in ComfyUI's venv)."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep
    from support.h3_tiny_qwen import tiny_processor, tiny_qwen3vl

    from omnivideo.models.h3.text import ref2va_presentation

    model, _, vae, audio_vae, _, _ = h3
    _, tokenizer, image_processor = tiny_qwen3vl()
    processor = tiny_processor(tokenizer, image_processor)
    image, _, _, clip = reference_media()
    refs = [
        MiniMaxH3ImageReference(image),
        MiniMaxH3AudioReference(clip, 32000),
        MiniMaxH3ImageReference(image.rotate(90, expand=True)),
    ]
    normalized = normalize_references(
        refs, width=WIDTH, height=HEIGHT, frames=FRAMES, geo=model.geometry, image_short_edge=REF_IMAGE_EDGE
    )
    ids, tags, vision = ref2va_presentation(tokenizer, processor, "a cat <Picture 2> sings <Audio 1>", normalized)
    step = MiniMaxH3Ref2VATextEncoderStep()
    want_vision, counts, _, _ = step._gather_vision_features(processor, normalized, 24)
    want_ids, want_tags = step._build_presentation(
        tokenizer, "a cat <Picture 2> sings <Audio 1>", normalized, counts, [], []
    )
    assert (ids, tags) == (want_ids, want_tags)
    assert torch.equal(vision["pixel_values"], want_vision["pixel_values"])
    text = tokenizer.decode(ids)
    assert text.index("<Picture 1>: ") < text.index("<Audio 1>: ") < text.index("<Picture 2>: ")
    assert tags.count(0) == sum(c + 2 for c in counts)  # vision blocks (start + pads + end) are tagged video


def test_image_reference_sizes():
    # diffusers: 2048 short edge, up or down; core's "max": only down; core's "match": down to the canvas area
    assert image_reference_size(1000, 500, "diffusers", 32, 1344 * 768) == (4096, 2048)
    assert image_reference_size(1000, 500, "max", 32, 1344 * 768) == (992, 512)
    assert image_reference_size(3000, 1500, "match", 32, 1344 * 768) == (1440, 704)
    assert image_reference_size(600, 300, "match", 32, 1344 * 768) == (608, 288)
    with pytest.raises(ValueError, match="within 1:4 and 4:1"):
        image_reference_size(500, 100, "max", 32, 1344 * 768)


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        ([], "at least one reference"),
        (["image"] * 10, "at most 9 image"),
        (["video"] * 4, "at most 3 video"),
        (["image", "audio", "audio", "audio", "audio"], "at most 3 audio"),
        (["image"] * 9 + ["video"] * 3 + ["audio"], "at most 12 references"),
        (["audio", "audio"], "paired with at least one image or video"),
    ],
)
def test_reference_limits_are_diffusers(kinds, message):
    image, frames, _, clip = reference_media()
    make = {
        "image": lambda: MiniMaxH3ImageReference(image),
        "video": lambda: MiniMaxH3VideoReference(frames=frames),
        "audio": lambda: MiniMaxH3AudioReference(clip),
    }
    with pytest.raises(ValueError, match=message):
        check_references([make[k]() for k in kinds])


def test_refusals_before_heavy_work(h3):
    model, t2va_model, vae, audio_vae, _, root = h3
    image, frames, _, _ = reference_media()
    encoded = _encode(model, vae, audio_vae, [MiniMaxH3ImageReference(image)])
    emb, tags = text_inputs(n_vision_blocks=1)
    cond = H3Conditioning(text=emb, text_token_tags=tags, references=encoded)
    run = dict(seed=0, frames=FRAMES, steps=2, width=WIDTH, height=HEIGHT)
    with pytest.raises(ValueError, match="load the transformer_ref weights with OmniVideo H3 Ref2VA Loader"):
        sample(t2va_model, cond, **run)
    with pytest.raises(ValueError, match="needs references"):
        sample(model, H3Conditioning(text=emb, text_token_tags=tags), **run)
    with pytest.raises(ValueError, match="prepared for 96x64, 124 frames"):
        sample(model, cond, **{**run, "width": 128})
    with pytest.raises(ValueError, match="at least 22 frames"):
        normalize_references(
            [MiniMaxH3VideoReference(frames=frames[:20])], width=WIDTH, height=HEIGHT, frames=FRAMES, geo=model.geometry
        )
    transformer, tiny_vae, tiny_audio_vae = make_models()
    only_t2va = write_folder(root.parent / "t2va-only", transformer, tiny_vae, tiny_audio_vae)
    with pytest.raises(H3LoadError, match="no transformer_ref/config.json"):
        load_h3(only_t2va, "fp32", device=CPU, partition="transformer_ref")
    only_ref = write_folder(root.parent / "ref-only", None, tiny_vae, tiny_audio_vae, transformer_ref=transformer)
    hint = "it has transformer_ref/: the ref2va partition; load it with OmniVideo H3 Ref2VA Loader"
    with pytest.raises(H3LoadError, match=hint):
        load_h3(only_ref, "fp32", device=CPU)


def test_ref2va_through_the_nodes(tmp_path, monkeypatch):
    from support.comfy_folders import patch_comfy_folders
    from support.h3_tiny_qwen import LAYER, tiny_processor, tiny_qwen3vl

    from omnivideo.models.h3.text import H3TextEncoder
    from omnivideo.nodes import h3 as nodes
    from omnivideo.nodes import h3_references as ref_nodes

    folders = patch_comfy_folders(monkeypatch, tmp_path)
    transformer, vae, audio_vae = make_models(seed=4)
    write_folder(folders.models("diffusers") / "MiniMax-H3-tiny", None, vae, audio_vae, transformer_ref=transformer)
    assert ref_nodes.OmniVideoH3Ref2VALoader.validate_inputs(folder="MiniMax-H3-tiny") is True
    model, our_vae, our_audio_vae = ref_nodes.OmniVideoH3Ref2VALoader.execute("MiniMax-H3-tiny", dtype="fp32")
    assert model.partition == "transformer_ref" and model.load_args["partition"] == "transformer_ref"
    qwen, tokenizer, image_processor = tiny_qwen3vl()
    te = H3TextEncoder(compat.manage(qwen, "text_encoder", CPU), tokenizer, tiny_processor(tokenizer, image_processor))
    te.layer = LAYER

    _, frames, soundtrack, clip = reference_media()
    chain = ref_nodes.OmniVideoH3ReferenceAudio.execute({"waveform": clip[None], "sample_rate": 32000})[0]
    chain = ref_nodes.OmniVideoH3ReferenceImage.execute(torch.rand(2, 80, 120, 3), references=chain)[0]
    assert [r.kind for r in chain] == ["audio", "image", "image"]  # chain order is the model's reading order
    refs = ref_nodes.OmniVideoH3References.execute(
        our_vae, our_audio_vae, chain, WIDTH, HEIGHT, FRAMES, ref_image_size="match"
    )[0]
    assert [r.image.size for r in refs.references[1:]] == [(96, 64)] * 2  # "match": the 96x64 video's area
    cond = nodes.OmniVideoH3TextEncode.execute("A fox sings <Audio 1>.", text_encoder=te, references=refs)[0]
    assert cond.references is refs and int((cond.text_token_tags == 0).sum()) > 0
    latent = nodes.OmniVideoH3Sampler.execute(model, cond, seed=1, frames=FRAMES, steps=2, width=WIDTH, height=HEIGHT)[
        0
    ]
    assert latent["samples"].shape[2:] == (37, HEIGHT // 16, WIDTH // 16)

    with pytest.raises(ValueError, match="at most 9 image references, got 10"):
        ref_nodes.OmniVideoH3ReferenceImage.execute(torch.rand(8, 32, 32, 3), references=chain)
    video = ref_nodes.OmniVideoH3ReferenceVideo.execute(
        frames=torch.from_numpy(frames).float() / 255,
        fps=24.0,
        audio={"waveform": soundtrack[None], "sample_rate": 32000},
    )[0]
    assert video[0].kind == "video" and video[0].has_audio
    with pytest.raises(ValueError, match="a video or frames"):
        ref_nodes.OmniVideoH3ReferenceVideo.execute()
    with pytest.raises(ValueError, match="mono or stereo"):
        ref_nodes.OmniVideoH3ReferenceAudio.execute({"waveform": torch.zeros(1, 3, 100), "sample_rate": 32000})
    if getattr(te.processor, "video_processor", None) is None:  # this venv has no torchvision: a clear refusal
        video_refs = ref_nodes.OmniVideoH3References.execute(our_vae, our_audio_vae, video, WIDTH, HEIGHT, FRAMES)[0]
        with pytest.raises(ValueError, match="Install torchvision or use image references"):
            nodes.OmniVideoH3TextEncode.execute("A fox.", text_encoder=te, references=video_refs)


def test_a_parallel_job_carries_the_references(h3):
    """OmniVideo Parallel's workers get the references in the job message and load the same partition."""
    from omnivideo.pipelines.h3.denoise import H3Job

    model, _, vae, audio_vae, _, _ = h3
    image, frames, soundtrack, clip = reference_media()
    references = [  # every kind of slot, the videos short (the cheapest encode)
        MiniMaxH3ImageReference(image),
        MiniMaxH3VideoReference(frames=frames[:22], fps=24.0, audio=soundtrack, sample_rate=32000),
        MiniMaxH3AudioReference(audio=clip, sample_rate=32000),
        MiniMaxH3VideoReference(frames=frames[:22], fps=24.0),
    ]
    encoded = _encode(model, vae, audio_vae, references)
    emb, tags = text_inputs(n_vision_blocks=3)
    cond = H3Conditioning(text=emb, text_token_tags=tags, references=encoded)
    job = plan_job(model, cond, seed=SEED, frames=FRAMES, steps=STEPS, width=WIDTH, height=HEIGHT)
    args, tensors = job.message()
    again = H3Job.from_message(args, tensors).references
    assert again.slots == job.references.slots == (("image", False), ("video", True), ("audio", True), ("video", False))
    assert all(
        torch.equal(a, b) for a, b in zip(again.latents + again.audio_rows, encoded.latents + encoded.audio_rows)
    )
    assert len(again.latents) == 3 and len(again.audio_rows) == 2
    assert model.load_args["partition"] == "transformer_ref"


def test_ref2va_transformer_from_a_single_file(tmp_path):
    """A single-file ref2va transformer (original keys, as core's files) with a folder that has transformer_ref/ only:
    its config builds the network, the file's weights (not the folder's) fill it."""
    from safetensors.torch import save_file
    from support.h3_tiny import to_original_keys

    transformer, vae, audio_vae = make_models(seed=2)
    root = write_folder(tmp_path / "ref-only", None, vae, audio_vae, transformer_ref=transformer)
    single = tmp_path / "h3_ref2va.safetensors"
    transformer = make_models(seed=3)[0]
    save_file(to_original_keys(transformer.state_dict()), str(single))
    model = load_h3(root, "fp32", transformer_file=single, device=CPU, partition="transformer_ref")[0]
    loaded = model.patcher.model.module.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in transformer.state_dict().items())
    assert model.partition == "transformer_ref" and model.load_args["transformer_file"] == str(single)
