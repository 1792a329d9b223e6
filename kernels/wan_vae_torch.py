"""Wan VAE decode data movement, fused in plain torch ("torch"; CPU, NPU, CUDA).

Bit-exact twin of `wan_vae_reference` (same values AND same strides) that skips the
intermediate tensors: `cat_pad_5d` allocates the padded conv input once and copies cache
and x straight into it (no cat, no second F.pad allocation, zeros only on the borders);
`dup_up3d_add` adds strided/broadcast views of `source` into `main` instead of
materialising DupUp3D's repeat_interleave + permute().contiguous().

Output strides: instead of re-deriving ATen's memory-format rules (cat's "all inputs
channels_last_3d or contiguous", F.pad's suggest_memory_format, clone's preserve_format,
TensorIterator's stride permutation for the add, with all their size-1 corner cases), we
run the reference on meta tensors with the same shapes/strides and copy the strides it
reports (tests check this against real ATen over random layouts); cached per geometry, so
it costs nothing in the decode loop. The validation helpers here are shared with `wan_vae_triton`.
"""

from __future__ import annotations

import functools

import torch

from . import wan_vae_reference as _ref

# ----------------------------------------------------------------------------- layout


def _channels_last_3d_like(t: torch.Tensor) -> bool:
    """ATen's is_channels_last_strides_3d (the test behind Tensor.suggest_memory_format)."""
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    lo = 0
    for d in (1, 4, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < lo:
            return False
        if d == 0 and lo == strides[1]:  # ambiguous N111-like: ATen falls back to NCDHW
            return False
        lo = strides[d] * sizes[d] if sizes[d] > 1 else strides[d]
    return True


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """The memory format ATen picks for outputs derived from `t` (suggest_memory_format)."""
    return torch.channels_last_3d if _channels_last_3d_like(t) else torch.contiguous_format


def _geom(t):
    """Hashable (shape, strides, dtype) for the layout caches."""
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype)


def _meta_like(geom):
    shape, strides, dtype = geom
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


@functools.lru_cache(maxsize=4096)
def _cat_pad_layout(x_geom, cache_geom, padding, keep):
    x = _meta_like(x_geom)
    cache = None if cache_geom is None else _meta_like(cache_geom)
    padded, new_cache = _ref.cat_pad_5d(x, cache, padding, keep)
    nc = None if new_cache is None else (tuple(new_cache.shape), new_cache.stride())
    return (tuple(padded.shape), padded.stride()), nc


def cat_pad_layouts(x, cache, padding, keep):
    """((padded shape, strides), (new_cache shape, strides) or None) as the reference makes them."""
    return _cat_pad_layout(_geom(x), _geom(cache), padding, keep)


def _dense(shape, strides):
    """ATen's is_non_overlapping_and_dense (size-1 dims are free)."""
    need = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides) if sz > 1):
        if stride != need:
            return False
        need *= size
    return True


@functools.lru_cache(maxsize=1024)
def _add_strides(shape, main_strides, main_contig, source_geom, dup_args):
    # the shortcut exactly as DupUp3D makes it (its views give size-1 dims odd strides)
    shortcut = _ref.dup_up3d(_meta_like(source_geom), shape[1], *dup_args)
    sc_strides = shortcut.stride()
    if main_contig and shortcut.is_contiguous():  # fast setup: all contiguous
        return torch.empty(shape, device="meta").stride()
    if _dense(shape, main_strides) and _dense(shape, sc_strides) and main_strides == sc_strides:
        return sc_strides  # fast setup: all dense with equal strides

    def should_swap(d0, d1):  # 1: d0 is outer of d1, -1: inner, 0: undecided
        for st in (main_strides, sc_strides):
            if st[d0] == 0 or st[d1] == 0:
                continue
            if st[d0] != st[d1]:
                return 1 if st[d0] > st[d1] else -1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(range(len(shape)))[::-1]  # perm[0] is the fastest-moving dim
    for i in range(1, len(perm)):  # reorder_dimensions' insertion sort
        d1 = i
        for d0 in range(i - 1, -1, -1):
            cmp = should_swap(perm[d0], perm[d1])
            if cmp > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif cmp < 0:
                break
    strides, step = [0] * len(shape), 1
    for d in perm:
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


