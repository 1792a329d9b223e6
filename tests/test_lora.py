"""OmniVideo LoRA on tiny random weights: every H3 key format onto our modules, parity with diffusers' LoRA loading,
stacking, strength 0, unmatched keys named, OmniDreams' formats and re-laid layers, what the parallel workers merge."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from safetensors.torch import save_file
from support.comfy_folders import patch_comfy_folders
from support.comfy_probe import run_probe
from support.h3_tiny import FRAMES, HEIGHT, WIDTH, make_models, reference_pipeline, text_inputs, to_original_keys
from support.h3_tiny import write_folder as write_h3_folder
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo import compat
from omnivideo.integration import safe_paths
from omnivideo.models import lora as lora_mod
from omnivideo.models.h3.loader import load_h3
from omnivideo.models.handles import H3Conditioning, OmniDreamsModel
from omnivideo.models.omnidreams.loader import build_dit, weights_recipe
from omnivideo.nodes.lora import OmniVideoLoRA
from omnivideo.parallel.world import World
from omnivideo.pipelines.h3 import parallel as h3_parallel
from omnivideo.pipelines.h3 import sample
from omnivideo.pipelines.omnidreams import parallel as omnidreams_parallel

STEPS, SEED, RANK = 3, 5, 4
TOL = 2e-6  # fp32 sampler latents, ours vs diffusers' fused LoRA (measured: 2.4e-7, two stacked 4.8e-7)
CPU = torch.device("cpu")
# original (ComfyUI / reference) H3 module names a LoRA adapts in the tiny transformer, every kind of layer
H3_MODULES = (
    "blocks.0.attn.qkv_proj",
    "blocks.1.attn.out_proj",
    "blocks.0.mlp.fc1",
    "blocks.1.mlp.fc2",
    "blocks.0.adaln_proj.linear",
    "token_refiner.blocks.0.attn.qkv_proj",
    "condition_proj",
    "final_layer.video_out",
)


def _factors(original_sd: dict, modules, seed: int, scale: float = 0.3) -> dict[str, tuple]:
    """module -> (down, up) random rank-RANK factors fitting its weight in `original_sd`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module in modules:
        rows, cols = original_sd[module + ".weight"].shape
        out[module] = (torch.randn(RANK, cols, generator=g) * scale, torch.randn(rows, RANK, generator=g) * scale)
    return out


def _reference_format(factors, prefix: str = "") -> dict:
    """ComfyUI / reference keys (`blocks.N`, lora_A / lora_B); ai-toolkit's with prefix `diffusion_model.`."""
    out = {}
    for module, (down, up) in factors.items():
        out[f"{prefix}{module}.lora_A.weight"] = down
        out[f"{prefix}{module}.lora_B.weight"] = up
    return out


def _musubi_format(factors, alpha: float) -> dict:
    """musubi-tuner / kohya: flattened `lora_unet_` names, lora_down / lora_up and an alpha (delta * alpha / rank)."""
    out = {}
    for module, (down, up) in factors.items():
        flat = "lora_unet_" + module.replace(".", "_")
        out[f"{flat}.lora_down.weight"] = down
        out[f"{flat}.lora_up.weight"] = up * (RANK / alpha)  # the same delta once scaled by alpha / rank
        out[f"{flat}.alpha"] = torch.tensor(alpha)
    return out


def _diffsynth_format(factors, head_dim: int = 128) -> dict:
    """DiffSynth-Studio: the raw checkpoint's per-head-interleaved fused QKV, peft's `.default.` infix."""
    out = {}
    for module, (down, up) in factors.items():
        if module.endswith("qkv_proj"):
            heads = up.shape[0] // (3 * head_dim)
            up = torch.stack([part.reshape(heads, head_dim, -1) for part in up.chunk(3)], 1).reshape(up.shape)
        out[f"{module}.lora_A.default.weight"] = down
        out[f"{module}.lora_B.default.weight"] = up
    return out


def _expected_h3(transformer, factors, strength: float) -> dict:
    """Independent of the LoRA converters: the deltas added to the original checkpoint, then diffusers' checkpoint
    converter (the single-file path) -> the weights a LoRA at `strength` must give."""
    original = to_original_keys(transformer.state_dict())
    for module, (down, up) in factors.items():
        original[module + ".weight"] = original[module + ".weight"] + strength * up @ down
    return convert_minimax_h3_transformer_checkpoint_to_diffusers(original, dict(transformer.config))


