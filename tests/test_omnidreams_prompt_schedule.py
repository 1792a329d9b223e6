"""The prompt schedule (pipelines/omnidreams/prompt_schedule.py): its text parsed and refused clearly; its memory: each
distinct prompt is encoded once and shared by the entries that repeat it, the distinct prompts' embeddings are bounded
in bytes before anything is encoded, and the peak memory of a 256-entry schedule (node and sampler, in a fresh
process) stays near a one-entry schedule's. Its switches inside a rollout: test_omnidreams_resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.children import CHILD_CWD
from support.omnidreams_tiny import write_tiny_cosmos_reason1

from omnivideo.models.handles import OmniDreamsConditioning
from omnivideo.models.omnidreams import text as te
from omnivideo.nodes import omnidreams_text as nodes
from omnivideo.pipelines import omnidreams as pipe

WIDE_HIDDEN, WIDE_LAYERS = 256, 80  # a full_concat width of 20480: 40 MiB per prompt, which dominates the peak


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    folder = write_tiny_cosmos_reason1(tmp_path_factory.mktemp("cosmos_reason1_tiny"))
    return te.load_text_encoder(str(folder), torch.float32, torch.device("cpu"))


def _spy_encode(monkeypatch, encode=None) -> list[str]:
    prompts: list[str] = []

    def spy(encoder, prompt):
        prompts.append(prompt)
        return encode(encoder, prompt) if encode else torch.zeros(1)

    monkeypatch.setattr(nodes, "encode_prompt", spy)
    return prompts


def test_prompt_schedule_parses_and_refuses_clearly():
    assert pipe.parse_prompt_schedule("0: a red car, at dusk, 40: rain starts\n90:night") == [
        (0, "a red car, at dusk"),
        (40, "rain starts"),
        (90, "night"),
    ]
    for bad, why in [
        ("a car", "must start with a chunk index"),
        ("0: a car, 0: again", "must increase"),
        ("0: a car, 5:", "entry for chunk 5 is empty"),
        ("0: x" * 20000, "at most"),
    ]:
        with pytest.raises(ValueError, match=why):
            pipe.parse_prompt_schedule(bad)


def test_identical_prompts_are_encoded_once_and_shared(encoder, monkeypatch):
    real = te.encode_prompt
    cond = OmniDreamsConditioning(text=real(encoder, "a car"))
    prompts = _spy_encode(monkeypatch, real)
    schedule = "0: a car\n4: night\n8:  a car \n12: night, 16: street"
    out = nodes.OmniDreamsPromptSchedule.execute(cond, encoder, schedule)[0]
    assert prompts == ["a car", "night", "street"]  # after strip, in the order they first appear
    assert [k for k, _ in out.prompt_schedule] == [4, 8, 12, 16]
    (_, night), (_, car), (_, night_again), (_, street) = out.prompt_schedule
    assert car is out.text and night_again is night  # one tensor per prompt, also shared with chunk 0's text
    assert torch.equal(night, real(encoder, "night")) and torch.equal(street, real(encoder, "street"))
    assert te.embedding_bytes(encoder) == out.text.nbytes  # the size the byte bound counts, known before encoding


def _encoder_7b() -> te.TextEncoder:
    """A stand-in with Cosmos-Reason1 7B's config and no weights: its embedding is 512 x 28 x 3584 float32."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(text_config=dict(hidden_size=3584, num_hidden_layers=28))
    return te.TextEncoder(SimpleNamespace(model=SimpleNamespace(module=SimpleNamespace(config=config))), None, "")


def test_too_many_distinct_prompts_are_refused_before_encoding(monkeypatch):
    encoder = _encoder_7b()
    assert te.embedding_bytes(encoder) == 512 * 100352 * 4  # 196 MiB
    cond = OmniDreamsConditioning(text=torch.zeros(1))
    prompts = _spy_encode(monkeypatch)
    schedule = ", ".join(f"{k}: prompt {k % 21}" for k in range(256))  # 21 distinct prompts in 256 entries
    with pytest.raises(ValueError) as refused:
        nodes.OmniDreamsPromptSchedule.execute(cond, encoder, schedule)
    message = str(refused.value)
    assert "21 distinct prompts" in message and "196 MiB each" in message and "limit of 4 GiB" in message
    assert "use at most 20 distinct prompts" in message
    assert prompts == []  # refused before the encoder ran
    assert nodes.OmniDreamsPromptSchedule.validate_inputs(schedule=schedule) is True  # parsing alone stays cheap

    schedule = ", ".join(f"{k}: prompt {k % 20}" for k in range(256))  # 20 fit
    out = nodes.OmniDreamsPromptSchedule.execute(cond, encoder, schedule)[0]
    assert len(prompts) == 20 and len({id(t) for _, t in out.prompt_schedule}) == 20


