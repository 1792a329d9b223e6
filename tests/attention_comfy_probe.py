"""Run by tests/test_attention_nodes.py in ComfyUI's interpreter (COMFYUI_PYTHON): sample a tiny native
ComfyUI Wan 2.1 model with and without OmniVideo Patch Model Attention and print the differences as JSON.

ComfyUI infers the Wan dims from the checkpoint shapes (load_diffusion_model_state_dict), exactly as
for a real file. Where this ComfyUI boxes q / k / v in AttentionTensorContainer (0.33: MiniMax), a boxed call
of the patched model's attention must reach our override and equal the unboxed one (checked here: the probe
fails without its result line otherwise). Not a test module itself (no test_ prefix).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.environ["COMFYUI_PATH"])
from comfy.cli_args import args  # noqa: E402

args.cpu = not torch.cuda.is_available()

import comfy.ldm.wan.model as wan  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.sd  # noqa: E402
from support.differences import difference  # noqa: E402

from omnivideo.attention.config import AttentionConfig  # noqa: E402
from omnivideo.nodes.attention import OmniVideoPatchModelAttention  # noqa: E402
from omnivideo.nodes.backend_info import OmniVideoBackendInfo  # noqa: E402


def tiny_wan_state_dict():
    torch.manual_seed(0)
    net = wan.WanModel(
        model_type="t2v",
        patch_size=(1, 2, 2),
        in_dim=16,
        dim=128,
        ffn_dim=256,
        freq_dim=256,
        text_dim=4096,
        out_dim=16,
        num_heads=1,
        num_layers=2,
        operations=comfy.ops.disable_weight_init,
    )
    sd = {}
    for name, t in net.state_dict().items():  # comfy ops skip init: fill every tensor
        sd[name] = (torch.randn(t.shape) * (0.02 if t.dim() > 1 else 0.1)).to(torch.float32)
    return sd


def sample(model, latent, positive, negative, steps=2):
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(1))
    return comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", positive, negative, latent, seed=1)


def boxed_calls(patched) -> dict | None:
    """core's optimized_attention with the patched MODEL's transformer_options, once with tensors and once with
    q / k / v in AttentionTensorContainer boxes (None where this ComfyUI has no such boxes)."""
    import comfy.ldm.modules.attention as attention

    if not hasattr(attention, "AttentionTensorContainer"):
        return None
    opts = patched.model_options["transformer_options"]
    stats = opts["optimized_attention_override"].__self__.stats
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))  # [B, H, S, D]
    before = stats.dense_calls["no layout"]  # no DIFFUSION_MODEL wrapper ran: the override passes the call on
    plain = attention.optimized_attention(q, k, v, 2, skip_reshape=True, transformer_options=dict(opts))
    boxes = [attention.AttentionTensorContainer(t.clone()) for t in (q, k, v)]
    boxed = attention.optimized_attention(*boxes, 2, skip_reshape=True, transformer_options=dict(opts))
    result = {"boxed_vs_plain": difference(boxed, plain), "reached": stats.dense_calls["no layout"] - before}
    assert result["boxed_vs_plain"]["equal"] and result["reached"] == 2, result
    return result


def stacked(base, latent, cond, config, alone):
    """A stand-in for another attention override (another pack's; core's Model Attention Backend has the same shape)
    below ours (installed first: it must answer the calls ours declines) and above ours (installed after, chaining
    down as core's Model Sparse Attention does: Backend Info must say it decides first)."""
    counts = {"below": 0, "above": 0}

    def below(func, *args, **kwargs):
        counts["below"] += 1
        return func(*args, **kwargs)

    first = base.clone()
    first.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = below
    patched = OmniVideoPatchModelAttention.execute(first, config).args[0]
    got = sample(patched, latent, cond, cond)
    stats = patched.model_options["transformer_options"]["optimized_attention_override"].__self__.stats
    out = {
        "below": {
            "calls": counts["below"],
            "declined": sum(stats.dense_calls.values()),
            "sparse_calls": stats.sparse_calls,
            "max_abs_diff_vs_ours_alone": float((got - alone).abs().max()),
        }
    }
    patched = OmniVideoPatchModelAttention.execute(base, config).args[0]
    ours = patched.model_options["transformer_options"]["optimized_attention_override"]

    def above(func, *args, **kwargs):
        counts["above"] += 1
        return ours(func, *args, **kwargs)

    on_top = patched.clone()
    on_top.model_options["transformer_options"]["optimized_attention_override"] = above
    got = sample(on_top, latent, cond, cond)
    out["above"] = {
        "calls": counts["above"],
        "sparse_calls": ours.__self__.stats.sparse_calls,
        "max_abs_diff_vs_ours_alone": float((got - alone).abs().max()),
        "backend_info": OmniVideoBackendInfo.execute().args[0],
    }
    return out


def main():
    base = comfy.sd.load_diffusion_model_state_dict(tiny_wan_state_dict())
    g = torch.Generator().manual_seed(2)
    cond = [[torch.randn(1, 16, 4096, generator=g) * 0.1, {}]]
    latent = torch.zeros(1, 16, 2, 96, 96)  # patch grid (2, 48, 48): 4608 rows = 36 blocks of 128
    plain = sample(base, latent, cond, cond)
    out = {"grid": [2, 48, 48]}
    runs = {
        "0.0": AttentionConfig("rainfusion", sparsity=0.0),
        "0.8": AttentionConfig("rainfusion", sparsity=0.8),
        "gated": AttentionConfig("rainfusion", sparsity=0.8, start_step=1, skip_layers="1"),
    }
    for key, config in runs.items():
        patched = OmniVideoPatchModelAttention.execute(base, config).args[0]
        got = sample(patched, latent, cond, cond)
        stats = patched.model_options["transformer_options"]["optimized_attention_override"].__self__.stats
        out[key] = {
            "max_abs_diff": float((got - plain).abs().max()),
            "ref_scale": float(plain.abs().max()),
            "sparse_calls": stats.sparse_calls,
            "dense_calls": dict(stats.dense_calls),
            "impls": dict(stats.impls),
            "realized": stats.realized_sparsity,
        }
    gated_alone = sample(OmniVideoPatchModelAttention.execute(base, runs["gated"]).args[0], latent, cond, cond)
    out["stacked"] = stacked(base, latent, cond, runs["gated"], gated_alone)
    out["boxed"] = boxed_calls(OmniVideoPatchModelAttention.execute(base, runs["0.8"]).args[0])
    # the base model is untouched by patching (clone)
    out["base_untouched"] = "optimized_attention_override" not in base.model_options.get("transformer_options", {})
    print("PROBE_RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
