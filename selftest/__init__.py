"""`python -m omnivideo.selftest`: one command that proves an install (run.py), and what it shares with the test
suite: the headless ComfyUI server (server.py), the tiny random-weight models (tiny/), the shipped workflows at
small size (workflows.py), the kernel-vs-twin checks (kernels.py). Imports nothing at package import."""
