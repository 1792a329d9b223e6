"""ComfyUI's server and the prompt it runs: our HTTP routes on its route table, the running node and the queue, text
on the running node, websocket messages to the client that queued it. Each is a no-op (or empty) outside ComfyUI."""

from __future__ import annotations

import logging

log = logging.getLogger("omnivideo")


def _prompt_server():
    try:
        from server import PromptServer

        return getattr(PromptServer, "instance", None)
    except Exception:  # outside ComfyUI
        return None


def _executing_context():
    """ComfyUI's context of the node it runs now; None outside one (raises outside ComfyUI or on an older one)."""
    from comfy_execution.utils import get_executing_context

    return get_executing_context()


def show_text(text: str) -> None:
    """Text on the running node in ComfyUI's UI (and in the log); only the log outside ComfyUI."""
    log.info(text)
    try:
        context = _executing_context()
        if context is not None:
            _prompt_server().send_progress_text(text, context.node_id)
    except Exception:  # outside ComfyUI or an older one: the log line is enough
        pass


def add_routes(install) -> bool:
    """`install(routes)` on ComfyUI's route table (aiohttp's RouteTableDef; call it before the server starts, e.g. from
    comfy_entrypoint). False outside a ComfyUI server."""
    server = _prompt_server()
    if server is None:
        return False
    install(server.routes)
    return True


def running_node() -> tuple[str, str] | None:
    """(prompt id, node id) of the node ComfyUI is running now, None outside one."""
    try:
        context = _executing_context()
    except Exception:
        return None
    return None if context is None else (str(context.prompt_id), str(context.node_id))


def queued_prompts() -> list[tuple[str, dict]]:
    """(prompt id, API graph) of every prompt running or waiting in ComfyUI's queue; [] outside ComfyUI."""
    queue = getattr(_prompt_server(), "prompt_queue", None)
    try:
        running, pending = queue.get_current_queue_volatile()  # type: ignore[union-attr]
    except Exception:
        return []
    return [(str(item[1]), item[2]) for item in (*running, *pending) if len(item) > 2 and isinstance(item[2], dict)]


def tell_client(event: str, data: dict) -> bool:
    """A websocket message to the client that queued the running prompt only (never a broadcast: what it carries may
    be that client's alone); False when there is none (queued without a client_id, or outside ComfyUI)."""
    server = _prompt_server()
    client = getattr(server, "client_id", None)
    if server is None or client is None:
        return False
    server.send_sync(event, data, client)
    return True
