"""OmniVideo Backend Info: what a user pastes into a bug report."""

from __future__ import annotations

from ..backends import backend_report
from ..compat import io
from ..integration.attention_patch import describe_notes
from ..parallel.pool import describe_pool


class OmniVideoBackendInfo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="OmniVideoBackendInfo",
            display_name="OmniVideo Backend Info",
            category="OmniVideo/utils",
            description=(
                "Platform, versions, which implementation each operation resolves to (and why), the parallel "
                "workers (OmniVideo Parallel) running and the other attention patches seen on patched models."
            ),
            inputs=[],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls) -> io.NodeOutput:
        report = _report()
        return io.NodeOutput(report, ui={"text": [report]})

    @classmethod
    def fingerprint_inputs(cls):
        return _report()  # re-run when the environment or the workers change


def _report() -> str:
    return f"{backend_report()}\n{describe_pool()}\n{describe_notes()}"
