"""Test-wide settings. Triton kernels run on CPU through the interpreter, which must be
switched on before any kernel module is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMNIVIDEO_DEVICE", "")  # detection, unless a test overrides it
torch.backends.cudnn.benchmark = False  # bit-equality on GPU needs deterministic algorithm choice