def _save(tmp_path, name: str, sd: dict, metadata: dict | None = None) -> str:
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return str(path)


def _merged(transformer, path: str, family: str, strength: float):
    lora = lora_mod.read(path, family, transformer)
    out = copy.deepcopy(transformer)
    lora_mod.merge(out, [(lora, strength)])
    return out, lora


def _assert_weights(module, expected: dict, atol: float = 2e-6):
    got = module.state_dict()
    assert set(got) == set(expected)
    worst = max((got[k] - expected[k]).abs().max().item() for k in got)
    assert worst <= atol, worst


# ---------------------------------------------------------------------------------------------------- H3 formats


@pytest.mark.parametrize(
    "fmt", ["reference", "ai-toolkit", "musubi", "diffusers", "peft", "metadata alpha"], ids=lambda f: f
)
def test_h3_key_formats_give_the_checkpoint_deltas(tmp_path, fmt):
    transformer = make_models()[0]
    factors = _factors(to_original_keys(transformer.state_dict()), H3_MODULES, seed=1)
    expected = _expected_h3(transformer, factors, strength=0.5)
    metadata = None
    if fmt == "reference":
        sd = _reference_format(factors)
    elif fmt == "ai-toolkit":
        sd = _reference_format(factors, "diffusion_model.")
    elif fmt == "musubi":
        sd = _musubi_format(factors, alpha=2.0)
    elif fmt == "metadata alpha":  # alpha-less factors, the network alpha in `__metadata__`
        sd = {k: v * (RANK / 2.0) ** 0.5 for k, v in _reference_format(factors).items()}
        metadata = {"alpha": "2.0"}
    else:  # diffusers' own names, written by diffusers (`transformer.`) or as a peft dump (`.default.`)
        converted = lora_mod.read(_save(tmp_path, "ref.safetensors", _reference_format(factors)), "h3", transformer)
        sd = {}
        for weight, low_rank in converted.weights.items():
            base = weight.removesuffix(".weight")
            if fmt == "diffusers":
                sd[f"transformer.{base}.lora_A.weight"], sd[f"transformer.{base}.lora_B.weight"] = (
                    low_rank.down,
                    low_rank.up,
                )
            else:
                sd[f"{base}.lora_A.default.weight"], sd[f"{base}.lora_B.default.weight"] = low_rank.down, low_rank.up
    merged, lora = _merged(transformer, _save(tmp_path, "lora.safetensors", sd, metadata), "h3", 0.5)
    assert not lora.unmatched
    assert len(lora.weights) == 12  # the two fused QKVs became three projections each
    _assert_weights(merged, expected)


def test_h3_diffsynth_interleaved_qkv(tmp_path):
    transformer = make_models(attention_head_dim=128)[0]  # DiffSynth's de-interleave reads 128-wide heads
    factors = _factors(to_original_keys(transformer.state_dict()), H3_MODULES, seed=2)
    merged, lora = _merged(transformer, _save(tmp_path, "ds.safetensors", _diffsynth_format(factors)), "h3", 1.0)
    assert not lora.unmatched
    _assert_weights(merged, _expected_h3(transformer, factors, strength=1.0))


def test_h3_unmatched_keys_are_named(tmp_path, caplog):
    transformer = make_models()[0]
    factors = _factors(to_original_keys(transformer.state_dict()), H3_MODULES[:2], seed=3)
    junk = {
        "blocks.0.attn.bogus_proj.lora_A.weight": torch.zeros(RANK, 48),
        "blocks.0.attn.bogus_proj.lora_B.weight": torch.zeros(48, RANK),
        "text_encoder.something": torch.zeros(1),
    }
    with caplog.at_level(logging.WARNING, "omnivideo"):
        lora = lora_mod.read(
            _save(tmp_path, "mixed.safetensors", {**_reference_format(factors), **junk}), "h3", transformer
        )
    assert sorted(lora.unmatched) == sorted(junk)
    assert len(lora.weights) == 4
    assert "blocks.0.attn.bogus_proj.lora_A.weight" in caplog.text and "text_encoder.something" in caplog.text
    assert "3 keys match nothing" in lora.describe()
    with pytest.raises(lora_mod.LoraError, match=r"junk\.safetensors is not a LoRA for this h3 model.*bogus_proj"):
        lora_mod.read(_save(tmp_path, "junk.safetensors", junk), "h3", transformer)
    wide = {k: torch.cat([v, v], 0) if ".lora_B." in k else v for k, v in _reference_format(factors).items()}
    with pytest.raises(lora_mod.LoraError, match="does not fit its weight"):
        lora_mod.read(_save(tmp_path, "wide.safetensors", wide), "h3", transformer)