def add_strides(main, source, factor_t, factor_s, repeats, drop_first):
    """Output strides of the reference's `main + DupUp3D(source)`.

    Mirrors ATen's TensorIterator: fast setup (all contiguous -> contiguous; all dense with
    equal strides -> those), else reorder_dimensions (order dims by main's strides, ties
    broken by the shortcut's, then equal strides -> smaller size inner) and dense strides in
    that order. So a channels_last_3d (or T-major) main + contiguous shortcut keeps main's
    layout. Meta tensors can't be asked here: their add breaks size-1 ties differently
    for fp16/bf16 (seen with a T-major main and one frame)."""
    return _add_strides(
        tuple(main.shape),
        main.stride(),
        main.is_contiguous(),
        _geom(source),
        (factor_t, factor_s, repeats, bool(drop_first)),
    )


# ----------------------------------------------------------------------------- validation


def check_cat_pad(x, cache, padding, keep_cache_frames):
    """Validate cat_pad_5d's inputs; return (padding tuple, cache_used, temporal front pad left)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        raise ValueError(f"cat_pad_5d: x must be a 5-D [B,C,T,H,W] tensor, got {getattr(x, 'shape', type(x))}")
    if x.shape[2] == 0 or x.numel() == 0:
        raise ValueError(f"cat_pad_5d: x must be non-empty, got shape {tuple(x.shape)}")
    padding = tuple(int(p) for p in padding)
    if len(padding) != 6 or min(padding) < 0:
        raise ValueError(f"cat_pad_5d: padding must be 6 non-negative ints (F.pad order), got {padding}")
    if not isinstance(keep_cache_frames, int) or keep_cache_frames < 0:
        raise ValueError(f"cat_pad_5d: keep_cache_frames must be an int >= 0, got {keep_cache_frames!r}")
    used = cache is not None and padding[4] > 0  # diffusers ignores the cache without temporal pad
    if cache is not None:
        if not isinstance(cache, torch.Tensor) or cache.dim() != 5:
            raise ValueError("cat_pad_5d: cache must be None or a 5-D [B,C,Tc,H,W] tensor")
        if cache.shape[:2] != x.shape[:2] or cache.shape[3:] != x.shape[3:]:
            raise ValueError(
                f"cat_pad_5d: cache {tuple(cache.shape)} does not match x {tuple(x.shape)} outside the time dim"
            )
        if cache.dtype != x.dtype:
            raise ValueError(f"cat_pad_5d: dtype mismatch, x {x.dtype} vs cache {cache.dtype}")
        if cache.device != x.device:
            # diffusers moves the cache (cache.to(x.device)); a transfer is nothing to fuse
            raise ValueError(f"cat_pad_5d: device mismatch, x on {x.device} vs cache on {cache.device}")
        if used and memory_format_of(cache) != memory_format_of(x):
            # ATen's cat would silently fall back to NCDHW; the decoder never mixes, so refuse
            raise ValueError(
                "cat_pad_5d: mixed memory formats (x "
                f"{memory_format_of(x)}, cache {memory_format_of(cache)}); use the reference"
            )
        if used and cache.shape[2] > padding[4]:
            # F.pad would crop cache frames (negative pad); diffusers never does this
            raise ValueError(f"cat_pad_5d: cache has {cache.shape[2]} frames, more than the temporal pad {padding[4]}")
    front = padding[4] - (cache.shape[2] if used else 0)
    return padding, used, front


def check_dup_up3d_add(main, source, factor_t, factor_s, repeats, drop_first):
    """Validate dup_up3d_add's inputs; return (full shortcut shape, frames dropped in front)."""
    for name, t in (("main", main), ("source", source)):
        if not isinstance(t, torch.Tensor) or t.dim() != 5:
            raise ValueError(f"dup_up3d_add: {name} must be a 5-D [B,C,T,H,W] tensor")
    if main.dtype != source.dtype:
        raise ValueError(f"dup_up3d_add: dtype mismatch, main {main.dtype} vs source {source.dtype}")
    if main.device != source.device:
        raise ValueError(f"dup_up3d_add: device mismatch, main on {main.device} vs source on {source.device}")
    if min(factor_t, factor_s, repeats) < 1:
        raise ValueError("dup_up3d_add: factor_t, factor_s and repeats must be >= 1")
    b, cin, t, h, w = source.shape
    cout = main.shape[1]
    if cout * factor_t * factor_s * factor_s != cin * repeats:
        raise ValueError(
            f"dup_up3d_add: out_channels*factor ({cout}*{factor_t * factor_s * factor_s}) != "
            f"in_channels*repeats ({cin}*{repeats})"
        )
    drop = factor_t - 1 if drop_first else 0
    full = (b, cout, t * factor_t, h * factor_s, w * factor_s)
    if tuple(main.shape) != (b, cout, full[2] - drop, full[3], full[4]):
        raise ValueError(
            f"dup_up3d_add: main {tuple(main.shape)} does not match DupUp3D(source "
            f"{tuple(source.shape)}) of shape {(b, cout, full[2] - drop, full[3], full[4])}"
        )
    return full, drop


