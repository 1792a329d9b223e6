"""OmniDreams DiT pieces against independent computations of the spec's formulas:
RoPE layout and frequencies, time offset, patchify order, timestep embedding, schedule numbers."""

from __future__ import annotations

import math

import pytest
import torch
from omnidreams_tiny import TINY

from omnivideo.models.omnidreams_dit import (OmniDreamsConfig, apply_rope, patchify, rope_cos_sin,
                                             timestep_sinusoid, unpatchify)
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
    torch.testing.assert_close(a[:, n_t:TINY.head_dim // 2], c[:, n_t:TINY.head_dim // 2])  # h, w untouched
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
    from omnivideo.models.omnidreams_dit import _attention
    from omnivideo.pipelines.attention import AttentionConfig

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 32, generator=g) for n in (12, 36, 36))
    weights = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(32), dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    for config in (None, AttentionConfig(backend="sdpa")):
        torch.testing.assert_close(_attention(q, k, v, 1 / math.sqrt(32), config, (2, 2, 3), 0), ref,
                                   rtol=1e-5, atol=1e-5)
