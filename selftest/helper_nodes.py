"""The helper nodes of the self-test's ComfyUI (server.py writes them into its temporary custom_nodes folder as a
custom node pack of their own, `omnivideo_selftest_helpers`; never part of the pack): a lossless IMAGE saver, and
stand-ins for core's text encoder and MiniMax-H3 VAEs, which ComfyUI builds only at full size."""

from __future__ import annotations

import textwrap

HELPER_PACK = textwrap.dedent('''
    """OmniVideo self-test helpers (written by omnivideo.selftest.server into a temporary ComfyUI only)."""
    import os

    import folder_paths
    import torch
    from safetensors.torch import save_file


    class OmniVideoTestSaveTensor:
        """Writes IMAGE as float32 safetensors into the output folder, so two decoders can be compared exactly."""

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"images": ("IMAGE",), "name": ("STRING", {"default": "probe"})}}

        RETURN_TYPES = ()
        FUNCTION = "save"
        OUTPUT_NODE = True
        CATEGORY = "_for_testing"

        def save(self, images, name):
            path = os.path.join(folder_paths.get_output_directory(), name + ".safetensors")
            save_file({"images": images.detach().float().cpu().contiguous()}, path)
            return {"ui": {"probe": [{"path": path, "shape": list(images.shape), "dtype": str(images.dtype)}]}}


    class OmniVideoTestTextStandIn:
        """A CONDITIONING of random UMT5-XXL-shaped states ([1, tokens, 4096]): stands in for CLIPLoader +
        CLIPTextEncode of the core Wan graphs, whose 5.7B-parameter text encoder ComfyUI builds only at full size."""

        @classmethod
        def INPUT_TYPES(cls):
            return {
                "required": {
                    "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
                    "tokens": ("INT", {"default": 8, "min": 1, "max": 512}),
                }
            }

        RETURN_TYPES = ("CONDITIONING",)
        FUNCTION = "encode"
        CATEGORY = "_for_testing"

        def encode(self, seed, tokens):
            g = torch.Generator().manual_seed(seed)
            return ([[torch.randn(1, tokens, 4096, generator=g) * 0.1, {}]],)


    class OmniVideoTestFramesStandIn:
        """IMAGE frames from a video LATENT ([B, C, T, h, w] -> T frames of 16h x 16w, a fixed mix of the channels):
        stands in for VAE Decode with core's MiniMax-H3 video VAE, which ComfyUI builds only at full size (2.6B
        parameters)."""

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"samples": ("LATENT",)}}

        RETURN_TYPES = ("IMAGE",)
        FUNCTION = "decode"
        CATEGORY = "_for_testing"

        def decode(self, samples):
            latent = samples["samples"][:1].float()
            mix = torch.linspace(-1.0, 1.0, latent.shape[1] * 3).view(3, latent.shape[1])
            rgb = torch.einsum("rc,bcthw->bthwr", mix, latent)[0].sigmoid()
            return (rgb.repeat_interleave(16, dim=1).repeat_interleave(16, dim=2).contiguous(),)


    class OmniVideoTestAudioStandIn:
        """AUDIO from an audio LATENT ([B, C, ..., T] -> stereo at 32 kHz, 1280 samples per latent step): stands in
        for VAE Decode Audio with core's MiniMax-H3 audio VAE."""

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"samples": ("LATENT",)}}

        RETURN_TYPES = ("AUDIO",)
        FUNCTION = "decode"
        CATEGORY = "_for_testing"

        def decode(self, samples):
            latent = samples["samples"][:1].float()
            steps = latent.flatten(1, -2).mean(dim=1, keepdim=True)  # [1, 1, T]
            wave = steps.tanh().repeat_interleave(1280, dim=-1).repeat(1, 2, 1)
            return ({"waveform": wave.contiguous(), "sample_rate": 32000},)


    NODE_CLASS_MAPPINGS = {
        "OmniVideoTestSaveTensor": OmniVideoTestSaveTensor,
        "OmniVideoTestTextStandIn": OmniVideoTestTextStandIn,
        "OmniVideoTestFramesStandIn": OmniVideoTestFramesStandIn,
        "OmniVideoTestAudioStandIn": OmniVideoTestAudioStandIn,
    }
''')
