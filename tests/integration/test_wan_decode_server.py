"""One graph on a real ComfyUI server: core VAELoader -> core VAE Decode and -> OmniVideo Wan VAE Decode of the
same latent; the IMAGEs must be bit-identical (the full-size random Wan 2.1 VAE of conftest.py, on CPU)."""

import uuid

import torch
from safetensors.torch import load_file, save_file

FUSIONS = ("auto", "off")  # the server runs without the Triton interpreter: auto = fused torch on CPU


def test_core_vae_decode_and_ours_are_bit_identical(comfy_server, vae_file, report):
    latent = torch.randn(1, 16, 3, 6, 10, generator=torch.Generator().manual_seed(7))
    name = f"omnivideo_bitexact_{uuid.uuid4().hex[:8]}.latent"
    # LoadLatent: "latent_format_version_0" marks a raw latent (no 1/0.18215 rescale)
    raw = {"latent_tensor": latent, "latent_format_version_0": torch.tensor([])}
    save_file(raw, str(comfy_server.input_dir / name))
    tag = uuid.uuid4().hex[:8]
    graph = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_file}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": name}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "OmniVideoTestSaveTensor", "inputs": {"images": ["3", 0], "name": f"core_{tag}"}},
    }
    for i, fusion in enumerate(FUSIONS):
        graph[f"1{i}"] = {
            "class_type": "OmniVideoWanVAEDecode",
            "inputs": {"vae": ["1", 0], "samples": ["2", 0], "fusion": fusion},
        }
        graph[f"2{i}"] = {
            "class_type": "OmniVideoTestSaveTensor",
            "inputs": {"images": [f"1{i}", 0], "name": f"ours_{fusion}_{tag}"},
        }
    comfy_server.run(graph, timeout=300)

    def read(stem):
        return load_file(str(comfy_server.output_dir / f"{stem}_{tag}.safetensors"))["images"]

    core = read("core")
    assert core.shape == (9, 48, 80, 3), core.shape  # 1 + 4 * (3 - 1) frames of 8x the latent
    for fusion in FUSIONS:
        ours = read(f"ours_{fusion}")
        diff = (ours - core).abs().max().item() if ours.shape == core.shape else float("nan")
        assert ours.shape == core.shape and torch.equal(ours, core), f"fusion={fusion}: max |diff| {diff:.3g}"
    report.append(f"core VAE Decode vs OmniVideo Wan VAE Decode ({', '.join(FUSIONS)}), 80x48x9: bit-identical")
