"""A tiny Qwen3-VL (4 decoder layers, H3 reads layer 2) and a byte-level tokenizer built from scratch: no downloads.

`tiny_qwen3vl()` returns (model, tokenizer, image_processor); `write_text_encoder_folder` saves them as a Hugging
Face folder that `models.h3_text.load_text_encoder` loads (the video processor config is written by hand because
building Qwen3-VL's video processor needs torchvision, which the unit-test environment may lack).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LAYER = 2


def tiny_qwen3vl(text_dim: int = 40, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[])
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    tokenizer = Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    ids = {
        t: tokenizer.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    }
    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=text_dim,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=text_dim // 2,
            rope_scaling={"rope_type": "default", "mrope_section": [4, 3, 3], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=text_dim,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=128 * 128
    )
    return model, tokenizer, image_processor


def tiny_processor(tokenizer, image_processor):
    """Qwen3VLProcessor without its video processor (H3 keyframes are images; the video one needs torchvision)."""
    from transformers import Qwen3VLProcessor

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, *args, **kwargs):
            return None

    return Processor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def write_text_encoder_folder(folder: Path, model, tokenizer, image_processor) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    (folder / "video_preprocessor_config.json").write_text(
        json.dumps(
            {
                "video_processor_type": "Qwen3VLVideoProcessor",
                "patch_size": 16,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "processor_class": "Qwen3VLProcessor",
            }
        )
    )
    return folder
