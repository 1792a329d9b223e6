"""Pin the /object_info entries of the core nodes the workflow validator knows (tests/test_workflows.py) from a real
ComfyUI: starts it headless (tests/integration/conftest.py's server, on 127.0.0.1) and writes
tests/support/core_object_info_<version>.json, the version being the one that server reports in /system_stats.
Model- and input-folder choices are emptied (they depend on the machine).

    COMFYUI_PYTHON=.comfy33-venv/bin/python python tests/support/pin_core_object_info.py ../shared/comfyui-0.33

Not a test module (no test_ prefix); run it by hand when a supported ComfyUI version is added.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
FILE_INPUTS = {"vae_name", "unet_name", "clip_name", "image", "file", "latent"}  # = workflow_validator.FILE_INPUTS


def core_names() -> list[str]:
    """The nodes of the existing pins: the ones the validator (and so the workflows) use."""
    return sorted(
        {name for pin in SUPPORT.glob("core_object_info_*.json") for name in json.loads(pin.read_text("utf-8"))}
    )


def pinned_entry(info: dict) -> dict:
    info = json.loads(json.dumps(info))
    for group in info["input"].values():
        for name, entry in group.items():
            if name not in FILE_INPUTS:
                continue
            if isinstance(entry[0], list):  # V1 combo: the list itself
                entry[0] = []
            elif entry[0] == "COMBO":  # V3 combo: its options
                entry[1]["options"] = []
    return info


def main(comfy_path: str) -> Path:
    sys.path.insert(0, str(TESTS))
    spec = importlib.util.spec_from_file_location(
        "omnivideo_integration_conftest", TESTS / "integration" / "conftest.py"
    )
    server_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = server_module  # dataclasses look their module up there
    spec.loader.exec_module(server_module)
    with tempfile.TemporaryDirectory() as root:
        with server_module.running_comfyui(Path(root), str(Path(comfy_path).resolve()), with_vae=False) as server:
            version = server.get_json("/system_stats")["system"]["comfyui_version"]
            object_info = server.get_json("/object_info", timeout=120)
    # a node newer than this ComfyUI (core's MiniMax-H3 nodes before 0.33) is left out of its pin
    pin = {name: pinned_entry(object_info[name]) for name in core_names() if name in object_info}
    out = SUPPORT / f"core_object_info_{version}.json"
    out.write_text(json.dumps(pin, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    print(main(sys.argv[1]))
