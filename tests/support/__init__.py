"""Test support, importable as `support` (tests/ is on sys.path): tiny random-weight model builders for each family
(omnidreams_tiny, h3_tiny, h3_tiny_qwen, wan_vae_fixtures) and ComfyUI's folders in a temp dir (comfy_folders)."""
