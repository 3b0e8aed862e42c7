"""A bare TCP server on 127.0.0.1 for tests that need what an HTTP server library would never
send: each accepted connection goes to `handle` on a thread of its own."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class RawServer:
    """Hands every connection to `handle(connection)`; an OSError there ends that connection
    only. `stop` is set by close(), for handlers that wait."""

    def __init__(self, handle: Callable[[socket.socket], None], backlog: int = 16) -> None:
        self.handle = handle
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(backlog)
        self.port = int(self.sock.getsockname()[1])
        self.stop = threading.Event()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self.handle(conn)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
