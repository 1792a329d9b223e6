"""OmniVideo Attention (selector) and OmniVideo Patch Model Attention (native ComfyUI MODEL patch)."""

import copy
import math
import os
import types

import pytest
import torch
import torch.nn.functional as F
from support.comfy_probe import run_probe
from test_attention_npu import NPU, mindiesd  # noqa: F401  the fake torch_npu / MindIE-SD fixtures

from omnivideo.attention import dispatch
from omnivideo.attention.config import AttentionConfig
from omnivideo.attention.rows import AttnRows
from omnivideo.attention.torch_impl import rainfusion_reference
from omnivideo.integration.attention_patch import call_rows, patch_grid, sampling_step
from omnivideo.nodes import node_classes
from omnivideo.nodes.attention import OmniVideoAttention, OmniVideoPatchModelAttention

GRID = (3, 16, 16)  # patch grid of a [1, C, 3, 32, 32] latent with Wan's (1, 2, 2) patches
H, D = 2, 16
S = math.prod(GRID)


def test_selector_schema_validation_and_output():
    schema = OmniVideoAttention.define_schema()
    assert schema.node_id == "OmniVideoAttention" and schema.display_name == "OmniVideo Attention"
    assert [i.id for i in schema.inputs] == ["backend", "sparsity", "start_step", "skip_layers", "block_size"]
    assert schema.outputs[0].io_type == "OMNIVIDEO_ATTENTION"
    ok = dict(backend="rainfusion", sparsity=0.8, start_step=2, skip_layers="0-3,38", block_size=128)
    assert OmniVideoAttention.validate_inputs(skip_layers="0-3,38") is True
    assert "skip_layers" in OmniVideoAttention.validate_inputs(skip_layers="3-")
    with pytest.raises(ValueError, match="out of range"):  # sparsity: ComfyUI's max check, and here again
        OmniVideoAttention.execute(**{**ok, "sparsity": 0.97})
    with pytest.raises(ValueError, match="power of two"):
        OmniVideoAttention.execute(**{**ok, "block_size": 100})
    config = OmniVideoAttention.execute(**ok).args[0]
    assert config == AttentionConfig("rainfusion", 0.8, 2, "0-3,38", 128)
    assert [i for i in range(40) if i in config.skip_ranges] == [0, 1, 2, 3, 38]
    assert copy.deepcopy(config) == config


def test_both_attention_nodes_are_registered():
    classes = node_classes()
    assert classes.get("OmniVideoAttention") is OmniVideoAttention, sorted(classes)
    assert classes.get("OmniVideoPatchModelAttention") is OmniVideoPatchModelAttention, sorted(classes)


class FakeModelPatcher:
    """The ModelPatcher surface the patch node uses (clone deep-copies model_options, like ComfyUI)."""

    def __init__(self):
        self.model_options = {"transformer_options": {}}
        self.wrappers = {}

    def clone(self):
        n = FakeModelPatcher()
        n.model_options = copy.deepcopy(self.model_options)
        n.wrappers = {t: {k: list(v) for k, v in d.items()} for t, d in self.wrappers.items()}
        return n

    def add_wrapper_with_key(self, wrapper_type, key, fn):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)


