"""OmniDreams image-to-video: the released 2-step AR schedule, the rollout with a rolling KV
cache and the clean first-frame context write, and the VAE-side conditioning helpers.

Per chunk k (pin = k == 0), with one seeded generator and three draws in this order:
    x  = randn;                       x0 = x - 1.0 * F(x, 1000)
    x  = 0.19643 x0 + 0.80357 randn;  x0 = x - 0.80357 * F(x, 803.57);  pin x0
    xc = 0.87007 x0 + 0.12993 randn;  pin xc  <- BEFORE the K/V write;   F(xc, 128) -> cache only
F pins frame 0 of chunk 0 to the clean first-frame latent before running the DiT. Skipping the
pin before the context call would cache noise-corrupted frame-0 K/V that every later chunk
attends to: the video sharpens at frame 0 and blurs afterwards.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import compat
from ..attention.config import normalize_config
from ..attention.sequence_parallel import SINGLE, SequenceShard
from ..models.handles import check_family
from ..models.omnidreams.dit import OmniDreamsDiT
from ..models.omnidreams.kv_cache import RollingKVCache
from ..models.wan_vae.latent_stats import WAN21_CONFIG
from ..parallel.pool import WorkerPool, ensure_pool

# Wan 2.1 latent normalisation (= ComfyUI's Wan21 latent format): model latent = (mu - mean) / std
LATENT_MEAN: tuple[float, ...] = tuple(WAN21_CONFIG["latents_mean"])  # type: ignore[arg-type]
LATENT_STD: tuple[float, ...] = tuple(WAN21_CONFIG["latents_std"])  # type: ignore[arg-type]
VAE_SPATIAL, VAE_TEMPORAL = 8, 4
DEFAULT_STEPS = 2
NUM_TRAIN_TIMESTEPS, SHIFT = 1000, 5.0


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, len(LATENT_MEAN), 1, 1, 1)
    mean = torch.tensor(LATENT_MEAN, device=x.device).view(shape)
    return mean, torch.tensor(LATENT_STD, device=x.device).view(shape)


def normalize_latent(mu: torch.Tensor) -> torch.Tensor:
    mean, std = _stats(mu)
    return (mu.float() - mean) / std


def denormalize_latent(x: torch.Tensor) -> torch.Tensor:
    mean, std = _stats(x)
    return x.float() * std + mean


# ---------------------------------------------------------------------------- schedule


def sigma_table() -> torch.Tensor:
    """sigma_i = warp(s_i), s = linspace(1, 0, 1001)[:-1], warp(s) = 5s / (1 + 4s) (float64)."""
    s = torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1, dtype=torch.float64)[:-1]
    return SHIFT * s / (1.0 + (SHIFT - 1.0) * s)


@dataclass(frozen=True)
class Schedule:
    sigmas: tuple[float, ...]  # denoising sigmas, one per call
    timesteps: tuple[float, ...]  # network timesteps = 1000 sigma (the DiT casts them to bf16)
    context_t: float  # what the network receives for the context refresh
    context_index: int
    context_sigma: float  # the table sigma t snaps to


def released_schedule(denoise: tuple[int, ...] = (1000, 450), context_t: float = 128.0) -> Schedule:
    table = sigma_table()
    index = [NUM_TRAIN_TIMESTEPS - int(t) for t in denoise]
    if any(not 0 <= i < NUM_TRAIN_TIMESTEPS for i in index):
        raise ValueError(f"denoising timesteps must lie in (0, 1000], got {denoise}")
    sigmas = tuple(float(table[i]) for i in index)
    ctx = int(torch.argmin((table * NUM_TRAIN_TIMESTEPS - context_t).abs()))
    return Schedule(sigmas, tuple(NUM_TRAIN_TIMESTEPS * s for s in sigmas), float(context_t), ctx, float(table[ctx]))


@dataclass(frozen=True)
class ARSettings:
    len_t: int = 2  # latent frames per chunk
    window_frames: int = 6  # latent frames the cache keeps (sink included)
    sink_frames: int = 0  # leading latent frames that never leave the window
    denoise: tuple[int, ...] = (1000, 450)
    context_t: float = 128.0

    def slots(self) -> tuple[int, int]:
        """(sink chunks, rolling window chunks)."""
        for name, value in (("window_frames", self.window_frames), ("sink_frames", self.sink_frames)):
            if value % self.len_t:
                raise ValueError(f"{name}={value} must be a multiple of the chunk length {self.len_t}")
        if not 0 <= self.sink_frames < self.window_frames:
            raise ValueError(f"sink_frames={self.sink_frames} must be in [0, window_frames={self.window_frames})")
        return self.sink_frames // self.len_t, (self.window_frames - self.sink_frames) // self.len_t


def num_chunks_for_frames(frames: int, len_t: int = 2) -> int:
    """Smallest N whose pixel_frames(N, len_t) = 1 + (len_t N - 1) * 4 = 4 len_t N - 3 cover `frames`
    (8N - 3 for the released len_t = 2)."""
    return max(1, math.ceil((frames + VAE_TEMPORAL - 1) / (VAE_TEMPORAL * len_t)))


def pixel_frames(num_chunks: int, len_t: int = 2) -> int:
    return 1 + (len_t * num_chunks - 1) * VAE_TEMPORAL


# ---------------------------------------------------------------------------- prompt schedule

MAX_SCHEDULE_CHARS = 65536
MAX_SCHEDULE_ENTRIES = 256
# The distinct prompts' embeddings (float32, held by the conditioning in ComfyUI's cache for as long as the workflow
# is cached): 4 GiB is 20 prompts of Cosmos-Reason1 7B (512 x 100352 float32 = 196 MiB each), a new one every 6.4
# chunks (1.7 s) of the longest video the sampler makes (128 chunks), and small beside the 16 GB encoder itself.
MAX_SCHEDULE_BYTES = 4 * 2**30
_ENTRY = re.compile(r"(?:^|[,\n])[ \t]*(\d{1,6})[ \t]*:")  # "<chunk>:" at the start, after a comma or a newline


def parse_prompt_schedule(text: str) -> list[tuple[int, str]]:
    """'0: a car at dusk, 40: rain starts' -> [(0, 'a car at dusk'), (40, 'rain starts')]: each prompt holds
    from its chunk index until the next entry's. Linear time; bounded length and entry count."""
    if not isinstance(text, str) or len(text) > MAX_SCHEDULE_CHARS:
        raise ValueError(f"the prompt schedule must be text of at most {MAX_SCHEDULE_CHARS} characters")
    matches = list(_ENTRY.finditer(text))
    if not matches or text[: matches[0].start()].strip():
        raise ValueError(
            "the prompt schedule must start with a chunk index and a colon, e.g. '0: a car at dusk, 40: rain "
            "starts' (entries start at the beginning, after a comma or on a new line)"
        )
    if len(matches) > MAX_SCHEDULE_ENTRIES:
        raise ValueError(f"the prompt schedule has {len(matches)} entries; at most {MAX_SCHEDULE_ENTRIES}")
    entries: list[tuple[int, str]] = []
    for m, end in zip(matches, [n.start() for n in matches[1:]] + [len(text)]):
        chunk, prompt = int(m.group(1)), text[m.end() : end].strip()
        if not prompt:
            raise ValueError(f"the prompt schedule entry for chunk {chunk} is empty")
        if entries and chunk <= entries[-1][0]:
            raise ValueError(f"prompt schedule chunk indices must increase: {chunk} follows {entries[-1][0]}")
        entries.append((chunk, prompt))
    return entries


