"""Run by tests/test_attention_nodes.py in ComfyUI 0.33's interpreter (COMFYUI_PYTHON): sample core's own native
MiniMax-H3 MODEL (comfy/ldm/minimax) at a tiny size with and without OmniVideo Patch Model Attention and print
the differences as JSON.

The model is our tiny diffusers H3 transformer in core's single-file format (tests/support/h3_core_files.py),
loaded by core's detection (load_diffusion_model_state_dict, as UNETLoader does); the latent is core's
EmptyMiniMaxH3LatentAV; the conditioning is random Qwen3-VL-shaped states (core builds its text encoder only at
32B) with one keyframe latent as MiniMaxH3ImageToVideo attaches it, so the packed sequence is [text | keyframe |
audio | video]. Sampled with core's common_ksampler (what KSampler runs). Not a test module itself (no test_
prefix).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.environ["COMFYUI_PATH"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comfy.cli_args import args  # noqa: E402

args.cpu = True

import comfy.sd  # noqa: E402
from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV  # noqa: E402
from support.differences import difference  # noqa: E402
from support.h3_core_files import core_keys  # noqa: E402
from support.h3_tiny import TRANSFORMER, make_models  # noqa: E402

import omnivideo.integration.attention_patch as attention_patch  # noqa: E402
from nodes import common_ksampler  # noqa: E402  (ComfyUI's nodes.py)
from omnivideo.attention.config import AttentionConfig  # noqa: E402
from omnivideo.nodes.attention import OmniVideoPatchModelAttention  # noqa: E402

TEXT_ROWS, KEYFRAME_ROWS, AUDIO_ROWS = 9, 16 * 16, 2 * 8  # 512x512, 5 frames: video (2, 16, 16) = 512 rows
SPARSE = dict(block_size=16)  # 32 video blocks of 16 rows: RainFusion's minimum


def conditioning(text_dim: int):
    g = torch.Generator().manual_seed(2)
    keyframe = {"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 32, 32, generator=g)}
    return [[torch.randn(1, TEXT_ROWS, text_dim, generator=g), {"minimax_keyframes": [keyframe]}]]


def sample(model, cond, latent):
    (out,) = common_ksampler(model, 1, 2, 1.0, "euler", "simple", cond, cond, latent)
    return torch.cat([t.flatten() for t in out["samples"].unbind()])


class SparseCallSpy:
    """Wraps the patch's attention(): the rows of its calls, and the first sparse call's q, k, v and output."""

    def __init__(self):
        self.attn_rows, self.first = set(), None
        self.real = attention_patch.attention

    def __call__(self, q, k, v, config, **kw):
        out = self.real(q, k, v, config, **kw)
        rows = kw["rows"]
        self.attn_rows.add((rows.prefix_len, tuple(rows.grid)))
        if self.first is None and kw["stats"].sparse_calls:
            self.first = (q, k, v, kw["scale"], rows, out)
        return out


def rows_dense(spy) -> dict:
    """How far the first sparse call's output rows are from dense attention: the rows before the video (text,
    keyframe, audio) and the first frame must equal it, the later video rows may not."""
    q, k, v, scale, rows, out = spy.first
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), scale=scale
    ).transpose(1, 2)
    diff = (out - dense).abs().amax(dim=(0, 2, 3))
    frame = rows.grid[1] * rows.grid[2]
    start = rows.prefix_len
    return {
        "prefix": float(diff[:start].max()),
        "first_frame": float(diff[start : start + frame].max()),
        "later_video": float(diff[start + frame :].max()),
    }


def refiner_untouched(patched) -> dict:
    """A forward given the raw text states runs core's text refiner inside the patched forward (sampling refines
    the text once in extra_conds, outside it): its calls must reach ComfyUI's attention, so the output equals a
    forward given the text refined beforehand by the unpatched refiner, bit for bit."""
    patch = patched.model_options["transformer_options"]["optimized_attention_override"].__self__
    model = patched.model.diffusion_model
    g = torch.Generator().manual_seed(4)
    streams = [torch.randn(1, 24, 2, 32, 32, generator=g), torch.randn(1, 32, 2, 8, generator=g)]
    text = torch.randn(1, TEXT_ROWS, TRANSFORMER["text_dim"], generator=g)
    t = torch.tensor([600.0])

    def forward(context):
        opts = {
            "optimized_attention_override": patch.override,
            "wrappers": {"diffusion_model": {"omnivideo_attention": [patch.wrapper]}},
        }
        return torch.cat([o.flatten() for o in model([s.clone() for s in streams], t, context, opts)])

    stats = patch.stats
    raw = forward(text)
    refiner_calls = stats.dense_calls["text refiner"]
    with torch.no_grad():
        refined = model.preprocess_text_embeds(text)
    # no payload here: the wrapper built the layout itself, and the blocks went sparse with it
    return {
        "vs_refined": difference(raw, forward(refined)),
        "refiner_calls": refiner_calls,
        "block_sparse_calls": stats.sparse_calls,
    }


def main():
    torch.set_num_threads(1)
    transformer, _, _ = make_models(seed=0)
    base = comfy.sd.load_diffusion_model_state_dict(
        {"model.diffusion_model." + k: v for k, v in core_keys(transformer).items()}
    )
    cond = conditioning(TRANSFORMER["text_dim"])
    latent = EmptyMiniMaxH3LatentAV.execute(width=512, height=512, length=5).args[0]
    plain = sample(base, cond, latent)
    out = {"model": type(base.model.diffusion_model).__module__}
    runs = {
        "0.0": AttentionConfig("torch_block_sparse", sparsity=0.0, **SPARSE),
        "0.8": AttentionConfig("torch_block_sparse", sparsity=0.8, **SPARSE),
        "gated": AttentionConfig("torch_block_sparse", sparsity=0.8, start_step=1, skip_layers="1", **SPARSE),
    }
    for key, config in runs.items():
        spy = attention_patch.attention = SparseCallSpy()
        patched = OmniVideoPatchModelAttention.execute(base, config).args[0]
        got = sample(patched, cond, latent)
        attention_patch.attention = spy.real
        stats = patched.model_options["transformer_options"]["optimized_attention_override"].__self__.stats
        out[key] = {
            "max_abs_diff": float((got - plain).abs().max()),
            "ref_scale": float(plain.abs().max()),
            "sparse_calls": stats.sparse_calls,
            "dense_calls": dict(stats.dense_calls),
            "realized": stats.realized_sparsity,
            "attn_rows": sorted(spy.attn_rows),
            "rows_vs_dense": rows_dense(spy) if spy.first is not None else None,
        }
    out["refiner"] = refiner_untouched(OmniVideoPatchModelAttention.execute(base, runs["0.8"]).args[0])
    out["expected_prefix"] = TEXT_ROWS + KEYFRAME_ROWS + AUDIO_ROWS
    print("PROBE_RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
