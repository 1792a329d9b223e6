"""Run a worker: `python <pack>/parallel/worker_entry.py` (what WorkerPool starts, and what torchrun runs).

The pack is a ComfyUI custom-node folder, importable under no fixed name, so it is registered here as the package
`omnivideo` (without running its __init__, which registers ComfyUI nodes) and the worker imported from it.
"""

import importlib
import sys
import types
from pathlib import Path

if __name__ == "__main__":
    sys.path.pop(0)  # this script's folder: its modules are the package's, not top-level ones
    root = Path(__file__).resolve().parents[1]
    if "omnivideo" not in sys.modules:
        package = types.ModuleType("omnivideo")
        package.__path__ = [str(root)]
        sys.modules["omnivideo"] = package
    importlib.import_module("omnivideo.parallel.worker").main()
