"""OmniDreams DiT: the Cosmos-Predict2.5 network, AR-distilled, with a KV-cached self-attention.

Module names follow the checkpoint keys (`x_embedder.proj.1`, `blocks.N.self_attn.q_proj`, ...)
so a fused state dict loads with `load_state_dict` directly. The network sees one latent chunk at
a time; past chunks reach it only through the K/V cache passed to `forward`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ...attention.config import normalize_config
from ...attention.dispatch import bind
from ...attention.rows import AttnRows
from ...attention.sequence_parallel import SINGLE, SequenceShard


@dataclass(frozen=True)
class OmniDreamsConfig:
    model_channels: int = 2048
    num_blocks: int = 28
    num_heads: int = 16
    mlp_hidden: int = 8192
    adaln_lora_dim: int = 256
    in_channels: int = 16  # Wan 2.1 latent
    out_channels: int = 16
    patch_spatial: int = 2
    patch_temporal: int = 1
    hdmap_channels: int = 16  # through additional_patch_embedding
    text_in_dim: int = 100352  # Cosmos-Reason1 full_concat (28 x 3584)
    text_dim: int = 1024  # after crossattn_proj
    timestep_scale: float = 0.001
    rope_ratios: tuple[float, float, float] = (1.0, 3.0, 3.0)  # NTK extrapolation ratio for t, h, w
    # The released model was trained with bf16 timesteps: 803.5715 reaches the net as 804.0.
    timestep_dtype: torch.dtype = field(default=torch.bfloat16)

    @property
    def head_dim(self) -> int:
        return self.model_channels // self.num_heads

    @property
    def patch_volume(self) -> int:
        return self.patch_temporal * self.patch_spatial * self.patch_spatial

    @property
    def x_embed_in(self) -> int:
        """Live x_embedder inputs: latent patch features + the condition-mask channel's patch."""
        return (self.in_channels + 1) * self.patch_volume

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Head-dim split T/H/W: 44/42/42 at 128; H = W = dim//6*2 and T takes the rest."""
        d_h = self.head_dim // 6 * 2
        return self.head_dim - 2 * d_h, d_h, d_h


# ---------------------------------------------------------------------------- attention


def bind_attention(attention_config, num_layers: int) -> list[tuple]:
    """Per block, its (self-attention, cross-attention) calls, resolved through the registry before the blocks run
    (a compiled block holds only the kernel call): `fn(q [B,Sq,H,D], k/v [B,Sk,H,D], *, scale, rows)` ->
    [B,Sq,H,D], no mask. Self-attention follows the OMNIVIDEO_ATTENTION config (None = the fastest exact backend)
    and gets the chunk's (t, h, w) token grid, the video rows a sparse backend needs (with cached history,
    Sk > Sq, such backends fall back to dense by themselves); a sparse config also learns the layer (its
    skip_layers). Cross-attention over the 512 text tokens is always dense. Dense calls are the same function
    for every block."""
    config = normalize_config(attention_config)
    attend_self, attend_cross = bind(config), bind(None)
    if not config.is_sparse:
        return [(attend_self, attend_cross)] * num_layers
    return [(functools.partial(attend_self, layer=i), attend_cross) for i in range(num_layers)]


# ---------------------------------------------------------------------------- RoPE


