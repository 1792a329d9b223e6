"""pyproject.toml as the registry reads it: comfy-cli's own parser (what `comfy node publish` sends) must keep the
ComfyUI and frontend ranges, which it drops silently (a warning, then an empty field) when a bound is not
major.minor.patch."""

from __future__ import annotations

from pathlib import Path

import tomllib
from comfy_cli.registry.config_parser import extract_node_configuration

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_comfy_cli_publishes_the_comfyui_and_frontend_ranges(capsys):
    declared = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    config = extract_node_configuration(str(PYPROJECT))
    warnings = capsys.readouterr().out
    assert config is not None, warnings
    assert "Invalid" not in warnings, warnings
    assert config.project.supported_comfyui_version == declared["tool"]["comfy"]["requires-comfyui"]
    assert config.project.supported_comfyui_version.startswith(">=0.3.64"), config.project.supported_comfyui_version
    (frontend,) = [d for d in declared["project"]["dependencies"] if d.startswith("comfyui-frontend-package")]
    assert config.project.supported_comfyui_frontend_version == frontend.removeprefix("comfyui-frontend-package")
    assert config.project.supported_comfyui_frontend_version  # a range was kept, not dropped
    assert not any(d.startswith("comfyui-frontend-package") for d in config.project.dependencies)  # stripped


def test_the_old_range_is_refused_by_the_same_check(tmp_path, capsys):
    """Negative control: the range published before (an upper bound without a patch number) comes out empty."""
    old = PYPROJECT.read_text(encoding="utf-8").replace(
        'requires-comfyui = ">=0.3.64"', 'requires-comfyui = ">=0.3.64,<0.34"'
    )
    assert old != PYPROJECT.read_text(encoding="utf-8")
    (tmp_path / "pyproject.toml").write_text(old, encoding="utf-8")
    config = extract_node_configuration(str(tmp_path / "pyproject.toml"))
    assert config is not None and config.project.supported_comfyui_version == ""
    assert "No requires-comfyui will be populated" in capsys.readouterr().out
