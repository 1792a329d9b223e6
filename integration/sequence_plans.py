"""Where ComfyUI's own models are split for OmniVideo Sequence Parallel (integration/core_sequence_parallel): a
`SplitPlan` per core class says which of a block's arguments are per row and where the rows are gathered, and module
hooks apply it in the threads that run a split forward (`RankState`, one per rank and forward, thread-local: the
hooks do nothing in any other forward of the same module).

Wan (comfy/ldm/wan/model.py WanModel): a block takes x [B, L, D] and its rope table [1, L, 1, d/2, 2, 2] per row,
Wan 2.2's per-frame timesteps [B, T, 6, D] (repeated over each frame's rows by the block) are indexed per row; the
head's input is gathered. MiniMax-H3 (comfy/ldm/minimax/model.py MiniMaxH3Model): a block takes h [S, hidden], its
rope table [1, S, 1, r, 2, 2] per row and its modulation segments (start, stop, row) in packed-sequence rows, which
are cut to the rank's rows; the final layer's input is gathered. Exact classes only: Wan's subclasses (VACE, camera,
S2V, HuMo, Animate) add full-sequence inputs inside the blocks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..attention.sequence_parallel import SequenceShard

_rank = threading.local()  # .state: this thread's RankState while it runs a split forward


@dataclass
class RankState:
    """One rank's view of the forward it runs: the shard, the full sequence's rows once the blocks began."""

    plan: SplitPlan
    shard: SequenceShard
    total: int | None = None  # rows of the full sequence; None until the first block
    gathered: bool = False
    in_self_attention: bool = False
    attended: bool = False  # the current self-attention call went through our override
    _sliced: dict = field(default_factory=dict)  # id(full table) -> (table, this rank's rows)

    @property
    def bounds(self) -> tuple[int, int]:
        assert self.total is not None
        return self.shard.bounds(self.total)

    def rows(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's rows of a full-sequence tensor (the same table reaches every block: sliced once)."""
        hit = self._sliced.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        if t.shape[dim] != self.total:
            raise ValueError(
                f"OmniVideo Sequence Parallel: a {self.plan.name} block got a table of {t.shape[dim]} rows for a "
                f"sequence of {self.total}; this model's forward is not one it knows how to split"
            )
        local = take_rows(self, t, dim)
        self._sliced[id(t)] = (t, local)
        return local


def take_rows(state: RankState, t: torch.Tensor, dim: int) -> torch.Tensor:
    """The rows a rank computes: its `tensor_split` slice (module-level so a test can make a rank take wrong rows)."""
    return state.shard.split(t, dim)


def current() -> RankState | None:
    return getattr(_rank, "state", None)


@contextlib.contextmanager
def running(state: RankState):
    """This thread runs a split forward as `state` says, until the block ends."""
    _rank.state = state
    try:
        yield state
    finally:
        _rank.state = None


# ------------------------------------------------------------------ what each model's forward looks like


@dataclass(frozen=True)
class SplitPlan:
    """Where a core model's sequence is split and gathered (diffusers' `_cp_plan` in spirit): its blocks, each
    block's self-attention, the final layer, and how a block's arguments become this rank's."""

    name: str
    self_attention: str  # attribute of a block
    final: str  # attribute of the model: its input is gathered
    heads: Callable[[Any], int]  # the model's attention heads, read from the module
    shard_block: Callable[[RankState, tuple, dict], tuple[tuple, dict]]
    gather_final: Callable[[RankState, tuple, dict], tuple[tuple, dict]]


def _begin(state: RankState, x: torch.Tensor, dim: int) -> torch.Tensor:
    if state.total is None:
        state.total = x.shape[dim]
        return take_rows(state, x, dim).clone()  # not a view: H3's blocks write into it, keeping the whole alive
    start, stop = state.bounds
    if x.shape[dim] != stop - start:
        raise ValueError(f"OmniVideo Sequence Parallel: a {state.plan.name} block got {x.shape[dim]} rows, not a slice")
    return x


