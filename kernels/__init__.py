"""Triton kernels of the Wan VAE decode (CUDA; CPU under TRITON_INTERPRET=1) and their torch twins; their
registrations live in kernels/registrations.py (imported by the decode that resolves them). This __init__
stays import-free: with the repository root on sys.path, libraries probing for a top-level `kernels`
package (diffusers does) import this one."""
