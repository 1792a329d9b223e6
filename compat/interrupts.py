"""The cancel button: ComfyUI's interrupt flag inside ComfyUI, a flag of our own outside it (tests, scripts), and a
parallel job's deferral of a cancel to the point every rank shares."""

from __future__ import annotations

import contextlib

from .comfyui import HAS_COMFY, mm, ops


class ProcessingInterrupted(RuntimeError):
    """Raised by `check_interrupt` outside ComfyUI when `request_interrupt` was called."""


_interrupt_requested = False


def request_interrupt() -> None:
    """Standalone stand-in for ComfyUI's cancel button (tests use it)."""
    global _interrupt_requested
    _interrupt_requested = True


def is_interrupt(exc: BaseException) -> bool:
    """Whether `exc` is a cancel (ComfyUI's, or `request_interrupt`'s outside it), not a failure."""
    if HAS_COMFY and isinstance(exc, mm.InterruptProcessingException):
        return True
    return isinstance(exc, ProcessingInterrupted)


def check_interrupt() -> None:
    """A cancel point: raises if the user pressed cancel in ComfyUI."""
    global _interrupt_requested
    if HAS_COMFY:
        mm.throw_exception_if_processing_interrupted()
    elif _interrupt_requested:
        _interrupt_requested = False
        raise ProcessingInterrupted("processing interrupted")


@contextlib.contextmanager
def cancel_at_shared_points():
    """Inside: a cancel that ComfyUI's cast layers see (0.33 checks the flag in every layer forward,
    comfy.ops.run_every_op) stays pending instead of raising, until the next `check_interrupt`. A parallel job (rank 0)
    runs inside this, so a cancel stops every rank together at its shared interrupt point rather than rank 0 alone
    between two collectives (the workers would wait in the next one). Nothing changes outside ComfyUI or on 0.3.64."""
    check = getattr(ops, "run_every_op", None)
    if check is None or getattr(check, "omnivideo_deferring", False):
        yield
        return

    def run_every_op():
        try:
            check()
        except mm.InterruptProcessingException:
            mm.interrupt_current_processing(True)  # the check consumed the flag: set it again for the shared point

    run_every_op.omnivideo_deferring = True  # type: ignore[attr-defined]
    ops.run_every_op = run_every_op
    try:
        yield
    finally:
        ops.run_every_op = check
