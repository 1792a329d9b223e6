"""Run by tests/test_h3_core_files.py in ComfyUI 0.33's interpreter (COMFYUI_PYTHON): every tiny single-file H3
layout of tests/support/h3_core_files.py is loaded by core's own `comfy.sd.load_diffusion_model` (detection,
quantized layers) and by our H3 loader; each layer's weights from ours (in core's key names) must equal core's,
dequantized, bit for bit in fp32. Prints one `PROBE_RESULT <json>` line.

Not a test module itself (no test_ prefix).
"""

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.environ["COMFYUI_PATH"])
sys.path.insert(0, str(Path(__file__).parent))  # tests/support
from comfy.cli_args import args  # noqa: E402

args.cpu = True

import comfy.sd  # noqa: E402
from support.h3_core_files import core_files  # noqa: E402
from support.h3_tiny import make_models, to_original_keys, write_folder  # noqa: E402

from omnivideo.models.h3.loader import load_h3  # noqa: E402


class Complaints(logging.Handler):
    """core's 'unet missing / unexpected' warnings and 'left over keys' note while it loads a file."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        text = record.getMessage()
        if text.startswith(("unet missing", "unet unexpected", "left over keys")):
            self.lines.append(text[:300])


def plain(tensor) -> torch.Tensor:
    return (tensor.dequantize() if hasattr(tensor, "dequantize") else tensor).to(torch.float32)


def main():
    transformer, vae, audio_vae = make_models(seed=5)
    base = Path(tempfile.mkdtemp())
    root = write_folder(base / "folder", transformer, vae, audio_vae)
    complaints = Complaints()
    logging.getLogger().addHandler(complaints)
    logging.getLogger().setLevel(logging.DEBUG)
    result = {}
    for name, path in core_files(transformer, base).items():
        complaints.lines.clear()
        core = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
        net = core.model.diffusion_model
        # each parameter as the layer holds it (a QuantizedTensor for core's mixed-precision layers), dequantized
        theirs = {k: plain(v) for k, v in [*net.named_parameters(), *net.named_buffers()]}
        ours = load_h3(root, "fp32", transformer_file=path, device=torch.device("cpu"))[0].transformer
        mine = {**to_original_keys(ours.state_dict()), "rope.inv_freq": ours.rope.inv_freq}
        if "time_embedder.adaln_t_table" in mine:  # a pruned file: core keeps the table at the top level
            mine["adaln_t_table"] = mine.pop("time_embedder.adaln_t_table")
        result[name] = {
            "image_model": core.model.model_config.unet_config.get("image_model"),
            "core_complaints": list(complaints.lines),
            "only_in_core": sorted(set(theirs) - set(mine))[:5],
            "only_in_ours": sorted(set(mine) - set(theirs))[:5],
            "differ": sorted(k for k in set(theirs) & set(mine) if not torch.equal(theirs[k], mine[k].float()))[:5],
            "quantized_in_core": sum(type(v).__name__ == "QuantizedTensor" for v in net.parameters()),
        }
    print("PROBE_RESULT " + json.dumps(result))


main()
