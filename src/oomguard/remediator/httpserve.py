"""Serving an ASGI app with uvicorn so that the caller's cleanup runs on SIGTERM.

uvicorn restores the previous signal handlers after a graceful shutdown and re-raises the signal
it caught. With Python's default handler that kills the process before a `finally:` can stop
what it started (the supervisor's vLLM child, the remediator's scheduler). A handler that only
notes the signal is installed first, so the re-raised signal is harmless and `run` returns.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import uvicorn


def run(app: Any, host: str, port: int) -> None:
    def note(signum: int, frame: FrameType | None) -> None:
        pass  # uvicorn's own handler did the work; this one only keeps the process alive

    previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
        uvicorn.Server(config).run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
