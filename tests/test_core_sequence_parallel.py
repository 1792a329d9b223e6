"""OmniVideo Sequence Parallel (MODEL): ComfyUI's own Wan / MiniMax-H3 forwards split over ranks that are threads
(integration/core_sequence_parallel, parallel/threads), equal to one device through core's own sampling."""

import os
import threading
import time

import pytest
import torch
from support.comfy_probe import run_probe

from omnivideo.attention.sequence_parallel import SequenceShard
from omnivideo.nodes import node_classes
from omnivideo.parallel.threads import RankAborted, ThreadGroup, run_ranks

TOLERANCE = 1e-5  # fp32, same seed: the bound, relative to the output's scale


@pytest.mark.parametrize("size,rows", [(2, 10), (4, 11), (3, 7)])
def test_thread_ranks_trade_rows_for_heads_and_back(size, rows):
    """Ulysses between threads: every rank gets all rows of its heads (the full tensor's head slice), and back."""
    g = torch.Generator().manual_seed(size)
    full = torch.randn(2, rows, 2 * size, 8, generator=g)
    got: dict[int, tuple] = {}

    def body(rank, member):
        shard = SequenceShard(rank, size, member)
        heads = shard.to_heads(shard.split(full, 1), rows)
        got[rank] = (heads, shard.to_tokens(heads), shard.gather(shard.split(full, 1), 1, rows))

    run_ranks(size, body)
    for rank, (heads, tokens, gathered) in got.items():
        torch.testing.assert_close(heads, full[:, :, 2 * rank : 2 * rank + 2], rtol=0, atol=0)
        torch.testing.assert_close(tokens, SequenceShard(rank, size).split(full, 1), rtol=0, atol=0)
        torch.testing.assert_close(gathered, full, rtol=0, atol=0)


def test_a_failing_rank_ends_every_rank_and_names_itself():
    seen = []

    def body(rank, member):
        if rank == 2:
            raise RuntimeError("rank 2 lost its device")
        try:
            member.all_gather([torch.empty(1) for _ in range(4)], torch.ones(1))
        except RankAborted:
            seen.append(rank)
            raise

    with pytest.raises(RuntimeError, match="rank 2 lost its device"):
        run_ranks(4, body)
    assert sorted(seen) == [0, 1, 3]  # every other rank left its collective instead of waiting


def test_a_cancel_in_rank_0_reaches_the_others_at_their_next_collective():
    class Cancelled(BaseException):
        pass

    polls = {"n": 0}

    def poll():
        polls["n"] += 1
        if polls["n"] == 3:
            raise Cancelled()

    def body(rank, member):
        for _ in range(10):
            member.all_gather([torch.empty(1), torch.empty(1)], torch.ones(1))

    with pytest.raises(Cancelled):
        run_ranks(2, body, poll=poll, is_cancel=lambda exc: isinstance(exc, Cancelled))
    assert polls["n"] == 3


def test_a_collective_nobody_joins_times_out_instead_of_hanging():
    group = ThreadGroup(2, timeout=0.2)
    with pytest.raises(RankAborted):
        group.member(0).all_gather([torch.empty(1), torch.empty(1)], torch.ones(1))
    assert group.aborted


def test_ranks_whose_forwards_differ_fail_instead_of_mixing_their_pieces():
    def other_kind(rank, member):  # rank 1 gathers where rank 0 trades
        if rank == 1:
            member.all_gather([torch.empty(2), torch.empty(2)], torch.ones(2))
        else:
            member.all_to_all_single(torch.empty(2), torch.ones(2), [1, 1], [1, 1])

    with pytest.raises(RuntimeError, match=r"met in different collectives \(all_gather, all_to_all\)"):
        run_ranks(2, other_kind)

    def one_more(rank, member):  # rank 1 takes one collective more
        for _ in range(2 if rank == 1 else 1):
            member.all_gather([torch.empty(1), torch.empty(1)], torch.ones(1))

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="finished while another rank waited|after rank 0 finished"):
        run_ranks(2, one_more)
    assert time.monotonic() - started < 5  # not the 30-minute collective timeout


def test_ranks_run_on_their_own_threads_and_rank_0_on_the_caller():
    names = {}

    def body(rank, member):
        names[rank] = threading.current_thread().name

    run_ranks(3, body)
    assert names[0] == threading.current_thread().name
    assert all(names[r].startswith("omnivideo-rank") for r in (1, 2)), names


def test_node_is_registered_with_its_limits():
    schema = node_classes()["OmniVideoSequenceParallel"].define_schema()
    devices = next(i for i in schema.inputs if i.id == "devices")
    limits = {k: devices.options[k] for k in ("min", "max", "default")}  # the pack's stand-in of io, no ComfyUI here
    assert limits == {"min": 1, "max": 8, "default": 2}
    assert [i.id for i in schema.inputs] == ["model", "devices"]


def _probe(comfyui_path, group):
    return run_probe("sequence_parallel_probe.py", comfyui_path, env={"PROBE_GROUP": group})


def _assert_equal_to_one_device(result, keys):
    for key in keys:
        case = result[key]
        for world in ("2", "4"):
            if world in case:
                assert isinstance(case[world], float), f"{key} at {world} ranks: {case[world]}"
                assert case[world] <= TOLERANCE * max(1.0, case["scale"]), (
                    f"{key}: {world} ranks differ from one device by {case[world]} (output scale {case['scale']})"
                )


