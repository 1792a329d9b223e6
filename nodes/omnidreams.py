"""OmniDreams nodes: the model loader, first-frame and HD-map conditioning, and the OmniDreams sampler (the text
nodes: omnidreams_text.py)."""

from __future__ import annotations

from .. import compat
from ..backends import PLATFORM, WEIGHT_DTYPE_CHOICES, resolve_weight_dtype
from ..compat import io
from ..integration import comfy_types, safe_paths
from ..models.handles import OmniDreamsModel
from ..models.omnidreams.loader import load_omnidreams, weights_recipe
from ..pipelines.omnidreams import DEFAULT_STEPS, ARSettings, check_wan21_vae, encode_first_frame, encode_hdmap, sample
from ..pipelines.omnidreams.schedule import KV_DTYPE_CHOICES, KV_FINALIZE_CHOICES, MAX_SHORT_HISTORY_BLOCKS
from .input_checks import checks_inputs
from .omnidreams_text import check_conditioning
from .sampling import run_sampler, sampler_inputs
from .types import AttentionType, ConditioningType, ModelType

CKPT_EXTS = (".pt", ".pth", ".safetensors")
MAX_FRAMES = 1021  # 128 chunks, 34 s at 30 fps


def _checkpoint(name: str) -> str:
    return safe_paths.resolve_model_file("diffusion_models", name, CKPT_EXTS, what="ckpt_name")


KV_HISTORY_CHOICES = ("uniform", "early_short_history")
DEFAULT_SHORT_HISTORY_BLOCKS = 9  # FlashDreams' responsive presets (early_short_history_block_count=9)


@checks_inputs(ckpt_name=_checkpoint, combos=("dtype", "kv_history", "kv_finalize", "kv_dtype"))
class OmniDreamsModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsModelLoader",
            **compat.search_aliases("world model", "cosmos predict"),
            display_name="OmniVideo OmniDreams Model Loader",
            category="OmniVideo/OmniDreams",
            description=(
                "Loads the OmniDreams (Cosmos-Predict2.5 2B, AR-distilled) DiT from models/diffusion_models "
                "(.pt read with weights_only, or .safetensors). The size is inferred from the weights; every "
                "key and shape is checked. dtype 'auto' = bf16 on GPU/NPU, fp32 on CPU; 'fp8_e4m3fn' stores the "
                "block weights in fp8 (about half the memory of bf16) and computes in the 'auto' dtype. ComfyUI "
                "places the weights and streams what does not fit in VRAM. window/sink set the "
                "rolling KV cache in latent frames (released: 6 and 0). kv_history 'uniform' (default) gives every "
                "block that window; 'early_short_history' (FlashDreams' responsive history, its "
                "early_short_history_block_count) keeps only the sink and the current chunk in the first "
                "short_history_blocks blocks (FlashDreams' responsive presets: 9, with window_frames 4) and the "
                "window in the rest: less memory, history only in the later blocks. kv_finalize 'context_noise' "
                "(released) writes each chunk's K/V with a third DiT call on the re-noised clean chunk; 'skip' "
                "(FlashDreams' skip_finalize_kv_cache, its fast presets) keeps the K/V of the last denoising call "
                "and denoises at timesteps [1000, 100]: 2 DiT calls per chunk instead of 3. kv_dtype 'fp8_e4m3fn' "
                "stores the KV window in fp8 (half the memory of bf16; FlashDreams' fp8 KV cache). A saved stream "
                "state resumes only with the kv_history, kv_finalize and kv_dtype it was saved with."
            ),
            inputs=[
                io.Combo.Input("ckpt_name", options=safe_paths.list_model_files("diffusion_models", CKPT_EXTS)),
                io.Combo.Input("dtype", options=list(WEIGHT_DTYPE_CHOICES), default="auto"),
                io.Int.Input("window_frames", default=6, min=2, max=64, step=2),
                io.Int.Input("sink_frames", default=0, min=0, max=62, step=2),
                io.Combo.Input(
                    "kv_history",
                    options=list(KV_HISTORY_CHOICES),
                    default="uniform",
                    optional=True,  # absent in workflows saved before it: the uniform window they ran with
                    tooltip="uniform: every block keeps window_frames. early_short_history: the first "
                    "short_history_blocks blocks keep the sink and the current chunk only (FlashDreams).",
                ),
                io.Int.Input(
                    "short_history_blocks",
                    default=DEFAULT_SHORT_HISTORY_BLOCKS,
                    min=1,
                    max=MAX_SHORT_HISTORY_BLOCKS,
                    optional=True,
                    tooltip="With early_short_history: how many leading DiT blocks keep one chunk "
                    "(FlashDreams: 9; at most the model's blocks, 28 for the released 2B).",
                ),
                io.Combo.Input(
                    "kv_finalize",
                    options=list(KV_FINALIZE_CHOICES),
                    default="context_noise",
                    optional=True,  # absent in workflows saved before it: the released context write
                    tooltip="context_noise: the released third DiT call writes each chunk's K/V (timesteps "
                    "[1000, 450]). skip: FlashDreams' skip_finalize_kv_cache, the last denoising call's K/V stay "
                    "(timesteps [1000, 100]); a third less DiT work per chunk.",
                ),
                io.Combo.Input(
                    "kv_dtype",
                    options=list(KV_DTYPE_CHOICES),
                    default="auto",
                    optional=True,  # absent in workflows saved before it: the compute dtype
                    tooltip="What the KV window stores. auto: the compute dtype. fp8_e4m3fn: half the memory of "
                    "bf16 (scale 1, read back in the compute dtype; a small difference in the video).",
                ),
                AttentionType.Input(
                    "attention",
                    optional=True,
                    tooltip="From OmniVideo Attention; unconnected = the fastest exact backend (auto).",
                ),
            ],
            outputs=[ModelType.Output(display_name="model")],
        )

    @classmethod
    def execute(
        cls,
        ckpt_name,
        dtype="auto",
        window_frames=6,
        sink_frames=0,
        kv_history="uniform",
        short_history_blocks=DEFAULT_SHORT_HISTORY_BLOCKS,
        attention=None,
        kv_finalize="context_noise",
        kv_dtype="auto",
    ) -> io.NodeOutput:
        if kv_history not in KV_HISTORY_CHOICES:
            raise ValueError(f"kv_history {kv_history!r} is not one of {', '.join(KV_HISTORY_CHOICES)}")
        short = int(short_history_blocks) if kv_history == "early_short_history" else 0
        settings = ARSettings.for_kv_finalize(
            kv_finalize,
            window_frames=window_frames,
            sink_frames=sink_frames,
            short_history_blocks=short,
            kv_dtype=kv_dtype,
        )
        settings.slots()  # raises a clear ValueError
        path = _checkpoint(ckpt_name)
        device = PLATFORM.device
        weight_dtype, compute_dtype = resolve_weight_dtype(dtype, device)
        dit = load_omnidreams(path, compute_dtype, weight_dtype, compat.operations(weight_dtype, compute_dtype, device))
        try:
            settings.block_window_chunks(dit.config.num_blocks)
        except ValueError as err:
            raise ValueError(f"{err}: lower short_history_blocks or use kv_history 'uniform'") from None
        model = OmniDreamsModel(
            patcher=compat.manage(dit, "diffusion", device),
            dtype=compute_dtype,
            attention=attention,
            window_frames=window_frames,
            sink_frames=sink_frames,
            short_history_blocks=short,
            kv_finalize=kv_finalize,
            kv_dtype=kv_dtype,
            load_args=weights_recipe(path, compute_dtype, weight_dtype),
        )
        return io.NodeOutput(model)


