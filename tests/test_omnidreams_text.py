"""Cosmos-Reason1 'full_concat' encoding with a tiny random Qwen2.5-VL and a tokenizer built here
(no downloads), and the precomputed-embedding file round trip."""

from __future__ import annotations

import pytest
import torch
from support.omnidreams_tiny import TEXT_HIDDEN as HIDDEN
from support.omnidreams_tiny import TEXT_LAYERS as LAYERS
from support.omnidreams_tiny import write_tiny_cosmos_reason1

from omnivideo.models.omnidreams import text as te


@pytest.fixture(scope="module")
def encoder_folder(tmp_path_factory):
    return str(write_tiny_cosmos_reason1(tmp_path_factory.mktemp("cosmos_reason1_tiny")))


@pytest.fixture(scope="module")
def encoder(encoder_folder):
    return te.load_text_encoder(encoder_folder, torch.float32, torch.device("cpu"))


def test_token_ids_chat_template_and_padding(encoder, monkeypatch):
    rendered = []
    real_template = encoder.tokenizer.apply_chat_template

    def spy(*args, **kw):
        rendered.append(real_template(*args, **kw))
        return rendered[-1]

    monkeypatch.setattr(encoder.tokenizer, "apply_chat_template", spy)
    ids = te.prompt_token_ids(encoder.tokenizer, "a car drives down the road")
    assert ids.shape == (1, 512)
    n = int((ids[0] != 0).sum())
    assert torch.all(ids[0, n:] == 0)  # padded with pad_token_id
    # the exact chat text: the full system prompt, the user turn, and NO generation prompt
    # (add_generation_prompt=True would append "<|im_start|>assistant\n")
    assert rendered == [
        "<|im_start|>system\nYou are a helpful assistant who will provide prompts to an image "
        "generator.<|im_end|>\n<|im_start|>user\na car drives down the road<|im_end|>\n"
    ]
    # ... and exactly its tokens (the tiny tokenizer is word-level: newlines vanish, "You" is not in its
    # lower-case vocabulary), ending with <|im_end|>
    expected = (
        "<|im_start|> system [UNK] are a helpful assistant who will provide prompts to an image generator . "
        "<|im_end|> <|im_start|> user a car drives down the road <|im_end|>"
    )
    assert encoder.tokenizer.decode(ids[0, :n]) == expected
    assert encoder.tokenizer.convert_ids_to_tokens(ids[0, :n].tolist()) == expected.split()