def _axis_freqs(dim: int, ratio: float) -> torch.Tensor:
    theta = 10000.0 * ratio ** (dim / (dim - 2))
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def rope_cos_sin(
    config: OmniDreamsConfig, t: int, h: int, w: int, t_offset: int = 0, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [t*h*w, head_dim] for tokens in (t h w) order, frequencies laid out [t,h,w,t,h,w].

    `t_offset` = ar_idx * len_t: time positions keep growing across chunks.
    """
    (d_t, d_h, d_w), (r_t, r_h, r_w) = config.rope_split, config.rope_ratios
    pos_t = torch.arange(t, dtype=torch.float64) + t_offset
    ang_t = torch.outer(pos_t, _axis_freqs(d_t, r_t))
    ang_h = torch.outer(torch.arange(h, dtype=torch.float64), _axis_freqs(d_h, r_h))
    ang_w = torch.outer(torch.arange(w, dtype=torch.float64), _axis_freqs(d_w, r_w))
    half = torch.cat(
        [
            ang_t[:, None, None, :].expand(t, h, w, -1),
            ang_h[None, :, None, :].expand(t, h, w, -1),
            ang_w[None, None, :, :].expand(t, h, w, -1),
        ],
        dim=-1,
    ).reshape(t * h * w, -1)
    angles = torch.cat([half, half], dim=-1)  # rotate-half pairs (d, d + head_dim/2)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE on x [B,S,H,D] with cos/sin [S,D] (computed in fp32)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


# ---------------------------------------------------------------------------- patching


def patchify(x: torch.Tensor, p: int, pt: int) -> torch.Tensor:
    """b c (t kt)(h kh)(w kw) -> b (t h w)(c kt kh kw)."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t // pt, pt, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, (t // pt) * (h // p) * (w // p), c * pt * p * p)


def unpatchify(x: torch.Tensor, c: int, t: int, h: int, w: int, p: int, pt: int) -> torch.Tensor:
    """Inverse of `patchify`; t/h/w are token-grid sizes."""
    b = x.shape[0]
    x = x.reshape(b, t, h, w, c, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, c, t * pt, h * p, w * p)


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[B] -> [B, dim]: cos first, then sin; f_i = exp(-ln(1e4) i / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


# ---------------------------------------------------------------------------- modules


class PatchEmbed(nn.Module):
    def __init__(self, in_features: int, dim: int, ops):
        super().__init__()
        self.proj = nn.Sequential(nn.Identity(), ops.Linear(in_features, dim, bias=False))  # key: proj.1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(tokens)


class TimestepEmbedding(nn.Module):
    """Sinusoid -> the adaLN-LoRA term (3*C); linear_1 has no bias when adaLN-LoRA is used."""

    def __init__(self, dim: int, ops):
        super().__init__()
        self.linear_1 = ops.Linear(dim, dim, bias=False)
        self.linear_2 = ops.Linear(dim, 3 * dim, bias=False)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(s)))


def _adaln(dim: int, rank: int, chunks: int, ops) -> nn.Sequential:
    return nn.Sequential(nn.SiLU(), ops.Linear(dim, rank, bias=False), ops.Linear(rank, chunks * dim, bias=False))


class Attention(nn.Module):
    def __init__(self, dim: int, context_dim: int, heads: int, ops):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = ops.Linear(dim, dim, bias=False)
        self.k_proj = ops.Linear(context_dim, dim, bias=False)
        self.v_proj = ops.Linear(context_dim, dim, bias=False)
        self.output_proj = ops.Linear(dim, dim, bias=False)
        self.q_norm = ops.RMSNorm(self.head_dim, eps=1e-6)
        self.k_norm = ops.RMSNorm(self.head_dim, eps=1e-6)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_norm(self._heads(self.q_proj(x)))

    def key_value(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_norm(self._heads(self.k_proj(context))), self._heads(self.v_proj(context))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, ops):
        super().__init__()
        self.layer1 = ops.Linear(dim, hidden, bias=False)
        self.layer2 = ops.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.gelu(self.layer1(x)))


