"""What each device holds for the released OmniDreams 2B model, computed from the shapes (no weights, no GPU).

The DiT is built on the meta device from its released config to count its parameters; the KV window, the prompt's
cross-attention K/V and one chunk's latent follow from the token counts. Per resolution it prints the default setup
(bf16 weights, window 6, bf16 KV, the text encoder on the GPU) and the 24-32 GB recipe (fp8 weights, window 4, fp8
KV, the text encoder on the CPU in bf16). Activations (the DiT's per call, the Wan VAE decode's) are not included:
they depend on the attention backend and ComfyUI's decode tiling.

    python benchmarks/omnidreams_footprint.py
"""

from __future__ import annotations

import torch

from omnivideo.models.omnidreams.dit import OmniDreamsConfig, OmniDreamsDiT

GB = 1e9
TEXT_ENCODER_PARAMS = 8.29e9  # Cosmos-Reason1-7B = Qwen2.5-VL-7B: 7.6 B language model + 0.68 B vision tower
WAN_VAE_PARAMS = 127e6  # Wan 2.1 VAE (wan_2.1_vae.safetensors)
TEXT_TOKENS = 512
SIZES = ((704, 1280), (560, 1024))


def dit_bytes(cfg: OmniDreamsConfig, block_bytes: int) -> float:
    """The DiT's weights: its blocks at `block_bytes` per parameter (fp8: 1), the rest in bf16 (as the loader keeps
    embeddings, norms and the final layer)."""
    with torch.device("meta"):
        dit = OmniDreamsDiT(cfg, dtype=torch.bfloat16)
    blocks = sum(p.numel() for p in dit.blocks.parameters())
    rest = sum(p.numel() for p in dit.parameters()) - blocks
    return blocks * block_bytes + rest * 2


def kv_window_bytes(cfg: OmniDreamsConfig, height: int, width: int, window_frames: int, kv_bytes: int) -> float:
    tokens_per_frame = (height // 8 // cfg.patch_spatial) * (width // 8 // cfg.patch_spatial)
    return 2 * cfg.num_blocks * window_frames * tokens_per_frame * cfg.model_channels * kv_bytes


def main() -> None:
    cfg = OmniDreamsConfig()
    cross = 2 * cfg.num_blocks * TEXT_TOKENS * cfg.model_channels * 2
    setups = {
        "default (bf16, window 6, encoder on the GPU)": dict(block_bytes=2, window=6, kv_bytes=2, encoder_gpu=True),
        "24-32 GB recipe (fp8, window 4, encoder on the CPU)": dict(
            block_bytes=1, window=4, kv_bytes=1, encoder_gpu=False
        ),
    }
    for height, width in SIZES:
        print(f"\n{width}x{height} ({height // 16 * (width // 16)} tokens per latent frame)")
        for name, s in setups.items():
            parts = {
                "DiT weights": dit_bytes(cfg, s["block_bytes"]),
                "KV window": kv_window_bytes(cfg, height, width, s["window"], s["kv_bytes"]),
                "prompt cross K/V": cross,
                "Wan VAE weights": WAN_VAE_PARAMS * 2,
                "text encoder (bf16)": TEXT_ENCODER_PARAMS * 2,
            }
            gpu = sum(v for k, v in parts.items() if s["encoder_gpu"] or not k.startswith("text"))
            shown = ", ".join(f"{k} {v / GB:.2f}" for k, v in parts.items())
            where = "GPU" if s["encoder_gpu"] else "CPU"
            print(f"  {name}: {shown} GB (text encoder on the {where}) -> GPU {gpu / GB:.1f} GB before activations")


if __name__ == "__main__":
    main()
