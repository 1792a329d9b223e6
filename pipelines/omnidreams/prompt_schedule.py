"""The prompt schedule: parsed from its text ('0: a car at dusk, 40: rain starts'), each distinct prompt encoded
once, and which prompt holds at each chunk (the rollout that owns the switch computes its cross-attention K/V)."""

from __future__ import annotations

import bisect
import re

import torch

MAX_PROMPT_SCHEDULE_CHARS = 65536
MAX_PROMPT_SCHEDULE_ENTRIES = 256
# The distinct prompts' embeddings (float32, held by the conditioning in ComfyUI's cache for as long as the workflow
# is cached): 4 GiB is 20 prompts of Cosmos-Reason1 7B (512 x 100352 float32 = 196 MiB each), a new one every 6.4
# chunks (1.7 s) of the longest video the sampler makes (128 chunks), and small beside the 16 GB encoder itself.
MAX_PROMPT_SCHEDULE_BYTES = 4 * 2**30
_ENTRY = re.compile(r"(?:^|[,\n])[ \t]*(\d{1,6})[ \t]*:")  # "<chunk>:" at the start, after a comma or a newline


def parse_prompt_schedule(text: str) -> list[tuple[int, str]]:
    """'0: a car at dusk, 40: rain starts' -> [(0, 'a car at dusk'), (40, 'rain starts')]: each prompt holds
    from its chunk index until the next entry's. Linear time; bounded length and entry count."""
    if not isinstance(text, str) or len(text) > MAX_PROMPT_SCHEDULE_CHARS:
        raise ValueError(f"the prompt schedule must be text of at most {MAX_PROMPT_SCHEDULE_CHARS} characters")
    matches = list(_ENTRY.finditer(text))
    if not matches or text[: matches[0].start()].strip():
        raise ValueError(
            "the prompt schedule must start with a chunk index and a colon, e.g. '0: a car at dusk, 40: rain "
            "starts' (entries start at the beginning, after a comma or on a new line)"
        )
    if len(matches) > MAX_PROMPT_SCHEDULE_ENTRIES:
        raise ValueError(f"the prompt schedule has {len(matches)} entries; at most {MAX_PROMPT_SCHEDULE_ENTRIES}")
    entries: list[tuple[int, str]] = []
    for m, end in zip(matches, [n.start() for n in matches[1:]] + [len(text)]):
        chunk, prompt = int(m.group(1)), text[m.end() : end].strip()
        if not prompt:
            raise ValueError(f"the prompt schedule entry for chunk {chunk} is empty")
        if entries and chunk <= entries[-1][0]:
            raise ValueError(f"prompt schedule chunk indices must increase: {chunk} follows {entries[-1][0]}")
        entries.append((chunk, prompt))
    return entries


def encode_prompt_schedule(
    entries: list[tuple[int, str]], encode, embedding_bytes: int
) -> list[tuple[int, torch.Tensor]]:
    """A parsed schedule's (chunk, embedding) pairs: each distinct prompt encoded once (`encode(prompt)`), the entries
    that repeat it share its tensor. Their total size (`embedding_bytes` each) is checked before anything is encoded."""
    prompts = list(dict.fromkeys(prompt for _, prompt in entries))
    total, limit = len(prompts) * embedding_bytes, MAX_PROMPT_SCHEDULE_BYTES
    if total > limit:
        raise ValueError(
            f"the prompt schedule has {len(prompts)} distinct prompts; their embeddings ({embedding_bytes / 2**20:.0f} "
            f"MiB each, {total / 2**30:.1f} GiB) exceed the limit of {limit / 2**30:.0f} GiB: use at most "
            f"{limit // embedding_bytes} distinct prompts (an entry that repeats a prompt's text exactly "
            "costs nothing)"
        )
    encoded = {prompt: encode(prompt) for prompt in prompts}
    return [(chunk, encoded[prompt]) for chunk, prompt in entries]


class PromptSwitch:
    """Which prompt holds at each chunk (the conditioning's text, then its prompt schedule, then the prompts switched
    in while running) and when another switches in. Entries that share one tensor (a repeated prompt, see
    `encode_prompt_schedule`) are one prompt: no switch between them. A rollout owns one (`Rollout.switch_prompt`)."""

    def __init__(
        self, text: torch.Tensor | None, prompt_schedule=(), *, dtype: torch.dtype, device: torch.device | None = None
    ):
        # later entries: chunk > 0, rising. No text: none until one is switched in (a parallel worker's rollout)
        self.entries: list[tuple[int, torch.Tensor]] = [(0, text), *prompt_schedule] if text is not None else []
        self.starts = [start for start, _ in self.entries]
        self.dtype, self.device = dtype, device
        self.active: torch.Tensor | None = None

    def override(self, chunk: int, text: torch.Tensor) -> None:
        """`text` from `chunk` on (a live session's prompt): the schedule's entries from that chunk on give way."""
        keep = bisect.bisect_left(self.starts, chunk)
        self.entries = [*self.entries[:keep], (chunk, text)]
        self.starts = [start for start, _ in self.entries]

    def switch(self, chunk: int) -> torch.Tensor | None:
        """The prompt that switches in at `chunk`, in the compute dtype on the device (the one copy a rollout keeps
        or sends); None while the active one holds. Chunks only go forward: the entries before it are let go."""
        current = bisect.bisect_right(self.starts, chunk) - 1
        if current < 0:
            raise ValueError(f"no prompt holds at chunk {chunk}")
        text = self.entries[current][1]
        del self.entries[:current], self.starts[:current]
        if text is self.active:
            return None
        self.active = text
        return text.to(self.device, self.dtype)
