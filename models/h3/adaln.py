"""The AdaLN modulations our H3 loader installs on diffusers' transformer: fp8 storage, and core's pruned files.

fp8 storage: the projections compute in the model's dtype (fp8 is a storage type, not one to compute in).

Pruned files (core 0.33 detects them by `adaln_t_table`) have no time embedder: their AdaLN projections read a
point on the time-embedding curve, sampled on a grid of t in [0, 1] (`adaln_t_table` [grid, k]) and interpolated
linearly between grid rows, without the SiLU of the unpruned model (the table holds activated values projected onto a
small basis: k columns instead of the full embedding's 2688, shrinking the 50 blocks' projections, ~13B parameters
unpruned, by k / 2688). Core computes those projections in fp32 and casts their output to the block dtype; so do we.
Everything else is the unpruned model.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormModulation,
    MiniMaxH3AdaLayerNormOut,
)
from torch import nn

TABLE_KEY = "adaln_t_table"  # core's key, top level of the transformer
OUR_TABLE_KEY = "time_embedder.adaln_t_table"  # where the table lives in our transformer (an fp32 island)


class CurveTimeEmbedding(nn.Module):
    """t in [0, 1] -> the table row at t · (grid − 1), linearly interpolated (t = 1 lands on the last interval's
    end), as core's `MiniMaxH3Model._forward` reads it."""

    def __init__(self, grid: int, dim: int):
        super().__init__()
        self.adaln_t_table = nn.Parameter(torch.empty(grid, dim), requires_grad=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        table = self.adaln_t_table
        position = t.to(table.dtype).clamp(0.0, 1.0) * (table.shape[0] - 1)
        lower = position.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[lower], table[lower + 1], (position - lower).unsqueeze(1))


def is_fp32_parameter(name: str) -> bool:
    """The AdaLN projections of a pruned model stay fp32, as core keeps them (`adaln_dtype`)."""
    return ".adaln_proj.linear." in f".{name}" or name.startswith("norm_out.linear.")


def install_modulation(
    module: MiniMaxH3AdaLayerNormModulation, compute_dtype: torch.dtype, output_dtype: torch.dtype, activation=None
) -> None:
    module.activation = activation or nn.SiLU()
    module.compute_dtype, module.output_dtype = compute_dtype, output_dtype
    module.forward = types.MethodType(_modulation_forward, module)


def _modulation_forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Copied from diffusers' MiniMaxH3AdaLayerNormModulation.forward, with the activation and the dtypes set by
    # `install_modulation` instead of the projection's parameter dtype.
    temb = self.linear(self.activation(temb).to(self.compute_dtype)).to(self.output_dtype)
    temb = temb.view(-1, 6 * self.hidden_size)
    return temb.chunk(6, dim=-1)


def adopt_curve_adaln(transformer: Any, grid: int, dtype: torch.dtype) -> Any:
    """Turn a freshly built transformer (config `time_embed_dim` = the table's k) into the pruned layout computing
    in `dtype`."""
    transformer.time_proj = nn.Identity()  # the sampler's t goes straight to the table
    transformer.time_embedder = CurveTimeEmbedding(grid, transformer.config.time_embed_dim)
    for module in transformer.modules():
        if isinstance(module, MiniMaxH3AdaLayerNormModulation):
            install_modulation(module, torch.float32, dtype, activation=nn.Identity())
        elif isinstance(module, MiniMaxH3AdaLayerNormOut):
            module.forward = types.MethodType(_norm_out_forward, module)
    transformer.fp32_parameter = is_fp32_parameter
    return transformer


def _norm_out_forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor):
    # Copied from diffusers' MiniMaxH3AdaLayerNormOut.forward without the SiLU, the projection in fp32 (core's
    # FinalLayer: the fp32 shift / scale promote the modulated rows to fp32 before the fp32 output heads).
    shift, scale = self.linear(temb.to(torch.float32)).chunk(2, dim=-1)
    hidden_states = self.norm(hidden_states)
    return hidden_states * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)