class Block(nn.Module):
    def __init__(self, cfg: OmniDreamsConfig, ops):
        super().__init__()
        dim, rank = cfg.model_channels, cfg.adaln_lora_dim
        self.self_attn = Attention(dim, dim, cfg.num_heads, ops)
        self.cross_attn = Attention(dim, cfg.text_dim, cfg.num_heads, ops)
        self.mlp = MLP(dim, cfg.mlp_hidden, ops)
        self.adaln_modulation_self_attn = _adaln(dim, rank, 3, ops)
        self.adaln_modulation_cross_attn = _adaln(dim, rank, 3, ops)
        self.adaln_modulation_mlp = _adaln(dim, rank, 3, ops)

    @staticmethod
    def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale) + shift

    def forward(self, x, emb, lora, rope, grid, cross_kv, window, attend, shard=SINGLE):
        """`window`: this block's view of the KV cache (`kv_cache.block(i)`) or None; `attend`: its (self, cross)
        attention calls. No block index reaches the block, so all blocks share one compiled graph. With a `shard`
        (context parallel) x holds this rank's tokens: self-attention trades them for all tokens of this rank's
        heads (Ulysses), so the window caches only those heads."""
        shift, scale, gate = (self.adaln_modulation_self_attn(emb) + lora).chunk(3, dim=-1)
        h = self._modulate(x, shift, scale)
        attn = self.self_attn
        q = apply_rope(attn.query(h), *rope)
        k, v = attn.key_value(h)
        k = apply_rope(k, *rope)
        q, k, v = shard.qkv_to_heads(q, k, v, grid[0] * grid[1] * grid[2])
        if window is not None:  # K/V enter the cache after RoPE; attend over the visible window
            k, v = window.update(k, v)
        attend_self, attend_cross = attend
        out = shard.to_tokens(attend_self(q, k, v, scale=1.0 / math.sqrt(attn.head_dim), rows=AttnRows(0, grid)))
        x = x + gate * attn.output_proj(out.flatten(2))

        shift, scale, gate = (self.adaln_modulation_cross_attn(emb) + lora).chunk(3, dim=-1)
        h = self._modulate(x, shift, scale)
        q = self.cross_attn.query(h)
        out = attend_cross(q, *cross_kv, scale=1.0 / math.sqrt(attn.head_dim))  # all 512 text tokens
        x = x + gate * self.cross_attn.output_proj(out.flatten(2))

        shift, scale, gate = (self.adaln_modulation_mlp(emb) + lora).chunk(3, dim=-1)
        return x + gate * self.mlp(self._modulate(x, shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, cfg: OmniDreamsConfig, ops):
        super().__init__()
        self.adaln_modulation = _adaln(cfg.model_channels, cfg.adaln_lora_dim, 2, ops)
        self.linear = ops.Linear(cfg.model_channels, cfg.patch_volume * cfg.out_channels, bias=False)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, lora: torch.Tensor) -> torch.Tensor:
        dim = x.shape[-1]
        shift, scale = (self.adaln_modulation(emb) + lora[..., : 2 * dim]).chunk(2, dim=-1)
        return self.linear(F.layer_norm(x, (dim,), eps=1e-6) * (1 + scale) + shift)


