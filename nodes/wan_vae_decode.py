"""OmniVideo Wan VAE Decode: core VAE + Wan latent in, IMAGE frames out (core's decode, fused forwards)."""

from __future__ import annotations

from .. import compat
from ..compat import io
from ..pipelines.wan_decode import FUSIONS, decode
from .input_checks import checks_inputs


@checks_inputs(combos=("fusion",))
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
                "memory. 'auto' picks Triton on CUDA, fused torch elsewhere; 'off' runs ComfyUI's own module "
                "forwards, still in OmniVideo's decode loop (one preallocated output, progress per latent frame)."
            ),
            inputs=[
                io.Vae.Input("vae", tooltip="A Wan 2.1 (16-channel) or Wan 2.2 (48-channel) VAE from Load VAE."),
                io.Latent.Input("samples", tooltip="Raw Wan latent [B, C, T, H, W], as core samplers return it."),
                io.Combo.Input(
                    "fusion",
                    options=list(FUSIONS),
                    default="auto",
                    tooltip="Fused kernels: triton, torch, or off (ComfyUI's own module forwards in OmniVideo's "
                    "decode loop); auto picks the fastest usable. The same pixels as core VAE Decode at every choice.",
                ),
            ],
            outputs=[io.Image.Output(display_name="images")],
        )

    @classmethod
    def execute(cls, vae, samples, fusion="auto") -> io.NodeOutput:
        return io.NodeOutput(decode(vae, samples["samples"], fusion))
