"""What an OmniDreams worker holds (CPU, gloo): one DiT at a time (a model of another dtype or file evicts the one it
had) and only the current prompt, which rank 0 sends in the compute dtype at the step where it switches in; a rollout
whose prompt switches back and forth stays equal to the one-process rollout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.omnidreams_tiny import MID, TINY_4_HEADS, stored_state_dict

from omnivideo import compat
from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel
from omnivideo.models.omnidreams.loader import build_dit, weights_recipe
from omnivideo.parallel import pool as pool_mod
from omnivideo.parallel.world import World
from omnivideo.pipelines import omnidreams as pipe

H, W = 6, 6
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def stop_workers():
    torch.set_num_threads(1)  # the ranks share the 2 CI cores
    pool_mod.stop_pool()
    yield
    pool_mod.stop_pool()


def _checkpoint(tmp_path, config) -> Path:
    path = tmp_path / f"dit_{config.model_channels}.safetensors"
    if not path.exists():
        save_file(stored_state_dict(config, seed=1), str(path))
    return path


def _handle(path: Path, config, dtype: torch.dtype, world_size: int) -> OmniDreamsModel:
    dit = build_dit(stored_state_dict(config, seed=1), dtype)
    return OmniDreamsModel(
        patcher=compat.manage(dit, "diffusion", CPU),
        dtype=dtype,
        world_size=world_size,
        load_args=weights_recipe(str(path), dtype, dtype),
    )


def _sample(model, cond, frames: int):
    return pipe.sample(model, cond, seed=42, frames=frames, steps=0, width=W * 8, height=H * 8)


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc (Linux)")
def test_a_worker_holds_one_omnidreams_model_at_a_time(tmp_path):
    path = _checkpoint(tmp_path, MID)
    half_bytes = sum(t.numel() * 2 for t in stored_state_dict(MID, seed=1).values())  # bf16 / fp16: 69 MiB
    resident = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # one checkpoint, three dtypes in turn
        model = OmniDreamsModel(
            patcher=None, dtype=dtype, world_size=2, load_args=weights_recipe(str(path), dtype, dtype)
        )
        pool = pipe.ensure_workers(model)
        resident.append(_rss(pool.pids[0]))
        assert [k for k in pool.models if k.startswith(pipe.KEY_PREFIX)] == [pipe.model_key(model)]
    # fp32 weights stay mapped from the file (pages read as used); bf16 and fp16 are copies: holding both would add
    # two of them to what the worker had with the first model, the fp16 one replaces the bf16 one
    assert resident[2] - resident[0] < 1.5 * half_bytes, [r / 2**20 for r in resident]

    cond = OmniDreamsConditioning(
        text=torch.randn(1, 16, MID.text_in_dim, generator=torch.Generator().manual_seed(3)),
        hdmap=torch.zeros(1, 16, 2, H, W),
    )
    single = _sample(_handle(path, MID, torch.float32, 1), cond, frames=5)
    parallel = _sample(_handle(path, MID, torch.float32, 2), cond, frames=5)  # the workers load it again
    assert (parallel - single).abs().max() <= 1e-5  # as tests/test_omnidreams_parallel.py compares


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_are_sent_when_they_switch_in(tmp_path, monkeypatch, dtype):
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(1, 16, TINY_4_HEADS.text_in_dim, generator=g) for _ in range(3))
    cond = OmniDreamsConditioning(
        text=a,
        first_frame=torch.randn(1, 16, 1, H, W, generator=g),
        hdmap=torch.randn(1, 16, 12, H, W, generator=g),
        prompt_schedule=((1, b), (2, b), (3, a), (5, c)),  # b twice (one prompt), then a again, then c
    )
    path = _checkpoint(tmp_path, TINY_4_HEADS)
    single = _sample(_handle(path, TINY_4_HEADS, dtype, 1), cond, frames=45)

    sent = []
    real_send = World.send

    def spy(world, op, args=None, tensors=None):
        present = {name: t for name, t in (tensors or {}).items() if t is not None}
        sent.append((op, sorted(present), present.get("text")))
        real_send(world, op, args, tensors)

    monkeypatch.setattr(World, "send", spy)
    parallel = _sample(_handle(path, TINY_4_HEADS, dtype, 2), cond, frames=45)
    assert (parallel - single).abs().max() <= 1e-5

    rollout = [names for op, names, _ in sent if op == "omnidreams.rollout"]
    assert rollout == [["first_frame"]]  # no prompt up front
    steps = [text for op, _, text in sent if op == "step"]
    assert len(steps) == 6
    switched = {k: text for k, text in enumerate(steps) if text is not None}
    assert sorted(switched) == [0, 1, 3, 5]  # not at chunk 2 (the same prompt) nor 4
    for k, expected in ((0, a), (1, b), (3, a), (5, c)):
        assert switched[k].dtype == dtype and torch.equal(switched[k], expected.to(dtype))