class OmniDreamsDiT(nn.Module):
    """Expects the load-time fused layout: x_embedder without the padding-mask columns and final
    layer rows in (c kt kh kw) order (see models/omnidreams/loader.py).

    `operations` supplies the layer classes (ComfyUI's cast layers inside ComfyUI, so its model management
    can stream weights; torch.nn by default) and `dtype` is the compute dtype: the weights may be stored in
    another (fp8) and are cast per forward by those layers. The device is the inputs' device.
    """

    def __init__(self, config: OmniDreamsConfig, operations=nn, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg = self.config = config
        ops = operations
        self.dtype = dtype
        dim = cfg.model_channels
        self.x_embedder = PatchEmbed(cfg.x_embed_in, dim, ops)
        self.additional_patch_embedding = PatchEmbed(cfg.hdmap_channels * cfg.patch_volume, dim, ops)
        self.t_embedder = nn.Sequential(nn.Identity(), TimestepEmbedding(dim, ops))  # key: t_embedder.1
        self.t_embedding_norm = ops.RMSNorm(dim, eps=1e-6)
        self.crossattn_proj = nn.Sequential(ops.Linear(cfg.text_in_dim, cfg.text_dim, bias=True), nn.GELU())
        self.blocks = nn.ModuleList(Block(cfg, ops) for _ in range(cfg.num_blocks))
        self.final_layer = FinalLayer(cfg, ops)
        self._rope_memo: tuple | None = None  # (key, (cos, sin)) of the last chunk
        self._compiled: list | None = None  # torch.compile'd views of the blocks, made on first use

    def compiled_blocks(self) -> list:
        """The blocks under torch.compile (made once; they share the blocks' weights). No block index or attention
        lookup reaches a block, so all blocks share one graph, recompiled once while the KV window fills."""
        if self._compiled is None:
            self._compiled = [torch.compile(block) for block in self.blocks]
        return self._compiled

    @torch.no_grad()
    def cross_kv(self, text: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-block cross-attention K/V of one prompt (on its device): constant for the whole rollout."""
        ctx = self.crossattn_proj(text.to(self.dtype))
        return [block.cross_attn.key_value(ctx) for block in self.blocks]  # type: ignore[union-attr, operator]

    def timestep_tensor(self, t: float, device: torch.device) -> torch.Tensor:
        """[1] float32 on `device`: t as the network receives it (rounded through the timestep dtype)."""
        return torch.tensor([t], dtype=self.config.timestep_dtype).float().to(device)

    def rope_tables(
        self, grid: tuple[int, int, int], t_offset: int, device: torch.device, shard: SequenceShard = SINGLE
    ) -> tuple[torch.Tensor, ...]:
        """This rank's RoPE cos / sin for a chunk's token grid starting at latent frame `t_offset`."""
        return tuple(shard.split(c, 0) for c in rope_cos_sin(self.config, *grid, t_offset=t_offset, device=device))

    def embed_timestep(
        self, t: float | torch.Tensor, batch: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """t: a float, or its `timestep_tensor` (a static buffer: no host value reaches the device in the call)."""
        cfg = self.config
        t_net = (t if isinstance(t, torch.Tensor) else self.timestep_tensor(t, device)).expand(batch)
        s = timestep_sinusoid(t_net * cfg.timestep_scale, cfg.model_channels).to(self.dtype)
        return self.t_embedding_norm(s)[:, None], self.t_embedder[1](s)[:, None]

    def forward(
        self,
        x: torch.Tensor,
        t: float | torch.Tensor,
        cross_kv,
        *,
        cond_mask: torch.Tensor | None = None,
        hdmap: torch.Tensor | None = None,
        t_offset: int = 0,
        kv_cache=None,
        attention_config: dict | None = None,
        compiled: bool = False,
        shard: SequenceShard = SINGLE,
        rope: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """x [B,16,T,H,W] (model latent space) at scalar timestep t -> flow [B,16,T,H,W] (float32).

        t may be its `timestep_tensor` and rope the chunk's `rope_tables` (then t_offset is not read): a step on
        static buffers, replayable as a CUDA graph, passes them.

        cond_mask [B,1,T,H,W] is 1 on pinned frame-0 latents; hdmap [B,16,T,H,W] or None (= zeros);
        t_offset is the chunk's first latent-frame index for RoPE; kv_cache has `block(i)` -> that block's
        window with `update(k, v) -> (k_visible, v_visible)` (RollingKVCache); compiled: run the blocks under
        torch.compile (`compiled_blocks`); shard: this rank's share of a context-parallel run (each rank embeds and
        runs its slice of the chunk's tokens, the output is gathered on every rank; the cache holds its heads).
        """
        cfg = self.config
        p, pt = cfg.patch_spatial, cfg.patch_temporal
        b, _, t_len, h, w = x.shape
        if h % p or w % p or t_len % pt:
            raise ValueError(f"latent size {t_len}x{h}x{w} is not divisible by the patch ({pt},{p},{p})")
        x = x.to(self.dtype)
        if cond_mask is None:
            cond_mask = torch.zeros_like(x[:, :1])
        tokens = shard.split(torch.cat([patchify(x, p, pt), patchify(cond_mask.to(x), p, pt)], dim=-1), 1)
        hidden = self.x_embedder(tokens)
        if hdmap is not None:  # absent = zeros, whose (bias-free) embedding is zero
            hidden = hidden + self.additional_patch_embedding(shard.split(patchify(hdmap.to(x), p, pt), 1))
        emb, lora = self.embed_timestep(t, b, x.device)
        grid = (t_len // pt, h // p, w // p)
        if rope is None:
            key = (grid, t_offset, x.device, shard)
            if self._rope_memo is None or self._rope_memo[0] != key:  # the 3 calls of a chunk share it
                self._rope_memo = (key, self.rope_tables(grid, t_offset, x.device, shard))
            rope = self._rope_memo[1]
        attend = bind_attention(attention_config, len(self.blocks))
        blocks = self.compiled_blocks() if compiled else self.blocks
        for index, block in enumerate(blocks):
            window = kv_cache.block(index) if kv_cache is not None else None
            hidden = block(hidden, emb, lora, rope, grid, cross_kv[index], window, attend[index], shard)
        out = shard.gather(self.final_layer(hidden, emb, lora), 1, grid[0] * grid[1] * grid[2])
        return unpatchify(out.float(), cfg.out_channels, *grid, p, pt)
