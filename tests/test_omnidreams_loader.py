"""OmniDreams checkpoint loading: inferred config, fusions, strict validation, safe unpickling."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo.backends import resolve_dtype
from omnivideo.models.omnidreams.dit import OmniDreamsConfig, OmniDreamsDiT, patchify
from omnivideo.models.omnidreams.loader import (
    CheckpointError,
    build_dit,
    final_rows_to_model,
    final_rows_to_storage,
    infer_config,
    load_omnidreams,
    read_state_dict,
)

CPU = torch.device("cpu")


def test_full_size_key_count_and_inferred_config():
    with torch.device("meta"):
        model = OmniDreamsDiT(OmniDreamsConfig())
    sd = model.state_dict()
    assert len(sd) == 570
    stored = {k: torch.empty(v.shape, device="meta") for k, v in sd.items()}
    stored["x_embedder.proj.1.weight"] = torch.empty(2048, 72, device="meta")
    cfg = infer_config(stored)
    assert cfg == OmniDreamsConfig()
    assert tuple(sd["crossattn_proj.0.weight"].shape) == (1024, 100352) and "crossattn_proj.0.bias" in sd
    assert tuple(sd["final_layer.adaln_modulation.2.weight"].shape) == (4096, 256)
    assert tuple(sd["t_embedder.1.linear_2.weight"].shape) == (6144, 2048)


def test_tiny_inferred_config():
    assert infer_config(stored_state_dict()) == TINY


def test_padding_columns_dropped_and_final_rows_reordered():
    sd = stored_state_dict()
    sd["x_embedder.proj.1.weight"][:, -4:] = 7.0  # the padding-mask channel is zero: these never count
    model = build_dit(sd, torch.float32)
    assert model.x_embedder.proj[1].weight.shape == (64, 68)
    torch.testing.assert_close(model.x_embedder.proj[1].weight, sd["x_embedder.proj.1.weight"][:, :68])
    w = sd["final_layer.linear.weight"]
    assert torch.equal(final_rows_to_storage(final_rows_to_model(w, TINY), TINY), w)
    # stored row (kt=0, kh=1, kw=0, c=3) -> model row (c=3, kt=0, kh=1, kw=0)
    assert torch.equal(model.final_layer.linear.weight[3 * 4 + 2], w[2 * 16 + 3])


def test_fused_model_equals_the_stored_layout_network():
    """Embedding with the padding-mask channel (zeros) and unpatchifying (kt kh kw c) rows by hand
    gives what the fused model computes."""
    sd = stored_state_dict()
    model = build_dit(sd, torch.float32)
    x = torch.randn(1, 16, 2, 4, 4)
    mask = torch.zeros(1, 1, 2, 4, 4)
    mask[:, :, 0] = 1
    stored_in = torch.cat([x, mask, torch.zeros_like(mask)], dim=1)  # latent, condition mask, padding mask
    emb_stored = patchify(stored_in, 2, 1) @ sd["x_embedder.proj.1.weight"].T
    tokens = torch.cat([patchify(x, 2, 1), patchify(mask, 2, 1)], -1)
    torch.testing.assert_close(model.x_embedder(tokens), emb_stored)
    hidden = torch.randn(1, 8, 64)
    rows_stored = (hidden @ sd["final_layer.linear.weight"].T).reshape(1, 2, 2, 2, 2, 2, 16)  # t h w kh kw c
    by_hand = rows_stored.permute(0, 6, 1, 2, 4, 3, 5).reshape(1, 16, 2, 4, 4)
    from omnivideo.models.omnidreams.dit import unpatchify

    torch.testing.assert_close(unpatchify(model.final_layer.linear(hidden), 16, 2, 2, 2, 2, 1), by_hand)


@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
def test_load_from_file_with_prefix(tmp_path, ext):
    sd = stored_state_dict(prefix="net.")
    path = str(tmp_path / f"tiny{ext}")
    torch.save(sd, path) if ext == ".pt" else save_file(sd, path)
    model = load_omnidreams(path, torch.bfloat16, torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.config == TINY
    ref = build_dit(stored_state_dict(), torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def test_missing_unexpected_and_wrong_shape_are_named():
    sd = stored_state_dict()
    del sd["blocks.1.mlp.layer2.weight"]
    sd["blocks.0.extra.weight"] = torch.zeros(1)
    sd["blocks.0.cross_attn.k_proj.weight"] = torch.zeros(64, 31)
    with pytest.raises(CheckpointError) as err:
        build_dit(sd, torch.float32, name="broken.pt")
    msg = str(err.value)
    assert "broken.pt" in msg
    assert "missing (1): blocks.1.mlp.layer2.weight" in msg
    assert "unexpected (1): blocks.0.extra.weight" in msg
    assert "blocks.0.cross_attn.k_proj.weight (64, 31) (expected (64, 32))" in msg


def test_missing_inference_key_is_named():
    sd = stored_state_dict()
    del sd["blocks.0.self_attn.q_norm.weight"]
    with pytest.raises(CheckpointError, match="'blocks.0.self_attn.q_norm.weight' is missing"):
        infer_config(sd)


def test_bad_embedder_width():
    sd = stored_state_dict()
    sd["x_embedder.proj.1.weight"] = torch.zeros(64, 70)
    with pytest.raises(CheckpointError, match="70 input columns"):
        build_dit(sd, torch.float32)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ["OMNIDREAMS_PWNED"],))


def test_malicious_pickle_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("OMNIDREAMS_PWNED", str(marker))
    path = tmp_path / "evil.pt"
    torch.save({"x_embedder.proj.1.weight": torch.zeros(1), "payload": _Exploit()}, path)
    with pytest.raises(CheckpointError, match="refused to load"):
        read_state_dict(str(path))
    assert not marker.exists()


def test_non_tensor_dict_is_refused(tmp_path):
    path = tmp_path / "nested.pt"
    torch.save({"state_dict": {"a": torch.zeros(1)}}, path)
    with pytest.raises(CheckpointError, match="flat dict of tensors"):
        read_state_dict(str(path))


def test_dtype_choice():
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp16", CPU) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", CPU)
