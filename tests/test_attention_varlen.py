"""Packed `[real | pad]` attention: real rows equal SDPA over the real rows, and no (S x S) mask."""

import pytest
import torch
import torch.nn.functional as F

from omnivideo.attention.rows import AttnRows
from omnivideo.attention.torch_impl import flash_varlen, sdpa

S, USED = 300, 220


def qkv(b=1, s=S, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for _ in range(3)]


def ref(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Record every SDPA call's key length and mask shape (a spy: an O(S^2) mask cannot hide)."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((k.shape[-2], None if attn_mask is None else tuple(attn_mask.shape)))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("fn", [sdpa, flash_varlen])
def test_packed_real_rows_equal_sdpa_over_real_rows_without_a_mask(fn, sdpa_calls):
    q, k, v = qkv()
    # garbage in the padding must not leak into the real rows
    k[:, USED:] = 1e4
    out = fn(q, k, v, rows=AttnRows(kv_lengths=(USED,)))
    expected = ref(q[:, :USED], k[:, :USED], v[:, :USED])
    assert torch.equal(out[:, :USED], expected)
    assert sdpa_calls[0] == (USED, None)  # keys sliced, no mask at all
    assert all(shape is None or shape[-2] * shape[-1] < S * S for _, shape in sdpa_calls)


def test_unpacked_is_plain_sdpa(sdpa_calls):
    q, k, v = qkv()
    assert torch.equal(flash_varlen(q, k, v), ref(q, k, v))
    assert sdpa_calls[0] == (S, None)  # (the second call is the reference)


def test_batch_of_packed_rows_uses_an_o_s_key_mask(sdpa_calls):
    q, k, v = qkv(b=2)
    out = sdpa(q, k, v, rows=AttnRows(kv_lengths=(USED, S)))
    torch.testing.assert_close(out[:1, :USED], ref(q[:1, :USED], k[:1, :USED], v[:1, :USED]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[1:], ref(q[1:], k[1:], v[1:]), atol=1e-6, rtol=1e-5)
    assert sdpa_calls[0] == (S, (2, 1, 1, S))  # B x S key mask, not S x S


def test_unusable_lengths_raise_instead_of_attending_padding():
    q, k, v = qkv(b=2)
    with pytest.raises(ValueError, match="valid_kv_length"):
        sdpa(q, k, v, rows=AttnRows(kv_lengths=(USED,)))
    with pytest.raises(ValueError, match="valid_kv_length"):
        flash_varlen(q, k, v, rows=AttnRows(kv_lengths=(0, S + 1)))


def test_cudnn_preference_is_ordered(monkeypatch):
    """sdpa_kernel only honours the listed order with set_priority=True; a torch without it still works."""
    import contextlib

    import torch.nn.attention as nn_attention

    from omnivideo.attention import torch_impl as attention_torch

    calls = []

    def fake(backends, set_priority=False):
        calls.append((list(backends), set_priority))
        return contextlib.nullcontext()

    monkeypatch.setattr(nn_attention, "sdpa_kernel", fake)
    with attention_torch._prefer([nn_attention.SDPBackend.CUDNN_ATTENTION, nn_attention.SDPBackend.MATH]):
        pass
    assert calls == [([nn_attention.SDPBackend.CUDNN_ATTENTION, nn_attention.SDPBackend.MATH], True)]

    def old_torch(backends):  # no set_priority keyword: TypeError -> the plain restriction
        calls.append((list(backends), None))
        return contextlib.nullcontext()

    calls.clear()
    monkeypatch.setattr(nn_attention, "sdpa_kernel", old_torch)
    with attention_torch._prefer([nn_attention.SDPBackend.MATH]):
        pass
    assert calls == [([nn_attention.SDPBackend.MATH], None)]


def test_scale_and_stats_helpers_are_shared():
    from omnivideo.attention import flex_impl as attention_flex
    from omnivideo.attention import npu_impl as attention_npu
    from omnivideo.attention import rainfusion
    from omnivideo.attention import rows as attention_rows
    from omnivideo.attention import torch_impl as attention_torch

    assert attention_torch._scale is attention_rows.resolve_scale is attention_npu._scale
    assert attention_flex.resolve_scale is attention_rows.resolve_scale
    assert attention_torch.record_stats is rainfusion.record_stats is attention_flex.record_stats
    q = torch.zeros(1, 2, 1, 16)
    assert attention_rows.resolve_scale(q, None) == 0.25 and attention_rows.resolve_scale(q, 2) == 2.0
    plan = rainfusion.plan_and_permute(*qkv(s=3 * 16 * 16 + 16), (3, 16, 16), 16, 0.5, 0.25, 64)[3]
    stats = {}
    rainfusion.record_stats(stats, plan)
    assert stats == {
        "kept_blocks": plan.kept_blocks,
        "total_blocks": plan.block_mask.numel(),
        "realized_sparsity": plan.realized_sparsity,
        "nominal_sparsity": 0.5,
    }
    rainfusion.record_stats(None, plan)  # no stats dict: nothing to do


def test_flash_varlen_reads_every_key_of_a_longer_window(monkeypatch, sdpa_calls):
    """A KV window (or a prompt) longer than the queries: flash_attn's varlen kernel would be handed the queries'
    cu_seqlens for the keys too and read only the first Sq keys; such a call goes to SDPA over all keys. Queries and
    keys of one length still go to the kernel (a stand-in here: flash_attn needs CUDA)."""
    from omnivideo.attention import torch_impl

    kernel_calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None):
        kernel_calls.append((tuple(k.shape), cu_k.tolist()))
        return ref(q[None], k[None], v[None])[0]

    monkeypatch.setattr(torch_impl, "_flash_attn_varlen", lambda q: kernel)
    q, window, _ = qkv(s=3 * 40)
    q = q[:, :40]  # one chunk of queries over a three-chunk window
    out = flash_varlen(q, window, window)
    assert not kernel_calls and sdpa_calls == [(120, None)]
    assert torch.allclose(out, ref(q, window, window), atol=1e-6), "not attention over every key of the window"
    flash_varlen(q, q, q)
    assert kernel_calls == [((40, 2, 16), [0, 40])]
