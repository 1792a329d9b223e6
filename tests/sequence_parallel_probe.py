"""Run by tests/test_core_sequence_parallel.py in ComfyUI's interpreter (COMFYUI_PATH, COMFYUI_PYTHON): sample
ComfyUI's own tiny Wan 2.1 / Wan 2.2 (and, where core has it, MiniMax-H3) MODELs through core's sampling at 1, 2
and 4 ranks with OmniVideo Sequence Parallel and print, per case, the largest difference from one device, the scale
of the output and what ran, as JSON. The cases: CFG 1 and > 1, a LoRA loaded by core's own node, OmniVideo Patch
Model Attention (RainFusion at sparsity 0 and 0.8) below the split, H3 with a first-frame keyframe and with
reference blocks; a negative control (one rank takes its neighbour's rows: must differ), a cancel and a failing
rank (each must end every rank), and the refusals (with their messages). Not a test module itself (no test_ prefix).

PROBE_GROUP: the case group to run ("wan" or "h3"), so the test reports each group on its own.
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.environ["COMFYUI_PATH"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comfy.cli_args import args  # noqa: E402

args.cpu = True

import comfy.hooks  # noqa: E402
import comfy.ldm.wan.model as wan  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402

import omnivideo.integration.core_sequence_parallel as split_module  # noqa: E402
import omnivideo.integration.sequence_plans as plans  # noqa: E402
from omnivideo.attention.config import AttentionConfig  # noqa: E402
from omnivideo.nodes.attention import OmniVideoPatchModelAttention  # noqa: E402
from omnivideo.nodes.parallel import OmniVideoSequenceParallel  # noqa: E402

torch.set_num_threads(2)


def tiny_wan_state_dict(in_dim=16, out_dim=16, heads=4, seed=0):
    torch.manual_seed(seed)
    net = wan.WanModel(
        model_type="t2v",
        patch_size=(1, 2, 2),
        in_dim=in_dim,
        dim=128 * heads,  # core reads the heads from the width (128 per head)
        ffn_dim=256,
        freq_dim=256,
        text_dim=4096,
        out_dim=out_dim,
        num_heads=heads,
        num_layers=2,
        operations=comfy.ops.disable_weight_init,
    )
    return {name: torch.randn(t.shape) * (0.05 if t.dim() > 1 else 0.1) for name, t in net.state_dict().items()}


def split(model, devices, below=None):
    if below is not None:
        model = OmniVideoPatchModelAttention.execute(model, below).args[0]
    return OmniVideoSequenceParallel.execute(model, devices).args[0]


def sample(model, latent, cond, cfg=1.0, steps=2, noise_mask=None):
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(1))
    out = comfy.sample.sample(
        model,
        noise,
        steps,
        cfg,
        "euler",
        "simple",
        cond,
        cond if cfg == 1.0 else negative(cond),
        latent,
        noise_mask=noise_mask,
        seed=1,
    )
    return out.flatten() if isinstance(out, torch.Tensor) else torch.cat([t.flatten() for t in out])


def negative(cond):
    return [[c[0] * -0.5, dict(c[1])] for c in cond]


def compare(run, worlds=(2, 4)):
    """{world: max |diff| from one device} of `run(devices)`, with the one-device output's scale."""
    one = run(1)
    out = {"scale": float(one.abs().max())}
    for n in worlds:
        got = run(n)
        out[str(n)] = float((got - one).abs().max()) if got.shape == one.shape else f"shape {tuple(got.shape)}"
    return out


def error_of(fn) -> str:
    try:
        fn()
    except BaseException as exc:  # the message is what the test reads (0.33: a cancel is a BaseException)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def forwards_split(model, run_sampling) -> int:
    """How many forwards of a 2-rank sampling went through the split (not 0: the equality is not trivial)."""
    two = split(model, 2)
    sequence = two.model_options["transformer_options"]["optimized_attention_override"].__self__
    before = sequence.forwards
    run_sampling(two)
    return sequence.forwards - before


