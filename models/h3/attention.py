"""Our attention processor for diffusers' MiniMax-H3 transformer.

diffusers' `MiniMaxH3AttnProcessor` sees only q/k/v; sparse and packed backends also
need where the video sits in the packed sequence. `h3_attention(...)` installs one
processor per attention layer (refiner and blocks, each knowing its layer index) with
`set_attn_processor`, and a forward pre-hook that checks the forward's own row tensors
against the sampler's layout and stashes what the rows of the block calls are (its `attn_rows()`: dense
prefix = rows before the target video, patch grid (t, h, w), `[real | pad]` lengths).
Every call then goes through the pack's one attention function, `attention.dispatch.attention`
(backend choice, RainFusion gating by step/layer/size, realized-sparsity stats live there).

Sequence parallel (Ulysses, `shard.size` > 1): diffusers' `_cp_plan` for this model splits the packed sequence at the
first block (and the per-row `rope` / AdaLN / `norm_out` indices with it) and gathers it back after the two output
heads, so each rank runs the blocks on its rows. Around each block's attention the processor trades rows for heads
with one all-to-all (q, k, v stacked), attends over the full sequence with its heads (the `AttnRows`, padding
included, is the full sequence's), and trades back. The text refiner runs before the split, unsharded.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks.context_parallel import apply_context_parallel, remove_context_parallel
from diffusers.models._modeling_parallel import ContextParallelConfig, ContextParallelOutput
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor, _apply_rotary_emb

from ...attention.config import AttentionConfig, normalize_config
from ...attention.dispatch import AttentionStats, attention
from ...attention.registrations import packed_names
from ...attention.rows import AttnRows
from ...attention.sequence_parallel import SINGLE, SequenceShard

log = logging.getLogger("omnivideo")


__all__ = ["H3AttentionState", "OmniVideoH3AttnProcessor", "h3_attention", "normalize_config", "uses_packing"]


def uses_packing(config: AttentionConfig) -> bool:
    """Packed varlen backends get the sequence padded to a multiple of 128 ([real | pad])."""
    return config.backend in packed_names()


@dataclass
class H3AttentionState:
    """Shared by every processor of one transformer during one sampler run."""

    config: AttentionConfig
    shard: SequenceShard = SINGLE  # this rank's place in a sequence-parallel group
    expected: Any = None  # the sampler's H3Layout for the coming forwards
    block_rows: AttnRows | None = None  # stashed by the pre-hook for block calls
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
        rows = self.state.block_rows if self.kind == "block" else AttnRows(prefix_len=seq_len)
        if rows is None:
            raise RuntimeError("OmniVideo H3 attention: no rows stashed; run the transformer inside h3_attention().")
        if self.kind == "refiner":
            out = attention(query, key, value, self.state.refiner_config, scale=query.shape[-1] ** -0.5, rows=rows)
        else:
            shard = self.state.shard
            if shard.size > 1:  # this rank's rows, all heads -> all rows, this rank's heads (one all-to-all)
                total = self.state.expected.total_len
                qkv = shard.to_heads(torch.cat([query, key, value], dim=-1), total)
                query, key, value = qkv.chunk(3, dim=-1)
            out = attention(
                query,
                key,
                value,
                self.state.config,
                scale=query.shape[-1] ** -0.5,
                rows=rows,
                step=self.state.step,
                layer=self.layer,
                stats=self.state.stats,
            )
            out = shard.to_tokens(out)
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
        state.block_rows = plan.attn_rows()
        return None

    return hook


@contextlib.contextmanager
def h3_attention(transformer: Any, config: AttentionConfig | dict | None = None, shard: SequenceShard = SINGLE):
    # transformer: diffusers' MiniMaxH3Transformer3DModel (attn_processors, set_attn_processor)
    """Install our processors (and, for `shard.size` > 1, the sequence split) for the duration of a run; diffusers'
    originals come back afterwards."""
    shard.check_heads(int(transformer.config.num_attention_heads))
    state = H3AttentionState(normalize_config(config), shard)
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
        with _split_sequence(transformer, state):
            yield state
    finally:
        handle.remove()
        transformer.set_attn_processor(original)
        if state.stats.sparse_calls or state.stats.dense_calls:
            log.info("omnivideo h3 attention: %s", state.stats.summary())


# ---------------------------------------------------------------------------- sequence split (diffusers' _cp_plan)

_CP_CONFIGS: dict = {}  # per default process group: the ContextParallelConfig (its device mesh) made for it


def _cp_config(shard: SequenceShard, device: torch.device) -> ContextParallelConfig:
    """diffusers' context-parallel config over the whole default group, Ulysses only, any sequence length
    (`ulysses_anything`: torch.tensor_split's slices, the same as `SequenceShard`'s). Made once per world: the
    device mesh creates process groups, which every rank must do together (here: in the same sampler run)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.group.WORLD
    if shard.group is not None or dist.get_world_size() != shard.size:
        raise ValueError(
            f"MiniMax-H3 sequence parallelism runs over the whole torch.distributed world ({dist.get_world_size()} "
            f"ranks), not a sub-group of {shard.size}"
        )
    made = _CP_CONFIGS.get(shard.size)
    if made is None or made[0] is not world:  # a new world (the pool restarted): its groups are new too
        mesh = init_device_mesh(device.type, (1, shard.size), mesh_dim_names=("ring", "ulysses"))
        config = ContextParallelConfig(ulysses_degree=shard.size, ulysses_anything=True)
        config.setup(shard.rank, shard.size, device, mesh)
        made = _CP_CONFIGS[shard.size] = (world, config)
    return made[1]


@contextlib.contextmanager
def _split_sequence(transformer, state: H3AttentionState):
    """Split the packed sequence over the ranks by the model's `_cp_plan`: its inputs with diffusers' own hooks, its
    outputs gathered with `SequenceShard.gather`. diffusers' gather of uneven slices (`ulysses_anything`) is an
    `all_gather` of tensors of different sizes, which gloo (CPU) rejects; ours pads the pieces to one size."""
    shard = state.shard
    if shard.size == 1:
        yield
        return
    plan = type(transformer)._cp_plan
    splits = {name: entry for name, entry in plan.items() if isinstance(entry, dict)}
    gathers = {name: entry for name, entry in plan.items() if not isinstance(entry, dict)}
    if not all(isinstance(entry, ContextParallelOutput) for entry in gathers.values()):
        raise RuntimeError(f"MiniMax-H3 _cp_plan outputs changed in this diffusers version: {gathers}")

    def gather(dim: int):
        def hook(module, args, output):
            return shard.gather(output, dim, state.expected.total_len)

        return hook

    device = next(transformer.parameters()).device
    apply_context_parallel(transformer, _cp_config(shard, device), splits)
    handles = [transformer.get_submodule(n).register_forward_hook(gather(e.gather_dim)) for n, e in gathers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        remove_context_parallel(transformer, splits)
