"""Our networks under ComfyUI's model management: partial loading (a weight budget below the model's size) gives
the full load's output, fp8 weights halve the transformers, scaled-fp8 checkpoints load. The ComfyUI side runs in
tests/model_management_probe.py (ComfyUI's ModelPatcher and cast layers, in ComfyUI's interpreter)."""

from __future__ import annotations

import pytest
import torch
from support.comfy_probe import run_probe

from omnivideo import compat
from omnivideo.backends import resolve_weight_dtype
from omnivideo.models.checkpoint_io import SCALED_FP8_MARKER, dequantize_scaled_fp8, store_weights
from omnivideo.models.h3.build import store_blocks_in
from omnivideo.models.omnidreams.dit import OmniDreamsConfig, OmniDreamsDiT
from omnivideo.models.omnidreams.loader import fp8_candidate

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def probe(comfyui_path):
    return run_probe("model_management_probe.py", comfyui_path)


@pytest.mark.integration
@pytest.mark.parametrize("family", ["omnidreams", "h3"])
def test_partial_load_streams_layers_and_matches_the_full_load(probe, family):
    r = probe[family]
    assert r["listed_while_loaded"] == [{"omnidreams": "OmniDreamsDiT", "h3": "MiniMaxH3Transformer3DModel"}[family]]
    assert r["full_streamed_layers"] == 0  # a full load casts nothing
    assert r["budget_bytes"] < r["model_bytes"]
    assert 0 < r["streamed_layers"] < r["castable_layers"]  # some layers stayed resident, the rest streamed
    assert r["partial_vs_full"]["equal"], r["partial_vs_full"]  # bit for bit


@pytest.mark.integration
def test_h3_vae_layers_are_castable(probe):
    assert probe["h3"]["vae_castable_layers"] > 0


@pytest.mark.integration
@pytest.mark.parametrize("family", ["omnidreams", "h3"])
def test_fp8_weights_about_halve_bf16_and_stay_close(probe, family):
    r = probe[family]["fp8"]
    assert r["fp8_matrices"] > 0
    assert r["bytes_fp8"] < 0.6 * r["bytes_bf16"]  # the tiny models' edge layers weigh more than the real ones'
    assert r["rel_err_fp8_vs_fp32"] < 0.02  # e4m3 keeps 3 mantissa bits; measured ~0.007 / ~0.001
    if family == "omnidreams":  # both compute in bf16 here: fp8 storage costs about 2x bf16's rounding
        assert r["rel_err_fp8_vs_fp32"] < 4 * r["rel_err_bf16_vs_fp32"]
        assert r["rel_err_scaled_fp8_vs_fp32"] < 0.02


def _weight_bytes(module: torch.nn.Module, fp8: callable) -> tuple[int, int]:
    """(bytes in bf16, bytes with the matrices `fp8(name)` selects in fp8) of a model built on the meta device."""
    bf16 = fp8_bytes = 0
    for name, p in module.named_parameters():
        bf16 += 2 * p.numel()
        fp8_bytes += (1 if p.dim() == 2 and fp8(name) else 2) * p.numel()
    return bf16, fp8_bytes


def test_fp8_storage_is_about_half_of_bf16_at_the_released_sizes():
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        omnidreams = OmniDreamsDiT(OmniDreamsConfig())  # the 2B defaults
        h3 = MiniMaxH3Transformer3DModel()  # the 33B defaults
    bf16, fp8 = _weight_bytes(omnidreams, fp8_candidate)
    assert bf16 > 3.5e9 and fp8 / bf16 < 0.51
    bf16, fp8 = _weight_bytes(h3, lambda n: n.startswith(("transformer_blocks.", "token_refiner.")))
    assert bf16 > 60e9 and fp8 / bf16 < 0.51


def test_store_weights_puts_only_the_selected_matrices_in_fp8():
    sd = {
        "blocks.0.w.weight": torch.randn(4, 4),
        "blocks.0.norm.weight": torch.randn(4),
        "head.weight": torch.ones(2, 2),
    }
    out = store_weights(sd, FP8, torch.bfloat16, lambda k: k.startswith("blocks."))
    assert [out[k].dtype for k in sd] == [FP8, torch.bfloat16, torch.bfloat16]
    same = store_weights(sd, torch.float32, torch.float32, lambda k: True)
    assert all(same[k].dtype == torch.float32 for k in sd)


def test_scaled_fp8_is_dequantized_with_its_scale():
    w = torch.randn(8, 8)
    scale = w.abs().max() / 448
    sd = {
        "a.weight": (w / scale).to(FP8),
        "a.scale_weight": scale,
        "a.scale_input": torch.tensor(1.0),
        "b.weight": torch.ones(3, 3),
        SCALED_FP8_MARKER: torch.empty(0, dtype=FP8),
    }
    out = dequantize_scaled_fp8(sd, torch.float32)
    assert set(out) == {"a.weight", "b.weight"}
    torch.testing.assert_close(out["a.weight"], w, rtol=0.07, atol=scale.item())  # e4m3's rounding, scaled back
    assert out["b.weight"] is sd["b.weight"]
    plain = {"a.weight": w}
    assert dequantize_scaled_fp8(plain, torch.float32) is plain


def test_weight_dtype_choices():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_dtype("fp8_e4m3fn", cpu) == (FP8, torch.float32)
    assert resolve_weight_dtype("fp8_e4m3fn", cuda) == (FP8, torch.bfloat16)
    assert resolve_weight_dtype("bf16", cpu) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_e4m3fn"):
        resolve_weight_dtype("int4", cpu)


def test_fp8_without_comfyui_cast_layers_is_refused_clearly():
    assert not compat.HAS_COMFY
    with pytest.raises(RuntimeError, match="needs ComfyUI's cast layers"):
        compat.operations(FP8, torch.float32, torch.device("cpu"))
    assert compat.operations(torch.float32, torch.float32, torch.device("cpu")) is torch.nn


def test_h3_fp8_modulation_computes_in_the_compute_dtype():
    from support.h3_tiny import make_models

    transformer = make_models(seed=0)[0]
    store_blocks_in(transformer, FP8, torch.float32)
    adaln = transformer.transformer_blocks[0].adaln_proj
    assert adaln.linear.weight.dtype == FP8 and transformer.proj_in.weight.dtype == torch.float32
    linear = adaln.linear
    seen = []
    linear.forward = lambda x: (
        seen.append(x.dtype),
        torch.nn.functional.linear(x, linear.weight.float(), linear.bias),
    )[1]
    adaln(torch.randn(2, 16))
    assert seen == [torch.float32]  # not the fp8 storage dtype diffusers' get_parameter_dtype would give