# ---------------------------------------------------------------------------------------------------- H3 sampling


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    """Our loaded tiny H3 in ComfyUI's folders (diffusers/, loras/ with two LoRA files), and its source modules."""
    base = tmp_path_factory.mktemp("h3lora")

    with pytest.MonkeyPatch.context() as mp:
        folders = patch_comfy_folders(mp, base)
        transformer, vae, audio_vae = make_models(seed=3)
        root = write_h3_folder(folders.models("diffusers") / "H3-tiny", transformer, vae, audio_vae)
        original = to_original_keys(transformer.state_dict())
        files = {}
        for i, name in enumerate(("style.safetensors", "turbo.safetensors")):
            sd = _reference_format(_factors(original, H3_MODULES, seed=10 + i, scale=0.25))
            files[name] = _save(folders.models("loras"), name, sd)
        model = load_h3(root, "fp32", device=CPU)[0]
        yield model, (transformer, vae, audio_vae), files, mp


def _sample(model):
    emb, tags = text_inputs()
    cond = H3Conditioning(text=emb, text_token_tags=tags)
    return sample(model, cond, seed=SEED, frames=FRAMES, steps=STEPS, width=WIDTH, height=HEIGHT)


def _reference(modules, files, strengths):
    """diffusers' modular pipeline with each LoRA loaded by `load_lora_weights` and fused at its strength."""
    pytest.importorskip("peft", reason="diffusers' LoRA loading needs peft")

    pipe = reference_pipeline(copy.deepcopy(modules[0]), *modules[1:])
    pipe.blocks.sub_blocks.pop("decode")  # the latents are compared
    for (name, path), strength in zip(files.items(), strengths, strict=False):
        pipe.load_lora_weights(path, adapter_name=name.split(".")[0])
        pipe.fuse_lora(lora_scale=strength)
        pipe.unload_lora_weights()  # the fused weights stay
    emb, tags = text_inputs()
    return pipe(
        prompt_embeds=emb,
        text_token_tags=tags,
        num_frames=FRAMES,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(SEED),
        output=["latents", "audio_latents"],
    )


def _normalised(model, latent):
    n = model.latent_norm
    vm, vs = (torch.tensor(n[k]).view(1, -1, 1, 1, 1) for k in ("video_mean", "video_std"))
    am, ast = (torch.tensor(n[k]).view(1, -1, 1) for k in ("audio_mean", "audio_std"))
    return (latent.video - vm) / vs, (latent.audio - am) / ast


def _max_diff(a, b):
    return (a - b).abs().max().item()


def test_h3_lora_node_matches_diffusers_fused_lora(h3):
    model, modules, files, _ = h3
    patched = OmniVideoLoRA.execute(model, "style.safetensors", 0.7)[0]
    assert patched.transformer is not model.transformer  # the handle's own network is untouched
    ours = _normalised(patched, _sample(patched))
    ref = _reference(modules, {"style.safetensors": files["style.safetensors"]}, [0.7])
    assert _max_diff(ours[0], ref["latents"]) <= TOL
    assert _max_diff(ours[1], ref["audio_latents"]) <= TOL
    plain = _normalised(model, _sample(model))
    assert _max_diff(plain[0], ours[0]) > 1e-2  # the LoRA really changes the result


def test_h3_two_loras_stack_and_strength_zero_is_no_lora(h3):
    model, modules, files, _ = h3
    stacked = OmniVideoLoRA.execute(
        OmniVideoLoRA.execute(model, "style.safetensors", 0.7)[0], "turbo.safetensors", -0.4
    )[0]
    ours = _normalised(stacked, _sample(stacked))
    ref = _reference(modules, files, [0.7, -0.4])
    assert _max_diff(ours[0], ref["latents"]) <= TOL
    assert _max_diff(ours[1], ref["audio_latents"]) <= TOL
    # what the parallel workers do with load_args["loras"]: both merged into a fresh copy, the same weights
    assert [(r["path"], r["strength"]) for r in stacked.load_args["loras"]] == [
        (files["style.safetensors"], 0.7),
        (files["turbo.safetensors"], -0.4),
    ]
    _assert_worker_loads_the_same(h3_parallel.load, stacked)
    zero = OmniVideoLoRA.execute(model, "style.safetensors", 0.0)[0]
    assert zero is model
    assert torch.equal(_sample(zero).video, _sample(model).video)


