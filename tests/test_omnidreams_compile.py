"""The OmniDreams AR loop under torch.compile: a DiT block traces without a graph break, every block shares one
compiled graph (recompiled once while the KV window fills, then never again), and the compiled rollout stays
within float tolerance of eager on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo.models.omnidreams.loader import build_dit
from omnivideo.pipelines import omnidreams as pipe

H, W = 4, 6
CPU = torch.device("cpu")
SIX_BLOCKS = dataclasses.replace(TINY, num_blocks=6)  # more blocks than dynamo's default recompile limit (8) / 2


@pytest.fixture(scope="module")
def model():
    return build_dit(stored_state_dict(SIX_BLOCKS, seed=1), torch.float32)


@pytest.fixture(scope="module")
def text():
    return torch.randn(1, 16, TINY.text_in_dim, generator=torch.Generator().manual_seed(3))


def _chunks(model, text, n, **kw):
    run = pipe.Rollout(model, text=text, latent_hw=(H, W), seed=5, device=CPU, **kw)
    try:
        return torch.cat([run.step() for _ in range(n)], dim=2)
    finally:
        run.close()


def test_a_block_traces_without_graph_breaks(model, text, monkeypatch):
    calls = []
    block = model.blocks[3]
    real = block.forward
    monkeypatch.setattr(block, "forward", lambda *a: (calls.append(a), real(*a))[1])
    run = pipe.Rollout(model, text=text, latent_hw=(H, W), seed=5, device=CPU)
    try:
        for _ in range(4):  # past the point where the window is full
            run.step()
        monkeypatch.undo()
        with torch.no_grad():
            explained = torch._dynamo.explain(block)(*calls[-1])
    finally:
        run.close()
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_blocks_share_a_graph_and_match_eager(model, text):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = _chunks(model, text, 5)
    compiled = _chunks(model, text, 5, compiled=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2, graphs  # one graph for all 6 blocks; one recompile while the window fills
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
