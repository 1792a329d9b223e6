"""Every custom ComfyUI socket type of the pack (the objects travelling on them are defined in models/handles.py
and the family packages)."""

from ..compat import io

ModelType = io.Custom("OMNIVIDEO_MODEL")
ConditioningType = io.Custom("OMNIVIDEO_CONDITIONING")
TextEncoderType = io.Custom("OMNIVIDEO_TEXT_ENCODER")
AttentionType = io.Custom("OMNIVIDEO_ATTENTION")
H3VaeType = io.Custom("OMNIVIDEO_H3_VAE")
H3AudioVaeType = io.Custom("OMNIVIDEO_H3_AUDIO_VAE")
KeyframesType = io.Custom("OMNIVIDEO_H3_KEYFRAMES")
H3ReferenceListType = io.Custom("OMNIVIDEO_H3_REFERENCE_LIST")  # ref2va media, in the order they were chained
H3ReferencesType = io.Custom("OMNIVIDEO_H3_REFERENCES")  # ref2va references put on a canvas and encoded
