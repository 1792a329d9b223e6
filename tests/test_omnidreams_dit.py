"""OmniDreams DiT pieces against independent computations of the spec's formulas:
RoPE layout and frequencies, time offset, patchify order, timestep embedding, schedule numbers."""

from __future__ import annotations

import math

import pytest
import torch
from support.omnidreams_tiny import TINY

from omnivideo.models.omnidreams.dit import (
    OmniDreamsConfig,
    apply_rope,
    patchify,
    rope_cos_sin,
    timestep_sinusoid,
    unpatchify,
)
from omnivideo.pipelines.omnidreams import released_schedule, sigma_table

FULL = OmniDreamsConfig()


def _spec_angle(pos: tuple[int, int, int], pair: int, split, ratios=(1.0, 3.0, 3.0)) -> float:
    """Angle of rotate-half pair `pair` (dims pair and pair + D/2) for a token at (t, h, w):
    the first split[0]/2 pairs rotate with time, the next split[1]/2 with height, the rest with width;
    axis freq_i = 1 / theta^(2i/dim), theta = 1e4 * ratio^(dim/(dim-2))."""
    bounds = [split[0] // 2, split[0] // 2 + split[1] // 2]
    axis = 0 if pair < bounds[0] else 1 if pair < bounds[1] else 2
    i = pair - (0, bounds[0], bounds[1])[axis]
    dim = split[axis]
    theta = 1e4 * ratios[axis] ** (dim / (dim - 2))
    return pos[axis] / theta ** (2 * i / dim)


@pytest.mark.parametrize("cfg, split", [(FULL, (44, 42, 42)), (TINY, (12, 10, 10))])
def test_rope_split_layout_and_frequencies(cfg, split):
    assert cfg.rope_split == split
    t, h, w, offset = 2, 3, 4, 6
    cos, sin = rope_cos_sin(cfg, t, h, w, t_offset=offset)
    half = cfg.head_dim // 2
    assert cos.shape == (t * h * w, cfg.head_dim)
    for token, (ti, hi, wi) in enumerate((a, b, c) for a in range(t) for b in range(h) for c in range(w)):
        for pair in range(half):
            angle = _spec_angle((ti + offset, hi, wi), pair, split)
            for d in (pair, pair + half):  # [t,h,w,t,h,w]: the same angle at d and d + D/2
                assert math.isclose(cos[token, d].item(), math.cos(angle), abs_tol=1e-6)
                assert math.isclose(sin[token, d].item(), math.sin(angle), abs_tol=1e-6)


def test_rope_hw_use_the_ntk_factor_and_t_does_not():
    cos, _ = rope_cos_sin(FULL, 1, 1, 2)  # token 1 = (0, 0, 1): only the w pairs rotate
    w_pair = 22 + 21 + 1  # the second w frequency
    theta = 1e4 * 3.0 ** (42 / 40)
    assert math.isclose(cos[1, w_pair].item(), math.cos(1 / theta ** (2 / 42)), abs_tol=1e-7)
    cos_t, _ = rope_cos_sin(FULL, 2, 1, 1)
    assert math.isclose(cos_t[1, 1].item(), math.cos(1 / 1e4 ** (2 / 44)), abs_tol=1e-7)


def test_rope_time_offset_only_moves_time():
    a = rope_cos_sin(TINY, 2, 2, 2, t_offset=0)[0]
    b = rope_cos_sin(TINY, 4, 2, 2, t_offset=0)[0][8:]  # frames 2, 3 of a longer clip
    c = rope_cos_sin(TINY, 2, 2, 2, t_offset=2)[0]
    torch.testing.assert_close(b, c)
    n_t = TINY.rope_split[0] // 2
    torch.testing.assert_close(a[:, n_t : TINY.head_dim // 2], c[:, n_t : TINY.head_dim // 2])  # h, w untouched
    assert not torch.allclose(a[:, :n_t], c[:, :n_t])


def test_apply_rope_is_rotate_half_pairs():
    x = torch.randn(1, 5, 2, 8)
    angle = torch.rand(5, 4) * 3
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    out = apply_rope(x, cos, sin)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)[:, None]
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], -1), rtol=1e-5, atol=1e-6)