@pytest.mark.integration
def test_core_wan_models_split_over_2_and_4_ranks_equal_one_device(comfyui_path):
    """Core's own Wan 2.1 and Wan 2.2 (5B layout, per-frame timesteps) through core's sampling: CFG 1 and 3, an
    uneven split, a LoRA through core's loading before and after the node, fp8 weights, RainFusion 0 / 0.8 below it,
    core's torch.compile wrapper and EasyCache above it, the ranks on ComfyUI's own per-device copies (0.33+); a
    wrong split differs; a cancel and a failing rank end every rank; the refusals say why."""
    if not os.path.isfile(os.path.join(str(comfyui_path), "comfy", "ldm", "wan", "model.py")):
        pytest.skip(f"COMFYUI_PATH={comfyui_path} has no comfy/ldm/wan/model.py")
    r = _probe(comfyui_path, "wan")
    _assert_equal_to_one_device(
        r,
        [
            "wan21_cfg1",
            "wan21_cfg3",
            "wan21_uneven",
            "wan21_lora_before",
            "wan21_lora_after",
            "wan21_fp8",
            "wan21_rainfusion_0.0",
            "wan21_rainfusion_0.8",
            "wan22_masked",
            "wan22_cfg3",
            "wan21_compiled",
            "wan21_easycache",
            "wan21_hook_lora",
            "after_failure",
        ],
    )
    assert r["wan22_class"] == "WAN22", r["wan22_class"]  # core detected the 5B layout
    assert r["forwards_split"] == 2, r  # 2 steps, CFG 1: the split ran for each forward
    assert 0 < r["easycache_split_forwards"] < 10, r  # core's EasyCache above the split skipped steps, once each
    assert r["lora_changes_output"] > 1e-2, r["lora_changes_output"]  # the LoRA is not a no-op
    assert r["fp8_weights"] == "torch.float8_e4m3fn", r["fp8_weights"]  # the fp8 case really stores fp8
    assert r["hook_lora_changes_output"] > 1e-3, r["hook_lora_changes_output"]  # the hook LoRA is applied
    assert r["rainfusion_0.8_vs_dense"] > 1e-3, r["rainfusion_0.8_vs_dense"]  # 0.8 really went sparse
    assert r["negative_control"] > 1e-2, f"a wrong split must differ from one device: {r['negative_control']}"
    assert r["cancel"].startswith("InterruptProcessingException"), r["cancel"]
    assert r["cancel_seconds"] <= 2.0, r["cancel_seconds"]
    failed = "RuntimeError: OmniVideo Sequence Parallel: rank 1 on cpu failed: device lost (a test's failure)"
    assert r["failure"] == failed, r["failure"]
    assert r["failure_seconds"] <= 2.0, r["failure_seconds"]
    assert "which 3 devices cannot share" in r["refuse_heads"] and "divides 4" in r["refuse_heads"], r["refuse_heads"]
    assert "which 4 devices cannot share" in r["refuse_heads_2"], r["refuse_heads_2"]
    assert "NativeAttentionPatch.override was installed after it" in r["refuse_override_above"], r
    assert "apply that patch before OmniVideo Sequence Parallel" in r["refuse_override_above"], r
    assert "replaced by another patch (patches_replace 'dit')" in r["refuse_block_replaced"], r
    assert "'attn1_patch' patches read a block's or an attention's whole rows" in r["refuse_attn1_patch"], r
    assert r["unsplit"] == {"override": False, "max_diff": 0.0}, r["unsplit"]  # devices 1 unsplits a split MODEL
    assert r["refuse_unknown"].startswith("ValueError: OmniVideo Sequence Parallel cannot split Other"), r
    assert r["world1_unchanged"] is True  # devices 1 on a MODEL that is not split: the MODEL itself
    replicas = r["replicas"]  # the several-GPU path (core's per-device copies), on one CPU
    if "refused" in replicas:  # 0.3.64: no deepclone_multigpu
        assert "update ComfyUI to split a model over several GPUs" in replicas["refused"], replicas
    else:
        assert replicas["separate_module"] is True, replicas
        assert replicas["max_diff"] <= TOLERANCE * max(1.0, replicas["scale"]), replicas
        assert replicas["lora_changes_output"] > 1e-3, replicas  # a LoRA loaded after the split reaches the copies
        assert replicas["lora_after_max_diff"] <= TOLERANCE * max(1.0, replicas["scale"]), replicas
        assert "carries hooks (hook LoRAs, keyframed hooks)" in replicas["refuse_hooks"], replicas  # copies lack them


@pytest.mark.integration
def test_core_minimax_h3_splits_over_2_and_4_ranks_equal_one_device(comfyui_path):
    """Core 0.33's own MiniMax-H3 (its packed [text | keyframe / reference | audio | video] sequence): t2va at CFG 1
    and 3, a first-frame keyframe, a reference image, block-sparse attention 0 / 0.8 below the split."""
    if not os.path.isfile(os.path.join(str(comfyui_path), "comfy", "ldm", "minimax", "model.py")):
        pytest.skip(f"COMFYUI_PATH={comfyui_path} has no native MiniMax-H3 (comfy/ldm/minimax, ComfyUI 0.33+)")
    r = _probe(comfyui_path, "h3")
    assert r["model"] == "MiniMaxH3Model", r["model"]
    _assert_equal_to_one_device(
        r, ["h3_t2va_cfg1", "h3_t2va_cfg3", "h3_keyframe", "h3_reference", "h3_sparse_0.0", "h3_sparse_0.8"]
    )
    assert r["forwards_split"] >= 2, r
    assert r["keyframe_changes_output"] > 1e-3 and r["reference_changes_output"] > 1e-3, r  # the guides are read
    assert r["h3_sparse_0.8_vs_dense"] > 1e-3, r["h3_sparse_0.8_vs_dense"]
    assert r["negative_control"] > 1e-2, f"a wrong split must differ from one device: {r['negative_control']}"
    assert "which 3 devices cannot share" in r["refuse_heads"], r["refuse_heads"]
