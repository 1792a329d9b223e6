"""Inside a real ComfyUI with the pack loaded from custom_nodes (as ComfyUI names it: a module named after its folder):
nothing of the pack is a top-level module, transformers' hub kernels import, and `kernels` is the PyPI one (or
absent). The facts: support/import_isolation.py, read in the server by the probe pack's OmniVideoTestImports node."""


def test_the_pack_is_isolated_inside_comfyui(comfy_server):
    outputs = comfy_server.run({"1": {"class_type": "OmniVideoTestImports", "inputs": {}}})["outputs"]["1"]
    report = outputs["imports"][0]
    assert len(report["packages"]) == 1 and report["packages"][0].endswith("omnivideo"), report  # loaded, once
    problems = {k: v for k, v in report.items() if k != "packages" and v}
    assert not problems, problems
