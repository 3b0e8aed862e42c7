"""The focus lane: a webhook's engines are read, decided and acted on while a full pass is still
reading (a slow engine, a hundred engines under attention), never twice for one episode."""

from __future__ import annotations

import threading
import time

import pytest

from oomguard.remediator.audit import AuditLog
from oomguard.remediator.controller import Controller
from oomguard.remediator.main import Remediator
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.webhook import parse
from tests.remediator_helpers import Engines, alert, config, payload

SLOW_S = 4.0  # how long the slow engine takes to answer a read
FLEET = {
    "attention": {"read_all_below": 0, "quiet_resync_seconds": 3600},
    "policy": {"step_seconds": 3600},  # one cap per alert: a second one would be a double action
}


class Slow(Engines):
    """The in-memory fleet, where reads of `slow` engines take SLOW_S once `gate` is closed."""

    def __init__(self, engines: Engines) -> None:
        super().__init__(engines.engines)
        self.slow: set[str] = set()
        self.reading = threading.Event()  # a slow read has begun
        self.release = threading.Event()  # ends slow reads early (the test is done)

    def state(self, target):  # type: ignore[no-untyped-def]
        if target.name in self.slow and not self.release.is_set():
            self.reading.set()
            self.release.wait(SLOW_S)
        return super().state(target)


def fleet_config(tmp_path, engines: Engines, peers=(), **overrides):  # type: ignore[no-untyped-def]
    """One model per engine, but `peers` share e0's."""
    cfg = config(tmp_path, *engines.engines, **{**FLEET, **overrides})
    model = {t.name: "e0" if t.name in peers else t.name for t in cfg.targets}
    return cfg.model_copy(
        update={"targets": [t.model_copy(update={"model": model[t.name]}) for t in cfg.targets]}
    )


def caps_of(engines: Engines, name: str) -> list[int]:
    return [cap for n, kind, cap in engines.calls if n == name and kind == "set_cap"]


def wait_for(check, timeout: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds until check() holds (bounded)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "not within the timeout"
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.parametrize("peers", [(), ("e50",)], ids=["other-model", "slow-engines-model"])
def test_a_webhook_during_a_slow_pass_is_capped_before_the_pass_ends(tmp_path, peers):
    # a cap takes no step the disruption budget limits: not even the slow engine of its own
    # model (under attention, so read every pass) is read first
    engines = Slow(Engines.of(*(f"e{i}" for i in range(60))))
    cfg = fleet_config(tmp_path, engines, peers, reconcile_seconds=0.2)
    rem = Remediator(cfg, engines)
    try:
        rem.start()
        c = rem.controller
        wait_for(lambda: not c.attention._never, 10)  # every engine read once: all quiet
        c.receive(parse(payload(alert("OomguardMemoryPressure", "e0"))))
        wait_for(lambda: engines.engines["e0"].cap == 80, 10)
        engines.slow.add("e0")  # capped and firing: read every pass, now slowly
        assert engines.reading.wait(10)  # a full pass is reading it
        posted = time.monotonic()
        c.receive(parse(payload(alert("OomguardMemoryPressure", "e50"))))
        took = wait_for(lambda: engines.engines["e50"].cap == 80, SLOW_S)
        # well before the slow read (and so the full pass) could end
        assert took < SLOW_S / 4, took
        assert time.monotonic() - posted < SLOW_S
        engines.release.set()
        time.sleep(0.5)  # the full pass finishes and decides e50 too: on the newest state
        assert caps_of(engines, "e50") == [80]
    finally:
        engines.release.set()
        rem.stop()


def test_a_full_pass_that_read_before_a_focused_action_does_not_act_again(tmp_path):
    engines = Slow(Engines.of(*(f"e{i}" for i in range(60))))
    cfg = fleet_config(tmp_path, engines)
    c = Controller(cfg, engines, AuditLog(cfg.audit_log), RemediatorMetrics())
    try:
        c.reconcile()  # all read, all quiet
        c.receive(parse(payload(alert("OomguardMemoryPressure", "e0"))))
        c.reconcile()  # e0 capped: read every pass from now on
        # the full pass reads e50 (an alert asks a cap of it) while e0 holds the pass
        c.receive(parse(payload(alert("OomguardPreemptionRateHigh", "e50"))))
        engines.slow.add("e0")
        full = threading.Thread(target=c.reconcile)
        full.start()
        assert engines.reading.wait(10)  # e50 read at cap 100, e0 still answering
        c.receive(parse(payload(alert("OomguardMemoryPressure", "e50", start=10))))
        if engines.engines["e50"].cap == 100:  # the full pass has not acted yet: the focus lane
            c.focus_pass()
        assert engines.engines["e50"].cap == 80
        assert full.is_alive()  # the full pass, holding a read of e50 at cap 100, still runs
        engines.release.set()
        full.join(10)
        assert caps_of(engines, "e50") == [80]  # not lowered again on the stale read
        acted = [e for e in AuditLog(cfg.audit_log).entries() if e.get("event") == "acted"]
        assert [e["target"] for e in acted].count("e50") == 1
    finally:
        engines.release.set()
        c.close()
