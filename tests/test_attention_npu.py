"""Ascend NPU attention paths with fake `torch_npu` / `mindiesd` modules that record the calls.

The fakes compute on CPU (a stand-in for the NPU op), so outputs are checked too.
"""

import math
import sys
import types

import pytest
import torch

from omnivideo.attention.config import AttentionConfig, validate
from omnivideo.attention.dispatch import AttentionStats, attention
from omnivideo.attention.rows import AttnRows
from omnivideo.attention.torch_impl import rainfusion_reference
from omnivideo.backends import backend_report, detect, resolve
from omnivideo.backends.registry import clear_cache


def _math_attention(q, k, v, scale):
    """[..., S, D] attention in explicit math (no fused kernel): exact power-of-two behaviour."""
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v


@pytest.fixture
def NPU(monkeypatch, fake_torch_npu):
    monkeypatch.setenv("OMNIVIDEO_DEVICE", "npu")
    return detect()


@pytest.fixture
def mindiesd(monkeypatch):
    calls = []
    mod = types.ModuleType("mindiesd")

    def attention_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, **kw):
        calls.append(
            ("varlen", dict(shape=tuple(q.shape), cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, scale=softmax_scale, kw=kw))
        )
        out = torch.zeros_like(q)
        for a, b in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:]):  # TND: one sequence per segment
            seg = slice(a, b)
            out[seg] = _math_attention(
                q[seg].transpose(0, 1), k[seg].transpose(0, 1), v[seg].transpose(0, 1), softmax_scale
            ).transpose(0, 1)
        return out

    def attention_forward(q, k, v, attn_mask=None, scale=None, fused=True, head_first=False, **kw):
        calls.append(("laser", dict(q=q, scale=scale, head_first=head_first, kw=kw)))
        return _math_attention(q, k, v, scale)  # BNSD

    def sparse_attention(
        q,
        k,
        v,
        scale=None,
        head_num=1,
        input_layout="BNSD",
        sparse_type=None,
        txt_len=0,
        block_size=128,
        latent_shape_q=None,
        latent_shape_k=None,
        sparsity=0.0,
        **kw,
    ):
        calls.append(
            (
                "sparse",
                dict(
                    shape=tuple(q.shape),
                    scale=scale,
                    head_num=head_num,
                    layout=input_layout,
                    sparse_type=sparse_type,
                    txt_len=txt_len,
                    block_size=block_size,
                    latent_q=latent_shape_q,
                    latent_k=latent_shape_k,
                    sparsity=sparsity,
                ),
            )
        )
        return rainfusion_reference(
            q,
            k,
            v,
            rows=AttnRows(txt_len, tuple(latent_shape_q)),
            sparsity=sparsity,
            scale=scale,
            block_size=block_size,
        )

    def rain_fusion_attention(
        query,
        key,
        value,
        scale=None,
        head_num=None,
        input_layout="TND",
        select_idx=None,
        select_num_idx=None,
        blockshape=None,
        actual_seq_lengths=None,
        actual_seq_lengths_kv=None,
        inner_precise=0,
    ):
        """MindIE's block-sparse kernel, computed on CPU from the block tables it is given (TND, one sequence)."""
        calls.append(
            (
                "rain_fusion",
                dict(
                    shape=tuple(query.shape),
                    scale=scale,
                    head_num=head_num,
                    layout=input_layout,
                    select_idx=select_idx,
                    select_num_idx=select_num_idx,
                    blockshape=blockshape,
                    seq=actual_seq_lengths,
                    seq_kv=actual_seq_lengths_kv,
                ),
            )
        )
        s, bs = query.shape[0], blockshape[0]
        nb = select_idx.shape[0]
        allowed = torch.zeros(head_num, nb, nb, dtype=torch.bool)
        for qb in range(nb):
            for h in range(head_num):
                kept = select_idx[qb, h, : select_num_idx[qb, h]]
                assert (kept >= 0).all() and (select_idx[qb, h, select_num_idx[qb, h] :] == -1).all()
                allowed[h, qb, kept] = True
        blk = torch.arange(s) // bs
        mask = allowed[:, blk[:, None], blk[None, :]]  # [H, S, S]
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # HSD
        scores = (q @ k.transpose(-1, -2)) * scale
        return (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v).transpose(0, 1)

    mod.attention_forward_varlen = attention_forward_varlen
    mod.attention_forward = attention_forward
    mod.sparse_attention = sparse_attention
    rf_v2 = types.ModuleType("mindiesd.layers.flash_attn.sparse_flash_attn_rf_v2")
    rf_v2.rain_fusion_attention = rain_fusion_attention
    for name, module in (
        ("mindiesd", mod),
        ("mindiesd.layers", types.ModuleType("mindiesd.layers")),
        ("mindiesd.layers.flash_attn", types.ModuleType("mindiesd.layers.flash_attn")),
        ("mindiesd.layers.flash_attn.sparse_flash_attn_rf_v2", rf_v2),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def qkv(b=1, s=96, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for _ in range(3)]


def test_registry_picks_mindie_paths_on_npu(NPU, mindiesd, monkeypatch):
    assert NPU.name == "npu"
    assert resolve("attention", "auto", NPU).name == "npu_fusion_varlen"
    assert resolve("attention", "auto", NPU, exact=False).name == "npu_rainfusion"
    assert resolve("attention", "npu_laser", NPU).name == "npu_fusion_varlen"  # laser is opt-in
    monkeypatch.setenv("MINDIE_SD_FA_TYPE", "ascend_laser_attention")
    clear_cache()
    assert resolve("attention", "auto", NPU).name == "npu_laser"
    text = backend_report(NPU)
    assert "attention: auto -> npu_laser" in text and "npu_rainfusion: usable" in text


def test_missing_mindiesd_ops_fall_back_and_say_why(NPU, mindiesd, monkeypatch):
    rf_v2 = "mindiesd.layers.flash_attn.sparse_flash_attn_rf_v2"
    monkeypatch.delattr(sys.modules[rf_v2], "rain_fusion_attention")
    res = resolve("attention", "npu_rainfusion", NPU)
    assert res.name == "torch_block_sparse" and f"{rf_v2} has no rain_fusion_attention" in res.reason
    assert f"npu_rainfusion: unusable - {rf_v2} has no rain_fusion_attention" in backend_report(NPU)
    monkeypatch.setitem(sys.modules, "mindiesd", None)
    clear_cache()
    res = resolve("attention", "npu_fusion_varlen", NPU)
    assert res.name == "flash_varlen" and "mindiesd is not importable" in res.reason


def test_packed_varlen_calls_mindie_in_tnd_with_host_cu_seqlens(NPU, mindiesd):
    q, k, v = qkv()
    k[:, 70:] = 1e4  # padding garbage
    out = attention(q, k, v, AttentionConfig("auto"), scale=0.25, rows=AttnRows(kv_lengths=(70,)), platform=NPU)
    ((kind, call),) = mindiesd
    assert kind == "varlen" and call["shape"] == (96, 2, 16)
    assert call["cu_q"] == [0, 70, 96] and call["cu_k"] == [0, 70, 96] and call["scale"] == 0.25
    assert all(type(x) is int for x in call["cu_q"])  # host list: no device sync
    expected = _math_attention(*(x[0, :70].transpose(0, 1) for x in (q, k, v)), 0.25).transpose(0, 1)
    torch.testing.assert_close(out[0, :70], expected, atol=1e-6, rtol=1e-5)


def test_unpacked_batch_uses_one_segment_per_item(NPU, mindiesd):
    q, k, v = qkv(b=2, s=40)
    attention(q, k, v, AttentionConfig("auto"), platform=NPU)
    assert mindiesd[0][1]["cu_q"] == [0, 40, 80] and mindiesd[0][1]["scale"] == 16**-0.5


def test_laser_prescale_is_exact(NPU, mindiesd, monkeypatch):
    monkeypatch.setenv("MINDIE_SD_FA_TYPE", "ascend_laser_attention")
    q, k, v = qkv(s=64)
    out = attention(q, k, v, AttentionConfig("auto"), scale=0.3, rows=AttnRows(kv_lengths=(50,)), platform=NPU)
    ((kind, call),) = mindiesd
    assert kind == "laser" and call["scale"] == 0.3 * 256 * 256 and call["head_first"] is True
    assert call["kw"] == {"opt_mode": "manual", "op_type": "fused_attn_score", "layout": "BNSD"}
    assert call["q"].shape == (1, 2, 50, 16)  # BNSD, K/V sliced to the real rows
    assert torch.equal(call["q"] * 256, q[:, :50].transpose(1, 2))
    expected = _math_attention(*(x[:, :50].transpose(1, 2) for x in (q, k, v)), 0.3).transpose(1, 2)
    assert torch.equal(out[:, :50], expected)  # powers of two: bit-exact


def test_contract_failure_rebuilds_mask_or_raises(NPU, mindiesd):
    q, k, v = qkv(b=2, s=48)
    out = attention(q, k, v, AttentionConfig("auto"), rows=AttnRows(kv_lengths=(30, 48)), platform=NPU)
    assert mindiesd == []  # not the packed contract: MindIE varlen not called
    expected = _math_attention(*(x[0, :30].transpose(0, 1) for x in (q, k, v)), 16**-0.5).transpose(0, 1)
    torch.testing.assert_close(out[0, :30], expected, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="valid_kv_length"):
        attention(q, k, v, AttentionConfig("auto"), rows=AttnRows(kv_lengths=(30,)), platform=NPU)


@pytest.mark.parametrize("grid, prefix", [((2, 16, 32), 128), ((3, 8, 24), 200)])  # video rows 1024 / 576
def test_rainfusion_runs_our_plan_on_the_mindie_kernel(NPU, mindiesd, grid, prefix):
    """One plan for every device: the NPU path hands MindIE's rain_fusion_attention kernel the block tables of
    attention/rainfusion.py, so it selects what CPU/CUDA select, including the block that mixes video and prefix
    rows when the video rows are not a multiple of 128 (480 here: block 3 holds video rows 384-479 and the
    first 32 prefix rows)."""
    from omnivideo.attention.npu_impl import mindie_block_tables
    from omnivideo.attention.rainfusion import plan_and_permute

    q, k, v = qkv(b=2, s=prefix + math.prod(grid), seed=3)
    cfg = AttentionConfig("rainfusion", sparsity=0.7, min_video_blocks=2)
    stats = AttentionStats()
    out = attention(q, k, v, cfg, scale=0.2, rows=AttnRows(prefix, grid), platform=NPU, stats=stats)
    assert [kind for kind, _ in mindiesd] == ["rain_fusion", "rain_fusion"]  # one call per batch element
    for i, (_, call) in enumerate(mindiesd):
        *_, plan = plan_and_permute(q[i : i + 1], k[i : i + 1], v[i : i + 1], grid, prefix, 0.7, 0.2, 128)
        select_idx, select_num = mindie_block_tables(plan.block_mask[0])
        assert torch.equal(call["select_idx"], select_idx) and torch.equal(call["select_num_idx"], select_num)
        assert call["layout"] == "TND" and call["blockshape"] == [128, 128] and call["seq"] == [q.shape[1]]
        if math.prod(grid) % 128:  # the mixed block is protected: all its query rows attend every key block
            mixed = math.prod(grid) // 128
            assert plan.protected[mixed] and bool((select_num[mixed] == plan.n_blocks).all())
    expected = rainfusion_reference(
        q, k, v, rows=AttnRows(prefix, grid), sparsity=0.7, scale=0.2, block_size=128
    )  # the CPU reference of the same plan
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(
        out[:, :prefix], attention(q, k, v, AttentionConfig("sdpa"), scale=0.2)[:, :prefix], atol=2e-6, rtol=1e-5
    )  # every prefix row is dense
    assert stats.impls["npu_rainfusion"] == 1 and 0 < stats.realized_sparsity < 0.7


def test_npu_block_size_must_be_128(NPU):
    assert "block_size 64 is not supported on Ascend NPU" in validate("rainfusion", 0.8, 0, "", 64, NPU)
    assert validate("rainfusion", 0.8, 0, "", 128, NPU) is None