def replica_cases(cond):
    """The path several GPUs take, on one CPU: ranks 1.. run ComfyUI's own copy of the MODEL (deepclone_multigpu from
    the loader's factory, kept in step by match_multigpu_clones), here also with a LoRA loaded after the split.
    None where this ComfyUI cannot copy a MODEL (0.3.64)."""
    import tempfile

    from safetensors.torch import save_file

    from omnivideo import compat

    path = os.path.join(tempfile.mkdtemp(), "wan_tiny.safetensors")
    save_file(tiny_wan_state_dict(seed=5), path)
    model = comfy.sd.load_diffusion_model(path)
    if not hasattr(model, "deepclone_multigpu"):
        return {"refused": error_of(lambda: compat.device_clones(model.clone(), [torch.device("cpu")]))}
    latent = torch.zeros(1, 16, 3, 16, 24)
    one = sample(model, latent, cond)
    split, sequence = split_module.split_model(model, 2, replicate_on_one_device=True)
    replica = sequence.replicas[torch.device("cpu")]
    out = {
        "separate_module": replica is not model.model.diffusion_model,
        "max_diff": float((sample(split, latent, cond) - one).abs().max()),
    }
    g = torch.Generator().manual_seed(7)
    w = model.model.diffusion_model.blocks[0].self_attn.q.weight
    lora = {
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.randn(w.shape[0], 4, generator=g) * 0.5,
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.randn(4, w.shape[1], generator=g) * 0.5,
    }
    with_lora = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)[0]
    after = comfy.sd.load_lora_for_models(split, None, lora, 1.0, 0.0)[0]
    out["lora_after_max_diff"] = float((sample(after, latent, cond) - sample(with_lora, latent, cond)).abs().max())
    hooked = comfy.hooks.set_hooks_for_conditioning(cond, comfy.hooks.create_hook_lora(lora, 1.0, 0.0))
    out["refuse_hooks"] = error_of(lambda: sample(split, latent, hooked))
    out["lora_changes_output"] = float((sample(with_lora, latent, cond) - one).abs().max())
    out["scale"] = float(one.abs().max())
    return out


def negative_control(model, run_sampling):
    """Rank 1 takes rank 0's rows: the split must then differ from one device (the equality test can fail)."""
    real = plans.take_rows

    def wrong(state, t, dim):
        if state.shard.rank == 1:
            return t.narrow(dim, 0, state.shard.bounds(t.shape[dim])[1] - state.shard.bounds(t.shape[dim])[0])
        return real(state, t, dim)

    one = run_sampling(model)
    plans.take_rows = wrong
    try:
        got = run_sampling(split(model, 2))
    finally:
        plans.take_rows = real
    return float((got - one).abs().max())


def on_rank_1(model, run_sampling, act):
    """Sample the MODEL split over 2 ranks with `act()` called in rank 1's self-attention calls; (what the run
    raised, its seconds). The override is replaced before the split: the MODEL holds the bound one."""
    real = split_module.SequenceSplit.override

    def hooked(self, original, *a, **kw):
        state = plans.current()
        if state is not None and state.shard.rank == 1 and state.in_self_attention:
            act()
        return real(self, original, *a, **kw)

    split_module.SequenceSplit.override = hooked
    start = time.monotonic()
    try:
        return error_of(lambda: run_sampling(split(model, 2))), time.monotonic() - start
    finally:
        split_module.SequenceSplit.override = real
        comfy.model_management.interrupt_current_processing(False)


def cancel_and_failure(model, run_sampling):
    """A cancel pressed mid-step and a rank that raises: each ends the run on every rank, and says which."""
    calls = {"n": 0}

    def cancel_on_the_third_call():
        calls["n"] += 1
        if calls["n"] == 3:
            comfy.model_management.interrupt_current_processing(True)

    def fail():
        raise RuntimeError("device lost (a test's failure)")

    out = {}
    out["cancel"], out["cancel_seconds"] = on_rank_1(model, run_sampling, cancel_on_the_third_call)
    out["failure"], out["failure_seconds"] = on_rank_1(model, run_sampling, fail)
    out["after_failure"] = compare(lambda n: run_sampling(split(model, n)), worlds=(2,))  # the threads still work
    return out


