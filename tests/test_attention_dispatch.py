"""The one attention call: config validation, plan resolution (dense reasons), stats, registry choice."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from omnivideo.attention import config as C
from omnivideo.attention import dispatch as A
from omnivideo.attention.rows import AttnRows
from omnivideo.attention.torch_impl import rainfusion_reference
from omnivideo.backends import PLATFORM, Platform, resolve
from omnivideo.backends.log_once import forget

CPU = Platform("cpu", torch.device("cpu"), "test")
GRID, PREFIX = (3, 16, 16), 16  # the shape of test_attention_rainfusion: one flex compile


def qkv(s=PREFIX + 768, b=1, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for _ in range(3)]


def dense(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def test_parse_skip_layers():
    parsed = C.parse_skip_layers("0-3,38")
    assert [i for i in range(50) if i in parsed] == [0, 1, 2, 3, 38]
    assert [i for i in range(10) if i in C.parse_skip_layers(" 5 , 7-7 ,")] == [5, 7]
    assert not any(i in C.parse_skip_layers("") for i in range(100))
    for bad, msg in [
        ("a", "not a layer index"),
        ("3-1", "runs backwards"),
        ("-2", "not a layer index"),
        ("1;2", "not a layer index"),
        ("0-30000000", "beyond"),
        ("1," * 600, "characters long"),
    ]:
        with pytest.raises(ValueError, match=msg):
            C.parse_skip_layers(bad)


def test_validate_messages():
    assert C.validate("rainfusion", 0.8, 0, "0-3,38", 128, CPU) is None
    assert "sparsity 1.2 is out of range" in C.validate("rainfusion", 1.2, 0, "", 128, CPU)
    assert "out of range" in C.validate("rainfusion", -0.1, 0, "", 128, CPU)
    assert "skip_layers" in C.validate("rainfusion", 0.8, 0, "0-x", 128, CPU)
    assert "power of two" in C.validate("rainfusion", 0.8, 0, "", 96, CPU)
    assert "start_step" in C.validate("rainfusion", 0.8, -1, "", 128, CPU)
    assert "unknown" in C.validate("magic", 0.8, 0, "", 128, CPU)
    with pytest.raises(ValueError, match="sparsity 0.99"):
        C.AttentionConfig("rainfusion", sparsity=0.99)


def test_dense_backends_equal_sdpa():
    q, k, v = qkv()
    for backend in ("auto", "sdpa", "flash_varlen"):
        torch.testing.assert_close(
            A.attention(q, k, v, C.AttentionConfig(backend)), dense(q, k, v), atol=1e-6, rtol=1e-5
        )
    assert A.dense_backend(None, CPU)[0] == "flash_varlen"  # auto: fastest exact on CPU
    with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
        A.attention(q[0], k[0], v[0])


def test_sparse_auto_resolution_on_cpu():
    name = resolve("attention", "auto", CPU, exact=False).name
    flex_ok = resolve("attention", "flex_block_sparse", CPU).name == "flex_block_sparse"
    assert name == ("flex_block_sparse" if flex_ok else "torch_block_sparse")
    assert resolve("attention", "auto", CPU).impl.exact  # plain auto never picks a sparse path


@pytest.mark.parametrize("backend", ["torch_block_sparse", "rainfusion_reference"])
def test_sparse_call_matches_reference_and_reports_sparsity(backend):
    q, k, v = qkv()
    rows = AttnRows(PREFIX, GRID)
    cfg = C.AttentionConfig(backend, sparsity=0.8, block_size=32, min_video_blocks=4)
    stats = A.AttentionStats()
    out = A.attention(q, k, v, cfg, rows=rows, step=3, layer=1, stats=stats)
    info = {}
    ref = rainfusion_reference(q, k, v, rows=rows, sparsity=0.8, block_size=32, stats=info)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert stats.sparse_calls == 1 and stats.impls[backend] == 1 and stats.nominal_sparsity == 0.8
    assert stats.realized_sparsity == pytest.approx(info["realized_sparsity"])
    assert 0 < stats.realized_sparsity < 0.8 and "realized" in stats.summary()


def test_dense_reasons_are_logged_once_and_counted(caplog):
    forget()
    q, k, v = qkv()
    rows = AttnRows(PREFIX, GRID)
    cfg = C.AttentionConfig(
        "rainfusion", sparsity=0.8, start_step=2, skip_layers="0-1,5", block_size=32, min_video_blocks=4
    )
    stats = A.AttentionStats()
    expected = dense(q, k, v)
    with caplog.at_level(logging.INFO, logger="omnivideo"):
        for _ in range(3):
            out = A.attention(q, k, v, cfg, rows=rows, step=0, layer=3, stats=stats)  # warm-up
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
            A.attention(q, k, v, cfg, rows=rows, step=4, layer=5, stats=stats)  # skip_layers
            A.attention(q, k, v, cfg, rows=None, step=4, layer=2, stats=stats)  # no rows
            A.attention(q, k, v, cfg, rows=AttnRows(0, GRID), step=4, layer=2, stats=stats)  # inconsistent
            A.attention(q, k, v, C.AttentionConfig("rainfusion", block_size=32), rows=rows, stats=stats)  # short
    assert stats.sparse_calls == 0
    assert stats.dense_calls == {
        "warm-up": 3,
        "skip_layers": 3,
        "no layout": 3,
        "layout inconsistent": 3,
        "short video": 3,
    }
    lines = [r.getMessage() for r in caplog.records if "dense (" in r.getMessage()]
    assert len(lines) == 5, lines  # each reason once
    assert any("step 0 < start_step 2" in m for m in lines)
    assert any("24 video blocks < 32" in m for m in lines)
    A.attention(q, k, v, cfg, rows=rows, step=2, layer=2, stats=stats)
    assert stats.sparse_calls == 1  # past warm-up, not skipped: sparse


def test_packed_sequence_runs_sparse_on_real_rows():
    q, k, v = qkv(s=PREFIX + 768 + 40)
    rows = AttnRows(PREFIX, GRID, kv_lengths=(PREFIX + 768,))
    cfg = C.AttentionConfig("torch_block_sparse", sparsity=0.8, block_size=32, min_video_blocks=4)
    out = A.attention(q, k, v, cfg, rows=rows)
    real = slice(0, PREFIX + 768)
    ref = rainfusion_reference(
        q[:, real], k[:, real], v[:, real], rows=AttnRows(PREFIX, GRID), sparsity=0.8, block_size=32
    )
    torch.testing.assert_close(out[:, real], ref, atol=2e-6, rtol=1e-5)


def test_video_must_be_the_tail_of_the_real_rows():
    q, k, v = qkv()
    why = A.dense_reason(C.AttentionConfig("rainfusion", min_video_blocks=1), q, k, AttnRows(8, GRID), None, None)
    assert why[0] == "layout inconsistent" and "tail" in why[1]
    assert math.prod(GRID) + PREFIX == q.shape[1]
    assert PLATFORM.name in ("cpu", "cuda", "npu")


def test_unconnected_attention_is_the_same_default_for_every_family():
    from omnivideo.models.h3 import attention as h3_attention

    assert h3_attention.normalize_config is C.normalize_config  # one normaliser, used by H3 and OmniDreams
    assert C.normalize_config(None) == C.AttentionConfig() and C.AttentionConfig().backend == "auto"
    cfg = C.AttentionConfig("rainfusion", sparsity=0.5)
    assert C.normalize_config(cfg) is cfg
    assert C.normalize_config({"backend": "rainfusion", "sparsity": 0.5}) == cfg
    with pytest.raises(TypeError, match="AttentionConfig"):
        C.normalize_config("sdpa")
    q, k, v = qkv()
    # None and a plain dict go through the same path as the config object (a dict used to crash on .is_sparse)
    torch.testing.assert_close(A.attention(q, k, v, None), A.attention(q, k, v, C.AttentionConfig()))
    torch.testing.assert_close(A.attention(q, k, v, {"backend": "sdpa"}), dense(q, k, v), atol=1e-6, rtol=1e-5)
    # the H3 text refiner follows the same default (used to be pinned to sdpa)
    state = h3_attention.H3AttentionState(C.normalize_config(None))
    assert state.config.backend == "auto" and state.refiner_config.backend == "auto"


def test_npu_block_size_rule_lives_in_the_backends():
    import inspect

    from omnivideo.backends.attention import block_size_error

    npu = Platform("npu", torch.device("cpu"), "test")
    assert block_size_error(npu, 128) is None and block_size_error(CPU, 64) is None
    assert "Ascend NPU" in block_size_error(npu, 64)
    assert "Ascend NPU" in C.validate("rainfusion", 0.8, 0, "", 64, npu)  # validate still reports it
    assert C.validate("rainfusion", 0.8, 0, "", 64, CPU) is None
    assert '"npu"' not in inspect.getsource(A)  # the pipeline does not know devices


def test_resolve_is_cached_per_request(monkeypatch):
    from omnivideo.backends import registry

    probes = []
    sdpa_impl = registry.implementations("attention")["sdpa"]
    fake = registry.Impl(
        "attention", "probe_counter", ("cpu",), sdpa_impl.loader, lambda platform: probes.append(platform.name)
    )
    monkeypatch.setitem(registry._OPS["attention"].impls, "probe_counter", fake)
    first = resolve("attention", "probe_counter", CPU)
    assert resolve("attention", "probe_counter", Platform("cpu", torch.device("cpu"), "other")) is first
    assert probes == ["cpu"]  # probed once for (op, requested, platform name, exact)
    resolve("attention", "probe_counter", CPU, exact=None)
    assert probes == ["cpu", "cpu"]  # another key
    registry.clear_cache()
    assert resolve("attention", "probe_counter", CPU) is not first and len(probes) == 3
