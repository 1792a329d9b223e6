"""One forward of ComfyUI's own video models (Wan 2.1 / 2.2, MiniMax-H3) split over several devices: Ulysses
sequence parallelism on core's MODEL, with everything above the forward left to core.

The pieces are ComfyUI's hooks and torch's: a DIFFUSION_MODEL wrapper runs the forward once per rank (a thread per
device, parallel/threads; rank 0 in ComfyUI's execution thread), each rank on its own copy of the model (core's
per-device clone, or on the CPU the one module); module hooks on the model's blocks (integration/sequence_plans: a
plan per core class) give each rank its contiguous slice of the token sequence where the blocks begin and gather the
rows back in front of the final layer; the attention override trades rows
for heads around each self-attention call (attention/sequence_parallel.SequenceShard, the same all-to-all as the
pack's own pipelines) and hands the call below it - the override that was on the MODEL before (OmniVideo Patch Model
Attention's RainFusion then plans the heads this rank holds), else ComfyUI's attention - all rows of H/N heads.

Which rows a rank holds is per thread (`sequence_plans.running`), so the hooks do nothing in a forward that is not
split (another MODEL sharing the module, core's MultiGPU CFG threads). What would make a split forward wrong is
refused with a message: patches that see a block's or an attention's rows (`patches`, `patches_replace`), an
attention override above ours (it would see a slice of the rows), core's CFG split at the same time, hooks on the
conds where other devices hold copies, a self-attention that did not reach our override, a forward that does not
reach the final layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import compat
from ..attention.sequence_parallel import SequenceShard
from ..backends import device_scope, thread_rank_devices
from ..parallel.threads import RankAborted, run_ranks
from .attention_patch import call_arguments, call_below, forward_options, override_name
from .sequence_plans import RankState, SplitPlan, current, install_hooks, plan_for, running

WRAPPER_KEY = "omnivideo_sequence_parallel"


# ------------------------------------------------------------------ the wrapper and the override


def _to_device(value, device: torch.device, keep):
    if value is keep:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_to_device(v, device, keep) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, keep) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device, keep) for k, v in value.items()}
    return value


def _rank_options(opts: dict) -> dict:
    """A rank's own transformer_options: the forward writes into them (block index, a patch's per-forward record)."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in opts.items()}