def test_patchify_order_and_inverse():
    x = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(1, 2, 3, 4, 6)
    tokens = patchify(x, 2, 1)
    assert tokens.shape == (1, 3 * 2 * 3, 2 * 4)
    # token (t=1, h=0, w=2), features (c kt kh kw): c=1, kh=1, kw=0 -> x[0, 1, 1, 1, 4]
    assert tokens[0, 1 * 6 + 0 * 3 + 2, 1 * 4 + 1 * 2 + 0] == x[0, 1, 1, 1, 4]
    assert torch.equal(unpatchify(tokens, 2, 3, 2, 3, 2, 1), x)


def test_timestep_sinusoid_cos_first():
    s = timestep_sinusoid(torch.tensor([0.8]), 8)
    f = torch.exp(-math.log(1e4) * torch.arange(4) / 4)
    torch.testing.assert_close(s[0], torch.cat([torch.cos(0.8 * f), torch.sin(0.8 * f)]))


def test_schedule_numbers():
    sched = released_schedule()
    assert sched.timesteps[0] == pytest.approx(1000.0) and sched.timesteps[1] == pytest.approx(803.5715, abs=1e-4)
    assert sched.sigmas == pytest.approx((1.0, 0.8035715), abs=1e-7)
    assert sched.context_index == 971 and sched.context_sigma == pytest.approx(0.12993, abs=1e-5)
    assert sched.context_t == 128.0  # the net gets 128, not 1000 * 0.12993
    table = sigma_table()
    assert len(table) == 1000 and table[0] == 1.0
    assert 1 - sched.sigmas[1] == pytest.approx(0.19643, abs=1e-5)
    assert 1 - sched.context_sigma == pytest.approx(0.87007, abs=1e-5)
    # the network sees bf16-cast timesteps
    assert torch.tensor(sched.timesteps[1]).to(torch.bfloat16).item() == 804.0


