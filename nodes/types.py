"""Custom ComfyUI socket types shared by our nodes (objects defined in models/handles.py)."""

from ..compat import io

ModelType = io.Custom("OMNIVIDEO_MODEL")
ConditioningType = io.Custom("OMNIVIDEO_CONDITIONING")
TextEncoderType = io.Custom("OMNIVIDEO_TEXT_ENCODER")
AttentionType = io.Custom("OMNIVIDEO_ATTENTION")
