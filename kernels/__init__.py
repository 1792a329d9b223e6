"""Triton kernels (CUDA; CPU under TRITON_INTERPRET=1) and their torch twins."""