def test_attention_with_a_longer_cached_window_is_plain_softmax():
    from omnivideo.attention.config import AttentionConfig
    from omnivideo.attention.rows import AttnRows
    from omnivideo.models.omnidreams.dit import bind_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 32, generator=g) for n in (12, 36, 36))
    weights = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(32), dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    for config in (None, AttentionConfig(backend="sdpa"), AttentionConfig(backend="rainfusion", sparsity=0.8)):
        attend_self, attend_cross = bind_attention(config, 1)[0]
        out = attend_self(q, k, v, scale=1 / math.sqrt(32), rows=AttnRows(0, (2, 2, 3)))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # sparse backends go dense over a window
        torch.testing.assert_close(attend_cross(q, k, v, scale=1 / math.sqrt(32)), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ whole forward vs the spec


class SpecReferenceDiT:
    """The DiT written again from the spec, in float64, from the STORED state dict (x_embedder with
    the 4 padding-mask columns, final-layer rows in (kt kh kw c) order), with loops where the model
    uses reshapes. Shares no code with models/omnidreams/dit.py."""

    def __init__(self, sd: dict[str, torch.Tensor], cfg: OmniDreamsConfig):
        self.sd = {k: v.double() for k, v in sd.items()}
        self.cfg = cfg
        self.C, self.NH = cfg.model_channels, cfg.num_heads
        self.D = self.C // self.NH

    # -- primitives
    def lin(self, x, key):
        return x @ self.sd[key].T

    @staticmethod
    def rms(x, w, eps=1e-6):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    @staticmethod
    def layer_norm(x, eps=1e-6):  # no affine
        m = x.mean(-1, keepdim=True)
        return (x - m) / torch.sqrt(((x - m) ** 2).mean(-1, keepdim=True) + eps)

    @staticmethod
    def gelu(x):
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    @staticmethod
    def silu(x):
        return x * torch.sigmoid(x)

    def heads(self, x):
        return x.reshape(*x.shape[:-1], self.NH, self.D)

    def attend(self, q, k, v):  # no mask, scale 1/sqrt(head_dim)
        w = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.D), dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", w, v).flatten(2)

    # -- input side
    def tokens(self, x, mask, hd):
        """Token (t,h,w) t-major; features (c, kh, kw) channel-major. Stored x_embedder input channels:
        16 latent + 1 condition mask + 1 always-zero padding mask (72 columns)."""
        full = torch.cat([x, mask, torch.zeros_like(mask)], 1)
        _, _, T, H, W = x.shape
        gh, gw = H // 2, W // 2
        tok = torch.zeros(1, T * gh * gw, 18 * 4, dtype=torch.float64)
        tok_hd = torch.zeros(1, T * gh * gw, 16 * 4, dtype=torch.float64)
        grid = []
        for ti in range(T):
            for hi in range(gh):
                for wi in range(gw):
                    n = len(grid)
                    grid.append((ti, hi, wi))
                    for c in range(18):
                        for kh in range(2):
                            for kw in range(2):
                                tok[0, n, c * 4 + kh * 2 + kw] = full[0, c, ti, 2 * hi + kh, 2 * wi + kw]
                                if c < 16:
                                    tok_hd[0, n, c * 4 + kh * 2 + kw] = hd[0, c, ti, 2 * hi + kh, 2 * wi + kw]
        return tok, tok_hd, grid

    def timestep(self, t):
        """t (bf16-cast) * 0.001 -> sinusoid (cos first), f_i = exp(-ln(1e4) i / (C/2))."""
        ts = float(torch.tensor(t).to(torch.bfloat16)) * 0.001
        half = self.C // 2
        f = torch.tensor([math.exp(-math.log(1e4) * i / half) for i in range(half)], dtype=torch.float64)
        s = torch.cat([torch.cos(ts * f), torch.sin(ts * f)])[None, None]
        lora = self.lin(self.silu(self.lin(s, "t_embedder.1.linear_1.weight")), "t_embedder.1.linear_2.weight")
        return self.rms(s, self.sd["t_embedding_norm.weight"]), lora

    def rope_angles(self, positions):
        """Per token, D/2 angles laid out [t, h, w]; theta = 1e4 * ratio^(dim/(dim-2)), ratios 1, 3, 3."""
        d_hw = self.D // 6 * 2
        d_t = self.D - 2 * d_hw

        def freqs(dim, ratio):
            theta = 1e4 * ratio ** (dim / (dim - 2))
            return [1 / theta ** (2 * i / dim) for i in range(dim // 2)]

        ft, fh, fw = freqs(d_t, 1.0), freqs(d_hw, 3.0), freqs(d_hw, 3.0)
        return torch.tensor(
            [[p[0] * a for a in ft] + [p[1] * a for a in fh] + [p[2] * a for a in fw] for p in positions],
            dtype=torch.float64,
        )

    def rope(self, q, ang):
        """Rotate-half pairs (d, d + D/2), both with angle d."""
        a = ang[None, :, None, :]
        q1, q2 = q[..., : self.D // 2], q[..., self.D // 2 :]
        return torch.cat([q1 * a.cos() - q2 * a.sin(), q2 * a.cos() + q1 * a.sin()], -1)

    # -- the network
    def forward(self, x, t, text, mask, hd, t_offset, history=None):
        """Returns (flow [1,16,T,H,W], per-block (k, v) after RoPE for the cache).
        history: per-block (k, v) of earlier chunks, attended to before this chunk's own K/V."""
        sd = self.sd
        tok, tok_hd, grid = self.tokens(x, mask, hd)
        hid = self.lin(tok, "x_embedder.proj.1.weight") + self.lin(tok_hd, "additional_patch_embedding.proj.1.weight")
        emb, lora = self.timestep(t)
        ang = self.rope_angles([(ti + t_offset, hi, wi) for ti, hi, wi in grid])
        ctx = self.gelu(self.lin(text, "crossattn_proj.0.weight") + sd["crossattn_proj.0.bias"])
        written = []
        for b in range(self.cfg.num_blocks):
            P = f"blocks.{b}."

            def modulation(name):
                m = (
                    self.lin(
                        self.lin(self.silu(emb), P + f"adaln_modulation_{name}.1.weight"),
                        P + f"adaln_modulation_{name}.2.weight",
                    )
                    + lora
                )
                return m.chunk(3, -1)  # shift, scale, gate

            shift, scale, gate = modulation("self_attn")
            h = self.layer_norm(hid) * (1 + scale) + shift
            q = self.rope(
                self.rms(self.heads(self.lin(h, P + "self_attn.q_proj.weight")), sd[P + "self_attn.q_norm.weight"]), ang
            )
            k = self.rope(
                self.rms(self.heads(self.lin(h, P + "self_attn.k_proj.weight")), sd[P + "self_attn.k_norm.weight"]), ang
            )
            v = self.heads(self.lin(h, P + "self_attn.v_proj.weight"))
            written.append((k, v))
            if history is not None:
                k, v = torch.cat([history[b][0], k], 1), torch.cat([history[b][1], v], 1)
            hid = hid + gate * self.lin(self.attend(q, k, v), P + "self_attn.output_proj.weight")

            shift, scale, gate = modulation("cross_attn")
            h = self.layer_norm(hid) * (1 + scale) + shift
            q = self.rms(self.heads(self.lin(h, P + "cross_attn.q_proj.weight")), sd[P + "cross_attn.q_norm.weight"])
            k = self.rms(self.heads(self.lin(ctx, P + "cross_attn.k_proj.weight")), sd[P + "cross_attn.k_norm.weight"])
            v = self.heads(self.lin(ctx, P + "cross_attn.v_proj.weight"))
            hid = hid + gate * self.lin(self.attend(q, k, v), P + "cross_attn.output_proj.weight")

            shift, scale, gate = modulation("mlp")
            h = self.layer_norm(hid) * (1 + scale) + shift
            hid = hid + gate * self.lin(self.gelu(self.lin(h, P + "mlp.layer1.weight")), P + "mlp.layer2.weight")

        m = (
            self.lin(
                self.lin(self.silu(emb), "final_layer.adaln_modulation.1.weight"),
                "final_layer.adaln_modulation.2.weight",
            )
            + lora[..., : 2 * self.C]
        )
        shift, scale = m.chunk(2, -1)
        o = self.lin(self.layer_norm(hid) * (1 + scale) + shift, "final_layer.linear.weight")
        out = torch.zeros(x.shape, dtype=torch.float64)
        for n, (ti, hi, wi) in enumerate(grid):
            for kh in range(2):
                for kw in range(2):
                    for c in range(16):  # stored rows (kt kh kw c)
                        out[0, c, ti, 2 * hi + kh, 2 * wi + kw] = o[0, n, (kh * 2 + kw) * 16 + c]
        return out, written


def test_forward_matches_spec_reference():
    """The fp32 model (stored checkpoint -> loader fusions -> forward) against SpecReferenceDiT:
    chunk 0 (pinned frame-0 mask, offset 0, t = 803.57 as bf16) and chunk 1 (offset 2, t = 128)
    attending to chunk 0's K/V through the real rolling cache."""
    from support.omnidreams_tiny import stored_state_dict

    from omnivideo.models.omnidreams.kv_cache import RollingKVCache
    from omnivideo.models.omnidreams.loader import build_dit

    stored = stored_state_dict(TINY, seed=5)
    model = build_dit(stored, torch.float32)
    ref = SpecReferenceDiT(stored, TINY)
    g = torch.Generator().manual_seed(0)
    T, H, W = 2, 4, 6
    x0, x1, hd0, hd1 = (torch.randn(1, 16, T, H, W, generator=g, dtype=torch.float64) for _ in range(4))
    text = torch.randn(1, 16, TINY.text_in_dim, generator=g, dtype=torch.float64)
    mask = torch.zeros(1, 1, T, H, W, dtype=torch.float64)
    mask[:, :, 0] = 1

    want0, kv0 = ref.forward(x0, 803.5714285714286, text, mask, hd0, t_offset=0)
    want1, _ = ref.forward(x1, 128.0, text, torch.zeros_like(mask), hd1, t_offset=2, history=kv0)

    cache = RollingKVCache(
        num_blocks=TINY.num_blocks,
        chunk_tokens=T * (H // 2) * (W // 2),
        window_chunks=3,
        heads=TINY.num_heads,
        head_dim=TINY.head_dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    cross = model.cross_kv(text.float())
    with torch.no_grad():
        cache.begin_chunk()
        got0 = model(
            x0.float(), 803.5714285714286, cross, cond_mask=mask.float(), hdmap=hd0.float(), t_offset=0, kv_cache=cache
        )
        cache.begin_chunk()
        got1 = model(x1.float(), 128.0, cross, hdmap=hd1.float(), t_offset=2, kv_cache=cache)

    for got, want in ((got0, want0), (got1, want1)):
        scale = float(want.abs().max())
        assert scale > 0.1  # a non-trivial output
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale)
    # the history matters: without it chunk 1 differs from what the model produced
    alone, _ = ref.forward(x1, 128.0, text, torch.zeros_like(mask), hd1, t_offset=2)
    assert (alone - want1).abs().max() > 1e-3
