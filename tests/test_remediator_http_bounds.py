"""The remediator's HTTP server against many and slow clients (issue 25 item 6), the real
process: connections beyond the cap are refused at once, a client that does not send its
request whole in time is cut, and the API answers again as soon as the slots are free."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from oomguard.lab.processes import RemediatorProcess, free_port


@pytest.mark.slow  # waits out a restart backoff (seconds)
def test_connections_are_capped_and_slow_clients_cut(tmp_path):
    config = {
        "listen": f"127.0.0.1:{free_port()}",
        "auth": {"allow_unauthenticated": True},
        "targets": [{"name": "a", "url": f"http://127.0.0.1:{free_port()}"}],
        "audit_log": str(tmp_path / "audit.jsonl"),
        "max_connections": 20,
        "request_timeout_seconds": 2,
    }
    proc = RemediatorProcess(tmp_path, config)
    host, port = config["listen"].rsplit(":", 1)
    sockets: list[socket.socket] = []
    try:
        threads_before = _threads(proc.proc.pid)
        for _ in range(40):  # slowloris: half a request head each, then nothing
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            sockets.append(s)
            time.sleep(0.01)
        refused = [s for s in sockets if _answer(s, 1.0).startswith(b"HTTP/1.1 503")]
        assert len(refused) >= 15, len(refused)  # 20 slots; the rest answered 503 and closed
        # the slow ones are cut within the request timeout (2 s), whatever they send later
        started = time.monotonic()
        open_ones = [s for s in sockets if s not in refused]
        closed = [s for s in open_ones if _closed(s, 10.0)]
        assert len(closed) == len(open_ones)
        assert time.monotonic() - started < 10
        r = httpx.get(f"{proc.url}/healthz", timeout=5)  # slots free again: served
        assert r.status_code == 200
        assert _threads(proc.proc.pid) <= threads_before + 2  # coroutines, not threads
    finally:
        for s in sockets:
            s.close()
        proc.kill()


def _answer(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    try:
        return s.recv(4096)
    except (TimeoutError, OSError):
        return b""


def _closed(s: socket.socket, timeout: float) -> bool:
    """True once the server closed the connection (EOF or reset) within `timeout`."""
    s.settimeout(timeout)
    try:
        while data := s.recv(4096):
            if b"HTTP/1.1 408" in data:
                continue
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (TimeoutError, OSError):
        return False


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def test_connections_that_do_nothing_give_way_to_a_new_client(tmp_path):
    """Found: clients holding the cap with kept-alive connections (one request every few
    seconds keeps them within the idle limit) or with request heads that never end made every
    new connection 503, Alertmanager's webhooks included. Now a new client takes the place of
    the connection that has done nothing the longest; 503 only while every one is busy."""
    config = {
        "listen": f"127.0.0.1:{free_port()}",
        "auth": {"allow_unauthenticated": True},
        "targets": [{"name": "a", "url": f"http://127.0.0.1:{free_port()}"}],
        "audit_log": str(tmp_path / "audit.jsonl"),
        "max_connections": 4,
        "request_timeout_seconds": 30,
    }
    proc = RemediatorProcess(tmp_path, config)
    host, port = config["listen"].rsplit(":", 1)
    sockets: list[socket.socket] = []
    try:
        for _ in range(4):  # kept alive after one answer each
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _answer(s, 10).startswith(b"HTTP/1.1 200")
            sockets.append(s)
        r = httpx.get(f"{proc.url}/healthz", timeout=5)
        assert r.status_code == 200
        for s in sockets:
            s.close()
        sockets.clear()
        time.sleep(0.5)
        for _ in range(4):  # half a request head each, then nothing
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            sockets.append(s)
        time.sleep(1.5)  # slower than any real client's head
        r = httpx.get(f"{proc.url}/healthz", timeout=5)
        assert r.status_code == 200
    finally:
        for s in sockets:
            s.close()
        proc.kill()
