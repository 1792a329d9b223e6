"""Wan VAE decode data movement, exactly as diffusers 0.42.1 does it (the oracle).

`cat_pad_5d` is `WanCausalConv3d.forward`'s input preparation plus the `cache_x`
bookkeeping of the cached call sites; `dup_up3d_add` is `WanResidualUpBlock`'s
`x + DupUp3D(x_copy, first_chunk)`. Same ops, same order, so same values and strides.
The fused twins (`wan_vae_torch`, `wan_vae_triton`) are tested against this module, by the tests and by the
self-test's kernel checks (it is the module of the registry's `off`, the end of their fallback chain).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(device) -> bool:
    """Plain torch: any device."""
    return True


def cat_pad_5d(x, cache, padding, keep_cache_frames=0):
    """Return (padded conv input, next cache or None) like diffusers' cached conv call."""
    pad = list(padding)
    if cache is not None and padding[4] > 0:  # 1x1x1 convs (no temporal pad) ignore the cache
        cache = cache.to(x.device)
        xin = torch.cat([cache, x], dim=2)
        pad[4] -= cache.shape[2]
    else:
        xin = x
    padded = F.pad(xin, pad)

    new_cache = None
    if keep_cache_frames:
        new_cache = x[:, :, -keep_cache_frames:].clone()
        if new_cache.shape[2] < keep_cache_frames and cache is not None:
            # diffusers: cat([feat_cache[idx][:, :, -1].unsqueeze(2), cache_x], 2)
            new_cache = torch.cat([cache[:, :, -1:].to(new_cache.device), new_cache], dim=2)
    return padded, new_cache


def dup_up3d(source, out_channels, factor_t, factor_s, repeats, drop_first):
    """diffusers' DupUp3D.forward (repeat_interleave + view + permute + contiguous)."""
    x = source.repeat_interleave(repeats, dim=1)
    x = x.view(x.size(0), out_channels, factor_t, factor_s, factor_s, x.size(2), x.size(3), x.size(4))
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()
    x = x.view(x.size(0), out_channels, x.size(2) * factor_t, x.size(4) * factor_s, x.size(6) * factor_s)
    if drop_first:
        x = x[:, :, factor_t - 1 :, :, :]
    return x


def dup_up3d_add(main, source, factor_t, factor_s, repeats, drop_first):
    """main + DupUp3D(source, first_chunk=drop_first); a new tensor (ATen's add)."""
    return main + dup_up3d(source, main.shape[1], factor_t, factor_s, repeats, drop_first)
