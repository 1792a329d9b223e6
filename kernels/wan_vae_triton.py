"""Wan VAE decode data movement as Triton kernels ("triton"; CUDA, or CPU under TRITON_INTERPRET=1).

- `cat_pad_5d`: one pass writes the padded conv input (cache frames, x, zero borders) in
  the layout the reference would produce (NCDHW or channels_last_3d, never a new one, so
  cuDNN sees the same tensor) and, in the same pass, diffusers' next feature cache.
- `dup_up3d_add`: main + DupUp3D(source) reading source through index arithmetic (no
  repeat_interleave/permute copy), added in fp32 and rounded once to the output dtype,
  like ATen's half-precision add.

Output shapes/strides and input validation come from `wan_vae_torch` (shared rules), so
the three implementations stay interchangeable. Index math is int64 throughout (tensors
past 2**31 elements). Only imported when the registry reports Triton usable.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..backends.registry import triton_interpreted, triton_runs_on
from . import wan_vae_torch as _t

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The interpreter pays per program and per op, not per element: huge tiles keep it fast.
# BLOCK is constexpr and only sets the tile size, never the result.
_INTERPRET = triton_interpreted()
_BLOCK = 1 << 15 if _INTERPRET else 2048
_MAX_INNER = 1 << 12 if _INTERPRET else 256


def supports(device: torch.device) -> bool:
    """CUDA tensors; CPU tensors only under the interpreter (tests): the backends' rule."""
    return triton_runs_on(device)


