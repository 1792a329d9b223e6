"""The pack's one "say it once per process" logger: the reasons a backend or a dense fallback was chosen repeat
on every call, the log line must not."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("omnivideo")
_said: set[tuple] = set()
_lock = threading.Lock()  # models run on several threads at once (core's MultiGPU CFG Split)


def log_once(key: tuple, level: int, message: str, *args) -> bool:
    """Log `message % args` the first time `key` is seen; True when it was logged now."""
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    log.log(level, message, *args)
    return True


def forget() -> None:
    """Log everything again (tests)."""
    _said.clear()