def wan_cases():
    out = {}
    g = torch.Generator().manual_seed(2)
    cond = [[torch.randn(1, 16, 4096, generator=g) * 0.1, {}]]
    wan21 = comfy.sd.load_diffusion_model_state_dict(tiny_wan_state_dict())
    latent = torch.zeros(1, 16, 3, 16, 24)  # patch grid (3, 8, 12): 288 rows

    def run21(model, cfg=1.0):
        return sample(model, latent, cond, cfg=cfg)

    out["wan21_cfg1"] = compare(lambda n: run21(split(wan21, n)))
    out["wan21_cfg3"] = compare(lambda n: run21(split(wan21, n), cfg=3.0))
    odd = torch.zeros(1, 16, 3, 10, 14)  # (3, 5, 7): 105 rows, not divisible by 2 or 4
    out["wan21_uneven"] = compare(lambda n: sample(split(wan21, n), odd, cond))

    # a LoRA through core's own loading (comfy.sd.load_lora_for_models, what LoraLoaderModelOnly runs), before and
    # after the split
    lora = {}
    for key in ("blocks.0.self_attn.q", "blocks.1.ffn.0"):
        w = wan21.model.diffusion_model.get_submodule(key).weight
        lora[f"diffusion_model.{key}.lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.1
        lora[f"diffusion_model.{key}.lora_down.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.1

    def lora_model(model):
        return comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)[0]

    lora_first = lora_model(wan21)
    out["wan21_lora_before"] = compare(lambda n: run21(split(lora_first, n)))
    out["wan21_lora_after"] = compare(lambda n: run21(lora_model(split(wan21, n))))
    out["lora_changes_output"] = float((run21(lora_first) - run21(wan21)).abs().max())

    # fp8 weights, as UNETLoader's weight_dtype fp8_e4m3fn stores them (ComfyUI's cast layers compute in fp32 here)
    fp8 = comfy.sd.load_diffusion_model_state_dict(tiny_wan_state_dict(), model_options={"dtype": torch.float8_e4m3fn})
    out["fp8_weights"] = str(fp8.model.diffusion_model.blocks[0].self_attn.q.weight.dtype)
    out["wan21_fp8"] = compare(lambda n: run21(split(fp8, n)))

    # OmniVideo Patch Model Attention below the split: RainFusion over all rows of the heads each rank holds
    big = torch.zeros(1, 16, 2, 96, 96)  # (2, 48, 48): 4608 rows = 36 blocks of 128
    for sparsity in (0.0, 0.8):
        config = AttentionConfig("rainfusion", sparsity=sparsity)
        out[f"wan21_rainfusion_{sparsity}"] = compare(
            lambda n, c=config: sample(split(wan21, n, below=c), big, cond), worlds=(2,)
        )
    out["rainfusion_0.8_vs_dense"] = float(
        (sample(split(wan21, 1, AttentionConfig("rainfusion", sparsity=0.8)), big, cond) - sample(wan21, big, cond))
        .abs()
        .max()
    )

    # Wan 2.2 5B layout (48 latent channels, a timestep per latent frame under a denoise mask)
    wan22 = comfy.sd.load_diffusion_model_state_dict(tiny_wan_state_dict(in_dim=48, out_dim=48, seed=3))
    out["wan22_class"] = type(wan22.model).__name__
    latent22 = torch.zeros(1, 48, 3, 16, 16)
    mask = torch.ones(1, 1, 3, 16, 16)
    mask[:, :, 0] = 0.0  # the first frame kept (Wan22ImageToVideoLatent's mask): per-frame timesteps
    out["wan22_masked"] = compare(lambda n: sample(split(wan22, n), latent22, cond, noise_mask=mask))
    out["wan22_cfg3"] = compare(lambda n: sample(split(wan22, n), latent22, cond, cfg=3.0))

    out["replicas"] = replica_cases(cond)
    out["negative_control"] = negative_control(wan21, run21)
    out.update(cancel_and_failure(wan21, run21))

    # refusals
    out["refuse_heads"] = error_of(lambda: split(wan21, 3))
    two_heads = comfy.sd.load_diffusion_model_state_dict(tiny_wan_state_dict(heads=2))
    out["refuse_heads_2"] = error_of(lambda: split(two_heads, 4))
    above = split(wan21, 2)
    above = OmniVideoPatchModelAttention.execute(above, AttentionConfig("rainfusion", sparsity=0.8)).args[0]
    out["refuse_override_above"] = error_of(lambda: run21(above))
    replaced = split(wan21, 2).clone()
    replaced.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 0)
    out["refuse_block_replaced"] = error_of(lambda: run21(replaced))

    from comfy_api.torch_helpers import set_torch_compile_wrapper

    def compiled(n):  # what core's TorchCompileModel does, after the split (backend "eager": no C compiler needed)
        model = split(wan21, n).clone()
        set_torch_compile_wrapper(model, backend="eager")
        return run21(model)

    out["wan21_compiled"] = compare(compiled, worlds=(2,))

    from comfy_extras.nodes_easycache import EasyCacheNode

    easy_runs = {}

    def easycache(n):  # core's EasyCache after the split: its forward wrapper must run once per forward, not per rank
        model = EasyCacheNode.execute(split(wan21, n), 1.5, 0.1, 0.95, False).args[0]
        got = sample(model, latent, cond, steps=10)
        sequence = model.model_options["transformer_options"].get("optimized_attention_override")
        easy_runs[n] = getattr(getattr(sequence, "__self__", None), "forwards", None)
        return got

    out["wan21_easycache"] = compare(easycache, worlds=(2,))
    out["easycache_split_forwards"] = easy_runs[2]  # fewer than the 10 steps: EasyCache skipped some

    class Other(torch.nn.Module):
        pass

    fake = wan21.clone()
    fake.model = type("M", (), {"diffusion_model": Other()})()
    out["refuse_unknown"] = error_of(lambda: OmniVideoSequenceParallel.execute(fake, 2))
    patched = split(wan21, 2).clone()  # an attn1 patch reads the attention's rows: refused
    patched.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
    out["refuse_attn1_patch"] = error_of(lambda: run21(patched))
    # a hook LoRA on the conditioning (Create Hook LoRA + Cond Set Props): the ranks share the hooked module here
    g = torch.Generator().manual_seed(8)
    q = wan21.model.diffusion_model.blocks[1].self_attn.q.weight
    hook_lora = {
        "diffusion_model.blocks.1.self_attn.q.lora_up.weight": torch.randn(q.shape[0], 4, generator=g) * 0.5,
        "diffusion_model.blocks.1.self_attn.q.lora_down.weight": torch.randn(4, q.shape[1], generator=g) * 0.5,
    }
    hooked = comfy.hooks.set_hooks_for_conditioning(cond, comfy.hooks.create_hook_lora(hook_lora, 1.0, 0.0))
    out["wan21_hook_lora"] = compare(lambda n: sample(split(wan21, n), latent, hooked))
    out["hook_lora_changes_output"] = float((sample(wan21, latent, hooked) - run21(wan21)).abs().max())
    out["forwards_split"] = forwards_split(wan21, run21)
    unsplit = split(split(wan21, 2), 1)
    out["unsplit"] = {
        "override": "optimized_attention_override" in unsplit.model_options.get("transformer_options", {}),
        "max_diff": float((run21(unsplit) - run21(wan21)).abs().max()),
    }
    out["world1_unchanged"] = OmniVideoSequenceParallel.execute(wan21, 1).args[0] is wan21
    return out


