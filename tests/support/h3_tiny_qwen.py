"""A tiny Qwen3-VL and its byte-level tokenizer: the pack's builders (omnivideo/selftest/tiny/h3_qwen.py),
re-exported under the name the tests import."""

from omnivideo.selftest.tiny.h3_qwen import LAYER, tiny_processor, tiny_qwen3vl, write_text_encoder_folder  # noqa: F401
