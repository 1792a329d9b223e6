"""The OmniDreams rollout, one chunk at a time: the released 2-step AR schedule with a rolling KV cache and the
clean first-frame context write.

Per chunk k (pin = k == 0), with one seeded generator and three draws in this order:
    x  = randn;                       x0 = x - 1.0 * F(x, 1000)
    x  = 0.19643 x0 + 0.80357 randn;  x0 = x - 0.80357 * F(x, 803.57);  pin x0
    xc = 0.87007 x0 + 0.12993 randn;  pin xc  <- BEFORE the K/V write;   F(xc, 128) -> cache only
F pins frame 0 of chunk 0 to the clean first-frame latent before running the DiT. Skipping the
pin before the context call would cache noise-corrupted frame-0 K/V that every later chunk
attends to: the video sharpens at frame 0 and blurs afterwards.

With `kv_finalize="skip"` (FlashDreams' skip_finalize_kv_cache; timesteps [1000, 100]) there is no third call: the
chunk's slot keeps the K/V of the second call (whose input has frame 0 pinned). The context noise is still drawn,
as FlashDreams draws it, so the generator's sequence is the same in both modes.
"""

from __future__ import annotations

import torch

from ... import compat
from ...attention.sequence_parallel import SINGLE, SequenceShard
from ...models.omnidreams.dit import OmniDreamsDiT
from ...models.omnidreams.kv_cache import FP8_STORAGE, RollingKVCache
from .prompt_schedule import PromptSwitch
from .schedule import ARSettings, released_schedule
from .static_step import StaticChunk

KV_STORAGE = {"auto": None, "fp8_e4m3fn": FP8_STORAGE}  # ARSettings.kv_dtype -> the window's storage dtype


