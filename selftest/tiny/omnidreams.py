"""Tiny random OmniDreams checkpoints in the released (stored) layout, for tests, benchmarks and the self-test."""

from __future__ import annotations

import torch

from ...models.omnidreams.dit import OmniDreamsConfig, OmniDreamsDiT
from ...models.omnidreams.loader import final_rows_to_storage

TINY = OmniDreamsConfig(
    model_channels=64, num_blocks=2, num_heads=2, mlp_hidden=256, adaln_lora_dim=16, text_in_dim=96, text_dim=32
)


def stored_state_dict(cfg: OmniDreamsConfig = TINY, seed: int = 0, prefix: str = "") -> dict[str, torch.Tensor]:
    """A random DiT's weights as the released .pt stores them: x_embedder with the 4 padding-mask
    columns appended, final-layer rows in (kt kh kw c) order."""
    torch.manual_seed(seed)
    model = OmniDreamsDiT(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(p, 0.5, 1.5)  # not all-ones, so a skipped norm is visible
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    w = sd["x_embedder.proj.1.weight"]
    sd["x_embedder.proj.1.weight"] = torch.cat([w, torch.zeros(w.shape[0], cfg.patch_volume)], dim=1)
    sd["final_layer.linear.weight"] = final_rows_to_storage(sd["final_layer.linear.weight"], cfg)
    return {prefix + k: v for k, v in sd.items()}


# ------------------------------------------------------------------ a tiny Cosmos-Reason1 (Qwen2.5-VL)

TEXT_LAYERS, TEXT_HIDDEN = 28, 16  # full_concat width 28 * 16 = 448
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "you are a helpful assistant who will provide prompts to an image generator . system user car drives "
    "down the road at night camera street sunny"
).split()


def write_tiny_cosmos_reason1(folder, seed: int = 0, *, hidden: int = TEXT_HIDDEN, layers: int = TEXT_LAYERS):
    """A random Qwen2.5-VL (28 layers of hidden 16: full_concat width 448) and a word-level tokenizer with a
    Qwen-style chat template, saved as a Hugging Face folder (config.json, weights, tokenizer files). No downloads.
    hidden (a multiple of 8: heads of 8 channels, as the rope sections need) x layers: the embedding width."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(specials[:3])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="[UNK]"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=64,
            hidden_size=hidden,
            intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 8,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            fullatt_block_indexes=[0],
        ),
    )
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Context-parallel tests split the heads over up to 4 ranks: TINY with 4 heads, and the benchmarks' mid config.
TINY_4_HEADS = OmniDreamsConfig(
    model_channels=64, num_blocks=2, num_heads=4, mlp_hidden=256, adaln_lora_dim=16, text_in_dim=96, text_dim=32
)
MID = OmniDreamsConfig(
    model_channels=512, num_blocks=8, num_heads=4, mlp_hidden=2048, adaln_lora_dim=64, text_in_dim=1024, text_dim=256
)