def encode_schedule(entries: list[tuple[int, str]], encode, embedding_bytes: int) -> list[tuple[int, torch.Tensor]]:
    """A parsed schedule's (chunk, embedding) pairs: each distinct prompt encoded once (`encode(prompt)`), the entries
    that repeat it share its tensor. Their total size (`embedding_bytes` each) is checked before anything is encoded."""
    prompts = list(dict.fromkeys(prompt for _, prompt in entries))
    total = len(prompts) * embedding_bytes
    if total > MAX_SCHEDULE_BYTES:
        raise ValueError(
            f"the prompt schedule has {len(prompts)} distinct prompts; their embeddings ({embedding_bytes / 2**20:.0f} "
            f"MiB each, {total / 2**30:.1f} GiB) exceed the limit of {MAX_SCHEDULE_BYTES / 2**30:.0f} GiB: use at most "
            f"{MAX_SCHEDULE_BYTES // embedding_bytes} distinct prompts (an entry that repeats a prompt's text exactly "
            "costs nothing)"
        )
    encoded = {prompt: encode(prompt) for prompt in prompts}
    return [(chunk, encoded[prompt]) for chunk, prompt in entries]


class PromptSwitch:
    """Which prompt holds at each chunk (the conditioning's text, then its schedule) and when another switches in.
    Entries that share one tensor (a repeated prompt, see `encode_schedule`) are one prompt: no switch between them."""

    def __init__(self, text: torch.Tensor, schedule=(), *, dtype: torch.dtype, device: torch.device | None = None):
        self.entries: list[tuple[int, torch.Tensor]] = [(0, text), *schedule]  # later entries: chunk > 0, rising
        self.starts = [start for start, _ in self.entries]
        self.dtype, self.device = dtype, device
        self.active: torch.Tensor | None = None

    def switch(self, chunk: int) -> torch.Tensor | None:
        """The prompt that switches in at `chunk`, in the compute dtype on the device (the one copy a rollout keeps
        or sends); None while the active one holds."""
        text = self.entries[bisect.bisect_right(self.starts, chunk) - 1][1]
        if text is self.active:
            return None
        self.active = text
        return text.to(self.device, self.dtype)


