"""integration/attention_patch.py beside other attention patches: the calls it declines go to the override that was on
the MODEL before it (or the call's preferred backend), what else decides is said once, and two threads running the
patched MODEL at once (core's MultiGPU CFG Split: clones sharing one patch) get what they get one after the other."""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest
import torch
from test_attention_nodes import CFG, FakeModelPatcher, H, comfy_original, patched_model, qkv, run_forward

from omnivideo.backends.log_once import forget
from omnivideo.integration import attention_patch
from omnivideo.nodes.attention import OmniVideoPatchModelAttention
from omnivideo.nodes.backend_info import OmniVideoBackendInfo


class Foreign:
    """A stand-in for another pack's (or core's Model Attention Backend) override: counts, then runs ComfyUI's
    function, or chains to the override below it as core's Model Sparse Attention does."""

    def __init__(self, below=None):
        self.calls, self.below = 0, below

    def __call__(self, func, *args, **kwargs):
        self.calls += 1
        return func(*args, **kwargs) if self.below is None else self.below(func, *args, **kwargs)


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(attention_patch, "_notes", {})
    monkeypatch.setattr(comfy_original, "calls", 0, raising=False)
    forget()


def _ours_on(model: FakeModelPatcher):
    patched = OmniVideoPatchModelAttention.execute(model, CFG).args[0]
    ((wrapper,),) = patched.wrappers["diffusion_model"].values()
    return patched, patched.model_options["transformer_options"]["optimized_attention_override"], wrapper


def _cross_then_self(override, q, k, v, ctx):
    return lambda o: (
        override(comfy_original, q, ctx, ctx, heads=H, transformer_options=o),
        override(comfy_original, q, k, v, heads=H, transformer_options=o),
    )


def test_declined_calls_go_to_the_override_installed_before_ours(caplog):
    model = FakeModelPatcher()
    model.model_options["transformer_options"]["optimized_attention_override"] = Foreign()
    with caplog.at_level("INFO", logger="omnivideo"):
        patched, override, wrapper = _ours_on(model)
    below = override.__self__.previous  # the clone's copy of it (the fake clone deep-copies model_options)
    assert isinstance(below, Foreign)
    q, k, v = qkv()
    ctx = torch.randn(1, 77, H * 16)
    cross, ours = run_forward(wrapper, _cross_then_self(override, q, k, v, ctx), {})
    assert below.calls == 1  # the cross-attention call, not the self-attention call ours took
    assert torch.equal(cross, comfy_original(q, ctx, ctx, H))
    assert override.__self__.stats.sparse_calls == 1
    assert "installed before it: test_attention_patch.Foreign" in caplog.text, caplog.text
    # patching the patched MODEL again replaces ours and keeps the one below
    again = OmniVideoPatchModelAttention.execute(patched, CFG).args[0]
    assert again.model_options["transformer_options"]["optimized_attention_override"].__self__.previous is below


def test_an_override_above_ours_and_replaced_blocks_are_said_once_and_in_backend_info():
    patched, override, wrapper = _ours_on(FakeModelPatcher())
    above = Foreign(below=override)  # installed after ours, chaining down (core's sparse attention does so)
    opts = patched.model_options["transformer_options"]
    opts["optimized_attention_override"] = above
    opts["patches_replace"] = {"dit": {("double_block", 0): object(), ("double_block", 1): object()}}
    q, k, v = qkv()
    for _ in range(2):
        run_forward(wrapper, lambda o: above(comfy_original, q, k, v, heads=H, transformer_options=o), dict(opts))
    assert above.calls == 2 and override.__self__.stats.sparse_calls == 2
    report = OmniVideoBackendInfo.execute().args[0]
    assert "sits above it and decides first: test_attention_patch.Foreign" in report, report
    assert "2 double_block block(s) are replaced by another patch" in report, report
    assert len(attention_patch._notes) == 2  # said once, not once per forward


def test_the_calls_preferred_backend_answers_a_declined_call_without_an_override_below():
    _, override, wrapper = patched_model(CFG)
    preferred = types.SimpleNamespace(calls=0)

    def backend(q, k, v, heads, **kwargs):
        preferred.calls += 1
        assert "preferred_attention" not in kwargs
        return comfy_original(q, k, v, heads, **kwargs)

    preferred.function = backend
    q, k, v = qkv()
    ctx = torch.randn(1, 77, H * 16)
    run_forward(
        wrapper,
        lambda o: override(comfy_original, q, ctx, ctx, heads=H, transformer_options=o, preferred_attention=preferred),
        {},
    )
    assert preferred.calls == 1


def _forward(override, wrapper, x: torch.Tensor, layers: int, barrier: threading.Barrier) -> torch.Tensor:
    """A DiT-like forward: `layers` self-attention calls, each thread waiting for the other between them."""

    def body(opts):
        h = x
        for layer in range(layers):
            barrier.wait(timeout=60)
            h = override(comfy_original, h, h * 0.5, h, heads=H, transformer_options=opts) + h
            assert opts[attention_patch.ROWS_KEY]["layer"] == layer + 1
        return h

    return run_forward(wrapper, body, {"block_index": None})


def test_two_threads_running_the_patched_model_at_once_equal_running_it_one_after_the_other():
    _, override, wrapper = patched_model(dataclasses.replace(CFG, sparsity=0.5, skip_layers="1"))
    inputs = [qkv(seed=seed)[0] for seed in (1, 2)]
    alone = [_forward(override, wrapper, x, 3, threading.Barrier(1)) for x in inputs]
    stats = override.__self__.stats
    once = (stats.sparse_calls, dict(stats.dense_calls))
    assert once == (4, {"skip_layers": 2})  # layer 1 is in skip_layers: dense, the others sparse

    results: list = [None, None]
    barrier = threading.Barrier(2)  # both forwards in lock step: layer i of one, then layer i of the other

    def run(i):
        results[i] = _forward(override, wrapper, inputs[i], 3, barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(results, alone)), [
        float((a - b).abs().max()) for a, b in zip(results, alone)
    ]
    assert (stats.sparse_calls, dict(stats.dense_calls)) == (8, {"skip_layers": 4})
