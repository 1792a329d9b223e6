"""Shared Wan VAE test fixtures: the pack's builders (omnivideo/selftest/tiny/wan.py), re-exported under the name
the tests and benchmarks import."""

from omnivideo.selftest.tiny.wan import (  # noqa: F401
    COMFY_FULL,
    COMFY_GEOMETRY,
    random_wan_state_dict,
    to_original_names,
)
