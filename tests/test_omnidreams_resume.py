"""The OmniDreams rollout stepped chunk by chunk and resumed from a saved state: N chunks in one run equal k chunks,
a saved state (through a .safetensors file) and N - k chunks in a fresh run, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo.models.omnidreams.loader import build_dit
from omnivideo.pipelines import omnidreams as pipe

H, W = 4, 6
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return build_dit(stored_state_dict(TINY, seed=1), torch.float32)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(3)
    text = torch.randn(1, 16, TINY.text_in_dim, generator=g)
    return text, torch.randn(1, 16, 1, H, W, generator=g), torch.randn(1, 16, 2 * 7, H, W, generator=g)


def _run(model, text, **kw) -> pipe.Rollout:
    return pipe.Rollout(model, text=text, latent_hw=(H, W), seed=11, device=CPU, **kw)


@pytest.mark.parametrize("split", [1, 2, 5])  # before, at and after the window (3 slots) fills
def test_resumed_rollout_equals_one_run_bit_for_bit(model, inputs, tmp_path, split):
    text, first, hdmap = inputs
    n = 7
    hd = lambda k: hdmap[:, :, 2 * k : 2 * k + 2]  # noqa: E731
    one = _run(model, text, first_frame=first)
    whole = torch.cat([one.step(hd(k)) for k in range(n)], dim=2)
    assert torch.equal(
        whole,
        pipe.rollout(model, text, num_chunks=n, latent_hw=(H, W), seed=11, first_frame=first, hdmap=hdmap, device=CPU),
    )  # the stepper is the rollout

    first_part = _run(model, text, first_frame=first)
    head = [first_part.step(hd(k)) for k in range(split)]
    save_file(first_part.state_dict(), str(tmp_path / "state.safetensors"))
    first_part.close()
    resumed = _run(model, text, first_frame=first)
    resumed.load_state_dict(load_file(str(tmp_path / "state.safetensors")))
    tail = [resumed.step(hd(k)) for k in range(split, n)]
    assert torch.equal(torch.cat(head + tail, dim=2), whole)


def test_state_from_another_size_is_refused_clearly(model, inputs):
    text, first, _ = inputs
    run = _run(model, text)
    run.step()
    other = pipe.Rollout(model, text=text, latent_hw=(H, 2 * W), seed=11, device=CPU)
    with pytest.raises(ValueError, match="resume with the model, size and window settings it was saved with"):
        other.load_state_dict(run.state_dict())


def test_prompt_schedule_switches_the_text_at_its_chunks(model, inputs):
    text, first, _ = inputs
    other = torch.randn(text.shape, generator=torch.Generator().manual_seed(9))
    run = lambda **kw: pipe.rollout(  # noqa: E731
        model, text, num_chunks=4, latent_hw=(H, W), seed=11, first_frame=first, device=CPU, **kw
    )
    plain, switched = run(), run(prompt_schedule=((2, other),))
    assert torch.equal(switched[:, :, :4], plain[:, :, :4])  # chunks 0-1: the first prompt
    assert not torch.equal(switched[:, :, 4:], plain[:, :, 4:])  # from chunk 2: the other prompt
    only_other = pipe.rollout(model, other, num_chunks=4, latent_hw=(H, W), seed=11, first_frame=first, device=CPU)
    assert not torch.equal(switched[:, :, 4:], only_other[:, :, 4:])  # the window still holds chunks of prompt 1
