"""Tiny random OmniDreams checkpoints and a tiny Cosmos-Reason1: the pack's builders (omnivideo/selftest/tiny),
re-exported under the name the tests and benchmarks import."""

from omnivideo.selftest.tiny.omnidreams import (  # noqa: F401
    CHAT_TEMPLATE,
    MID,
    TEXT_HIDDEN,
    TEXT_LAYERS,
    TINY,
    TINY_4_HEADS,
    WORDS,
    stored_state_dict,
    write_tiny_cosmos_reason1,
)