def supports(device) -> bool:
    """Plain torch: any device."""
    return True


# ----------------------------------------------------------------------------- ops


def cat_pad_5d(x, cache, padding, keep_cache_frames=0):
    """Fused `F.pad(torch.cat([cache, x], 2), pad)` (+ diffusers' next cache_x).

    Same values and strides as `wan_vae_reference.cat_pad_5d`. When there is nothing to
    pad and no cache is used (1x1x1 convs) `padded` is x itself (F.pad would return a
    clone with identical strides; Conv3d never writes its input, so the copy is skipped).
    Mixed memory formats, a device mismatch or a cache longer than the pad raise ValueError.
    """
    padding, used, front = check_cat_pad(x, cache, padding, keep_cache_frames)
    (shape, strides), nc_layout = cat_pad_layouts(x, cache, padding, keep_cache_frames)
    wl, wr, ht, hb, _, tb = padding
    tc = cache.shape[2] if used else 0

    if not used and not any(padding) and strides == x.stride():
        padded = x
    else:
        padded = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
        t_end = front + tc + x.shape[2]
        h_end, w_end = ht + x.shape[3], wl + x.shape[4]
        inner = padded[:, :, front:t_end, ht:h_end, wl:w_end]
        if tc:
            inner[:, :, :tc].copy_(cache)
        inner[:, :, tc:].copy_(x)
        # zero only the borders: temporal front/back, then h and w bands of the real frames
        padded[:, :, :front].zero_()
        padded[:, :, t_end:].zero_()
        frames = padded[:, :, front:t_end]
        frames[:, :, :, :ht].zero_()
        frames[:, :, :, h_end:].zero_()
        frames[:, :, :, ht:h_end, :wl].zero_()
        frames[:, :, :, ht:h_end, w_end:].zero_()

    new_cache = None
    if keep_cache_frames:
        new_cache = torch.empty_strided(*nc_layout, dtype=x.dtype, device=x.device)
        kx = min(keep_cache_frames, x.shape[2])
        new_cache[:, :, new_cache.shape[2] - kx :].copy_(x[:, :, x.shape[2] - kx :])
        if new_cache.shape[2] > kx:  # diffusers prepends the previous cache's last frame
            new_cache[:, :, :1].copy_(cache[:, :, -1:])
    return padded, new_cache


