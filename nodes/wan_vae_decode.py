"""OmniVideo Wan VAE Decode: core VAE + Wan latent in, IMAGE frames out (core's decode, fused forwards)."""

from __future__ import annotations

from .. import compat
from ..compat import io
from ..integration import safe_paths
from ..pipelines.wan_decode import FUSION_CHOICES, decode


class OmniVideoWanVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoWanVAEDecode",
            **compat.search_aliases("vae decode", "wan vae", "fused decode"),
            display_name="OmniVideo Wan VAE Decode",
            category="OmniVideo/latent",
            description=(
                "Decodes a Wan 2.1 / 2.2 video latent with core's VAE decode running fused fast paths on the "
                "loaded VAE itself (no second copy): the same pixels as core VAE Decode, faster and with less "
                "memory. 'auto' picks Triton on CUDA, fused torch elsewhere; 'off' runs ComfyUI's own operations."
            ),
            inputs=[
                io.Vae.Input("vae", tooltip="A Wan 2.1 (16-channel) or Wan 2.2 (48-channel) VAE from Load VAE."),
                io.Latent.Input("samples", tooltip="Raw Wan latent [B, C, T, H, W], as core samplers return it."),
                io.Combo.Input(
                    "fusion",
                    options=list(FUSION_CHOICES),
                    default="auto",
                    tooltip="Fused kernels: the same pixels as core VAE Decode at every choice.",
                ),
            ],
            outputs=[io.Image.Output(display_name="images")],
        )

    if not safe_paths.CORE_CHECKS_V3_COMBOS:  # this ComfyUI passes any combo value on: ours checks fusion

        @classmethod
        def validate_inputs(cls, fusion=None):
            return safe_paths.validated_choices(cls, fusion=fusion)

    @classmethod
    def execute(cls, vae, samples, fusion="auto") -> io.NodeOutput:
        return io.NodeOutput(decode(vae, samples["samples"], fusion))