def comfy_original(
    q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs
):
    """Stand-in for ComfyUI's attention function; tags its output so pass-through is visible."""
    comfy_original.calls += 1
    if not skip_reshape:
        b, s, hd = q.shape
        q, k, v = (t.view(b, -1, heads, hd // heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out if skip_output_reshape else out.transpose(1, 2).reshape(out.shape[0], -1, heads * out.shape[-1])


def patched_model(config):
    model = FakeModelPatcher()
    patched = OmniVideoPatchModelAttention.execute(model, config).args[0]
    assert "optimized_attention_override" not in model.model_options["transformer_options"]  # original untouched
    opts = patched.model_options["transformer_options"]
    ((wrapper,),) = patched.wrappers["diffusion_model"].values()
    return patched, opts["optimized_attention_override"], wrapper


class Executor:
    """ComfyUI's WrapperExecutor surface: callable, with the diffusion model as class_obj."""

    def __init__(self, body):
        self.body, self.class_obj = body, types.SimpleNamespace(patch_size=(1, 2, 2))

    def __call__(self, x, t, context, clip_fea, time_dim_concat, transformer_options):
        return self.body(transformer_options)


def run_forward(wrapper, body, opts, latent_shape=(1, 16, 3, 32, 32)):
    """Call the DIFFUSION_MODEL wrapper as Wan's forward does: wrapper(executor, x, t, ctx, clip, tdc, opts)."""
    return wrapper(Executor(body), torch.zeros(latent_shape), None, None, None, None, opts)


def qkv(s=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, H * D, generator=g) for _ in range(3)]


CFG = AttentionConfig("torch_block_sparse", sparsity=0.8, block_size=32, min_video_blocks=4)


def test_patch_routes_self_attention_through_rainfusion_with_the_latent_grid():
    _, override, wrapper = patched_model(CFG)
    q, k, v = qkv()
    comfy_original.calls = 0
    out = run_forward(wrapper, lambda opts: override(comfy_original, q, k, v, heads=H, transformer_options=opts), {})
    ref = rainfusion_reference(
        *(t.view(1, S, H, D) for t in (q, k, v)), rows=AttnRows(0, GRID), sparsity=0.8, block_size=32
    )
    assert comfy_original.calls == 0 and out.shape == q.shape
    torch.testing.assert_close(out, ref.reshape(1, S, H * D), atol=2e-6, rtol=1e-5)
    assert override.__self__.stats.sparse_calls == 1


def test_patch_passes_cross_attention_masks_and_unknown_rows_to_the_original():
    patched, override, wrapper = patched_model(CFG)
    q, k, v = qkv()
    ctx = torch.randn(1, 77, H * D)
    comfy_original.calls = 0
    opts = {}

    def body(o):
        a = override(comfy_original, q, ctx, ctx, heads=H, transformer_options=o)  # cross-attention
        torch.testing.assert_close(a, comfy_original(q, ctx, ctx, H))
        mask = torch.zeros(1, 1, S, S)
        override(comfy_original, q, k, v, H, mask, transformer_options=o)  # masked
        return a

    run_forward(wrapper, body, opts)
    assert comfy_original.calls == 3  # cross-attention and masked call passed through + 1 direct reference call
    assert opts == {}  # the rows are removed after the forward
    out = override(comfy_original, q, k, v, heads=H, transformer_options={})  # no wrapper ran: no rows
    assert torch.equal(out, comfy_original(q, k, v, H))
    assert override.__self__.stats.dense_calls["no layout"] == 1
    out = run_forward(
        wrapper,
        lambda o: override(comfy_original, q, k, v, heads=H, transformer_options=o),
        {},
        latent_shape=(1, 16, 3, 32, 34),
    )  # grid (3, 16, 17) != rows: inconsistent
    assert torch.equal(out, comfy_original(q, k, v, H))
    assert (
        copy.deepcopy(patched.model_options)["transformer_options"]["optimized_attention_override"].__self__
        is override.__self__
    )  # clones share one patch and its stats


def test_patch_gates_steps_from_sigmas_and_counts_layers():
    config = AttentionConfig(
        "torch_block_sparse", sparsity=0.8, start_step=1, skip_layers="1", block_size=32, min_video_blocks=4
    )
    _, override, wrapper = patched_model(config)
    q, k, v = qkv()
    schedule = torch.tensor([1.0, 0.7, 0.3, 0.0])
    stats = override.__self__.stats
    for sigma in (1.0, 0.7):
        opts = {"sigmas": torch.tensor([sigma]), "sample_sigmas": schedule}
        run_forward(
            wrapper,
            lambda o: [override(comfy_original, q, k, v, heads=H, transformer_options=o) for _ in range(2)],
            opts,
        )  # two blocks: layers 0 and 1
    assert stats.dense_calls == {"warm-up": 1, "skip_layers": 2} and stats.sparse_calls == 1  # layer 1 always skipped
    assert sampling_step({"sigmas": torch.tensor([0.31]), "sample_sigmas": schedule}) == 2
    assert sampling_step({}) is None


def test_patch_handles_comfy_bhsd_layout():
    _, override, wrapper = patched_model(CFG)
    q, k, v = (t.view(1, S, H, D).transpose(1, 2) for t in qkv())  # Cosmos: skip_reshape=True, [B, H, S, D]
    out = run_forward(
        wrapper,
        lambda o: override(
            comfy_original, q, k, v, H, skip_reshape=True, skip_output_reshape=True, transformer_options=o
        ),
        {},
    )
    ref = rainfusion_reference(
        *(t.transpose(1, 2) for t in (q, k, v)), rows=AttnRows(0, GRID), sparsity=0.8, block_size=32
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=2e-6, rtol=1e-5)


def test_patch_grid_for_wan_and_cosmos():
    assert patch_grid((1, 16, 21, 60, 104), types.SimpleNamespace(patch_size=(1, 2, 2))) == (21, 30, 52)
    assert patch_grid((1, 16, 5, 45, 45), types.SimpleNamespace(patch_spatial=2, patch_temporal=1)) == (5, 23, 23)
    assert patch_grid((1, 16, 64, 64), types.SimpleNamespace(patch_size=(1, 2, 2))) is None
    assert patch_grid((1, 16, 2, 8, 8), object()) is None


class PackedLayout:
    """Stand-in of core 0.33's comfy.ldm.minimax.model.PackedLayout (segments and signature only): the wrapper
    finds the class in its model's module, here this one."""

    built = 0

    def __init__(self, text_len, latent_t, latent_h, latent_w, audio_t, keyframes=None, refs=None):
        PackedLayout.built += 1
        rows = [("text", text_len), ("cond", 4 * len(keyframes or ())), ("audio", 2 * audio_t)]
        rows.append(("video", latent_t * (latent_h // 2) * (latent_w // 2)))
        starts = [sum(n for _, n in rows[:i]) for i in range(len(rows) + 1)]
        self.segments = [(a, b, kind) for a, b, (kind, _) in zip(starts, starts[1:], rows)]
        self.seq_len = starts[-1]
        self.signature = (text_len, latent_t, latent_h, latent_w, audio_t)


class NativeH3:
    patch_size = (1, 2, 2)


def test_call_rows_of_native_h3_and_wan():
    h3, video, audio, text = NativeH3(), torch.zeros(1, 24, 3, 15, 16), torch.zeros(1, 32, 2, 5), torch.zeros(1, 7, 8)
    h3_args = ([video, audio], None, text, {})  # forward(x, timestep, context, transformer_options)
    PackedLayout.built = 0
    payload = {"keyframes": [{}], "layout": PackedLayout(7, 3, 16, 16, 5, keyframes=[{}])}  # h padded to 16
    assert call_rows(h3, h3_args, {"minimax_payload": payload}) == (AttnRows(7 + 4 + 10, (3, 8, 8)), 213)
    assert PackedLayout.built == 1  # the payload's layout was used
    assert call_rows(h3, h3_args, {}) == (AttnRows(7 + 10, (3, 8, 8)), 209)  # built as the model builds it
    assert PackedLayout.built == 2
    payload["layout"] = PackedLayout(7, 3, 16, 16, 4)  # a stale layout (other audio length): rebuilt
    assert call_rows(h3, h3_args, {"minimax_payload": payload}) == (AttnRows(21, (3, 8, 8)), 213)
    assert call_rows(types.SimpleNamespace(patch_size=(1, 2, 2)), h3_args, {}) == (None, None)  # no PackedLayout
    wan = (torch.zeros(1, 16, 3, 32, 32), None, None)
    assert call_rows(types.SimpleNamespace(patch_size=(1, 2, 2)), wan, {}) == (AttnRows(0, GRID), None)


class H3Executor:
    """ComfyUI's WrapperExecutor surface around MiniMax-H3's forward([video, audio], t, context, opts, payload)."""

    class_obj = NativeH3()

    def __init__(self, body):
        self.body = body

    def __call__(self, x, t, context, transformer_options, minimax_payload=None):
        return self.body(transformer_options)


def test_native_h3_attention_runs_the_npu_paths(NPU, mindiesd, monkeypatch):  # noqa: F811
    """On Ascend, the blocks of core's H3 go to MindIE-SD (RainFusion: its rf_v2 kernel, the rows before the video
    dense; dense: packed varlen over the unpadded sequence); the text refiner's calls stay ComfyUI's."""
    monkeypatch.setattr(dispatch, "PLATFORM", NPU)
    streams, text = [torch.zeros(1, 24, 2, 32, 32), torch.zeros(1, 32, 2, 8)], torch.zeros(1, 24, 8)
    prefix, rows = 24 + 16, 24 + 16 + 512  # [text | audio | video (2, 16, 16)]
    q, k, v = (t.view(1, rows, H, D).transpose(1, 2) for t in qkv(rows))  # core's H3: [B, H, S, D], skip_reshape
    refiner = torch.randn(1, H, 24, D)
    comfy_original.calls = 0
    dense = comfy_original(q, k, v, H, skip_reshape=True).view(1, rows, H, D)

    def forward(config):
        _, override, wrapper = patched_model(config)

        def body(opts):
            override(comfy_original, refiner, refiner, refiner, H, skip_reshape=True, transformer_options=opts)
            return override(comfy_original, q, k, v, H, skip_reshape=True, transformer_options=opts)

        comfy_original.calls = 0
        out = wrapper(H3Executor(body), streams, None, text, {}, minimax_payload=None)
        assert comfy_original.calls == 1 and override.__self__.stats.dense_calls == {"text refiner": 1}
        return out.view(1, rows, H, D)

    sparse = forward(AttentionConfig("rainfusion", sparsity=0.8, min_video_blocks=2))
    assert [kind for kind, _ in mindiesd] == ["rain_fusion"] and mindiesd[0][1]["seq"] == [rows]
    torch.testing.assert_close(sparse[:, :prefix], dense[:, :prefix], atol=2e-6, rtol=1e-5)
    assert not torch.allclose(sparse, dense, atol=1e-3)  # the later video rows went sparse
    mindiesd.clear()
    torch.testing.assert_close(forward(AttentionConfig("auto", min_video_blocks=2)), dense, atol=2e-6, rtol=1e-5)
    assert [(kind, call["cu_q"]) for kind, call in mindiesd] == [("varlen", [0, rows])]


@pytest.mark.integration
def test_patch_node_with_a_tiny_native_comfyui_wan_model(comfyui_path):
    path = str(comfyui_path)
    if not os.path.isfile(os.path.join(path, "comfy", "ldm", "wan", "model.py")):
        pytest.skip(f"COMFYUI_PATH={path} has no comfy/ldm/wan/model.py")
    result = run_probe("attention_comfy_probe.py", comfyui_path)
    zero, sparse, gated = result["0.0"], result["0.8"], result["gated"]
    assert result["base_untouched"]
    assert zero["sparse_calls"] == 4 and zero["dense_calls"] == {}  # 2 layers x 2 steps, all through our op
    assert zero["max_abs_diff"] <= 1e-5 * max(1.0, zero["ref_scale"])  # sparsity 0: the same latent
    assert sparse["sparse_calls"] == 4 and sparse["realized"] > 0.1
    assert sparse["max_abs_diff"] > 1e-5 * sparse["ref_scale"]  # sparsity 0.8: runs and differs
    assert gated["dense_calls"] == {"warm-up": 1, "skip_layers": 2} and gated["sparse_calls"] == 1
    below, above = result["stacked"]["below"], result["stacked"]["above"]
    # one installed after ours sees every call first (4 self-attention calls in 2 layers x 2 steps, and the
    # cross-attention calls) and chains down; Backend Info names it
    assert above["calls"] >= 4 and above["sparse_calls"] == 1, above
    assert above["max_abs_diff_vs_ours_alone"] <= 1e-6, above
    # one installed first answers every call ours declines (the 3 dense self-attention calls and the same
    # cross-attention calls), none that ours takes
    assert below["declined"] == 3 and below["sparse_calls"] == 1, below
    assert below["calls"] - below["declined"] == above["calls"] - 4, (below, above)
    assert below["max_abs_diff_vs_ours_alone"] <= 1e-6, below
    assert above["max_abs_diff_vs_ours_alone"] <= 1e-6, above
    assert "sits above it and decides first: __main__.stacked.above" in above["backend_info"], above["backend_info"]
    assert "installed before it: __main__.stacked.below" in above["backend_info"], above["backend_info"]


@pytest.mark.integration
def test_patch_node_on_core_native_minimax_h3(comfyui_path):
    """ComfyUI 0.33's own MiniMax-H3 MODEL (tiny, core's single-file format, core's sampler): RainFusion over the
    generated video rows only, the same latent as the unpatched model at sparsity 0, the text refiner untouched."""
    if not os.path.isfile(os.path.join(str(comfyui_path), "comfy", "ldm", "minimax", "model.py")):
        pytest.skip(f"COMFYUI_PATH={comfyui_path} has no native MiniMax-H3 (comfy/ldm/minimax, ComfyUI 0.33+)")
    result = run_probe("attention_native_h3_probe.py", comfyui_path)
    zero, sparse, gated = result["0.0"], result["0.8"], result["gated"]
    video = [[result["expected_prefix"], [2, 16, 16]]]  # [text | keyframe | audio] rows, then the video grid
    for run in (zero, sparse, gated):
        assert run["attn_rows"] == video
        assert run["rows_vs_dense"]["prefix"] <= 1e-6 and run["rows_vs_dense"]["first_frame"] <= 1e-6
    assert zero["sparse_calls"] == 4 and zero["dense_calls"] == {}  # 2 blocks x 2 steps, all through our op
    assert zero["max_abs_diff"] <= 1e-5 * max(1.0, zero["ref_scale"])  # sparsity 0: core's latent
    assert sparse["sparse_calls"] == 4 and sparse["realized"] > 0.05
    assert sparse["rows_vs_dense"]["later_video"] > 1e-3  # only the later video rows went sparse
    assert sparse["max_abs_diff"] > 1e-4 * sparse["ref_scale"]  # sparsity 0.8: runs and differs
    assert gated["dense_calls"] == {"warm-up": 1, "skip_layers": 2} and gated["sparse_calls"] == 1
    refiner = result["refiner"]
    assert refiner["vs_refined"]["equal"], refiner["vs_refined"]  # the text refiner's calls reached ComfyUI's
    assert (refiner["refiner_calls"], refiner["block_sparse_calls"]) == (1, 4), refiner