def _device_guard(t):
    # torch.cuda.device() on a CPU tensor fails; the interpreter needs no guard.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _tile(outer, inner):
    """(BI, BJ): power-of-two tile over the two fastest dims, about _BLOCK elements."""
    bj = min(triton.next_power_of_2(inner), _MAX_INNER)
    bi = min(triton.next_power_of_2(outer), max(1, _BLOCK // bj))
    return bi, bj


def _check_dtype(op, t):
    if t.dtype not in _DTYPES:
        raise ValueError(f"{op}: triton path supports float32/float16/bfloat16, got {t.dtype}")


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _cat_pad_kernel(
    out_ptr,
    x_ptr,
    c_ptr,
    nc_ptr,
    C,
    T_out,
    H_out,
    W_out,
    H,
    W,
    Tc,
    T_src,
    nc_t0,
    pt,
    ph,
    pw,
    so_b,
    so_c,
    so_t,
    so_h,
    so_w,
    sx_b,
    sx_c,
    sx_t,
    sx_h,
    sx_w,
    sc_b,
    sc_c,
    sc_t,
    sc_h,
    sc_w,
    sn_b,
    sn_c,
    sn_t,
    sn_h,
    sn_w,
    CL: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ii = tl.program_id(1).to(tl.int64) * BI + tl.arange(0, BI).to(tl.int64)[:, None]
    jj = tl.program_id(2).to(tl.int64) * BJ + tl.arange(0, BJ).to(tl.int64)[None, :]
    if CL:  # one program per (b, t, h) row; tile (w, c), c fastest in memory
        h = row % H_out
        t = (row // H_out) % T_out
        b = row // H_out // T_out
        w = ii
        c = jj
        tile = (w < W_out) & (c < C)
    else:  # one program per (b, c, t) plane; tile (h, w)
        t = row % T_out
        c = (row // T_out) % C
        b = row // T_out // C
        h = ii
        w = jj
        tile = (h < H_out) & (w < W_out)
    # position in cat([cache, x], 2); t is per program, so the source choice is scalar
    ts = t - pt
    hs = h - ph
    ws = w - pw
    if CL:  # h is per program too
        row_ok = (ts >= 0) & (ts < T_src) & (hs >= 0) & (hs < H)
        inside = tile & (ws >= 0) & (ws < W)
    else:
        row_ok = (ts >= 0) & (ts < T_src)
        inside = tile & (hs >= 0) & (hs < H) & (ws >= 0) & (ws < W)
    # scalar & block misbehaves in the interpreter (int64 mask); where() broadcasts cleanly
    inside = tl.where(row_ok, inside, False)
    if ts < Tc:
        src = c_ptr + b * sc_b + c * sc_c + ts * sc_t + hs * sc_h + ws * sc_w
    else:
        src = x_ptr + b * sx_b + c * sx_c + (ts - Tc) * sx_t + hs * sx_h + ws * sx_w
    val = tl.load(src, mask=inside, other=0)
    tl.store(out_ptr + b * so_b + c * so_c + t * so_t + h * so_h + w * so_w, val, mask=tile)
    if WRITE_CACHE:  # the last unpadded frames double as the next chunk's cache
        tn = ts - nc_t0
        tl.store(
            nc_ptr + b * sn_b + c * sn_c + tn * sn_t + hs * sn_h + ws * sn_w, val, mask=tl.where(tn >= 0, inside, False)
        )


@triton.jit
def _pick(slot: tl.constexpr, c0, c1, c2, c3, c4):
    """Coordinate held in memory slot `slot` (resolved at compile time)."""
    v = c0
    if slot == 1:
        v = c1
    if slot == 2:
        v = c2
    if slot == 3:
        v = c3
    if slot == 4:
        v = c4
    return v


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even with integer ops.

    The interpreter truncates on .to(tl.bfloat16); this gives the same bits on CPU and
    GPU, and matches ATen (c10::BFloat16's round_to_nearest_even, NaN -> 0x7FC0)."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dup_up3d_add_kernel(
    out_ptr,
    main_ptr,
    src_ptr,
    S1,
    S2,
    S3,
    S4,
    so0,
    so1,
    so2,
    so3,
    so4,
    sm0,
    sm1,
    sm2,
    sm3,
    sm4,
    ss_b,
    ss_c,
    ss_t,
    ss_h,
    ss_w,
    SLOT_B: tl.constexpr,
    SLOT_C: tl.constexpr,
    SLOT_T: tl.constexpr,
    SLOT_H: tl.constexpr,
    SLOT_W: tl.constexpr,
    FT: tl.constexpr,
    FS: tl.constexpr,
    REPEATS: tl.constexpr,
    DROP: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
):
    # Slots are out's dims from slowest (0) to fastest (4): the program walks the 3 outer
    # slots, the tile covers the 2 fastest, so out and main are read/written coalesced
    # whatever their layout (NCDHW, channels_last_3d, the upsampler's T-major view).
    row = tl.program_id(0).to(tl.int64)
    c2 = row % S2
    c1 = (row // S2) % S1
    c0 = row // S2 // S1
    c3 = tl.program_id(1).to(tl.int64) * BI + tl.arange(0, BI).to(tl.int64)[:, None]
    c4 = tl.program_id(2).to(tl.int64) * BJ + tl.arange(0, BJ).to(tl.int64)[None, :]
    mask = (c3 < S3) & (c4 < S4)
    o_off = c0 * so0 + c1 * so1 + c2 * so2 + c3 * so3 + c4 * so4
    m_off = c0 * sm0 + c1 * sm1 + c2 * sm2 + c3 * sm3 + c4 * sm4

    b = _pick(SLOT_B, c0, c1, c2, c3, c4)
    co = _pick(SLOT_C, c0, c1, c2, c3, c4)
    t = _pick(SLOT_T, c0, c1, c2, c3, c4) + DROP  # frame in the undropped shortcut
    h = _pick(SLOT_H, c0, c1, c2, c3, c4)
    w = _pick(SLOT_W, c0, c1, c2, c3, c4)
    # DupUp3D: out[co, t*FT+it, h*FS+ih, w*FS+iw] = src[(co*F + k) // REPEATS, t, h, w],
    # k = (it*FS + ih)*FS + iw  (repeat_interleave then view as (co, FT, FS, FS))
    k = (t % FT) * (FS * FS) + (h % FS) * FS + (w % FS)
    ci = (co * (FT * FS * FS) + k) // REPEATS
    s_off = b * ss_b + ci * ss_c + (t // FT) * ss_t + (h // FS) * ss_h + (w // FS) * ss_w

    acc = tl.load(main_ptr + m_off, mask=mask, other=0).to(tl.float32)
    acc += tl.load(src_ptr + s_off, mask=mask, other=0).to(tl.float32)
    if OUT_BF16:
        res = _bf16_rne(acc)
    else:
        res = acc.to(out_ptr.dtype.element_ty)  # fp16: RNE in the interpreter and on GPU
    tl.store(out_ptr + o_off, res, mask=mask)


# ----------------------------------------------------------------------------- wrappers


def cat_pad_5d(x, cache, padding, keep_cache_frames=0):
    """Same contract as `wan_vae_reference.cat_pad_5d` (values and strides).

    `padded` is x itself when there is nothing to pad and no cache is used (F.pad would
    return a same-strided clone; Conv3d never writes its input). Raises ValueError on
    mixed memory formats, dtype/device mismatch or shapes the fused path does not cover.
    """
    padding, used, front = _t.check_cat_pad(x, cache, padding, keep_cache_frames)
    _check_dtype("cat_pad_5d", x)
    (shape, strides), nc_layout = _t.cat_pad_layouts(x, cache, padding, keep_cache_frames)
    if not used and not any(padding) and strides == x.stride():
        return _t.cat_pad_5d(x, cache, padding, keep_cache_frames)  # no copy of x; tiny cache copy

    padded = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
    tc = cache.shape[2] if used else 0
    t_src = tc + x.shape[2]
    new_cache, write_cache, nc_t0 = None, False, 0
    if keep_cache_frames:
        new_cache = torch.empty_strided(*nc_layout, dtype=x.dtype, device=x.device)
        # the next cache is the last frames of cat([cache, x]) — in padded iff they come
        # from x or from a cache that was used (1x1x1 convs ignore it; copy those by hand)
        nc_t0 = t_src - new_cache.shape[2]
        write_cache = new_cache.shape[2] <= x.shape[2] or used

    B, C, T_out, H_out, W_out = shape
    cl = strides[1] == 1 and C > 1  # channels fastest: tile (w, c) rows, else (h, w) planes
    if cl:
        bi, bj = _tile(W_out, C)
        grid = (B * T_out * H_out, triton.cdiv(W_out, bi), triton.cdiv(C, bj))
    else:
        bi, bj = _tile(H_out, W_out)
        grid = (B * C * T_out, triton.cdiv(H_out, bi), triton.cdiv(W_out, bj))
    c_src = cache if used else x  # dummy pointer when no cache (never read: Tc == 0)
    nc = new_cache if write_cache else padded
    with _device_guard(x):
        _cat_pad_kernel[grid](
            padded,
            x,
            c_src,
            nc,
            C,
            T_out,
            H_out,
            W_out,
            x.shape[3],
            x.shape[4],
            tc,
            t_src,
            nc_t0,
            front,
            padding[2],
            padding[0],
            *padded.stride(),
            *x.stride(),
            *c_src.stride(),
            *nc.stride(),
            CL=cl,
            WRITE_CACHE=write_cache,
            BI=bi,
            BJ=bj,
            num_warps=4,
        )
    if new_cache is not None and not write_cache:
        kx = min(keep_cache_frames, x.shape[2])
        new_cache[:, :, new_cache.shape[2] - kx :].copy_(x[:, :, x.shape[2] - kx :])
        new_cache[:, :, : new_cache.shape[2] - kx].copy_(cache[:, :, -1:])
    return padded, new_cache


def dup_up3d_add(main, source, factor_t, factor_s, repeats, drop_first):
    """`main + DupUp3D(source, first_chunk=drop_first)`, fp32 add, one rounding.

    Writes a new tensor with the strides ATen's add gives (main is left untouched).
    """
    full, drop = _t.check_dup_up3d_add(main, source, factor_t, factor_s, repeats, drop_first)
    _check_dtype("dup_up3d_add", main)
    strides = _t.add_strides(main, source, factor_t, factor_s, repeats, drop_first)
    out = torch.empty_strided(main.shape, strides, dtype=main.dtype, device=main.device)
    if out.numel() == 0:
        return out
    # out's dims from slowest to fastest (size-1 dims first: their stride is meaningless)
    order = sorted(range(5), key=lambda d: (out.shape[d] > 1, -out.stride(d), -d))
    sizes = [out.shape[d] for d in order]
    slot = {d: i for i, d in enumerate(order)}
    bi, bj = _tile(sizes[3], sizes[4])
    grid = (sizes[0] * sizes[1] * sizes[2], triton.cdiv(sizes[3], bi), triton.cdiv(sizes[4], bj))
    with _device_guard(main):
        _dup_up3d_add_kernel[grid](
            out,
            main,
            source,
            sizes[1],
            sizes[2],
            sizes[3],
            sizes[4],
            *[out.stride(d) for d in order],
            *[main.stride(d) for d in order],
            *source.stride(),
            SLOT_B=slot[0],
            SLOT_C=slot[1],
            SLOT_T=slot[2],
            SLOT_H=slot[3],
            SLOT_W=slot[4],
            FT=factor_t,
            FS=factor_s,
            REPEATS=repeats,
            DROP=drop,
            OUT_BF16=main.dtype == torch.bfloat16,
            BI=bi,
            BJ=bj,
            num_warps=4,
        )
    return out
