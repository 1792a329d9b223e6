"""Core ComfyUI 0.33's single-file MiniMax-H3 transformers (tests/support/h3_core_files.py) in our H3 loader:
every layout core reads loads with the same weights core sees, or is refused with the layout named."""

from __future__ import annotations

import json

import pytest
import torch
from support.comfy_probe import run_probe
from support.h3_core_files import as_tensor, core_files, core_keys, fp8_per_tensor, pruned_keys, write
from support.h3_tiny import FRAMES, HEIGHT, WIDTH, make_models, text_inputs, write_folder

from omnivideo.models.checkpoint_io import CheckpointError
from omnivideo.models.h3.folder import H3LoadError
from omnivideo.models.h3.loader import load_h3
from omnivideo.models.handles import H3Conditioning
from omnivideo.pipelines.h3 import sample

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    transformer, vae, audio_vae = make_models(seed=3)
    base = tmp_path_factory.mktemp("h3core")
    return transformer, write_folder(base / "folder", transformer, vae, audio_vae), base


def _load(root, path) -> dict[str, torch.Tensor]:
    return load_h3(root, "fp32", transformer_file=path, device=CPU)[0].transformer.state_dict()


def test_every_core_layout_loads(tiny):
    transformer, root, base = tiny
    for name, path in core_files(transformer, base).items():
        ours, want = _load(root, path), transformer.state_dict()
        if "pruned" in name:  # the table instead of the time embedder (test_pruned_file_samples_the_curve_of_its_table)
            assert ours.pop("time_embedder.adaln_t_table").shape == (1025, transformer.config.time_embed_dim)
            want = {k: v for k, v in want.items() if not k.startswith("time_embedder.")}
        assert ours.keys() == want.keys(), name
        changed = [k for k in want if not torch.equal(ours[k], want[k])]
        if "fp8" in name:  # the block matrices come back as fp8 · scale, everything else as stored
            assert changed and all(k.startswith("transformer_blocks.") and k.endswith(".weight") for k in changed)
            for k in changed:
                torch.testing.assert_close(ours[k], want[k], rtol=0.07, atol=want[k].abs().max().item() / 448)
        else:
            assert not changed, (name, changed[:3])


def test_core_and_ours_read_the_same_weights(comfyui_path):
    """Core's own loader (detection, its quantized layers dequantized) and ours give every layer the same values,
    bit for bit in fp32."""
    if not (comfyui_path / "comfy" / "ldm" / "minimax").is_dir():
        pytest.skip("this ComfyUI has no native MiniMax-H3 (before 0.33)")
    result = run_probe("h3_core_files_probe.py", comfyui_path, timeout=600)
    assert set(result) == {
        "model.diffusion_model.",
        "all-in-one checkpoint",
        "no prefix",
        "pruned (adaln_t_table)",
        "fp8 comfy_quant keys",
        "fp8 _quantization_metadata",
    }
    for name, seen in result.items():
        assert seen["image_model"] == "minimax_h3", name
        assert seen["core_complaints"] == [], (name, seen)  # core found every key it expects and nothing else
        assert seen["only_in_core"] == seen["only_in_ours"] == seen["differ"] == [], (name, seen)
        assert (seen["quantized_in_core"] > 0) == ("fp8" in name), (name, seen)


def test_block_scaled_formats_are_refused_by_name(tiny):
    transformer, root, base = tiny
    quant, layers = fp8_per_tensor(core_keys(transformer))
    layer = next(iter(layers))
    layers[layer] = {"format": "nvfp4"}
    by_key = write(base / "h3_nvfp4.safetensors", {**quant, f"{layer}.comfy_quant": as_tensor(layers[layer])})
    in_header = write(
        base / "h3_nvfp4_meta.safetensors", quant, metadata={"_quantization_metadata": json.dumps({"layers": layers})}
    )
    for path in (by_key, in_header):
        with pytest.raises(CheckpointError, match=rf"{path.name} is quantized as nvfp4 \(layer {layer}"):
            load_h3(root, "fp32", transformer_file=path, device=CPU)
    broken = write(base / "h3_badquant.safetensors", {**quant, f"{layer}.comfy_quant": torch.tensor([1, 2, 255])})
    with pytest.raises(CheckpointError, match="h3_badquant.safetensors.*quantization configs do not parse"):
        load_h3(root, "fp32", transformer_file=broken, device=CPU)


def test_rope_of_another_config_is_refused(tiny):
    transformer, root, base = tiny
    sd = core_keys(transformer)
    sd["rope.inv_freq"] = sd["rope.inv_freq"] * 2
    path = write(base / "h3_other_rope.safetensors", sd)
    with pytest.raises(H3LoadError, match=r"h3_other_rope.safetensors: rope.inv_freq \(4,\) differs.*rope_theta"):
        load_h3(root, "fp32", transformer_file=path, device=CPU)


def test_pruned_file_samples_the_curve_of_its_table(tiny):
    """A pruned file made from the tiny model (its activated time embedding tabulated on a fine grid) runs as that
    model: the table lookup is the model's embedding at the grid points, and a whole t2va run agrees with the
    unpruned model to the interpolation error."""
    transformer, root, base = tiny
    path = write(base / "h3_pruned_run.safetensors", pruned_keys(transformer, grid=4097))
    pruned = load_h3(root, "fp32", transformer_file=path, device=CPU)[0]
    plain = load_h3(root, "fp32", device=CPU)[0]
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    with torch.no_grad():
        expected = torch.nn.functional.silu(transformer.time_embedder(transformer.time_proj(t)))
        torch.testing.assert_close(pruned.transformer.time_embedder(t), expected, rtol=0, atol=1e-6)
    emb, tags = text_inputs()
    cond = H3Conditioning(text=emb, text_token_tags=tags)
    run = dict(seed=7, frames=FRAMES, steps=4, width=WIDTH, height=HEIGHT)
    a, b = sample(pruned, cond, **run), sample(plain, cond, **run)
    assert (a.video - b.video).abs().max() < 1e-5 and (a.audio - b.audio).abs().max() < 1e-5
    assert (a.video - b.video).abs().max() > 0  # the curve really replaced the embedder
