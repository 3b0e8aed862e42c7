"""The lab's free_port never hands out a port twice in one process (the demo once gave a
restarting engine's port to the next engine it started)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from oomguard.lab import processes


class _Offers:
    """socket.socket whose bind(0) gets the ports listed, in order, as a kernel may offer them."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ports = self.ports

        class Sock:
            def __enter__(self) -> Sock:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def bind(self, address: tuple[str, int]) -> None:
                self.port = ports.pop(0)

            def getsockname(self) -> tuple[str, int]:
                return ("127.0.0.1", self.port)

        return Sock()


def test_a_port_offered_again_is_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_HANDED_OUT", set())
    monkeypatch.setattr(socket, "socket", _Offers([50083, 50083, 50083, 50091]))
    assert processes.free_port() == 50083
    assert processes.free_port() == 50091  # the kernel offered 50083 twice more


def test_it_gives_up_rather_than_repeat_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_HANDED_OUT", {50083})
    monkeypatch.setattr(socket, "socket", _Offers([50083] * 5))
    with pytest.raises(RuntimeError, match="no free port in 5 tries"):
        processes.free_port(attempts=5)


def test_real_ports_are_distinct_and_bindable() -> None:
    ports = [processes.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
