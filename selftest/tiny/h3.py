"""Tiny random-weight MiniMax-H3 parts (the CPU configs of shared/specs/h3.md) for the H3 tests and the
self-test (the test-only helpers around them stay in tests/support/h3_tiny.py).

The spec's audio VAE lists latent_channels=8, which cannot feed the spec's transformer
(audio_in_channels=32); both sides use 32 here. Latent mean/std are non-trivial so the
(de)normalisation is exercised.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from safetensors.torch import save_file

TRANSFORMER = dict(
    num_attention_heads=2,
    attention_head_dim=32,
    hidden_size=48,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=64,
    in_channels=24,
    audio_in_channels=32,
    patch_size=(1, 2, 2),
    text_dim=40,
    freq_dim=32,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
    rope_freq_dim=4,
)
VAE = dict(
    block_out_channels=(32,) * 6,
    layers_per_block=1,
    decoder_num_layers=1,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=16,
    decoder_num_register_tokens=4,
    latents_mean=tuple(float(x) for x in np.linspace(-0.2, 0.2, 24)),
    latents_std=tuple(float(x) for x in np.linspace(0.5, 1.5, 24)),
)
AUDIO_VAE = dict(
    encoder_dim=4,
    encoder_rates=(8, 10, 10),
    latent_dim=32,
    latent_channels=32,
    num_attention_heads=2,
    decoder_dim=32,
    decoder_rates=(8, 10, 10),
    decoder_kernel_sizes=(16, 20, 20),
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1,),),
    latents_mean=[float(x) for x in np.linspace(-0.1, 0.1, 32)],
    latents_std=[float(x) for x in np.linspace(0.8, 1.2, 32)],
)
TEXT_DIM = 40
FRAMES, WIDTH, HEIGHT = 124, 96, 64  # 124 = 17*7+5 frames (5.2 s), the shortest H3 allows


def make_models(seed: int = 0, **transformer_overrides):
    torch.manual_seed(seed)
    transformer = MiniMaxH3Transformer3DModel(**{**TRANSFORMER, **transformer_overrides}).eval()
    vae = AutoencoderKLMiniMaxH3(**VAE).eval()
    audio_vae = AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE).eval()
    # random init leaves some output heads at exactly zero: perturb everything so parity is not trivial
    with torch.no_grad():
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return transformer, vae, audio_vae


def write_folder(
    root: Path, transformer, vae, audio_vae, *, transformer_weights: bool = True, transformer_ref=None
) -> Path:
    """A diffusers-format H3 folder as the HF repo lays it out (the parts we load); `transformer` None leaves out
    transformer/, `transformer_ref` (the ref2va partition) adds transformer_ref/."""
    root.mkdir(parents=True, exist_ok=True)
    parts = (("transformer", transformer), ("transformer_ref", transformer_ref), ("vae", vae), ("audio_vae", audio_vae))
    for sub, model in ((sub, model) for sub, model in parts if model is not None):
        (root / sub).mkdir(exist_ok=True)
        model.save_config(str(root / sub))  # config.json with _class_name, as save_pretrained writes it
        if sub != "transformer" or transformer_weights:
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()},
                str(root / sub / "diffusion_pytorch_model.safetensors"),
            )
    for sub, shift in (("scheduler", 12.0), ("audio_scheduler", 3.0)):
        MiniMaxH3Scheduler(shift=shift).save_config(str(root / sub))
    return root


def write_lora(path: Path, transformer, seed: int = 0, rank: int = 4) -> Path:
    """A diffusers-format LoRA (`transformer.<module>.lora_A/B.weight`) on every Linear of the block stack."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks."):
            rows, cols = module.weight.shape
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.1
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.1
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))
    return path


def to_original_keys(sd: dict) -> dict:
    """diffusers -> original single-file keys (inverse of convert_minimax_h3_transformer_checkpoint_to_diffusers)."""
    renames = [
        ("token_refiner.refiner_blocks.", "token_refiner.blocks."),
        ("time_embedder.linear_1.", "time_embedder.proj_in."),
        ("time_embedder.linear_2.", "time_embedder.proj_out."),
        ("audio_proj_in.", "audio_patch_proj."),
        ("context_embedder.", "condition_proj."),
        ("norm_out.norm.", "final_layer.norm."),
        ("norm_out.linear.", "final_layer.adaln_proj.linear."),
        ("audio_proj_out.", "final_layer.audio_out."),
        (".attn.norm_q.", ".attn.q_norm."),
        (".attn.norm_k.", ".attn.k_norm."),
        (".attn.to_out.0.", ".attn.out_proj."),
        (".ff.net.0.proj.", ".mlp.fc1."),
        (".ff.net.2.", ".mlp.fc2."),
    ]
    out = {}
    for key, value in sd.items():
        if key.endswith(".ff.net.0.proj.weight"):  # SwiGLU [value; gate] -> checkpoint [gate; value]
            v, g = torch.chunk(value, 2, dim=0)
            value = torch.cat([g, v])
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        if ".attn.to_q.weight" in key:
            base = key.replace(".attn.to_q.weight", "")
            value = torch.cat([sd[key], sd[base + ".attn.to_k.weight"], sd[base + ".attn.to_v.weight"]])
            key = base + ".attn.qkv_proj.weight"
        if key.startswith("transformer_blocks."):
            key = "blocks." + key[len("transformer_blocks.") :]
        if key.startswith("proj_in."):
            key = "video_patch_proj." + key[len("proj_in.") :]
        if key.startswith("proj_out."):
            key = "final_layer.video_out." + key[len("proj_out.") :]
        for new, old in renames:
            key = key.replace(new, old)
        out[key] = value.contiguous()
    return out


def core_keys(transformer) -> dict[str, torch.Tensor]:
    """Core ComfyUI's single-file layout: original keys plus the `rope.inv_freq` buffer every core file stores
    (diffusers does not save it)."""
    return {**to_original_keys(transformer.state_dict()), "rope.inv_freq": transformer.rope.inv_freq.clone()}
