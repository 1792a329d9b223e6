"""Attention for every model of the pack: what the rows of a call are (rows.py), the settings and dispatch
through the backend registry (dispatch.py, which also loads registrations.py), and the implementations (torch,
flex, Triton, Ascend NPU) with RainFusion's block plan."""