def h3_cases():
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
    from support.h3_core_files import core_keys
    from support.h3_tiny import TRANSFORMER, make_models

    transformer, _, _ = make_models(seed=0, num_attention_heads=4)
    model = comfy.sd.load_diffusion_model_state_dict(
        {"model.diffusion_model." + k: v for k, v in core_keys(transformer).items()}
    )
    g = torch.Generator().manual_seed(2)
    text = torch.randn(1, 9, TRANSFORMER["text_dim"], generator=g)
    keyframe = {"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 16, 16, generator=g)}
    reference = {"kind": "image", "latent_h": 8, "latent_w": 8, "latent": torch.randn(1, 24, 1, 8, 8, generator=g)}
    latent = EmptyMiniMaxH3LatentAV.execute(width=256, height=256, length=5).args[0]  # video (2, 8, 8): 128 rows

    def run(m, extra=None, cfg=1.0, lat=latent):
        cond = [[text, dict(extra or {})]]
        streams = lat["samples"]
        noise = [torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for t in streams.unbind()]
        from comfy.nested_tensor import NestedTensor

        out = comfy.sample.sample(
            m,
            NestedTensor(noise),
            2,
            cfg,
            "euler",
            "simple",
            cond,
            negative(cond) if cfg != 1.0 else cond,
            streams,
            seed=1,
        )
        return torch.cat([t.flatten() for t in out.unbind()])

    out = {"model": type(model.model.diffusion_model).__name__}
    out["h3_t2va_cfg1"] = compare(lambda n: run(split(model, n)))
    out["h3_t2va_cfg3"] = compare(lambda n: run(split(model, n), cfg=3.0))
    out["h3_keyframe"] = compare(lambda n: run(split(model, n), {"minimax_keyframes": [keyframe]}))
    out["h3_reference"] = compare(lambda n: run(split(model, n), {"minimax_refs": [reference]}))
    big = EmptyMiniMaxH3LatentAV.execute(width=512, height=512, length=5).args[0]  # 512 video rows: 32 blocks of 16
    for sparsity in (0.0, 0.8):
        config = AttentionConfig("torch_block_sparse", sparsity=sparsity, block_size=16)
        out[f"h3_sparse_{sparsity}"] = compare(lambda n, c=config: run(split(model, n, below=c), lat=big), worlds=(2,))
    out["h3_sparse_0.8_vs_dense"] = float(
        (
            run(split(model, 1, AttentionConfig("torch_block_sparse", sparsity=0.8, block_size=16)), lat=big)
            - run(model, lat=big)
        )
        .abs()
        .max()
    )
    out["forwards_split"] = forwards_split(model, run)
    out["keyframe_changes_output"] = float((run(model, {"minimax_keyframes": [keyframe]}) - run(model)).abs().max())
    out["reference_changes_output"] = float((run(model, {"minimax_refs": [reference]}) - run(model)).abs().max())
    out["negative_control"] = negative_control(model, run)
    out["refuse_heads"] = error_of(lambda: split(model, 3))
    return out


def main():
    group = os.environ.get("PROBE_GROUP", "wan")
    out = {"wan": wan_cases, "h3": h3_cases}[group]()
    print("PROBE_RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