def test_node_refuses_names_outside_the_loras_folder(h3):
    assert OmniVideoLoRA.validate_inputs(lora_name="style.safetensors") is True
    for bad in ("../diffusers/H3-tiny/transformer/diffusion_pytorch_model.safetensors", "/etc/passwd", "x.ckpt"):
        assert isinstance(OmniVideoLoRA.validate_inputs(lora_name=bad), str)


def _assert_worker_loads_the_same(load, model):
    """A parallel worker's load operation (in this process) on the handle's load_args: the same weights, bit for bit."""
    models: dict = {}
    load(World(1, 2, 1, CPU), models, {**model.load_args, "key": "worker"}, {})
    theirs, ours = models["worker"].state_dict(), model.transformer.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


# ---------------------------------------------------------------------------------------------------- OmniDreams


def test_omnidreams_formats_and_relaid_layers(tmp_path):
    stored = stored_state_dict(TINY, seed=1)
    dit = build_dit(stored, torch.float32)
    modules = ("blocks.0.self_attn.q_proj", "blocks.1.mlp.layer2", "x_embedder.proj.1", "final_layer.linear")
    factors = _factors(stored, modules, seed=4)
    expected_sd = dict(stored)
    for module, (down, up) in factors.items():
        expected_sd[module + ".weight"] = stored[module + ".weight"] + 0.8 * up @ down
    expected = build_dit(expected_sd, torch.float32).state_dict()  # the loader re-lays the two layers
    for fmt, sd in {
        "comfy": _reference_format(factors, "diffusion_model."),
        "net": _reference_format(factors, "net."),
        "kohya": _musubi_format(factors, alpha=8.0),
    }.items():
        lora = lora_mod.read(_save(tmp_path, f"{fmt}.safetensors", sd), "omnidreams", dit)
        assert sorted(lora.weights) == sorted(m + ".weight" for m in modules), fmt
        merged = copy.deepcopy(dit)
        lora_mod.merge(merged, [(lora, 0.8)])
        _assert_weights(merged, expected)
    # through the node, and what a parallel worker loads from the handle's load_args
    path = _save(tmp_path, "comfy.safetensors", _reference_format(factors, "diffusion_model."))
    torch.save(stored, tmp_path / "dit.pt")
    model = OmniDreamsModel(
        patcher=compat.manage(build_dit(stored, torch.float32), "diffusion", CPU),
        dtype=torch.float32,
        load_args=weights_recipe(str(tmp_path / "dit.pt"), torch.float32, torch.float32),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(safe_paths, "resolve_model_file", lambda kind, name, *a, **k: str(tmp_path / name))
        patched = OmniVideoLoRA.execute(model, "comfy.safetensors", 0.8)[0]
    assert patched.load_args["loras"] == [lora_mod.recipe(path, 0.8)]
    _assert_weights(patched.transformer, expected)
    _assert_worker_loads_the_same(omnidreams_parallel.load, patched)
    with pytest.raises(lora_mod.LoraError, match="not a LoRA for this omnidreams model"):
        lora_mod.read(
            _save(tmp_path, "h3.safetensors", _reference_format({"condition_proj": factors[modules[0]]})),
            "omnidreams",
            dit,
        )


# ---------------------------------------------------------------------------------------------------- inside ComfyUI


@pytest.mark.integration
def test_comfyui_patcher_applies_what_merge_applies(comfyui_path):
    r = run_probe("lora_comfy_probe.py", comfyui_path)
    assert r["is_model_patcher"] and r["shares_the_network"]  # a clone with patches: no second copy, no reload
    # bit for bit what the workers merge, and not the base weights
    assert r["stacked_vs_merge"]["equal"] and not r["stacked_vs_base"]["equal"], (
        r["stacked_vs_merge"],
        r["stacked_vs_base"],
    )
    assert r["other_strength_vs_merge"]["equal"], r["other_strength_vs_merge"]  # another strength, same loaded weights
    assert r["unpatched_vs_base"]["equal"], r["unpatched_vs_base"]  # without the LoRA: its own weights back
    assert r["streamed_layers"] > 0 and r["partial_vs_full"]["equal"], r["partial_vs_full"]  # streamed: same samples
    assert r["load_args_loras"] == [["a.safetensors", 0.7], ["b.safetensors", -0.4]]