CHILD = """
import dataclasses, gc, json, sys
from pathlib import Path
import torch
from omnivideo import compat
from omnivideo.models.handles import OmniDreamsModel
from omnivideo.models.omnidreams import text as te
from omnivideo.models.omnidreams.loader import build_dit
from omnivideo.nodes.omnidreams_text import OmniDreamsPromptSchedule, OmniDreamsTextEncode
from omnivideo.pipelines import omnidreams as pipe
from omnivideo.selftest.tiny.omnidreams import TINY, stored_state_dict

def rss(field):
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024

torch.set_num_threads(1)
folder, schedule = sys.argv[1:]
cpu = torch.device("cpu")
encoder = te.load_text_encoder(folder, torch.float32, cpu)
width = te.embedding_bytes(encoder) // (te.MAX_TOKENS * 4)
dit = build_dit(stored_state_dict(dataclasses.replace(TINY, text_in_dim=width)), torch.bfloat16)
model = OmniDreamsModel(patcher=compat.manage(dit, "diffusion", cpu), dtype=torch.bfloat16)
cond = OmniDreamsTextEncode.execute(encoder, "a car")[0]  # the workflow: Text Encode -> Prompt Schedule -> Sampler
# a first run (one prompt) pages in the code and the allocator's pools, which would count as growth otherwise
pipe.sample(model, OmniDreamsPromptSchedule.execute(cond, encoder, "0: warm up")[0], seed=1, frames=45, steps=0,
            width=48, height=32)
gc.collect()
ready = rss("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts over from here
scheduled = OmniDreamsPromptSchedule.execute(cond, encoder, schedule)[0]
z = pipe.sample(model, scheduled, seed=1, frames=45, steps=0, width=48, height=32)
print("RESULT " + json.dumps({"peak": rss("VmHWM") - ready, "embedding": te.embedding_bytes(encoder),
                              "chunks": z.shape[2] // 2, "finite": bool(z.isfinite().all())}))
"""


def _peak(folder: str, schedule: str) -> dict:
    # glibc serves mid-sized blocks from its heap once the mmap threshold has grown past them, and how much of a
    # freed heap goes back to the system varies from run to run; a fixed 1 MiB threshold maps every large block and
    # unmaps it when freed, so the high-water mark counts the memory that was live together
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, folder, schedule],
        cwd=CHILD_CWD,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"the child failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads VmHWM from /proc (Linux)")
def test_long_schedule_peak_memory_stays_near_one_entry(tmp_path):
    folder = str(write_tiny_cosmos_reason1(tmp_path / "wide", hidden=WIDE_HIDDEN, layers=WIDE_LAYERS))
    one = _peak(folder, "0: a car")
    # 256 entries, the prompt switching at every chunk of the rollout: two distinct prompts
    prompts = ("night", "a car drives")
    long = _peak(folder, ", ".join(f"{k}: {prompts[k % 2]}" for k in range(pipe.MAX_PROMPT_SCHEDULE_ENTRIES)))
    embedding = one["embedding"]
    assert embedding == 512 * WIDE_HIDDEN * WIDE_LAYERS * 4
    assert one["chunks"] == long["chunks"] == 6 and one["finite"] and long["finite"]
    assert one["peak"] >= embedding  # the embedding dominates what is measured
    # one more distinct prompt is one more embedding (held while the next is encoded) and its encode's working set,
    # not 255 more embeddings; the high-water mark of one process moves by a few embeddings from run to run
    assert long["peak"] < 2 * one["peak"] + 2 * embedding, (one, long)