def _size_inputs() -> list:
    return [
        io.Int.Input("width", default=1280, min=16, max=8192, step=16),
        io.Int.Input("height", default=704, min=16, max=8192, step=16),
    ]


class OmniDreamsEncodeFirstFrame(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsEncodeFirstFrame",
            display_name="OmniVideo OmniDreams Encode First Frame",
            category="OmniVideo/OmniDreams",
            description=(
                "Resizes the first image (no crop) to width x height, encodes it with the Wan 2.1 VAE "
                "(posterior mean, normalised) and attaches it: the video starts from this frame and its "
                "size fixes the output size. Native size 1280x704."
            ),
            inputs=[
                ConditioningType.Input("conditioning"),
                io.Vae.Input("vae"),
                io.Image.Input("image"),
                *_size_inputs(),
            ],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, conditioning, vae, image, width=1280, height=704) -> io.NodeOutput:
        check_conditioning(conditioning)
        check_wan21_vae(vae)
        return io.NodeOutput(conditioning.replace(first_frame=encode_first_frame(vae, image, width, height)))


class OmniDreamsEncodeHDMap(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsEncodeHDMap",
            display_name="OmniVideo OmniDreams Encode HD-Map",
            category="OmniVideo/OmniDreams",
            description=(
                "Optional. Encodes an HD-map video (IMAGE frames, resized to width x height) with the Wan "
                "2.1 VAE in one causal pass; chunk 0 uses frames [0,5), each later chunk the next 8. "
                "Needs at least as many frames as the video. Without this node the HD-map input is "
                "zeros (plain image-to-video)."
            ),
            inputs=[
                ConditioningType.Input("conditioning"),
                io.Vae.Input("vae"),
                io.Image.Input("hdmap"),
                *_size_inputs(),
            ],
            outputs=[ConditioningType.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, conditioning, vae, hdmap, width=1280, height=704) -> io.NodeOutput:
        check_conditioning(conditioning)
        check_wan21_vae(vae)
        return io.NodeOutput(conditioning.replace(hdmap=encode_hdmap(vae, hdmap, width, height)))


class OmniDreamsSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniDreamsSampler",
            **compat.search_aliases("world model", "autoregressive video", "cosmos"),
            display_name="OmniVideo OmniDreams Sampler",
            category="OmniVideo/OmniDreams",
            description=(
                "Autoregressive world-model rollout: 2-frame chunks, two distilled steps each, a rolling KV cache and "
                "the clean first-frame context write. The video has 8N-3 frames (5, 13, 21, ..., 61); other counts "
                "round up. The first frame (if encoded) fixes the size. The LATENT is raw Wan 2.1 latent space: VAE "
                "Decode and OmniVideo Wan VAE Decode both take it."
            ),
            inputs=sampler_inputs(
                frames=61,
                max_frames=MAX_FRAMES,
                frames_tip=f"Pixel frames (8N-3, at most {MAX_FRAMES}: the whole video is held in memory).",
                max_steps=DEFAULT_STEPS,
                steps_tip="0 = the distilled 2 steps (the only schedule it has).",
                size_step=16,
                width=1280,
                height=704,
                size_tip="Used when no first frame is encoded (native 1280x704).",
            ),
            outputs=[io.Latent.Output(display_name="LATENT")],
        )

    @classmethod
    def execute(cls, model, conditioning, seed=42, frames=61, steps=0, width=1280, height=704) -> io.NodeOutput:
        z = run_sampler(sample, 16, model, conditioning, seed, frames, steps, width, height)
        return io.NodeOutput(comfy_types.latent(z))


NODES = [OmniDreamsModelLoader, OmniDreamsEncodeFirstFrame, OmniDreamsEncodeHDMap, OmniDreamsSampler]
