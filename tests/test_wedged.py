"""Threads and reads that hang rather than fail. Found: a peer that accepts and never answers
(a Kubernetes API connection that vanished without a reset) held leader election and pod
discovery forever (no client-side timeout), with /healthz 200; a server that sends its answer a
byte at a time held `oomguard status --timeout 2s` (measured: still waiting after 60 s), the
remediator's standalone watch (every exporter read in turn) and an exporter's collector, since
every timeout was per read. A supervised thread that hangs was never reported."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from oomguard.errors import CollectorError
from oomguard.exporter.scrape import Scraper
from oomguard.supervised import Supervised
from tests.raw_server import RawServer

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Pad: " + b"a" * 4000 + b"\r\n\r\n"


class Peer(RawServer):
    """Answers every request on a connection with `serve(connection)`."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        def handle(conn: socket.socket) -> None:
            conn.recv(65536)
            serve(conn)

        super().__init__(handle, backlog=64)
        self.url = f"http://127.0.0.1:{self.port}"


@pytest.fixture
def peers() -> Iterator[Callable[[str], Peer]]:
    made: list[Peer] = []

    def make(kind: str) -> Peer:
        def trickle(conn: socket.socket) -> None:  # a byte every 0.2 s, for 800 s
            for byte in HEAD:
                if made[-1].stop.wait(0.2):
                    return
                conn.sendall(bytes([byte]))

        def silent(conn: socket.socket) -> None:  # reads, never answers
            made[-1].stop.wait(600)

        made.append(Peer(trickle if kind == "trickle" else silent))
        return made[-1]

    yield make
    for p in made:
        p.close()


def within(seconds: float, call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """`call()`'s result or exception; AssertionError when it is still running after `seconds`
    (its thread, a daemon, is left behind)."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    return (out[0] if out else None), (err[0] if err else None)


def test_a_trickled_answer_is_cut_at_the_scrapers_timeout(peers):
    peer = peers("trickle")
    started = time.monotonic()
    _, err = within(15, lambda: Scraper(f"{peer.url}/metrics", timeout=1.0).get())
    assert isinstance(err, CollectorError) and err.reason == "timeout"
    assert time.monotonic() - started < 5


def test_status_reads_a_trickling_part_within_its_timeout(peers):
    from oomguard.status import fetch

    peer = peers("trickle")
    with httpx.Client(timeout=1.0) as client:
        read, err = within(15, lambda: fetch(client, f"{peer.url}/metrics", None, False))
    assert err is None and read.error == "no whole answer within 1s"


def test_the_standalone_watch_reads_on_past_a_trickling_exporter(peers):
    from oomguard.remediator.config import StandaloneConfig
    from oomguard.remediator.standalone import PressureWatcher

    slow, silent = peers("trickle"), peers("silent")
    watcher = PressureWatcher(
        StandaloneConfig(exporters=[f"{slow.url}/metrics", f"{silent.url}/metrics"])
    )
    started = time.monotonic()
    _, err = within(30, watcher.poll)
    assert err is None and len(watcher.errors) == 2
    assert time.monotonic() - started < 10  # two timeouts of 2 s, not the trickle's 800 s


def test_leader_election_gives_up_on_an_api_server_that_never_answers(peers):
    from kubernetes import client

    from oomguard.remediator.leader import LeaderElectionConfig, LeaseElector

    peer = peers("silent")
    cfg = client.Configuration()
    cfg.host = peer.url
    elector = LeaseElector(
        LeaderElectionConfig(
            namespace="oomguard", lease_seconds=3, renew_deadline_seconds=1, retry_seconds=0.5
        ),
        "me",
        client.ApiClient(cfg),
    )
    leading, err = within(20, elector.try_once)
    assert err is None and leading is False


def test_pod_discovery_gives_up_on_an_api_server_that_never_answers(peers, monkeypatch):
    from kubernetes import client

    from oomguard.remediator import discovery

    monkeypatch.setattr(discovery, "LIST_TIMEOUT", 1.0)
    peer = peers("silent")
    cfg = client.Configuration()
    cfg.host = peer.url
    pods = discovery.PodDiscovery(
        discovery.DiscoveryConfig(namespaces=["llm"]), client.ApiClient(cfg)
    )
    _, err = within(20, lambda: pods._list("llm"))
    assert err is not None and "timed out" in str(err).lower()


def test_a_supervised_thread_that_stops_beating_is_reported_stuck():
    now = [0.0]
    stop, release = threading.Event(), threading.Event()
    beats = []

    def body() -> None:
        beats.append(1)
        thread.beat()
        release.wait(30)  # hangs, as a call without a timeout would

    thread = Supervised("watch", body, stop, clock=lambda: now[0], stall_after=60)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not beats and time.monotonic() < deadline:
            time.sleep(0.01)
        now[0] = 59.0
        assert thread.problem() is None
        now[0] = 61.0
        assert thread.problem() == "thread watch has made no progress for 61 s (stuck)"
        thread.beat()
        assert thread.problem() is None
    finally:
        stop.set()
        release.set()
        thread.join(5)


def test_a_reconcile_pass_that_hangs_degrades_healthz(tmp_path):
    from oomguard.remediator.audit import AuditLog
    from oomguard.remediator.controller import Controller
    from tests.remediator_helpers import Engines, config

    c = Controller(config(tmp_path, "a"), Engines.of("a"), AuditLog(tmp_path / "audit.jsonl"))
    c.stuck_after = 0.5
    release = threading.Event()
    c.convergence.begin = lambda *a, **k: release.wait(30)  # type: ignore[method-assign]
    worker = threading.Thread(target=c.reconcile, daemon=True)
    worker.start()
    try:
        time.sleep(1.0)
        assert any("reconcile pass has run for" in p for p in c.problems()), c.problems()
    finally:
        release.set()
        worker.join(10)
    assert not any("reconcile pass" in p for p in c.problems())
