"""The fused Wan VAE data-movement ops (torch, triton) against diffusers' operation order.

Every comparison is bit-exact: torch.equal AND identical strides (cuDNN must see the same
tensor). Triton runs through the interpreter on CPU (conftest sets TRITON_INTERPRET=1), so
tensors stay tiny.
"""

from __future__ import annotations

import importlib
import os
import random

import pytest
import torch
import torch.nn.functional as F

from omnivideo.kernels import wan_vae_reference as ref
from omnivideo.kernels import wan_vae_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CL = torch.channels_last_3d


def _triton_module():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton on CPU needs TRITON_INTERPRET=1 before import")
    return importlib.import_module("omnivideo.kernels.wan_vae_triton")


@pytest.fixture(params=["torch", "triton"])
def impl(request):
    return wan_vae_torch if request.param == "torch" else _triton_module()


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.stride() == b.stride(), f"strides {a.stride()} != {b.stride()}"
    assert torch.equal(a, b)


def _rand(shape, dtype=torch.float32, layout="ncdhw", seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return t.contiguous(memory_format=CL) if layout == "cl" else t


def _check_cat_pad(impl, x, cache, padding, keep):
    want_p, want_c = ref.cat_pad_5d(x, cache, padding, keep)
    got_p, got_c = impl.cat_pad_5d(x, cache, padding, keep)
    _same(got_p, want_p)
    if keep:
        _same(got_c, want_c)
    else:
        assert got_c is None and want_c is None


# ----------------------------------------------------------------------------- cat_pad_5d

PADS = {"3x3x3": (1, 1, 1, 1, 2, 0), "time_conv": (0, 0, 0, 0, 2, 0), "1x1x1": (0, 0, 0, 0, 0, 0)}
# (T of x, cache frames or None, keep_cache_frames): first chunk, steady state, short chunks
CACHE_CASES = [(2, None, 0), (1, None, 2), (1, 1, 2), (1, 2, 2), (2, 2, 2), (3, 2, 1), (2, 0, 2)]


@pytest.mark.parametrize("pad", list(PADS))
@pytest.mark.parametrize("layout", ["ncdhw", "cl"])
@pytest.mark.parametrize("t,tc,keep", CACHE_CASES)
def test_cat_pad_matches_reference(impl, pad, layout, t, tc, keep):
    x = _rand((2, 3, t, 4, 5), layout=layout)
    cache = None if tc is None else _rand((2, 3, tc, 4, 5), layout=layout, seed=1)
    if tc == 0 and layout == "cl" and PADS[pad][4] > 0:
        # ATen calls an empty tensor NCDHW, so cat() would leave channels_last: refused
        with pytest.raises(ValueError, match="mixed memory formats"):
            impl.cat_pad_5d(x, cache, PADS[pad], keep)
        return
    _check_cat_pad(impl, x, cache, PADS[pad], keep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["ncdhw", "cl"])
def test_cat_pad_dtypes(impl, dtype, layout):
    x = _rand((1, 4, 1, 3, 6), dtype, layout)
    cache = _rand((1, 4, 2, 3, 6), dtype, layout, seed=1)
    _check_cat_pad(impl, x, cache, PADS["3x3x3"], 2)


@pytest.mark.parametrize("layout", ["ncdhw", "cl"])
def test_cat_pad_strided_views(impl, layout):
    """Cache and x that are slices of larger tensors (non-dense strides)."""
    big = _rand((2, 5, 4, 4, 5), layout=layout, seed=2)
    cache = big[:, 1:4, 2:]  # channel and time slice: 2 frames, 3 channels
    x = _rand((2, 3, 3, 4, 5), layout=layout)[:, :, 1:]  # last 2 frames of a 3-frame tensor
    for pad in PADS.values():
        for keep in (0, 1, 2):
            _check_cat_pad(impl, x, cache, pad, keep)
    _check_cat_pad(impl, x[:, :, 1:], cache, PADS["3x3x3"], 2)  # 1-frame x: cache frame prepended


def test_cat_pad_asymmetric_and_back_pad(impl):
    x = _rand((1, 2, 2, 3, 4))
    _check_cat_pad(impl, x, _rand((1, 2, 1, 3, 4), seed=3), (2, 0, 1, 3, 2, 1), 2)


def test_cat_pad_single_channel_ambiguous_layout(impl):
    """C=1: a channels_last_3d tensor is also 'contiguous'; ATen still keeps its strides."""
    x = _rand((1, 1, 2, 3, 4), layout="cl")
    _check_cat_pad(impl, x, _rand((1, 1, 2, 3, 4), layout="cl", seed=1), PADS["3x3x3"], 2)
    _check_cat_pad(impl, x, None, PADS["3x3x3"], 2)


def test_no_padding_returns_x(impl):
    x = _rand((1, 2, 2, 3, 4), layout="cl")
    padded, new_cache = impl.cat_pad_5d(x, _rand((1, 2, 2, 3, 4), seed=1), PADS["1x1x1"], 0)
    assert padded is x and new_cache is None  # the cache is ignored without temporal pad


def test_keep_cache_follows_diffusers_chunk_loop(impl):
    """Feed chunks like the decode loop does; cache and padded input track diffusers' own code."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import CACHE_T

    pad = PADS["3x3x3"]
    want_cache = got_cache = None
    for i, t in enumerate([1, 1, 2, 4, 1]):
        x = _rand((1, 3, t, 4, 4), layout="cl", seed=10 + i)
        # diffusers WanResidualBlock / WanDecoder3d, verbatim
        cache_x = x[:, :, -CACHE_T:, :, :].clone()
        if cache_x.shape[2] < 2 and want_cache is not None:
            cache_x = torch.cat([want_cache[:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
        want_p, _ = ref.cat_pad_5d(x, want_cache, pad, 0)
        got_p, new = impl.cat_pad_5d(x, got_cache, pad, CACHE_T)
        _same(got_p, want_p)
        _same(new, cache_x)
        want_cache, got_cache = cache_x, new


def test_reference_is_wan_causal_conv(impl):
    """padded fed to Conv3d reproduces WanCausalConv3d.forward(x, cache) exactly."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    torch.manual_seed(0)
    for kernel, padding in ((3, 1), ((3, 1, 1), (1, 0, 0))):
        conv = WanCausalConv3d(3, 4, kernel, padding=padding).to(DEVICE)
        x, cache = _rand((1, 3, 2, 4, 5), layout="cl"), _rand((1, 3, 2, 4, 5), layout="cl", seed=1)
        padded, _ = impl.cat_pad_5d(x, cache, conv._padding, 0)
        with torch.no_grad():
            want = conv(x, cache)
            got = F.conv3d(padded, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)
        _same(got, want)


@pytest.mark.parametrize("x_layout,cache_layout", [("cl", "ncdhw"), ("ncdhw", "cl")])
def test_mixed_layouts_refused(impl, x_layout, cache_layout):
    x = _rand((1, 3, 1, 4, 4), layout=x_layout)
    cache = _rand((1, 3, 2, 4, 4), layout=cache_layout, seed=1)
    with pytest.raises(ValueError, match="mixed memory formats"):
        impl.cat_pad_5d(x, cache, PADS["3x3x3"], 2)
    ref.cat_pad_5d(x, cache, PADS["3x3x3"], 2)  # diffusers itself copes (contiguous result)


def test_cat_pad_invalid_inputs(impl):
    x = _rand((1, 2, 1, 3, 3))
    pad = PADS["3x3x3"]
    bad = [
        ((x[0], None, pad), "5-D"),
        ((x, x.double(), pad), "dtype mismatch"),
        ((x, torch.empty((1, 2, 1, 3, 3), device="meta"), pad), "device mismatch"),
        ((x, _rand((1, 2, 1, 3, 4)), pad), "does not match"),
        ((x, _rand((1, 2, 3, 3, 3)), pad), "more than the temporal pad"),
        ((x, None, (1, 1, 1, 1, 2)), "padding"),
        ((x, None, (1, 1, -1, 1, 2, 0)), "padding"),
    ]
    for (a, c, p), msg in bad:
        with pytest.raises(ValueError, match=msg):
            impl.cat_pad_5d(a, c, p)


# ----------------------------------------------------------------------------- dup_up3d_add

UP_BLOCKS = [(2, 2, 8), (1, 2, 2)]  # Wan 2.2's (factor_t, factor_s, repeats) per up block


def _main(shape, dtype, layout, seed=5):
    b, c, t, h, w = shape
    if layout == "tmajor":  # WanResample's output: view(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return _rand((b, t, c, h, w), dtype, seed=seed).permute(0, 2, 1, 3, 4)
    return _rand(shape, dtype, layout, seed)


def _check_dup(
    impl, ft, fs, r, drop, dtype=torch.float32, layout="ncdhw", src_layout="ncdhw", b=2, cout=2, t=2, h=2, w=3
):
    cin = cout * ft * fs * fs // r
    source = _rand((b, cin, t, h, w), dtype, src_layout, seed=4)
    main = _main((b, cout, t * ft - (ft - 1 if drop else 0), h * fs, w * fs), dtype, layout)
    want = ref.dup_up3d_add(main, source, ft, fs, r, drop)
    before = main.clone()
    got = impl.dup_up3d_add(main, source, ft, fs, r, drop)
    _same(got, want)
    assert torch.equal(main, before)  # main is not written in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["ncdhw", "cl", "tmajor"])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("ft,fs,r", UP_BLOCKS)
def test_dup_up3d_add_matches_reference(impl, ft, fs, r, drop, layout, dtype):
    _check_dup(impl, ft, fs, r, drop, dtype, layout)


@pytest.mark.parametrize("ft,fs,r", [(2, 2, 4), (2, 2, 16), (2, 1, 1), (1, 2, 8)])
def test_dup_up3d_add_other_channel_maps(impl, ft, fs, r):
    _check_dup(impl, ft, fs, r, True, torch.bfloat16, "cl", cout=4)


@pytest.mark.parametrize("layout", ["ncdhw", "cl", "tmajor"])
def test_dup_up3d_add_size_one_dims(impl, layout):
    """B=1 / single frame: size-1 dims whose strides ATen's add chooses by tie-breaking."""
    _check_dup(impl, 2, 2, 8, True, torch.bfloat16, layout, "cl", b=1, t=1)
    _check_dup(impl, 1, 2, 2, True, torch.float16, layout, b=1, cout=1, t=1, w=1)


def test_reference_dup_up3d_is_diffusers():
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    for ft, fs, r in UP_BLOCKS:
        cout = 4
        cin = cout * ft * fs * fs // r
        module = DupUp3D(cin, cout, ft, fs)
        assert module.repeats == r
        x = _rand((1, cin, 2, 2, 3))
        for first in (False, True):
            _same(ref.dup_up3d(x, cout, ft, fs, r, first), module(x, first_chunk=first))


def test_bf16_add_rounds_to_nearest_even(impl):
    """fp32 sums whose bf16 truncation differs from round-to-nearest-even (the interpreter truncates)."""
    ulp, big = 2.0**-7, 2.0**120  # bf16 spacing in [1, 2) and at the largest finite bf16
    pairs = [
        (1.0, 1.5 * ulp),
        (1.0, 0.75 * ulp),
        (1.0, 0.5 * ulp),
        (1 + ulp, 0.5 * ulp),
        (-1.0, -1.5 * ulp),
        (3.0, 3 * ulp),
        (float("inf"), 1.0),
        ((2 - ulp) * 2.0**127, 0.75 * big),
    ]  # last: rounds to inf
    main_vals = torch.tensor([m for m, _ in pairs]).bfloat16()
    src_vals = torch.tensor([s for _, s in pairs]).bfloat16()
    assert torch.equal(main_vals.float(), torch.tensor([m for m, _ in pairs]))  # inputs exact in bf16
    assert torch.equal(src_vals.float(), torch.tensor([s for _, s in pairs]))
    sums = main_vals.float() + src_vals.float()
    n = main_vals.numel()
    # (1,2,2): out[co, t, 2h+ih, 2w+iw] = src[2co+ih, t, h, w]; put each case on one output pixel
    main = torch.zeros(1, 1, 1, 2, 2 * n, dtype=torch.bfloat16)
    source = torch.zeros(1, 2, 1, 1, n, dtype=torch.bfloat16)
    main[0, 0, 0, 0, 0::2] = main_vals
    source[0, 0, 0, 0, :] = src_vals
    main, source = main.to(DEVICE), source.to(DEVICE)
    want = ref.dup_up3d_add(main, source, 1, 2, 2, False)
    got = impl.dup_up3d_add(main, source, 1, 2, 2, False)
    _same(got, want)
    truncated = (sums.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    assert not torch.equal(got[0, 0, 0, 0, 0::2].cpu(), truncated)  # truncation would fail this test

    nan_main = main.clone()
    nan_main[0, 0, 0, 0, 0] = float("nan")
    assert torch.isnan(impl.dup_up3d_add(nan_main, source, 1, 2, 2, False)[0, 0, 0, 0, 0])


def test_fp16_add_rounds_to_nearest_even(impl):
    ulp = 2.0**-10
    main = torch.full((1, 1, 1, 2, 2), 1.0, dtype=torch.float16, device=DEVICE)
    source = torch.tensor([1.5 * ulp, 0.5 * ulp], dtype=torch.float16).view(1, 2, 1, 1, 1).to(DEVICE)
    _same(impl.dup_up3d_add(main, source, 1, 2, 2, False), ref.dup_up3d_add(main, source, 1, 2, 2, False))


def test_dup_up3d_add_invalid_inputs(impl):
    source = _rand((1, 2, 1, 2, 2))
    main = _rand((1, 2, 2, 4, 4))
    with pytest.raises(ValueError, match="dtype mismatch"):
        impl.dup_up3d_add(main, source.half(), 2, 2, 8, False)
    with pytest.raises(ValueError, match="does not match"):
        impl.dup_up3d_add(main, source, 2, 2, 8, True)  # drop_first leaves 1 frame, main has 2
    with pytest.raises(ValueError, match="repeats"):
        impl.dup_up3d_add(main, source, 2, 2, 4, False)
    with pytest.raises(ValueError, match="device mismatch"):
        impl.dup_up3d_add(main, torch.empty((1, 2, 1, 2, 2), device="meta"), 2, 2, 8, False)


# ----------------------------------------------------------------------------- layout rules


def test_add_stride_rule_matches_aten():
    """The TensorIterator mirror used for dup_up3d_add's output, over random dense layouts."""
    rnd = random.Random(0)
    for _ in range(300):
        ft, fs, r = rnd.choice([(2, 2, 8), (1, 2, 2), (2, 1, 1)])
        drop = rnd.random() < 0.5
        b, cout, t, h, w = (rnd.choice([1, 1, 2, 3]) for _ in range(5))
        dtype = rnd.choice([torch.float32, torch.bfloat16])  # meta add differs for half types
        source = torch.empty(b, cout * ft * fs * fs // r, t, h, w, dtype=dtype)
        shape = (b, cout, t * ft - (ft - 1 if drop else 0), h * fs, w * fs)
        perm = list(range(5))
        rnd.shuffle(perm)
        main = torch.empty([shape[p] for p in perm], dtype=dtype).permute([perm.index(d) for d in range(5)])
        want = (main + ref.dup_up3d(source, cout, ft, fs, r, drop)).stride()
        assert wan_vae_torch.add_strides(main, source, ft, fs, r, drop) == want


def test_memory_format_rule_matches_aten():
    """memory_format_of == the format F.pad gives (ATen's suggest_memory_format)."""
    rnd = random.Random(1)
    for _ in range(300):
        shape = [rnd.choice([1, 1, 2, 3]) for _ in range(5)]
        perm = list(range(5))
        rnd.shuffle(perm)
        t = torch.empty([shape[p] for p in perm]).permute([perm.index(d) for d in range(5)])
        fmt = wan_vae_torch.memory_format_of(t)
        assert F.pad(t, (1, 1)).stride() == torch.empty([*shape[:4], shape[4] + 2], memory_format=fmt).stride()