def _wan_block(state: RankState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # WanAttentionBlock(x, e=e0, freqs=..., context=..., context_img_len=..., transformer_options=...)
    x = _begin(state, args[0], 1)
    kwargs = dict(kwargs)
    kwargs["freqs"] = state.rows(kwargs["freqs"], 1)  # [1, L, 1, d/2, 2, 2]
    e = kwargs.get("e")
    if isinstance(e, torch.Tensor) and e.dim() == 4 and e.shape[1] > 1:
        kwargs["e"] = _frame_rows(state, e)
    return (x, *args[1:]), kwargs


def _frame_rows(state: RankState, e: torch.Tensor) -> torch.Tensor:
    """Wan 2.2 (5B) under a denoise mask: a timestep per latent frame, [B, T, 6, D], which the block repeats over each
    frame's rows (repeat_e); this rank gets one row per token it holds, its frame's (without the full table)."""
    hit = state._sliced.get(("frames", id(e)))
    if hit is not None and hit[0] is e:
        return hit[1]
    assert state.total is not None
    frames = e.shape[1]
    if state.total % frames:
        raise ValueError(
            f"OmniVideo Sequence Parallel: {frames} per-frame timesteps for {state.total} rows; this Wan forward is "
            "not one it knows how to split"
        )
    start, stop = state.bounds
    local = e.index_select(1, torch.arange(start, stop, device=e.device) // (state.total // frames))
    state._sliced[("frames", id(e))] = (e, local)
    return local


def _wan_head(state: RankState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # Head(x, e): the full sequence again (e stays the model's: per token it is already full)
    assert state.total is not None
    return (state.shard.gather(args[0], 1, state.total), *args[1:]), kwargs


def _h3_block(state: RankState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # DiTBlock(h [S, hidden], t_emb, mod_segments [(start, stop, row)], rope_freqs [1, S, 1, r, 2, 2])
    h, t_emb, segments, rope = args[:4]
    h = _begin(state, h, 0)
    start, stop = state.bounds
    local = [(max(a, start) - start, min(b, stop) - start, row) for a, b, row in segments if b > start and a < stop]
    return (h, t_emb, local, state.rows(rope, 1), *args[4:]), kwargs


def _h3_final(state: RankState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # FinalLayer(h, t_emb, video_seg, audio_seg): segments in packed-sequence rows, so the whole h
    assert state.total is not None
    return (state.shard.gather(args[0], 0, state.total), *args[1:]), kwargs


PLANS = {
    # exact classes: Wan's subclasses (VACE, camera, S2V, HuMo, Animate) add full-sequence inputs inside the blocks
    ("comfy.ldm.wan.model", "WanModel"): SplitPlan(
        "Wan", "self_attn", "head", lambda m: int(m.num_heads), _wan_block, _wan_head
    ),
    ("comfy.ldm.minimax.model", "MiniMaxH3Model"): SplitPlan(
        "MiniMax-H3", "attn", "final_layer", lambda m: int(m.blocks[0].attn.heads), _h3_block, _h3_final
    ),
}


def plan_for(diffusion_model: Any, size: int) -> SplitPlan:
    """The plan for this core model split over `size` ranks, or a ValueError that says why it cannot be."""
    cls = type(diffusion_model)
    plan = PLANS.get((cls.__module__, cls.__name__))
    if plan is None:
        known = ", ".join(f"{name} ({module})" for module, name in PLANS)
        raise ValueError(
            f"OmniVideo Sequence Parallel cannot split {cls.__name__} ({cls.__module__}): it splits ComfyUI's own "
            f"{known}. Other models (and Wan's VACE / camera / S2V variants, whose blocks take full-sequence inputs) "
            "run on one device: remove this node"
        )
    heads = plan.heads(diffusion_model)
    if heads % size:
        raise ValueError(
            f"OmniVideo Sequence Parallel: {plan.name} has {heads} attention heads, which {size} devices cannot share "
            f"(Ulysses gives each device whole heads): use a device count that divides {heads}"
        )
    return plan


# ------------------------------------------------------------------ hooks on the model's modules

_hooks_lock = threading.Lock()
HOOKS_ATTR = "_omnivideo_sequence_hooks"


def _block_hook(module, args, kwargs):
    state = current()
    return None if state is None else state.plan.shard_block(state, args, kwargs)


def _final_hook(module, args, kwargs):
    state = current()
    if state is None or state.total is None:
        return None
    state.gathered = True
    return state.plan.gather_final(state, args, kwargs)


def _attention_enter(module, args, kwargs):
    state = current()
    if state is not None and state.total is not None:
        state.in_self_attention, state.attended = True, False


def _attention_leave(module, args, kwargs, output):
    state = current()
    if state is None or not state.in_self_attention:
        return
    state.in_self_attention = False
    if not state.attended:  # it attended over this rank's rows alone
        raise RuntimeError(
            f"OmniVideo Sequence Parallel: a {state.plan.name} self-attention did not reach its attention override "
            "(something calls attention another way), so it would see one device's rows only; remove the node that "
            "replaced it or this one"
        )


def install_hooks(diffusion_model: Any, plan: SplitPlan) -> None:
    """Once per module (shared by every MODEL clone of it): hooks that act only in a thread running a split forward."""
    with _hooks_lock:
        if getattr(diffusion_model, HOOKS_ATTR, False):
            return
        for block in diffusion_model.blocks:
            block.register_forward_pre_hook(_block_hook, with_kwargs=True)
            attention = getattr(block, plan.self_attention)
            attention.register_forward_pre_hook(_attention_enter, with_kwargs=True)
            attention.register_forward_hook(_attention_leave, with_kwargs=True)
        getattr(diffusion_model, plan.final).register_forward_pre_hook(_final_hook, with_kwargs=True)
        setattr(diffusion_model, HOOKS_ATTR, True)