class SequenceSplit:
    """The wrappers and the override of one MODEL split over `devices` (rank r on devices[r]). `replicas`: the
    diffusion model each other device runs (core's per-device clones); ranks on rank 0's device (the CPU) run the
    MODEL's own module. `previous`: the attention override that was on the MODEL before; it gets every call, ours
    with fewer heads."""

    def __init__(self, plan: SplitPlan, devices: list[torch.device], replicas: dict | None = None, previous=None):
        owner = getattr(previous, "__self__", None)
        if isinstance(owner, SequenceSplit):  # splitting a split MODEL again replaces it
            previous = owner.previous
        self.plan, self.devices, self.replicas = plan, devices, replicas or {}
        self.previous: Callable | None = previous
        self.forwards = 0  # forwards run split (rank 0 counts them)

    def __deepcopy__(self, memo):  # MODEL.clone() deep-copies model_options: one split, its replicas not copied
        return self

    @property
    def size(self) -> int:
        return len(self.devices)

    def refuse_others(self, opts: dict) -> None:
        """What makes a split forward wrong, said before it runs."""
        top = opts.get("optimized_attention_override")
        if getattr(top, "__self__", None) is not self:
            raise ValueError(
                f"OmniVideo Sequence Parallel: the attention override {override_name(top)} was installed after it "
                "and would see one device's slice of the sequence: apply that patch before OmniVideo Sequence "
                "Parallel (nearer the model loader)"
            )
        replaced = sorted(name for name, found in (opts.get("patches_replace") or {}).items() if found)
        if replaced:
            raise ValueError(
                f"OmniVideo Sequence Parallel: parts of this model are replaced by another patch (patches_replace "
                f"{', '.join(map(repr, replaced))}), which would see one device's slice: remove that patch or this node"
            )
        patched = sorted(name for name, found in (opts.get("patches") or {}).items() if found)
        if patched:
            raise ValueError(
                f"OmniVideo Sequence Parallel: {', '.join(map(repr, patched))} patches read a block's or an "
                "attention's whole rows, which no device holds: remove those patches or this node"
            )
        if "multigpu_thread_device" in opts:
            raise ValueError(
                "OmniVideo Sequence Parallel with ComfyUI's MultiGPU CFG Split: both would use the same devices at "
                "once; use one of them"
            )

    # OUTER_SAMPLE wrapper: outer_sample(executor, noise, latent_image, sampler, sigmas, ...), class_obj the guider
    def outer_sample(self, executor, *args, **kwargs):
        """Refuses hooks on the run's conds (Create Hook LoRA, keyframed hooks) where other devices hold copies:
        core applies hooks to the MODEL it samples, device 0's, and the copies would run without them."""
        conds = getattr(executor.class_obj, "conds", None) or {}
        hooked = any(isinstance(c, dict) and c.get("hooks") is not None for group in conds.values() for c in group)
        if hooked and self.replicas:
            raise ValueError(
                "OmniVideo Sequence Parallel: this run's conditioning carries hooks (hook LoRAs, keyframed hooks), "
                "which ComfyUI applies to the first device's copy of the model only: on several devices use a LoRA "
                "loader instead, or remove this node"
            )
        return executor(*args, **kwargs)

    # DIFFUSION_MODEL wrapper: wrapper(executor, x, timestep, context, ..., transformer_options, ...)
    def wrapper(self, executor, *args, **kwargs):
        """Splits at the innermost point, wherever this wrapper sits among the MODEL's: every other DIFFUSION_MODEL
        wrapper (EasyCache, an attention patch's layout record) runs once per forward, in ComfyUI's thread, and only
        the model's own forward runs per rank."""
        opts = forward_options(args, kwargs)
        if opts is None or current() is not None or self.size == 1:
            return executor(*args, **kwargs)
        self.refuse_others(opts)
        original, model = executor.original, executor.class_obj

        def split_forward(*args, **kwargs):
            out = self.run_split(original, model, args, kwargs)
            self.forwards += 1
            return out

        return (
            type(executor)
            .new_class_executor(split_forward, model, executor.wrappers, executor.idx + 1)
            .execute(*args, **kwargs)
        )

    def run_split(self, original, model, args: tuple, kwargs: dict):
        """`original` (the model's own forward) once per rank, each on its device's copy; rank 0's output."""
        opts = forward_options(args, kwargs)
        here = self.devices[0]
        # grad and inference mode are per thread: the other ranks run as ComfyUI's sampling thread does
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def rank_forward(rank: int, member):
            device = self.devices[rank]
            own = _rank_options(opts or {})
            if device != here:  # its inputs and options (sigmas, ...) on its device, as core's CFG threads do
                own = _to_device(own, device, None)
                args_, kwargs_ = _to_device(args, device, opts), _to_device(kwargs, device, opts)
            else:
                args_, kwargs_ = args, kwargs
            a = tuple(own if v is opts else v for v in args_)
            kw = {k: (own if v is opts else v) for k, v in kwargs_.items()}
            replica = self.replicas.get(device) if rank and device != here else model
            if replica is None:
                raise RuntimeError(f"OmniVideo Sequence Parallel: no copy of the model on {device} (rank {rank})")
            install_hooks(replica, self.plan)
            forward = original if replica is model else getattr(replica, original.__name__)
            state = RankState(self.plan, SequenceShard(rank, self.size, member))
            try:
                with (
                    running(state),
                    device_scope(device),
                    torch.inference_mode(inference),
                    torch.set_grad_enabled(grad),
                ):
                    out = forward(*a, **kw)
            except (RankAborted, KeyboardInterrupt):
                raise
            except Exception as exc:
                if compat.is_interrupt(exc):
                    raise
                if isinstance(exc, torch.OutOfMemoryError):  # ComfyUI's own handling (unload, advice) by its type
                    exc.add_note(f"OmniVideo Sequence Parallel: rank {rank} on {device}")
                    raise
                raise RuntimeError(f"OmniVideo Sequence Parallel: rank {rank} on {device} failed: {exc}") from exc
            if not state.gathered:
                raise RuntimeError(
                    f"OmniVideo Sequence Parallel: {self.plan.name}'s forward returned without reaching its "
                    f"{self.plan.final}, so the sequence was never gathered; this forward cannot be split"
                )
            return out

        return run_ranks(self.size, rank_forward, poll=compat.check_interrupt, is_cancel=compat.is_interrupt)

    def override(self, original, *args, **kwargs):
        state = current()
        if state is None or not state.in_self_attention or state.total is None:
            return call_below(self.previous, original, args, kwargs)
        state.attended = True
        call = call_arguments(args, kwargs)
        q, k, v, heads = call["q"], call["k"], call["v"], int(call["heads"])
        skip_reshape = bool(call.get("skip_reshape", False))
        if skip_reshape:  # [B, H, S, D]
            q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
        else:  # [B, S, H*D]
            b, s, hd = q.shape
            q4, k4, v4 = (t.reshape(b, s, heads, hd // heads) for t in (q, k, v))
        q4, k4, v4 = state.shard.qkv_to_heads(q4, k4, v4, state.total)  # [B, S_all, H/N, D]
        b, total, local_heads, d = q4.shape
        if skip_reshape:
            q2, k2, v2 = (t.transpose(1, 2) for t in (q4, k4, v4))
        else:
            q2, k2, v2 = (t.reshape(b, total, local_heads * d) for t in (q4, k4, v4))
        names = [n for n in ("q", "k", "v", "heads") if n in kwargs]
        rest = {n: kw for n, kw in kwargs.items() if n not in names}
        positional = args[4:] if len(args) > 4 else ()
        out = call_below(self.previous, original, (q2, k2, v2, local_heads, *positional), rest)
        if call.get("skip_output_reshape", False):  # [B, H/N, S_all, D]
            out4 = out.transpose(1, 2)
            return state.shard.to_tokens(out4).transpose(1, 2)
        out4 = out.reshape(b, total, local_heads, d)
        tokens = state.shard.to_tokens(out4)  # [B, S_rank, H, D]
        return tokens.reshape(b, tokens.shape[1], heads * d)


def unsplit_model(model):
    """`model` without a split this node put on it (the override below it back on top), or `model` itself."""
    opts = model.model_options.get("transformer_options", {})
    split = getattr(opts.get("optimized_attention_override"), "__self__", None)
    if not isinstance(split, SequenceSplit):
        return model
    plain = model.clone()
    plain_opts = plain.model_options["transformer_options"]
    if split.previous is None:
        plain_opts.pop("optimized_attention_override", None)
    else:
        plain_opts["optimized_attention_override"] = split.previous
    for kind in (compat.wrapper_type("DIFFUSION_MODEL"), compat.wrapper_type("OUTER_SAMPLE")):
        plain.remove_wrappers_with_key(kind, WRAPPER_KEY)
    return plain


def split_model(model, size: int, replicate_on_one_device: bool = False):
    """A clone of core's MODEL whose forwards run split over `size` ranks: rank 0 on the MODEL's load device, the
    others on the next devices of its kind, each with ComfyUI's own copy of the model (`compat.device_clones`); on the
    CPU they share the MODEL's module, unless `replicate_on_one_device` (the copies several GPUs get, made on one).
    Raises (before any step) for a model it cannot split."""
    plan = plan_for(model.model.diffusion_model, size)
    ranks = thread_rank_devices(model.load_device, size)
    split = model.clone()
    others = list(dict.fromkeys(d for d in ranks[1:] if replicate_on_one_device or d != ranks[0]))
    replicas = compat.device_clones(split, others) if others else {}
    opts = split.model_options.setdefault("transformer_options", {})
    sequence = SequenceSplit(plan, ranks, replicas, previous=opts.get("optimized_attention_override"))
    opts["optimized_attention_override"] = sequence.override
    for kind, wrapper in (
        (compat.wrapper_type("DIFFUSION_MODEL"), sequence.wrapper),
        (compat.wrapper_type("OUTER_SAMPLE"), sequence.outer_sample),
    ):
        split.remove_wrappers_with_key(kind, WRAPPER_KEY)
        split.add_wrapper_with_key(kind, WRAPPER_KEY, wrapper)
    return split, sequence
