"""Leader election on a coordination.k8s.io Lease, through the official client, against the
Kubernetes API stand-in (RBAC, schema and resourceVersion conflicts checked)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kubernetes import client
from starlette.testclient import TestClient

from oomguard.remediator.leader import LeaderElectionConfig, LeaseElector
from tests.kube_standin import KubeStandIn

NS = "oomguard"
ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "Role",
    "metadata": {"name": "oomguard-remediator", "namespace": NS},
    "rules": [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["oomguard-remediator"],
            "verbs": ["get", "update"],
        },
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    ],
}


def api(standin: KubeStandIn, token: str = "kube-token") -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = standin.url
    cfg.api_key = {"BearerToken": token}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    return client.ApiClient(cfg)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def elector(standin, who: str, clock: Clock, changes: list | None = None) -> LeaseElector:
    cfg = LeaderElectionConfig(
        namespace=NS, lease_seconds=15, renew_deadline_seconds=10, retry_seconds=2
    )
    seen = changes if changes is not None else []
    return LeaseElector(
        cfg, who, api(standin), lambda leading: seen.append((who, leading)), clock=clock
    )


def test_one_replica_leads_and_a_standby_takes_over_after_the_lease_period():
    standin = KubeStandIn([], ROLE)
    clock, changes = Clock(), []
    a, b = elector(standin, "a", clock, changes), elector(standin, "b", clock, changes)
    try:
        assert a.try_once() and not b.try_once()
        lease = standin.leases[(NS, "oomguard-remediator")]
        assert lease["spec"]["holderIdentity"] == "a"
        for _ in range(5):  # a renews; b watches the record change and never takes over
            clock.t += 2
            assert a.try_once() and not b.try_once()
        clock.t += 14.9  # a stopped renewing (killed): not yet expired for b
        assert not b.try_once()
        assert not a.leading  # past its renew deadline: a acts no more, whatever b does
        clock.t += 0.2
        assert b.try_once()
        lease = standin.leases[(NS, "oomguard-remediator")]
        assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
        assert not a.try_once()  # a comes back: b holds a fresh lease, a stands by
        assert [c for c in changes if c[0] == "a"] == [("a", True), ("a", False)]
        assert [c for c in changes if c[0] == "b"] == [("b", True)]
    finally:
        standin.close()


def test_a_leader_that_cannot_renew_stops_acting_before_anyone_may_take_over():
    standin = KubeStandIn([], ROLE)
    clock = Clock()
    a, b = elector(standin, "a", clock), elector(standin, "b", clock)
    try:
        assert a.try_once() and not b.try_once()
        standin.down = True  # the API server is unreachable for a
        for _ in range(5):
            clock.t += 2
            a.try_once()
        assert not a.leading  # 10 s without a renewal: stepped down
        standin.down = False
        clock.t += 5.1  # only now, 15 s after a's last renewal was seen, may b take it
        assert b.try_once() and not a.try_once()
    finally:
        standin.close()


def test_racing_standbys_one_wins_by_resource_version():
    standin = KubeStandIn([], ROLE)
    clock = Clock()
    old = elector(standin, "old", clock)
    try:
        assert old.try_once()
        standbys = [elector(standin, f"s{i}", clock) for i in range(4)]
        for s in standbys:
            assert not s.try_once()
        clock.t += 16
        barrier = threading.Barrier(len(standbys))
        # every standby reads the expired Lease before any of them writes: a real race each run
        # (otherwise a fast first writer leaves the others reading a live Lease, and no 409)
        all_read = threading.Barrier(len(standbys), timeout=10)
        for s in standbys:
            read = s._read

            def read_then_wait(read: Any = read) -> Any:
                lease = read()
                all_read.wait()
                return lease

            s._read = read_then_wait  # type: ignore[method-assign]
        results: dict[str, bool] = {}

        def go(s: LeaseElector) -> None:
            barrier.wait()
            results[s.identity] = s.try_once()

        threads = [threading.Thread(target=go, args=(s,)) for s in standbys]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        winners = [k for k, v in results.items() if v]
        assert len(winners) == 1, results
        assert standin.leases[(NS, "oomguard-remediator")]["spec"]["holderIdentity"] == winners[0]
        assert any(r.status == 409 for r in standin.requests)
    finally:
        standin.close()


def test_a_replica_without_the_rbac_never_leads():
    role = {**ROLE, "rules": ROLE["rules"][:1]}  # no create
    standin = KubeStandIn([], role)
    try:
        assert not elector(standin, "a", Clock()).try_once()
        assert standin.requests[-1].status == 403
    finally:
        standin.close()


def test_release_on_stop_lets_a_standby_take_over_at_once():
    standin = KubeStandIn([], ROLE)
    cfg = LeaderElectionConfig(
        namespace=NS, lease_seconds=3, renew_deadline_seconds=2, retry_seconds=0.2
    )
    a = LeaseElector(cfg, "a", api(standin))
    b = LeaseElector(cfg, "b", api(standin))
    try:
        a.start()
        deadline = time.monotonic() + 10
        while not a.leading and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.leading
        b.start()
        time.sleep(0.5)
        assert not b.leading
        a.stop()
        t0 = time.monotonic()
        while not b.leading and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert b.leading and time.monotonic() - t0 < 1.5  # well within the 3 s lease
    finally:
        a.stop()
        b.stop(release=False)
        standin.close()


def test_only_the_leader_acts_and_a_takeover_keeps_the_old_leaders_cooldowns(tmp_path, monkeypatch):
    from oomguard.remediator.main import Remediator
    from oomguard.remediator.webhook import parse
    from tests.remediator_helpers import Engines, alert, config, payload

    standin = KubeStandIn([], ROLE)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: s, cluster: {{server: '{standin.url}'}}}}]\n"
        "users: [{name: u, user: {token: kube-token}}]\n"
        "contexts: [{name: c, context: {cluster: s, user: u}}]\n"
    )
    # as KUBECONFIG names it (the client reads that variable once, when it is imported)
    monkeypatch.setattr(
        "kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig)
    )
    engines = Engines.of("a", "b")
    replicas = []
    for who in ("one", "two"):
        cfg = config(
            tmp_path,  # one audit log for both: a shared volume
            "a",
            "b",
            safety={"cooldown_seconds": 3600},
            leader_election={
                "namespace": NS,
                "identity": who,
                "lease_seconds": 2,
                "renew_deadline_seconds": 1.5,
                "retry_seconds": 0.5,
            },
        )
        replicas.append(Remediator(cfg, engines))
    one, two = replicas
    try:
        assert one.elector.try_once() and not two.elector.try_once()
        sample = two.controller.metrics.registry.get_sample_value
        assert sample("oomguard_remediator_leader") == 0
        first = payload(alert("OomguardMemoryPressure", "a", start=0))
        for r in replicas:  # Alertmanager posts to every replica
            r.controller.receive(parse(first))
            r._reconcile()
        assert [c[:2] for c in engines.calls] == [("a", "set_cap")]  # one action, not two
        # the leader dies (stops renewing); the standby takes over after the lease period
        time.sleep(2.1)
        assert two.elector.try_once() and sample("oomguard_remediator_leader") == 1
        engines.engines["a"].cap = 100  # reset behind the remediator's back
        again = payload(
            alert("OomguardMemoryPressure", "a", start=500),
            alert("OomguardMemoryPressure", "b", start=500),
        )
        two.controller.receive(parse(again))
        two._reconcile()
        # b is capped; a is not: the old leader's cooldown on a holds on the new leader
        assert engines.engines["b"].cap == 80 and engines.engines["a"].cap == 100
        assert [c[:2] for c in engines.calls] == [("a", "set_cap"), ("b", "set_cap")]
    finally:
        for r in replicas:
            r.elector.stop(release=False)
            r.controller.close()
        standin.close()


def replica(tmp_path, monkeypatch, standin: KubeStandIn, who: str = "one", **le: Any) -> Any:
    """A Remediator with leader election against the stand-in (not started)."""
    from oomguard.remediator.main import Remediator
    from tests.remediator_helpers import Engines, config

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: s, cluster: {{server: '{standin.url}'}}}}]\n"
        "users: [{name: u, user: {token: kube-token}}]\n"
        "contexts: [{name: c, context: {cluster: s, user: u}}]\n"
    )
    monkeypatch.setattr(
        "kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig)
    )
    election = {
        "namespace": NS,
        "identity": who,
        "lease_seconds": 3,
        "renew_deadline_seconds": 2,
        "retry_seconds": 0.2,
        **le,
    }
    return Remediator(config(tmp_path, "a", leader_election=election), Engines.of("a"))


def renewals(standin: KubeStandIn, seconds: float) -> set[str]:
    """The distinct renewTimes of the Lease seen over `seconds`."""
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lease = standin.leases.get((NS, "oomguard-remediator"))
        if lease:
            seen.add(lease["spec"]["renewTime"])
        time.sleep(0.05)
    return seen


def test_a_bad_audit_line_does_not_kill_the_leader(tmp_path, monkeypatch):
    """Defect 2: restoring the safety state on taking the lead hit a line that is not UTF-8;
    the exception killed the election thread: the Lease was taken once and never renewed, no
    replica acted, /healthz said 200."""
    standin = KubeStandIn([], ROLE)
    one = replica(tmp_path, monkeypatch, standin)
    try:
        with (tmp_path / "audit.jsonl").open("ab") as fh:  # written by anyone, after start-up
            fh.write(b'{"event": "paused", "reason": "\xff\xfe"}\n')
        one.elector.start()
        assert len(renewals(standin, 2.0)) >= 3  # renewed every 0.2 s, not taken once
        assert one.elector.leading and one._leading.is_set()
        assert one.controller.metrics.registry.get_sample_value("oomguard_remediator_leader") == 1
        assert one.problems() == []
    finally:
        one.elector.stop(release=False)
        one.controller.close()
        standin.close()


class Killed(BaseException):
    """What no loop catches: the injected death of a thread."""


@pytest.mark.slow  # waits out a restart backoff (seconds)
def test_a_dead_election_thread_is_restarted_counted_and_degrades_healthz(tmp_path, monkeypatch):
    standin = KubeStandIn([], ROLE)
    one = replica(tmp_path, monkeypatch, standin)
    one.elector.thread.settle = 3.0
    real = one.elector.try_once
    calls = []

    def dies_once() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise Killed("injected")
        return real()

    monkeypatch.setattr(one.elector, "try_once", dies_once)
    sample = one.controller.metrics.registry.get_sample_value
    try:
        assert (
            sample("oomguard_remediator_thread_restarts_total", {"thread": "leader-election"}) == 0
        )
        one.elector.start()
        deadline = time.monotonic() + 10
        while not one.problems() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any("leader-election" in p for p in one.problems())
        with TestClient(one.app) as client:
            health = client.get("/healthz")
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            deadline = time.monotonic() + 10
            while not one.elector.leading and time.monotonic() < deadline:
                time.sleep(0.05)
            assert one.elector.leading  # restarted (after 1 s), it took the Lease
            assert (
                sample("oomguard_remediator_thread_restarts_total", {"thread": "leader-election"})
                == 1
            )
            deadline = time.monotonic() + 10
            while client.get("/healthz").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.get("/healthz").status_code == 200  # recovered after `settle`
    finally:
        one.elector.stop(release=False)
        one.controller.close()
        standin.close()
