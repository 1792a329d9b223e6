"""Our attention processor for diffusers' MiniMax-H3 transformer.

diffusers' `MiniMaxH3AttnProcessor` sees only q/k/v; sparse and packed backends also
need where the video sits in the packed sequence. `h3_attention(...)` installs one
processor per attention layer (refiner and blocks, each knowing its layer index) with
`set_attn_processor`, and a forward pre-hook that checks the forward's own row tensors
against the sampler's layout and stashes the per-call metadata (`AttnLayout`: dense
prefix = rows before the target video, patch grid (t, h, w), `[real | pad]` lengths).
Every call then goes through the pack's one attention function, `attention.dispatch.attention`
(backend choice, RainFusion gating by step/layer/size, realized-sparsity stats live there).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor, _apply_rotary_emb

from ...attention.config import AttentionConfig, normalize_config
from ...attention.dispatch import AttentionStats, attention
from ...attention.layout import AttnLayout
from ...attention.registrations import packed_names

log = logging.getLogger("omnivideo")


__all__ = ["H3AttentionState", "OmniVideoH3AttnProcessor", "h3_attention", "normalize_config", "uses_packing"]


def uses_packing(config: AttentionConfig) -> bool:
    """Packed varlen backends get the sequence padded to a multiple of 128 ([real | pad])."""
    return config.backend in packed_names()


@dataclass
class H3AttentionState:
    """Shared by every processor of one transformer during one sampler run."""

    config: AttentionConfig
    expected: Any = None  # the sampler's H3Layout for the coming forwards
    block_layout: AttnLayout | None = None  # stashed by the pre-hook for block calls
    step: int = 0
    stats: AttentionStats = field(default_factory=AttentionStats)
    refiner_config: AttentionConfig = field(init=False)

    def __post_init__(self):
        # The text refiner sees text only (no video): always dense, with the exact backend the user picked.
        dense = self.config.backend if not self.config.is_sparse else "auto"
        self.refiner_config = AttentionConfig(backend=dense)


class OmniVideoH3AttnProcessor(MiniMaxH3AttnProcessor):
    """diffusers' projections, q/k norms and RoPE; attention through the pack's one function."""

    def __init__(self, state: H3AttentionState, kind: str, layer: int):
        super().__init__()
        self.state, self.kind, self.layer = state, kind, layer

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        if attention_mask is not None:
            raise ValueError("MiniMax-H3 packs one unmasked sequence; an attention mask is not supported here.")
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = attn.norm_q(query.unflatten(-1, (attn.heads, -1)))
        key = attn.norm_k(key.unflatten(-1, (attn.heads, -1)))
        value = value.unflatten(-1, (attn.heads, -1))
        if rotary_emb is not None:
            query = _apply_rotary_emb(query, *rotary_emb)
            key = _apply_rotary_emb(key, *rotary_emb)

        seq_len = query.shape[1]
        # Refiner: text only, no video, no padding -> all rows are dense prefix.
        layout = self.state.block_layout if self.kind == "block" else AttnLayout(prefix_len=seq_len)
        if layout is None:
            raise RuntimeError("OmniVideo H3 attention: no layout stashed; run the transformer inside h3_attention().")
        if self.kind == "refiner":
            out = attention(query, key, value, self.state.refiner_config, scale=query.shape[-1] ** -0.5, layout=layout)
        else:
            out = attention(
                query,
                key,
                value,
                self.state.config,
                scale=query.shape[-1] ** -0.5,
                layout=layout,
                step=self.state.step,
                layer=self.layer,
                stats=self.state.stats,
            )
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _check_and_stash(state: H3AttentionState):
    def hook(module, args, kwargs):
        plan = state.expected
        if plan is None:
            raise RuntimeError("OmniVideo H3 attention: the sampler did not set the layout before the forward.")
        total = int(kwargs["position_ids"].shape[0])
        n_text = int(kwargs["text_indices"].numel())
        if total != plan.total_len or n_text != plan.num_text:
            raise RuntimeError(
                f"OmniVideo H3 attention: forward has {total} rows / {n_text} text rows but the layout says "
                f"{plan.total_len} / {plan.num_text}; rebuild the layout for this request."
            )
        state.block_layout = AttnLayout(
            prefix_len=plan.video_start,
            grid=tuple(plan.grid),
            kv_lengths=(plan.real_len,) if plan.total_len > plan.real_len else None,
        )
        return None

    return hook


@contextlib.contextmanager
def h3_attention(transformer: Any, config: AttentionConfig | dict | None = None):
    # transformer: diffusers' MiniMaxH3Transformer3DModel (attn_processors, set_attn_processor)
    """Install our processors for the duration of a run; diffusers' originals come back afterwards."""
    state = H3AttentionState(normalize_config(config))
    original = dict(transformer.attn_processors)
    ours = {}
    for key in original:
        if key.startswith("token_refiner."):
            ours[key] = OmniVideoH3AttnProcessor(state, "refiner", int(key.split(".")[2]))
        else:
            ours[key] = OmniVideoH3AttnProcessor(state, "block", int(key.split(".")[1]))
    transformer.set_attn_processor(ours)
    handle = transformer.register_forward_pre_hook(_check_and_stash(state), with_kwargs=True)
    try:
        yield state
    finally:
        handle.remove()
        transformer.set_attn_processor(original)
        if state.stats.sparse_calls or state.stats.dense_calls:
            log.info("omnivideo h3 attention: %s", state.stats.summary())