def _pin(x: torch.Tensor, image: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    return x * (1 - inject) + image * inject


def _pin_context(xc: torch.Tensor, image: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """The clean first frame back in before the context-noise call: its K/V are what the cache keeps, so they must
    come from clean frame 0, not a noisy one (the known port bug; the regression tests take this step out)."""
    return _pin(xc, image, inject)


class Rollout:
    """The OmniDreams rollout one chunk at a time. Between chunks it carries only its state: the KV window, the
    chunk index and the noise generator (`state_dict` / `load_state_dict` save and restore it, so k chunks now and
    N - k later give the N chunks of one run, bit for bit), and the prompt it owns. Free the window with `close`
    (also on interrupt).

    text / prompt_schedule: the prompt from chunk 0 and ((chunk index, text), ...) from those chunks on; a prompt
    switched in while it runs comes through `switch_prompt` (None: none until then — a parallel worker's rollout).
    first_frame: clean normalised latent [1,16,1,h,w] pinned at frame 0 (None: no pin).
    device: where it runs (the model's load device). compiled: the DiT blocks under torch.compile. cuda_graph: once
    the window is full, each chunk runs on static buffers (`static_step.StaticChunk`), captured as a CUDA graph and
    replayed where the device can (eagerly elsewhere); its one cancel point is before the chunk.
    shard: this rank's share of a context-parallel rollout (every rank runs the same steps on the same noise; the
    DiT splits each chunk's tokens and this rank's window holds its heads); interrupt: the cancel point before each
    DiT call (default: ComfyUI's; in a parallel run one that all ranks pass together).
    """

    def __init__(
        self,
        dit: OmniDreamsDiT,
        *,
        text: torch.Tensor | None,
        prompt_schedule=(),
        latent_hw: tuple[int, int],
        seed: int,
        first_frame: torch.Tensor | None = None,
        settings: ARSettings = ARSettings(),
        attention_config: dict | None = None,
        device: torch.device,
        compiled: bool = False,
        cuda_graph: bool = False,
        shard: SequenceShard = SINGLE,
        interrupt=None,
    ):
        cfg = dit.config
        shard.check_heads(cfg.num_heads)
        self.compiled, self.shard = compiled, shard
        self.interrupt = interrupt or compat.check_interrupt
        self.dit, self.device, self.settings, self.attention_config = dit, device, settings, attention_config
        self.prompts = PromptSwitch(text, prompt_schedule, dtype=dit.dtype, device=device)
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []  # the K/V of the prompt that holds
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
            dtype=dit.dtype,
            device=device,
            block_window_chunks=settings.block_window_chunks(cfg.num_blocks),
            storage_dtype=KV_STORAGE[settings.kv_dtype],
        )
        self.generator = torch.Generator("cpu").manual_seed(int(seed))
        self.shape = (1, cfg.in_channels, lt, h, w)
        self.first_frame = first_frame
        self.chunk = 0  # index of the next chunk
        self.static = StaticChunk(self) if cuda_graph else None

    def draw(self) -> torch.Tensor:
        """The next noise draw, on the CPU: the same noise on every device."""
        return torch.randn(self.shape, generator=self.generator, dtype=torch.float32)

    def switch_prompt(self, chunk: int, text: torch.Tensor) -> None:
        """`text` from `chunk` on: the one way a prompt switches in while the rollout runs (a live session's prompt,
        a worker told by rank 0); the prompt schedule's entries from that chunk on give way."""
        self.prompts.override(chunk, text)

    @torch.no_grad()
    def _next_prompt(self) -> torch.Tensor | None:
        """The prompt that switches in at this chunk, its K/V computed (None while the one that holds goes on)."""
        text = self.prompts.switch(self.chunk)
        if text is None:
            return None
        if self.static is not None and self.cross:  # a chunk on static buffers reads these: refilled in place
            for (k, v), (new_k, new_v) in zip(self.cross, self.dit.cross_kv(text)):
                k.copy_(new_k)
                v.copy_(new_v)
        else:
            self.cross = []  # the previous prompt's K/V go first
            self.cross = self.dit.cross_kv(text)
        return text

    def step(self, hdmap: torch.Tensor | None = None) -> torch.Tensor:
        """One chunk: its clean model-space latent [1, 16, len_t, h, w] (float32).

        hdmap: this chunk's normalised HD-map latent [1, 16, len_t, h, w] (None: zeros)."""
        self._next_prompt()
        return self._chunk(hdmap)

    def denoise(self, draw, flow, pin=None, pin_context=None) -> torch.Tensor:
        """A chunk's arithmetic (the module's note): draw(i) -> the i-th noise (the last: the context noise), flow(x,
        i) -> the DiT at the i-th timestep (the last: the context write); pin / pin_context put the clean first frame
        in (chunk 0 only). Both the eager step and the static one run it."""
        sched, keep = self.schedule, (lambda x: x)
        pin, pin_context = pin or keep, pin_context or keep
        x0 = torch.empty(0)
        for i, sigma in enumerate(sched.sigmas):
            x = pin(draw(i) if i == 0 else (1 - sigma) * x0 + sigma * draw(i))  # later: re-noised to this sigma
            x0 = x - sigma * flow(x, i)
        x0 = pin(x0)  # the clean first-frame latent back in
        context_noise = draw(len(sched.sigmas))  # drawn in both kv_finalize modes
        if self.settings.kv_finalize == "context_noise":
            xc = pin_context((1 - sched.context_sigma) * x0 + sched.context_sigma * context_noise)
            flow(xc, len(sched.sigmas))  # output discarded; its K/V stay in this chunk's slot
        return x0

    def _steady(self) -> bool:
        """Whether this chunk (its window slot taken) runs as every later one: the window full, nothing pinned."""
        return self.cache.used == self.cache.slots and not (self.chunk == 0 and self.first_frame is not None)

    @torch.no_grad()
    def _chunk(self, hdmap: torch.Tensor | None) -> torch.Tensor:
        """The steps of one chunk with the prompt that holds."""
        dev, sched, lt, k = self.device, self.schedule, self.settings.len_t, self.chunk
        self.cache.begin_chunk()
        if self.static is not None and self._steady():  # the window full and nothing pinned: chunk 2 on by default
            x0 = self.static(hdmap)
            self.chunk += 1
            return x0
        pins, inject = {}, None
        if k == 0 and self.first_frame is not None:
            image = torch.zeros(self.shape, device=dev)  # the clean first frame at frame 0
            image[:, :, :1] = self.first_frame.to(dev, torch.float32)
            inject = torch.zeros((1, 1, lt, *self.shape[-2:]), device=dev)  # 1 where it is pinned
            inject[:, :, 0] = 1.0
            pins = dict(pin=lambda x: _pin(x, image, inject), pin_context=lambda x: _pin_context(x, image, inject))
        hd = hdmap.to(dev) if hdmap is not None else None
        times = (*sched.timesteps, sched.context_t)

        def flow(x: torch.Tensor, i: int) -> torch.Tensor:
            self.interrupt()
            return self.dit(
                x,
                times[i],
                self.cross,
                cond_mask=inject,
                hdmap=hd,
                t_offset=k * lt,
                kv_cache=self.cache,
                attention_config=self.attention_config,
                compiled=self.compiled,
                shard=self.shard,
            )

        x0 = self.denoise(lambda i: self.draw().to(dev), flow, **pins)
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
        if self.static is not None:
            self.static.release()
        self.cross = []  # the prompt's K/V (0.1 GB at 2B) go with the window
        self.cache.free()  # the window is GBs at 704x1280


@torch.no_grad()
def rollout(
    dit: OmniDreamsDiT,
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
    prompt_schedule=(),
    compiled: bool = False,
    cuda_graph: bool = False,
) -> torch.Tensor:
    """Generate `num_chunks` chunks; returns the model-space latent [1, 16, len_t*N, h, w] (float32).

    hdmap: normalised HD-map latent [1,16,>=len_t*N,h,w] (None: zeros).
    prompt_schedule: ((chunk index, text), ...): the prompt from that chunk on (see `Rollout`).
    bar: a progress bar (update(1) after each chunk; also a cancel point). Everywhere else `progress` is the
    factory that makes one (progress(total) -> bar). The rest: see `Rollout`.
    """
    run = Rollout(
        dit,
        text=text,
        prompt_schedule=prompt_schedule,
        latent_hw=latent_hw,
        seed=seed,
        first_frame=first_frame,
        settings=settings,
        attention_config=attention_config,
        device=device,
        compiled=compiled,
        cuda_graph=cuda_graph,
    )
    return run_chunks(run, num_chunks, hdmap=hdmap, bar=bar)


def run_chunks(run: Rollout, num_chunks: int, *, hdmap=None, bar=None) -> torch.Tensor:
    """`num_chunks` chunks of `run` (closed afterwards, also on interrupt) as one model-space latent."""
    lt, channels = run.settings.len_t, run.dit.config.out_channels
    out = torch.empty((1, channels, lt * num_chunks, *run.shape[-2:]), dtype=torch.float32, device=run.device)
    try:
        for k in range(num_chunks):
            hd = hdmap[:, :, k * lt : (k + 1) * lt] if hdmap is not None else None
            out[:, :, k * lt : (k + 1) * lt] = run.step(hd)
            if bar is not None:
                bar.update(1)
    finally:
        run.close()
    return out