class PromptCross(PromptSwitch):
    """The cross-attention K/V of the prompt that holds at each chunk, computed when the prompt switches; one
    prompt's K/V are kept at a time."""

    def __init__(self, model: OmniDreamsDiT, text: torch.Tensor, schedule=(), device: torch.device | None = None):
        super().__init__(text, schedule, dtype=model.dtype, device=device)
        self.model = model
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []

    def at(self, chunk: int) -> list:
        text = self.switch(chunk)
        if text is not None:
            self.cross = []  # the previous prompt's K/V go first
            self.cross = self.model.cross_kv(text)
        return self.cross


# ---------------------------------------------------------------------------- rollout


def _pin(x: torch.Tensor, image: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    return x * (1 - inject) + image * inject


def _pin_context(xc: torch.Tensor, image: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """The clean first frame back in before the context-noise call: its K/V are what the cache keeps, so they must
    come from clean frame 0, not a noisy one (the known port bug; the regression tests take this step out)."""
    return _pin(xc, image, inject)


class Rollout:
    """The OmniDreams rollout one chunk at a time. Between chunks it carries only its state: the KV window, the
    chunk index and the noise generator (`state_dict` / `load_state_dict` save and restore it, so k chunks now and
    N - k later give the N chunks of one run, bit for bit). Free the window with `close` (also on interrupt).

    first_frame: clean normalised latent [1,16,1,h,w] pinned at frame 0 (None: no pin).
    device: where it runs (the model's load device). compiled: the DiT blocks under torch.compile.
    shard: this rank's share of a context-parallel rollout (every rank runs the same steps on the same noise; the
    DiT splits each chunk's tokens and this rank's window holds its heads); interrupt: the cancel point before each
    DiT call (default: ComfyUI's; in a parallel run one that all ranks pass together).
    """

    def __init__(
        self,
        model: OmniDreamsDiT,
        *,
        latent_hw: tuple[int, int],
        seed: int,
        first_frame: torch.Tensor | None = None,
        settings: ARSettings = ARSettings(),
        attention_config: dict | None = None,
        device: torch.device,
        compiled: bool = False,
        shard: SequenceShard = SINGLE,
        interrupt=None,
    ):
        cfg = model.config
        shard.check_heads(cfg.num_heads)
        self.compiled, self.shard = compiled, shard
        self.interrupt = interrupt or compat.check_interrupt
        self.model, self.device, self.settings, self.attention_config = model, device, settings, attention_config
        h, w = latent_hw
        lt = settings.len_t
        sink, window = settings.slots()
        self.schedule = released_schedule(settings.denoise, settings.context_t)
        p = cfg.patch_spatial
        self.cache = RollingKVCache(
            num_blocks=cfg.num_blocks,
            chunk_tokens=lt // cfg.patch_temporal * (h // p) * (w // p),
            window_chunks=window,
            sink_chunks=sink,
            heads=cfg.num_heads // shard.size,
            head_dim=cfg.head_dim,
            dtype=model.dtype,
            device=device,
        )
        self.generator = torch.Generator("cpu").manual_seed(int(seed))
        self.shape = (1, cfg.in_channels, lt, h, w)
        self.first_frame = first_frame
        self.chunk = 0  # index of the next chunk

    def _randn(self) -> torch.Tensor:  # drawn on CPU: the same noise on every device
        return torch.randn(self.shape, generator=self.generator, dtype=torch.float32).to(self.device)

    @torch.no_grad()
    def step(self, cross, hdmap: torch.Tensor | None = None) -> torch.Tensor:
        """One chunk: its clean model-space latent [1, 16, len_t, h, w] (float32).

        cross: the prompt's `model.cross_kv(text)` (the schedule may switch it between chunks);
        hdmap: this chunk's normalised HD-map latent [1, 16, len_t, h, w] (None: zeros)."""
        dev, sched, lt, k = self.device, self.schedule, self.settings.len_t, self.chunk
        pin = k == 0 and self.first_frame is not None
        image = inject = torch.empty(0)  # used only when pinning
        if self.first_frame is not None and pin:
            image = torch.zeros(self.shape, device=dev)  # the clean first frame at frame 0
            image[:, :, :1] = self.first_frame.to(dev, torch.float32)
            inject = torch.zeros((1, 1, lt, *self.shape[-2:]), device=dev)  # 1 where it is pinned
            inject[:, :, 0] = 1.0
        hd = hdmap.to(dev) if hdmap is not None else None
        self.cache.begin_chunk()

        def dit(x: torch.Tensor, t: float) -> torch.Tensor:
            self.interrupt()
            return self.model(
                x,
                t,
                cross,
                cond_mask=inject if pin else None,
                hdmap=hd,
                t_offset=k * lt,
                kv_cache=self.cache,
                attention_config=self.attention_config,
                compiled=self.compiled,
                shard=self.shard,
            )

        x = x0 = self._randn()  # draw 1
        for i, (sigma, t) in enumerate(zip(sched.sigmas, sched.timesteps)):
            if i:
                x = (1 - sigma) * x0 + sigma * self._randn()  # draw 2: re-noise to the next sigma
            if pin:
                x = _pin(x, image, inject)
            x0 = x - sigma * dit(x, t)
        if pin:
            x0 = _pin(x0, image, inject)  # clean first-frame latent back in
        xc = (1 - sched.context_sigma) * x0 + sched.context_sigma * self._randn()  # draw 3: context noise
        if pin:
            xc = _pin_context(xc, image, inject)
        dit(xc, sched.context_t)  # output discarded; its K/V stay in this chunk's slot
        self.chunk += 1
        return x0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "chunk": torch.tensor(self.chunk),
            "generator": self.generator.get_state(),
            **{f"kv.{key}": value for key, value in self.cache.state_dict().items()},
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from a saved state of a rollout with the same model, size and settings (checked by the cache)."""
        self.cache.load_state_dict({key[3:]: value for key, value in state.items() if key.startswith("kv.")})
        self.generator.set_state(state["generator"])
        self.chunk = int(state["chunk"])

    def close(self) -> None:
        self.cache.free()  # the window is GBs at 704x1280


@torch.no_grad()
def rollout(
    model: OmniDreamsDiT,
    text: torch.Tensor,
    *,
    num_chunks: int,
    latent_hw: tuple[int, int],
    seed: int,
    first_frame: torch.Tensor | None = None,
    hdmap: torch.Tensor | None = None,
    settings: ARSettings = ARSettings(),
    attention_config: dict | None = None,
    bar=None,
    device: torch.device,
    schedule=(),
) -> torch.Tensor:
    """Generate `num_chunks` chunks; returns the model-space latent [1, 16, len_t*N, h, w] (float32).

    hdmap: normalised HD-map latent [1,16,>=len_t*N,h,w] (None: zeros).
    schedule: ((chunk index, text), ...): the prompt from that chunk on (see `PromptCross`).
    bar: a progress bar (update(1) after each chunk; also a cancel point). Everywhere else `progress` is the
    factory that makes one (progress(total) -> bar). The rest: see `Rollout`.
    """
    run = Rollout(
        model,
        latent_hw=latent_hw,
        seed=seed,
        first_frame=first_frame,
        settings=settings,
        attention_config=attention_config,
        device=device,
    )
    return run_chunks(run, PromptCross(model, text, schedule, device), num_chunks, hdmap=hdmap, bar=bar)


def run_chunks(run: Rollout, prompts: PromptCross, num_chunks: int, *, hdmap=None, bar=None) -> torch.Tensor:
    """`num_chunks` chunks of `run` (closed afterwards, also on interrupt) as one model-space latent."""
    lt, channels = run.settings.len_t, run.model.config.out_channels
    out = torch.empty((1, channels, lt * num_chunks, *run.shape[-2:]), dtype=torch.float32, device=run.device)
    try:
        for k in range(num_chunks):
            hd = hdmap[:, :, k * lt : (k + 1) * lt] if hdmap is not None else None
            out[:, :, k * lt : (k + 1) * lt] = run.step(prompts.at(run.chunk), hd)
            if bar is not None:
                bar.update(1)
    finally:
        run.close()
    return out


# ---------------------------------------------------------------------------- context parallel (rank 0)


class DrivenRollout(Rollout):
    """Rank 0 of a context-parallel rollout. The workers mirror it (pipelines/omnidreams_parallel.py): they get the
    rollout's inputs once, then each step's HD-map latent (and the prompt, in the compute dtype, at the steps where
    it switches in), and run the same steps on their share of the tokens; the DiT gathers every chunk on every rank.
    A cancel inside a step stops all ranks at one interrupt point; anywhere else the workers are waiting for the next
    message and `close` ends their rollout."""

    def __init__(self, pool, model: OmniDreamsDiT, *, model_key: str, text: torch.Tensor, schedule=(), **kwargs):
        world = pool.world
        # local only: a setting that does not fit (heads, window) fails here, before the workers hear of the run
        super().__init__(model, shard=world.shard, interrupt=world.interrupt_point, **kwargs)
        self.prompt = PromptSwitch(text, schedule, dtype=model.dtype)  # the workers keep only the current prompt
        self._job = pool.job()
        self.world = self._job.__enter__()
        try:
            self.world.send(
                "omnidreams.rollout",
                {
                    "key": model_key,
                    "latent_hw": list(self.shape[-2:]),
                    "seed": int(kwargs["seed"]),
                    "settings": dataclasses.asdict(self.settings),
                    "attention": dataclasses.asdict(normalize_config(self.attention_config)),
                    "compiled": self.compiled,
                },
                {"first_frame": self.first_frame},
            )
        except BaseException as exc:
            self._end(exc)
            raise

    def step(self, cross, hdmap: torch.Tensor | None = None) -> torch.Tensor:
        try:
            self.world.send("step", tensors={"hdmap": hdmap, "text": self.prompt.switch(self.chunk)})
            return super().step(cross, hdmap)
        except BaseException as exc:
            self._end(exc)  # inside a step: the workers stopped with us (a cancel) or the pool is gone
            raise

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise ValueError("saving the rollout state needs world size 1: each rank holds only its heads' KV window")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise ValueError("resuming a rollout needs world size 1: each rank holds only its heads' KV window")

    def close(self) -> None:
        super().close()
        if self._job is None:
            return
        try:
            self.world.send("end")
        except BaseException as exc:
            self._end(exc)
            raise
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        if exc is None:
            job.__exit__(None, None, None)
        else:
            job.__exit__(type(exc), exc, exc.__traceback__)  # raises WorkerError if a worker died


FAMILY = "omnidreams:"


def ensure_workers(model) -> WorkerPool:
    """The running workers of `model.world_size`, each holding this model (and no other OmniDreams one)."""
    if model.load_args.get("weight_dtype") != model.load_args.get("dtype"):
        raise ValueError(
            "parallel workers compute with plain torch layers, which cannot cast fp8 weights: load the model with "
            "dtype 'auto', 'bf16', 'fp16' or 'fp32' for a world size above 1"
        )
    pool = ensure_pool(model.world_size)
    pool.ensure_model(model_key(model), "omnidreams.load", model.load_args)
    return pool


def model_key(model) -> str:
    """Names the weights a worker holds: the file (with its modification time) and the dtypes."""
    return FAMILY + json.dumps(model.load_args, sort_keys=True)


def open_rollout(model, *, text: torch.Tensor, schedule=(), **kwargs) -> Rollout:
    """The rollout of a model handle: in this process, or across its world (`model.world_size` > 1)."""
    dit = compat.loaded(model.patcher)  # ComfyUI places the weights (all, or what fits: the rest stream)
    kwargs.update(attention_config=model.attention, device=model.device)
    if model.world_size == 1:
        return Rollout(dit, **kwargs)
    pool = ensure_workers(model)
    return DrivenRollout(pool, dit, model_key=model_key(model), text=text, schedule=schedule, **kwargs)


# ---------------------------------------------------------------------------- conditioning


def resize_images(images: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """IMAGE [T,H,W,C] in [0,1] -> [T,height,width,3], resized without cropping."""
    x = images[..., :3].movedim(-1, 1).float()
    if x.shape[-2:] != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return x.clamp(0, 1).movedim(1, -1)


def check_size(width: int, height: int) -> None:
    unit = VAE_SPATIAL * 2  # VAE 8x, then the DiT's 2x2 patch
    if width % unit or height % unit or width <= 0 or height <= 0:
        raise ValueError(f"width and height must be positive multiples of {unit}; got {width}x{height}")


def check_wan21_vae(vae) -> None:
    """Before any encoding: ComfyUI's VAE object must be the Wan 2.1 VAE (16-channel video latents)."""
    channels, dims = getattr(vae, "latent_channels", None), getattr(vae, "latent_dim", None)
    network = type(getattr(vae, "first_stage_model", None)).__name__
    if channels != len(LATENT_MEAN) or dims != 3 or network not in ("WanVAE", "NoneType"):
        raise ValueError(
            f"OmniDreams needs the Wan 2.1 VAE (16-channel video latents); this VAE is {network} with "
            f"{channels} latent channels over {dims} dimensions. Load wan_2.1_vae.safetensors with Load VAE."
        )


def _vae_encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """ComfyUI's VAE.encode: IMAGE in [0,1] (it scales to [-1,1] itself) -> raw posterior mean."""
    mu = vae.encode(pixels)
    if mu.dim() != 5 or mu.shape[1] != len(LATENT_MEAN):
        raise ValueError(
            f"the VAE returned a latent of shape {tuple(mu.shape)}; OmniDreams needs the Wan 2.1 VAE "
            f"(16 latent channels, e.g. wan_2.1_vae.safetensors)"
        )
    return mu


def encode_first_frame(vae, image: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """First IMAGE frame -> normalised latent [1,16,1,height/8,width/8]."""
    check_size(width, height)
    return normalize_latent(_vae_encode(vae, resize_images(image[:1], width, height))[:, :, :1])


def encode_hdmap(vae, frames: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """HD-map video -> normalised latent [1,16,1+(F-1)//4,h,w] in one causal pass.

    Latent frames 2k, 2k+1 belong to chunk k: pixel frames [0,5) for chunk 0, then 8 per chunk.
    Trailing frames beyond the last 1+4m boundary are dropped.
    """
    check_size(width, height)
    usable = 1 + (frames.shape[0] - 1) // VAE_TEMPORAL * VAE_TEMPORAL
    return normalize_latent(_vae_encode(vae, resize_images(frames[:usable], width, height)))


# ---------------------------------------------------------------------------- sampler entry


def rollout_plan(model, conditioning, width: int, height: int) -> tuple[tuple[int, int], ARSettings]:
    """Check the model and conditioning families; (latent size, AR settings) of their rollout. The first frame (if
    encoded) fixes the size, else width x height."""
    check_family(model, "omnidreams", "model", "load it with OmniDreams Model Loader")
    check_family(conditioning, "omnidreams", "conditioning", "use OmniDreams Text Encode or Load Text Embedding")
    if conditioning.first_frame is not None:
        h, w = conditioning.first_frame.shape[-2:]
    else:
        check_size(width, height)
        h, w = height // VAE_SPATIAL, width // VAE_SPATIAL
        compat.log.warning("OmniDreams: no first frame connected; generating without an image pin")
    settings = ARSettings(len_t=model.chunk_frames, window_frames=model.window_frames, sink_frames=model.sink_frames)
    return (int(h), int(w)), settings


def sample(
    model, conditioning, *, seed: int, frames: int, steps: int, width: int, height: int, progress=None
) -> torch.Tensor:
    """The OmniDreams sampler: the video latent [1, 16, T, h, w] in raw Wan 2.1 space.

    frames: pixel frames wanted; rounded up to 8N - 3 (N chunks of 2 latent frames).
    steps: 0 or 2 (the distilled schedule). width/height: used when no first frame fixes the size.
    progress: a callable total -> object with update(n) (compat.ProgressBar).
    """
    if steps not in (0, DEFAULT_STEPS):
        raise ValueError(
            f"OmniDreams is distilled for {DEFAULT_STEPS} steps; set steps to 0 (default) or 2, not {steps}"
        )
    (h, w), settings = rollout_plan(model, conditioning, width, height)
    first = conditioning.first_frame
    n = num_chunks_for_frames(frames, settings.len_t)
    if pixel_frames(n, settings.len_t) != frames:
        compat.log.info(
            "OmniDreams: %d frames rounded up to %d (%d chunks)", frames, pixel_frames(n, settings.len_t), n
        )
    text, config = conditioning.text, model.transformer.config
    if text.dim() != 3 or text.shape[-1] != config.text_in_dim:
        raise ValueError(
            f"text embedding has shape {tuple(text.shape)}; this model needs [1, 512, "
            f"{config.text_in_dim}] (Cosmos-Reason1 full_concat)"
        )
    hdmap = conditioning.hdmap
    if hdmap is not None:
        need = settings.len_t * n
        if tuple(hdmap.shape[-2:]) != (h, w) or hdmap.shape[2] < need:
            raise ValueError(
                f"HD-map latent {tuple(hdmap.shape)} does not cover {need} latent frames at "
                f"{h}x{w}: give at least {pixel_frames(n, settings.len_t)} HD-map frames at "
                f"{w * VAE_SPATIAL}x{h * VAE_SPATIAL}"
            )
    bar = progress(n) if progress is not None else None
    try:
        run = open_rollout(
            model,
            text=text,
            schedule=conditioning.schedule,
            latent_hw=(h, w),
            seed=seed,
            first_frame=first,
            settings=settings,
        )
        z = run_chunks(run, PromptCross(run.model, text, conditioning.schedule, model.device), n, hdmap=hdmap, bar=bar)
        z = denormalize_latent(z).to(compat.intermediate_device(torch.device("cpu")))
    finally:
        compat.free_memory()  # also on interrupt or error: return the freed KV window's blocks
    return z
