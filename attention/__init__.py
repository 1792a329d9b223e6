"""Attention for every model of the pack: layout metadata, the settings and dispatch through the backend
registry (dispatch.py, which also loads registrations.py), and the implementations (torch, flex, Triton,
Ascend NPU) with RainFusion's block plan."""
