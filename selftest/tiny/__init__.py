"""Tiny random-weight models in the layouts ComfyUI and the pack's loaders read, shared by the self-test and the
test suite (tests/support re-exports them): omnidreams (DiT checkpoint, Cosmos-Reason1 folder), h3 (diffusers H3
folder), h3_qwen (Qwen3-VL text encoder folder), wan (ComfyUI's Wan 2.1 VAE and DiT files). No downloads."""