@functools.lru_cache(maxsize=256)
def _channel_groups(cout, cin, factor, repeats):
    """Source channel of each (out channel, sub-offset k): (co*factor + k) // repeats.

    Returns, per k, a key describing that channel map, so sub-offsets sharing a map are
    added with one broadcast view: ("slice", start, step) or ("index", tuple)."""
    keys = []
    for k in range(factor):
        chans = [(co * factor + k) // repeats for co in range(cout)]
        step = chans[1] - chans[0] if cout > 1 else 1
        if step > 0 and all(c == chans[0] + i * step for i, c in enumerate(chans)):
            keys.append(("slice", chans[0], step))
        else:
            keys.append(("index", tuple(chans)))
    return tuple(keys)


def _source_channels(source, key, cout):
    if key[0] == "slice":
        _, start, step = key
        return source[:, start : start + step * (cout - 1) + 1 : step]
    return source.index_select(1, torch.tensor(key[1], device=source.device))


def dup_up3d_add(main, source, factor_t, factor_s, repeats, drop_first):
    """`main + DupUp3D(source, first_chunk=drop_first)` without materialising the repeat.

    Writes a new tensor with exactly the strides ATen's add would give (main is not
    modified). Sub-offsets (t, h, w) that read the same source channels are added through
    one broadcast view; otherwise a loop over the <= factor_t*factor_s^2 sub-offsets.
    """
    full, drop = check_dup_up3d_add(main, source, factor_t, factor_s, repeats, drop_first)
    out = torch.empty_strided(
        main.shape,
        add_strides(main, source, factor_t, factor_s, repeats, drop_first),
        dtype=main.dtype,
        device=main.device,
    )
    b, cout = main.shape[:2]
    ft, fs = factor_t, factor_s
    keys = _channel_groups(cout, source.shape[1], ft * fs * fs, repeats)
    t_src, h, w = source.shape[2:]

    def split(t, n):  # (b, co, n, H*fs, W*fs) -> (b, co, n, H, fs, W, fs): a view for any strides
        return t.unflatten(3, (h, fs)).unflatten(5, (w, fs))

    if not drop and len(set(keys)) == 1:
        # one add: every sub-offset reads the same channels (Wan 2.2's (2,2,8) blocks)
        s = _source_channels(source, keys[0], cout)[:, :, :, None, :, None, :, None]
        o = out.unflatten(2, (t_src, ft)).unflatten(4, (h, fs)).unflatten(6, (w, fs))
        m = main.unflatten(2, (t_src, ft)).unflatten(4, (h, fs)).unflatten(6, (w, fs))
        torch.add(m, s, out=o)
        return out

    for it in range(ft):
        # full frame t*ft + it lands at output frame t*ft + it - drop; frame 0 may be dropped
        t0 = 1 if it < drop else 0
        n = t_src - t0
        if n <= 0:
            continue
        start = t0 * ft + it - drop
        o, m = split(out[:, :, start::ft], n), split(main[:, :, start::ft], n)
        sub = keys[it * fs * fs : (it + 1) * fs * fs]
        if len(set(sub)) == 1:  # all (h, w) sub-offsets share channels: broadcast both
            s = _source_channels(source, sub[0], cout)[:, :, t0:, :, None, :, None]
            torch.add(m, s, out=o)
            continue
        for ih in range(fs):
            row = sub[ih * fs : (ih + 1) * fs]
            if len(set(row)) == 1:  # e.g. Wan 2.2's (1,2,2): channel 2*co + ih, w broadcast
                s = _source_channels(source, row[0], cout)[:, :, t0:, :, :, None]
                torch.add(m[:, :, :, :, ih], s, out=o[:, :, :, :, ih])
                continue
            for iw in range(fs):
                s = _source_channels(source, row[iw], cout)[:, :, t0:]
                torch.add(m[:, :, :, :, ih, :, iw], s, out=o[:, :, :, :, ih, :, iw])
    return out