def test_full_concat_shape_no_mask_and_normalisation(encoder, monkeypatch):
    seen = {}
    real_forward = encoder.model.forward

    def spy(*args, **kw):
        seen.update(kw)
        return real_forward(*args, **kw)

    monkeypatch.setattr(encoder.model, "forward", spy)
    head_positions = []
    hook = encoder.model.lm_head.register_forward_hook(lambda m, args, out: head_positions.append(args[0].shape[1]))
    try:
        emb = te.encode_prompt(encoder, "a car drives down the road at night")
    finally:
        hook.remove()
    assert emb.shape == (1, 512, LAYERS * HIDDEN)
    assert seen.get("attention_mask") is None and seen["output_hidden_states"]
    assert all(n == 1 for n in head_positions)  # no [512, vocab] logits: at most one position reaches the head

    # independent reference: hidden_states[1:29], per-token (h - mean) / (unbiased std + 1e-8)
    ids = te.prompt_token_ids(encoder.tokenizer, "a car drives down the road at night")
    with torch.no_grad():
        states = real_forward(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(states) == LAYERS + 1
    for layer in (0, 13, LAYERS - 1):
        h = states[layer + 1][0].double()
        centred = h - h.mean(-1, keepdim=True)
        ref = centred / ((centred**2).sum(-1, keepdim=True) / (HIDDEN - 1)).sqrt()  # unbiased
        torch.testing.assert_close(emb[0, :, layer * HIDDEN : (layer + 1) * HIDDEN].double(), ref, rtol=1e-4, atol=1e-4)
    chunk = emb[0, :, :HIDDEN]
    torch.testing.assert_close(chunk.std(-1), torch.ones(512), rtol=1e-4, atol=1e-4)


def test_padding_positions_differ_without_mask(encoder):
    """Without a mask the padding tokens attend to the prompt: their states are not all equal."""
    emb = te.encode_prompt(encoder, "a car")
    n = int((te.prompt_token_ids(encoder.tokenizer, "a car")[0] != 0).sum())
    assert (emb[0, n] - emb[0, n + 5]).abs().max() > 1e-4


def test_embedding_file_round_trip(tmp_path):
    emb = torch.randn(1, 512, 24)
    path = te.save_embedding(str(tmp_path / "p.safetensors"), emb, "a prompt")
    torch.testing.assert_close(te.load_embedding(path), emb)
    from safetensors.torch import save_file

    save_file({"other": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="holds no"):
        te.load_embedding(str(tmp_path / "x.safetensors"))
    save_file({te.EMBEDDING_KEY: torch.zeros(1, 77, 24)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(ValueError, match="expected"):
        te.load_embedding(str(tmp_path / "y.safetensors"))


def test_missing_folder_is_explained(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        te.load_text_encoder(str(tmp_path), torch.float32, torch.device("cpu"))


def test_encoder_is_loaded_by_model_management_and_releases_activations(encoder_folder, monkeypatch):
    """The 7B encoder belongs to ComfyUI's model management: encode_prompt asks it to load the encoder
    (ComfyUI evicts it when the DiT needs room), runs on the load device and releases its activations
    (compat.free_memory), also when the forward fails."""
    enc = te.load_text_encoder(encoder_folder, torch.float32, torch.device("cpu"))
    assert enc.patcher.load_device == torch.device("cpu") and next(enc.model.parameters()).device.type == "cpu"
    log = []
    real_load, real_forward = te.compat.load_models, enc.model.forward
    monkeypatch.setattr(
        te.compat, "load_models", lambda ps, *a: (log.append(("load", [p.model.module for p in ps])), real_load(ps))[1]
    )
    monkeypatch.setattr(te.compat, "free_memory", lambda: log.append(("free",)))

    def forward(*args, **kw):
        log.append(("forward", str(kw["input_ids"].device)))
        return real_forward(*args, **kw)

    monkeypatch.setattr(enc.model, "forward", forward)
    te.encode_prompt(enc, "a car")
    assert log == [("load", [enc.model]), ("forward", "cpu"), ("free",)]

    log.clear()

    def failing(*args, **kw):
        log.append(("forward",))
        raise RuntimeError("out of memory")

    monkeypatch.setattr(enc.model, "forward", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        te.encode_prompt(enc, "a car")
    assert log == [("load", [enc.model]), ("forward",), ("free",)]  # released all the same


def test_prompt_schedule_node_encodes_each_prompt_once(encoder):
    from omnivideo.models.handles import OmniDreamsConditioning
    from omnivideo.nodes.omnidreams_text import OmniDreamsPromptSchedule

    first = torch.randn(1, 16, 1, 4, 6)
    cond = OmniDreamsConditioning(text=te.encode_prompt(encoder, "a car"), first_frame=first)
    node = OmniDreamsPromptSchedule
    out = node.execute(cond, encoder, "0: a car drives, down the road\n40: night")[0]
    assert torch.equal(out.text, te.encode_prompt(encoder, "a car drives, down the road"))
    assert [k for k, _ in out.prompt_schedule] == [40] and torch.equal(
        out.prompt_schedule[0][1], te.encode_prompt(encoder, "night")
    )
    assert out.first_frame is first  # the rest of the conditioning is kept
    later = node.execute(cond, encoder, "8: night")[0]  # no entry for chunk 0: the connected prompt holds until 8
    assert later.text is cond.text and [k for k, _ in later.prompt_schedule] == [8]
    assert "must start with a chunk index" in node.validate_inputs(schedule="night")
    assert node.validate_inputs(schedule="0: a, 3: b") is True


def test_the_loaders_device_cpu_keeps_the_encoder_on_the_cpu(comfy_folders, monkeypatch):
    """device 'cpu' (the 24-32 GB recipe): the encoder loads and offloads on the CPU whatever ComfyUI picks for text
    encoders, and encodes there in bf16; 'default' (and a workflow saved before the option) is ComfyUI's pick."""
    from omnivideo.compat import model_management
    from omnivideo.nodes import omnidreams_text as nodes

    write_tiny_cosmos_reason1(comfy_folders.models("text_encoders") / "cosmos_reason1_tiny")
    gpu = torch.device("cuda", 7)  # what ComfyUI would pick on a GPU machine; never used here
    monkeypatch.setattr(model_management, "_devices", lambda kind, default: (gpu, torch.device("cpu")))
    load = nodes.OmniDreamsTextEncoderLoader.execute
    assert load("cosmos_reason1_tiny", "bf16")[0].patcher.load_device == gpu
    assert load("cosmos_reason1_tiny", "bf16", "default")[0].patcher.load_device == gpu
    on_cpu = load("cosmos_reason1_tiny", "bf16", "cpu")[0]
    assert (on_cpu.patcher.load_device, on_cpu.patcher.offload_device) == (torch.device("cpu"), torch.device("cpu"))
    assert te.encode_prompt(on_cpu, "a car").shape == (1, 512, LAYERS * HIDDEN)
    with pytest.raises(ValueError, match="device must be one of default, cpu; got 'gpu'"):
        load("cosmos_reason1_tiny", "bf16", "gpu")
