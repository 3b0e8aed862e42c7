"""Targets discovered from pods through the official client's list + watch, against the
Kubernetes API stand-in: resumable on resourceVersion, no re-listing, and the allowlist's
guarantees (alerts select among discovered pods, never supply an address or a Secret)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import pytest
from kubernetes import client

from oomguard.remediator.audit import AuditLog
from oomguard.remediator.controller import Controller
from oomguard.remediator.discovery import DiscoveryConfig, PodDiscovery, pod_target
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.webhook import parse
from tests.kube_standin import KubeStandIn
from tests.remediator_helpers import Engines, alert, config, payload

NS = "llm"
ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "Role",
    "metadata": {"name": "oomguard-remediator-discovery", "namespace": NS},
    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}],
}


def pod(name: str, ip: str = "10.0.0.1", phase: str = "Running", **annotations: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"oomguard.io/remediate": "true", "app.kubernetes.io/name": "llama"},
            "annotations": annotations,
        },
        "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "vllm", "image": "v"}]},
        "status": {"phase": phase, "podIP": ip},
    }


def api(standin: KubeStandIn) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = standin.url
    cfg.api_key = {"BearerToken": "kube-token"}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    return client.ApiClient(cfg)


def until(check: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def discovery(standin: KubeStandIn, **cfg) -> PodDiscovery:
    config = DiscoveryConfig(namespaces=[NS], watch_seconds=2, **cfg)
    return PodDiscovery(config, api(standin), backoff=0.1)


def names(d: PodDiscovery) -> list[str]:
    return [t.name for t in d.targets()]


@pytest.mark.slow  # seconds each: in make test, not in the 2-minute check lane
def test_pods_are_listed_once_then_followed_by_watch_with_no_relisting():
    standin = KubeStandIn([], ROLE)
    standin.put_pod(pod("vllm-0", "10.0.0.1"))
    other = pod("not-selected", "10.0.0.9")
    other["metadata"]["labels"] = {}
    standin.put_pod(other)
    d = discovery(standin)
    d.start()
    try:
        assert d.wait_synced(10)
        assert names(d) == ["llm:vllm-0"]
        assert d.targets()[0].url == "http://10.0.0.1:8000"
        assert d.targets()[0].model == "llama"
        standin.put_pod(pod("vllm-1", "10.0.0.2", **{"oomguard.io/plugin-port": "9000"}))
        assert until(lambda: names(d) == ["llm:vllm-0", "llm:vllm-1"])
        assert d.targets()[1].url == "http://10.0.0.2:9000"
        standin.put_pod(pod("vllm-0", "10.0.0.7"))  # rescheduled: a new IP
        assert until(lambda: d.targets()[0].url == "http://10.0.0.7:8000")
        standin.delete_pod(NS, "vllm-1")
        assert until(lambda: names(d) == ["llm:vllm-0"])
        time.sleep(2.5)  # the watch request times out and is resumed
        standin.put_pod(pod("vllm-2", "10.0.0.3"))
        assert until(lambda: "llm:vllm-2" in names(d))
        lists = [r for r in standin.requests if "/pods" in r.path and "watch" not in r.path]
        watches = [r for r in standin.requests if "watch=" in r.path.lower()]
        assert len(lists) == 1 and d.lists == 1  # the whole list read once
        assert len(watches) >= 2
        resumed = watches[-1].path
        assert "resourceVersion=" in resumed and "resourceVersion=0" not in resumed
    finally:
        d.stop()
        standin.close()


def test_a_compacted_version_is_listed_again_and_nothing_is_lost():
    standin = KubeStandIn([], ROLE)
    standin.put_pod(pod("vllm-0"))
    d = discovery(standin)
    d.start()
    try:
        assert d.wait_synced(10)
        # while the watch is between requests, history is compacted and a pod comes and goes
        standin.compact()
        standin.put_pod(pod("vllm-1", "10.0.0.2"))
        standin.compact()
        assert until(lambda: names(d) == ["llm:vllm-0", "llm:vllm-1"], timeout=15)
        assert d.lists >= 1
    finally:
        d.stop()
        standin.close()


@pytest.mark.slow  # seconds each: in make test, not in the 2-minute check lane
def test_an_api_outage_keeps_the_targets_and_recovers():
    standin = KubeStandIn([], ROLE)
    standin.put_pod(pod("vllm-0"))
    d = discovery(standin)
    d.start()
    try:
        assert d.wait_synced(10)
        standin.down = True
        standin.end_watches()
        time.sleep(1)
        assert names(d) == ["llm:vllm-0"]  # kept: an outage is not an empty fleet
        standin.down = False
        standin.put_pod(pod("vllm-1", "10.0.0.2"))
        assert until(lambda: names(d) == ["llm:vllm-0", "llm:vllm-1"], timeout=15)
    finally:
        d.stop()
        standin.close()


def test_without_rbac_to_watch_nothing_is_discovered():
    role = {**ROLE, "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]}
    standin = KubeStandIn([], role)
    standin.put_pod(pod("vllm-0"))
    d = discovery(standin)
    d.start()
    try:
        assert d.wait_synced(10)  # listed...
        assert until(lambda: any(r.status == 403 for r in standin.requests))  # ...not watched
    finally:
        d.stop()
        standin.close()


def test_what_a_pod_may_and_may_not_say_about_itself():
    cfg = DiscoveryConfig(
        namespaces=[NS], token_file="/run/default-token", token_secrets={"llama-token": "/run/t"}
    )
    assert pod_target(pod("a"), cfg).token_file == "/run/default-token"
    named = pod_target(pod("a", **{"oomguard.io/plugin-token-secret": "llama-token"}), cfg)
    assert named.token_file == "/run/t"
    # a Secret the operator did not list: the pod is no target (it gets no token at all)
    assert pod_target(pod("a", **{"oomguard.io/plugin-token-secret": "admin-token"}), cfg) is None
    for port in ("0", "70000", "80; rm -rf /", "8000@evil.example"):
        assert pod_target(pod("a", **{"oomguard.io/plugin-port": port}), cfg) is None
    assert pod_target(pod("a", phase="Pending"), cfg) is None
    assert pod_target(pod("a", ip=""), cfg) is None
    assert pod_target(pod("a", ip="evil.example/x"), cfg) is None
    v6 = pod_target(pod("a", ip="fd00::1"), cfg)
    assert v6.url == "http://[fd00::1]:8000"
    assert v6.selector() == {"instance": "gpu-node-1"}  # the exporter's alerts name the node


@pytest.mark.slow  # seconds each: in make test, not in the 2-minute check lane
def test_alerts_select_among_discovered_pods_and_never_supply_an_address(tmp_path):
    standin = KubeStandIn([], ROLE)
    for i in range(3):
        standin.put_pod(pod(f"vllm-{i}", f"10.0.0.{i + 1}"))
    d = discovery(standin, match={"namespace": "namespace", "pod": "pod"})
    d.start()
    try:
        assert d.wait_synced(10)
        engines = Engines.of(*names(d))
        cfg = config(tmp_path, "placeholder")
        c = Controller(cfg, engines, AuditLog(cfg.audit_log), RemediatorMetrics())
        c.set_targets(d.targets())
        assert sorted(c.targets) == names(d)
        # selected by the PodMonitor's labels; `target`/`instance` labels pointing elsewhere
        # do not matter, and no label can add a target
        hit = alert(
            "OomguardMemoryPressure",
            "http://attacker.example:8000",
            namespace=NS,
            pod="vllm-1",
            instance="attacker.example:8000",
            fingerprint="h",
        )
        stray = alert("OomguardMemoryPressure", "x", namespace=NS, pod="vllm-9", fingerprint="s")
        receipt = c.receive(parse(payload(hit, stray)))
        c.reconcile()
        assert engines.engines["llm:vllm-1"].cap == 80
        assert list(receipt.ignored) == ["s"]
        assert {t.url for t in c.targets.values()} == {f"http://10.0.0.{i}:8000" for i in (1, 2, 3)}
        # the pod goes away: its alerts select nothing, the controller drops it
        standin.delete_pod(NS, "vllm-1")
        assert until(lambda: "llm:vllm-1" not in names(d))
        c.set_targets(d.targets())
        assert "llm:vllm-1" not in c.targets and "llm:vllm-1" not in c.status
        c.close()
    finally:
        d.stop()
        standin.close()


# -- one engine identity: discovered targets are named as the exporter names the engine --------
def test_a_pod_is_named_by_its_target_label_as_the_exporter_names_its_engine():
    from oomguard.manifests.kubernetes import TARGET_LABEL, VLLM_NAME, vllm_example
    from oomguard.thresholds import AlertThresholds

    cfg = DiscoveryConfig(namespaces=[NS])
    # the generated example's pod: its label names it as the exporter's --vllm name does
    deployment = next(o for o in vllm_example(AlertThresholds()) if o["kind"] == "Deployment")
    example = pod("vllm-llama-3-8b-6f7d9-x8k2m")
    example["metadata"]["labels"] = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_target(example, cfg).name == VLLM_NAME
    assert pod_target(example, cfg).match == {"instance": "gpu-node-1"}
    labelled = pod("vllm-0")
    labelled["metadata"]["labels"][TARGET_LABEL] = "llama-a"
    assert pod_target(labelled, cfg).name == "llama-a"
    # no label: <namespace>:<pod>, as before; a bad one: no target at all
    assert pod_target(pod("vllm-1"), cfg).name == "llm:vllm-1"
    labelled["metadata"]["labels"][TARGET_LABEL] = "a b"
    assert pod_target(labelled, cfg) is None
    # one engine per GPU node, an exporter started with --vllm=$(NODE_NAME)=...
    by_node = DiscoveryConfig(namespaces=[NS], target_name="node")
    assert pod_target(pod("vllm-1"), by_node).name == "gpu-node-1"


def test_two_pods_claiming_one_name_are_neither_a_target():
    standin = KubeStandIn([], ROLE)
    for name, ip in (("vllm-0", "10.0.0.1"), ("vllm-1", "10.0.0.2"), ("vllm-2", "10.0.0.3")):
        p = pod(name, ip)
        p["metadata"]["labels"]["oomguard.io/target"] = "llama-b" if name == "vllm-2" else "llama-a"
        standin.put_pod(p)
    d = discovery(standin)
    d.start()
    try:
        assert d.wait_synced(10)
        assert until(lambda: names(d) == ["llama-b"])
        standin.delete_pod(NS, "vllm-1")  # the old pod of a rollout goes: the name is one pod's
        assert until(lambda: names(d) == ["llama-a", "llama-b"])
        assert d.targets()[0].url == "http://10.0.0.1:8000"
    finally:
        d.stop()
        standin.close()


# -- a drained engine stays reachable: its pod address, ready or not ----------------------------
class PluginStandIn:
    """The plugin's routes the remediator calls (state, drain, resume) and the readiness route
    the kubelet probes: 503 while draining, as the plugin answers."""

    def __init__(self) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.mode = "serving"
        self.calls: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _state(self) -> dict:
                return {
                    "startup_max_num_seqs": 64,
                    "admission_cap": 64,
                    "mode": outer.mode,
                    "running": 0,
                    "waiting": 0,
                    "since_cap_change": {
                        "seconds": 60.0,
                        "admitted": 0,
                        "finished": 0,
                        "preemptions": 0,
                    },
                }

            def do_GET(self) -> None:
                outer.calls.append(("GET", self.path))
                if self.path == "/oomguard/v1/ready":
                    self._send(503 if outer.mode == "draining" else 200, {})
                else:
                    self._send(200, self._state())

            def do_POST(self) -> None:
                outer.calls.append(("POST", self.path))
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                outer.mode = "draining" if self.path.endswith("/drain") else "serving"
                self._send(200, {"state": self._state()})

            def do_PUT(self) -> None:  # the admission cap: accepted, not modelled
                outer.calls.append(("PUT", self.path))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._send(200, {"state": self._state()})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.slow  # seconds: in make test, not in the 2-minute check lane
def test_a_drained_engine_is_read_and_resumed_at_its_pod_address(tmp_path):
    """Readiness answers 503 while the engine drains, so the kubelet marks the pod not ready
    and the engine's Service drops it (tests/test_kube_conformance.py); discovery keeps the
    pod as a target at its own address, so the remediator still reads and resumes it."""
    import httpx

    from oomguard.remediator.actuator import PluginActuator

    engine, peer = PluginStandIn(), PluginStandIn()
    standin = KubeStandIn([], ROLE)
    serving = pod("vllm-0", "127.0.0.1", **{"oomguard.io/plugin-port": str(engine.port)})
    serving["metadata"]["labels"]["oomguard.io/target"] = "llama-a"
    serving["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    standin.put_pod(serving)
    # a ready peer of the same model on another node: the last ready engine is never drained
    other = pod("vllm-1", "127.0.0.1", **{"oomguard.io/plugin-port": str(peer.port)})
    other["metadata"]["labels"]["oomguard.io/target"] = "llama-b"
    other["spec"]["nodeName"] = "gpu-node-2"
    standin.put_pod(other)
    d = discovery(standin)
    d.start()
    actuator = PluginActuator(timeout=2, backoff=0.05)
    try:
        assert d.wait_synced(10)
        cfg = config(tmp_path, "placeholder")
        c = Controller(cfg, actuator, AuditLog(cfg.audit_log), RemediatorMetrics())
        c.set_targets(d.targets())
        c.receive(parse(payload(alert("OomguardMemoryCritical", "x", instance="gpu-node-1"))))
        c.reconcile()
        assert engine.mode == "draining" and ("POST", "/oomguard/v1/drain") in engine.calls
        ready = f"http://127.0.0.1:{engine.port}/oomguard/v1/ready"
        assert httpx.get(ready, timeout=2).status_code == 503
        # the kubelet's probe fails: the pod is not ready, still running at its address
        drained = copy.deepcopy(serving)
        drained["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        standin.put_pod(drained)
        # a later event: once discovery has it, it has the not-ready one (a watch is in order)
        marker = pod("vllm-9", "10.0.0.9")
        marker["metadata"]["labels"]["oomguard.io/target"] = "llama-z"
        standin.put_pod(marker)
        assert until(lambda: "llama-z" in names(d))
        assert [(t.name, t.url) for t in d.targets() if t.name != "llama-z"] == [
            ("llama-a", f"http://127.0.0.1:{engine.port}"),
            ("llama-b", f"http://127.0.0.1:{peer.port}"),
        ]
        c.set_targets(d.targets())
        before = len(engine.calls)
        c.reconcile()  # reads the drained engine
        assert ("GET", "/oomguard/v1/state") in engine.calls[before:]
        actuator.resume(c.target("llama-a"))  # and reaches it to resume
        assert engine.mode == "serving"
        c.close()
    finally:
        actuator.close()
        d.stop()
        standin.close()
        engine.close()
        peer.close()


def test_an_event_the_client_rejects_does_not_stop_the_watch():
    """Defect 9: an event the Kubernetes client cannot deserialize (a malformed timestamp) made
    the watch fail and resume from the same resourceVersion forever: pods added after it were
    never discovered, and a deleted pod stayed a target (and was capped)."""
    standin = KubeStandIn([], ROLE)
    standin.put_pod(pod("vllm-0", "10.0.0.1"))
    d = discovery(standin)
    d.start()
    try:
        assert d.wait_synced(10)
        bad = pod("vllm-odd", "10.0.0.5")
        bad["metadata"]["creationTimestamp"] = "not a time"  # the client refuses this event
        standin.put_pod(bad)
        standin.put_pod(pod("vllm-1", "10.0.0.2"))
        standin.delete_pod(NS, "vllm-0")
        # listed again past the event: the list is read as raw JSON, every pod as it is
        assert until(lambda: names(d) == ["llm:vllm-1", "llm:vllm-odd"], timeout=15), names(d)
        assert d.lists >= 2
    finally:
        d.stop()
        standin.close()


class Killed(BaseException):
    """What no loop catches: the injected death of a thread."""


@pytest.mark.slow  # waits out a restart backoff (seconds)
def test_a_dead_discovery_thread_is_restarted_and_counted(monkeypatch):
    standin = KubeStandIn([], ROLE)
    standin.put_pod(pod("vllm-0", "10.0.0.1"))
    deaths: list[str] = []
    d = PodDiscovery(
        DiscoveryConfig(namespaces=[NS], watch_seconds=2),
        api(standin),
        backoff=0.1,
        on_death=deaths.append,
    )
    real = d._list
    calls = []

    def dies_once(namespace: str) -> str:
        calls.append(namespace)
        if len(calls) == 1:
            raise Killed("injected")
        return real(namespace)

    monkeypatch.setattr(d, "_list", dies_once)
    d.start()
    try:
        assert until(lambda: deaths == [f"discovery-{NS}"])
        assert "died" in (d.threads[0].problem() or "") or "restarted" in (
            d.threads[0].problem() or ""
        )
        assert d.wait_synced(10)  # restarted after its backoff: listed, and watching
        assert names(d) == ["llm:vllm-0"]
        standin.put_pod(pod("vllm-1", "10.0.0.2"))
        assert until(lambda: names(d) == ["llm:vllm-0", "llm:vllm-1"])
    finally:
        d.stop()
        standin.close()
