"""The Kubernetes deployment: manifests validated offline against the Kubernetes schemas and by
promtool/amtool; the restart backend against a schema- and RBAC-checking API stand-in; the
disruption budget under concurrent restart alerts for several engines."""

from __future__ import annotations

import copy
import json
import subprocess
import time

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from oomguard.engine_env import INITIAL_CAP_ENV
from oomguard.manifests.kubernetes import DISCOVERY_NAMESPACES
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import RemediatorConfig
from oomguard.remediator.controller import Controller
from oomguard.remediator.discovery import DiscoveryConfig, PodDiscovery
from oomguard.remediator.flags import Flags
from oomguard.remediator.kubernetes import ORIGINAL, KubernetesBackend
from oomguard.remediator.leader import LeaseElector
from oomguard.remediator.restart import RestartError
from oomguard.remediator.targets import KubernetesRef
from oomguard.remediator.webhook import parse
from tests.kube_standin import K8S_VERSION, KubeStandIn
from tests.remediator_helpers import Engines, alert, payload

CRDS = {"PodMonitor", "PrometheusRule", "AlertmanagerConfig"}


def docs(repo_root, name: str) -> list[dict]:
    text = (repo_root / "deploy" / "kubernetes" / name).read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def all_docs(repo_root) -> list[dict]:
    kustomization = docs(repo_root, "kustomization.yaml")[0]
    return [d for name in kustomization["resources"] for d in docs(repo_root, name)]


def test_every_builtin_object_is_valid_against_the_kubernetes_schema(repo_root):
    objects = all_docs(repo_root)
    kinds = {o["kind"] for o in objects}
    assert {"DaemonSet", "Deployment", "Role", "RoleBinding", "ConfigMap", "Service"} <= kinds
    for o in objects:
        if o["kind"] in CRDS:
            continue
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_the_validation_would_catch_a_mistake(repo_root):
    deployment = next(o for o in docs(repo_root, "remediator.yaml") if o["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}  # wrong case
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _plain(matchers: list[dict]) -> list[str]:
    return [f'{m["name"]}{m.get("matchType", "=")}"{m["value"]}"' for m in matchers]


def _plain_route(route: dict) -> dict:
    """An AlertmanagerConfig route back in Alertmanager's own shape."""
    keys = {
        "receiver": "receiver",
        "groupBy": "group_by",
        "groupWait": "group_wait",
        "groupInterval": "group_interval",
        "repeatInterval": "repeat_interval",
        "continue": "continue",
    }
    out = {plain: route[camel] for camel, plain in keys.items() if camel in route}
    if "matchers" in route:
        out["matchers"] = _plain(route["matchers"])
    if "routes" in route:
        out["routes"] = [_plain_route(r) for r in route["routes"]]
    return out


def test_prometheus_rule_and_alertmanager_config_pass_promtool_and_amtool(repo_root, tmp_path):
    from oomguard.alerts.generate import alertmanager_config

    monitoring = docs(repo_root, "monitoring.yaml")
    rule = next(o for o in monitoring if o["kind"] == "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # the operator routes an AlertmanagerConfig only alerts of its namespace
    (amc,) = [o for o in monitoring if o["kind"] == "AlertmanagerConfig"]
    namespace = amc["metadata"]["namespace"]
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert all(r["labels"]["namespace"] == namespace for r in alerts)
    # the same routes and inhibitions as the single box, in Alertmanager's own shape, the top
    # route limited to oomguard's alerts (the cluster's own alerts share the namespace)
    spec = amc["spec"]
    single_box = alertmanager_config()
    route = _plain_route(spec["route"])
    assert route.pop("matchers") == ['alertname=~"Oomguard.+|Watchdog"']
    assert route == single_box["route"]
    assert [
        {
            "source_matchers": _plain(r["sourceMatch"]),
            "target_matchers": _plain(r["targetMatch"]),
            "equal": r["equal"],
        }
        for r in spec["inhibitRules"]
    ] == single_box["inhibit_rules"]
    # ... which amtool accepts, with receivers of the same names
    plain = {
        "route": route,
        "inhibit_rules": single_box["inhibit_rules"],
        "receivers": [{"name": r["name"]} for r in spec["receivers"]],
    }
    (tmp_path / "am.yaml").write_text(yaml.safe_dump(plain))
    out = subprocess.run(
        ["amtool", "check-config", str(tmp_path / "am.yaml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (hook,) = next(r for r in spec["receivers"] if r["name"] == "remediator")["webhookConfigs"]
    assert hook["url"] == "http://oomguard-remediator.oomguard.svc:9849/v1/alertmanager"
    assert hook["httpConfig"]["authorization"]["credentials"] == {
        "name": "oomguard-alertmanager-webhook",
        "key": "remediator-token",
    }
    assert hook["maxAlerts"] == 0 and hook["sendResolved"] is True
    # the remediator's resync asks for the receiver under the name the operator gives it
    config_map = next(o for o in docs(repo_root, "remediator.yaml") if o["kind"] == "ConfigMap")
    config = RemediatorConfig.model_validate(yaml.safe_load(config_map["data"]["remediator.yaml"]))
    assert config.alertmanager is not None
    assert config.alertmanager.receiver == f"{namespace}/{amc['metadata']['name']}/remediator"
    # the cluster's own Alertmanager configuration is left alone
    assert not [o for o in monitoring if o["kind"] == "Secret"]


def test_the_pieces_fit_together(repo_root):
    remediator = docs(repo_root, "remediator.yaml")
    config_map = next(o for o in remediator if o["kind"] == "ConfigMap")
    config = RemediatorConfig.model_validate(yaml.safe_load(config_map["data"]["remediator.yaml"]))
    role = next(o for o in remediator if o["kind"] == "Role")
    # least privilege: get/patch, on exactly the workloads the remediator may restart
    assert role["rules"][0]["verbs"] == ["get", "patch"]
    restartable = {t.restart.kubernetes.name for t in config.targets if t.restart}
    assert set(role["rules"][0]["resourceNames"]) == restartable
    account = next(o for o in remediator if o["kind"] == "ServiceAccount")
    roles = {
        (o["metadata"]["namespace"], o["metadata"]["name"])
        for o in remediator
        if o["kind"] == "Role"
    }
    bindings = [o for o in remediator if o["kind"] == "RoleBinding"]
    # every Role is bound to the remediator's account, in its own namespace
    assert {(b["metadata"]["namespace"], b["roleRef"]["name"]) for b in bindings} == roles
    for b in bindings:
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "oomguard"}
        ]
    vllm = next(o for o in docs(repo_root, "vllm-example.yaml") if o["kind"] == "Deployment")
    container = vllm["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLM_PLUGINS"] == "oomguard" and "OOMGUARD_PLUGIN_TOKEN_FILE" in env
    assert container["readinessProbe"]["httpGet"]["path"] == "/oomguard/v1/ready"
    # the control Service, which keeps a drained (not ready) engine reachable
    assert config.targets[0].url.startswith(f"http://{vllm['metadata']['name']}-control.")
    exporter = next(o for o in docs(repo_root, "exporter.yaml") if o["kind"] == "DaemonSet")
    assert exporter["spec"]["template"]["spec"]["hostPID"] is True
    dashboards = docs(repo_root, "dashboards.yaml")
    assert len(dashboards) == len(
        list((repo_root / "dashboards" / "oomguard" / "dashboards" / "generated").glob("*.json"))
    )
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (text,) = cm["data"].values()
        assert json.loads(text)["uid"]


# -- RBAC: what the code calls, granted and no more --------------------------------------------
WRITES = {
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
    "escalate",
    "bind",
    "impersonate",
}


@pytest.mark.slow  # seconds each: in make test, not in the 2-minute check lane
def test_the_generated_rbac_lets_discovery_the_lease_and_restarts_work_and_no_more(repo_root):
    """The remediator's own code (pod discovery, leader election, the restart backend) against
    the API stand-in that checks every request against exactly the generated Roles."""
    remediator = docs(repo_root, "remediator.yaml")
    config_map = next(o for o in remediator if o["kind"] == "ConfigMap")
    config = RemediatorConfig.model_validate(yaml.safe_load(config_map["data"]["remediator.yaml"]))
    roles = [o for o in remediator if o["kind"] == "Role"]
    for r in roles:  # no wildcard, no Secrets; writes only on Leases and named workloads
        for rule in r["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert "secrets" not in rule["resources"]
            if WRITES & set(rule["verbs"]):
                assert rule["resources"] == ["leases"] or rule.get("resourceNames"), rule
                assert WRITES & set(rule["verbs"]) <= {"create", "update", "patch"}
    assert config.leader_election is not None
    target = next(t for t in config.targets if t.restart and t.restart.kubernetes)
    ref = target.restart.kubernetes
    standin = KubeStandIn([vllm_deployment(repo_root, ref.name)], roles[0])
    for r in roles[1:]:
        standin.allow(r)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "vllm-0",
            "namespace": ref.namespace,
            "labels": {"oomguard.io/remediate": "true"},
        },
        "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "vllm", "image": "v"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }
    standin.put_pod(pod)
    cfg = client.Configuration()
    cfg.host = standin.url
    cfg.api_key = {"BearerToken": "kube-token"}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    api = client.ApiClient(cfg)
    discovery = PodDiscovery(
        DiscoveryConfig(namespaces=DISCOVERY_NAMESPACES, watch_seconds=1), api, backoff=0.1
    )
    discovery.start()
    try:
        assert discovery.wait_synced(10)  # list, then watch
        assert [t.name for t in discovery.targets()] == ["llm:vllm-0"]
        time.sleep(1.5)  # the watch times out and is resumed
    finally:
        discovery.stop()
    elector = LeaseElector(config.leader_election, "replica-a", api)
    assert elector.try_once() and elector.try_once()  # create, then get + update (renew)
    elector.stop()  # gives the Lease up: get + update
    backend = KubernetesBackend(ref, api)
    backend.restart(Flags(0.86, 51), 1, "memory stayed critical")  # get, patch
    # (a 404 is fine: the first get of a Lease nobody created yet)
    refused = [(r.method, r.path, r.status) for r in standin.requests if r.status in (401, 403)]
    assert not refused
    calls = {(r.method, r.path.split("?")[0].rsplit("/", 1)[-1]) for r in standin.requests}
    assert ("POST", "leases") in calls and ("PUT", "oomguard-remediator") in calls
    assert ("PATCH", ref.name) in calls and ("GET", "pods") in calls
    standin.close()


# -- the backend against the stand-in -------------------------------------------------------------
def vllm_deployment(repo_root, name: str = "vllm-llama-3-8b") -> dict:
    d = copy.deepcopy(
        next(o for o in docs(repo_root, "vllm-example.yaml") if o["kind"] == "Deployment")
    )
    d["metadata"]["name"] = name
    return d


def role(repo_root, names: list[str]) -> dict:
    r = copy.deepcopy(next(o for o in docs(repo_root, "remediator.yaml") if o["kind"] == "Role"))
    r["rules"][0]["resourceNames"] = names
    return r


def backend(standin: KubeStandIn, name: str = "vllm-llama-3-8b", token: str = "kube-token"):
    cfg = client.Configuration()
    cfg.host = standin.url
    cfg.api_key = {"BearerToken": token}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    ref = KubernetesRef(namespace="llm", kind="Deployment", name=name, container="vllm")
    return KubernetesBackend(ref, client.ApiClient(cfg))


@pytest.fixture
def standin(repo_root):
    s = KubeStandIn([vllm_deployment(repo_root)], role(repo_root, ["vllm-llama-3-8b"]))
    yield s
    s.close()


def test_restart_patches_flags_cap_and_annotations_within_rbac(standin):
    b = backend(standin)
    view = b.flags()
    assert view.original == view.current == Flags(0.9, 64)
    b.restart(Flags(0.86, 51), 1, "memory stayed critical")
    methods = [(r.method, r.path.split("?")[0], r.status) for r in standin.requests]
    path = "/apis/apps/v1/namespaces/llm/deployments/vllm-llama-3-8b"
    assert methods == [("GET", path, 200), ("GET", path, 200), ("PATCH", path, 200)]
    patch = standin.requests[-1]
    assert patch.content_type.startswith("application/json-patch+json")
    assert patch.body[0]["op"] == "test"  # guarded by the resourceVersion
    obj = standin.objects[("llm", "Deployment", "vllm-llama-3-8b")]
    container = obj["spec"]["template"]["spec"]["containers"][0]
    assert "--gpu-memory-utilization=0.86" in container["args"]
    assert "--max-num-seqs=51" in container["args"]
    assert {"name": INITIAL_CAP_ENV, "value": "1"} in container["env"]
    assert json.loads(obj["metadata"]["annotations"][ORIGINAL]) == {
        "gpu_memory_utilization": 0.9,
        "max_num_seqs": 64,
    }
    assert "oomguard.io/restarted-at" in obj["spec"]["template"]["metadata"]["annotations"]
    after = b.flags()
    assert (after.original, after.current) == (Flags(0.9, 64), Flags(0.86, 51))
    # a second restart keeps the original and replaces (not duplicates) the cap
    b.restart(Flags(0.9, 64), None, "walk back")
    container = standin.objects[("llm", "Deployment", "vllm-llama-3-8b")]["spec"]["template"][
        "spec"
    ]["containers"][0]
    assert not any(e["name"] == INITIAL_CAP_ENV for e in container["env"])
    assert b.flags().original == Flags(0.9, 64)


def test_a_concurrent_edit_fails_the_patch_instead_of_being_overwritten(standin, monkeypatch):
    b = backend(standin)
    real_get = b._get

    def get_then_someone_edits():
        obj = real_get()
        key = ("llm", "Deployment", "vllm-llama-3-8b")
        standin.objects[key]["metadata"]["resourceVersion"] = "99"
        return obj

    monkeypatch.setattr(b, "_get", get_then_someone_edits)
    with pytest.raises(RestartError) as exc:
        b.restart(Flags(0.86, 51), 1, "x")
    assert exc.value.reason == "rejected" and "422" in str(exc.value)


def test_wrong_credentials_and_objects_outside_the_role_are_refused(standin):
    with pytest.raises(RestartError) as exc:
        backend(standin, token="stolen").flags()
    assert exc.value.reason == "auth"
    with pytest.raises(RestartError) as exc:
        backend(standin, name="someone-elses-model").restart(Flags(0.5, 1), 1, "x")
    assert exc.value.reason == "auth"
    assert all(r.method == "GET" for r in standin.requests)  # nothing was patched


def test_disruption_budget_restarts_one_engine_of_a_model_at_a_time(repo_root, tmp_path):
    names = ["engine-a", "engine-b", "engine-c"]
    engines = Engines.of(*names, startup=64)
    patches: list[tuple[float, str]] = []
    out_at_once: list[int] = []  # engines out of service whenever a pod is replaced

    def new_pod(obj: dict) -> None:
        out_at_once.append(sum(e.draining for e in engines.engines.values()))
        # the rolled pod comes up with the new flags, capped at the first stage
        name = obj["metadata"]["name"]
        args = obj["spec"]["template"]["spec"]["containers"][0]["args"]
        seqs = int(next(a for a in args if a.startswith("--max-num-seqs=")).split("=")[1])
        e = engines.engines[name]
        e.startup, e.cap, e.draining = seqs, 1, False
        e.changed()
        patches.append((time.monotonic(), name))

    standin = KubeStandIn(
        [vllm_deployment(repo_root, n) for n in names], role(repo_root, names), on_patch=new_pod
    )
    try:
        cfg = RemediatorConfig.model_validate(
            {
                "auth": {"allow_unauthenticated": True},
                "targets": [
                    {
                        "name": n,
                        "url": f"http://127.0.0.1:1/{n}",
                        "model": "llama",
                        "restart": {
                            "kubernetes": {"namespace": "llm", "name": n},
                            "drain_timeout_seconds": 5,
                            "ready_timeout_seconds": 5,
                        },
                    }
                    for n in names
                ],
                "safety": {"cooldown_seconds": 0, "max_draining_per_model": 2},
                "audit_log": str(tmp_path / "audit.jsonl"),
            }
        )
        backends = {n: backend(standin, n) for n in names}
        c = Controller(cfg, engines, AuditLog(cfg.audit_log), backends=backends)
        c.receive(
            parse(
                payload(
                    *(alert("OomguardCudaOomObserved", n, oomguard_action="restart") for n in names)
                )
            )
        )
        deadline = time.monotonic() + 30
        while len(patches) < 3 and time.monotonic() < deadline:
            c.reconcile()
            time.sleep(0.05)
        assert sorted(n for _, n in patches) == names  # each restarted once
        # two may be out at once (the budget) and never all three (the last ready one stays)
        assert out_at_once and max(out_at_once) <= 2
        limited = {e["result"] for e in c.audit.entries() if e["event"] == "withheld"}
        assert limited & {"disruption_budget", "last_ready"}
        deadline = time.monotonic() + 10
        while c._restarting and time.monotonic() < deadline:
            time.sleep(0.05)
        for n in names:
            e = engines.engines[n]
            assert (e.startup, e.cap) == (51, 1)  # 64 -> 51, back through staged re-admission
        assert all(r.status != 403 for r in standin.requests)
        assert {r.method for r in standin.requests} == {"GET", "PATCH"}
        c.close()
    finally:
        standin.close()


# -- the monitoring contract: what the rules select is what the manifests produce ------------------
def test_podmonitors_set_the_jobs_the_rules_select(repo_root):
    from oomguard.manifests.kubernetes import scrape_labels
    from oomguard.thresholds import AlertThresholds

    t = AlertThresholds()
    jobs = {
        name: scrape_labels(docs(repo_root, name), "p")["job"]
        for name in ("exporter.yaml", "remediator.yaml", "vllm-example.yaml")
    }
    assert jobs == {
        "exporter.yaml": t.exporter_job,
        "remediator.yaml": t.remediator_job,
        "vllm-example.yaml": t.vllm_job,
    }
    exporter = scrape_labels(docs(repo_root, "exporter.yaml"), "p", node="gpu-node-9")
    assert exporter["instance"] == "gpu-node-9"  # the node, stable across exporter restarts
    # without the relabeling prometheus-operator would say <namespace>/<PodMonitor name>
    monitor = next(o for o in docs(repo_root, "exporter.yaml") if o["kind"] == "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["relabelings"] = []
    bare = scrape_labels([monitor, *docs(repo_root, "exporter.yaml")[1:]], "p")
    assert bare["job"] == "oomguard/oomguard-exporter"


def test_prometheus_rule_groups_set_their_interval(repo_root):
    rule = next(o for o in docs(repo_root, "monitoring.yaml") if o["kind"] == "PrometheusRule")
    assert all(g.get("interval") for g in rule["spec"]["groups"])


def test_the_exporter_watches_a_cgroup_that_counts_oom_kills(repo_root):
    """The cgroup v2 root has no memory.events: OomguardHostOomKill could never fire on it."""
    ds = next(o for o in docs(repo_root, "exporter.yaml") if o["kind"] == "DaemonSet")
    container = ds["spec"]["template"]["spec"]["containers"][0]
    (arg,) = [a for a in container["args"] if a.startswith("--cgroup=")]
    path = arg.split("=", 2)[2]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"]))
    assert path.rstrip("/") != mount["mountPath"].rstrip("/"), "watches the cgroup root"
    assert path.endswith("/kubepods.slice")


def test_exporter_and_remediator_name_the_engine_alike(repo_root):
    """Rules join exporter and remediator series on `target` (queueing, capacity withheld)."""
    ds = next(o for o in docs(repo_root, "exporter.yaml") if o["kind"] == "DaemonSet")
    (arg,) = [a for a in ds["spec"]["template"]["spec"]["containers"][0]["args"] if "--vllm=" in a]
    exporter_target = arg.removeprefix("--vllm=").split("=", 1)[0]
    config_map = next(o for o in docs(repo_root, "remediator.yaml") if o["kind"] == "ConfigMap")
    config = RemediatorConfig.model_validate(yaml.safe_load(config_map["data"]["remediator.yaml"]))
    (target,) = config.targets
    assert target.name == exporter_target == target.selector()["target"]
    vllm = next(o for o in docs(repo_root, "vllm-example.yaml") if o["kind"] == "Deployment")
    template = vllm["spec"]["template"]
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    # the engine names itself from its pod's label (hand-off files, incident records), the
    # label pod discovery names it by too
    label = env["OOMGUARD_TARGET"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert label == "metadata.labels['oomguard.io/target']"
    assert template["metadata"]["labels"]["oomguard.io/target"] == exporter_target


def test_the_keda_example_scales_the_engine_on_recorded_capacity_withheld(repo_root):
    from oomguard.alerts.rules import recording_rules
    from oomguard.thresholds import AlertThresholds
    from tests.promql import metric_names, promtool_parses

    (scaled,) = docs(repo_root, "keda-example.yaml")
    assert scaled["kind"] == "ScaledObject"
    vllm = next(o for o in docs(repo_root, "vllm-example.yaml") if o["kind"] == "Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == vllm["metadata"]["name"]
    assert scaled["metadata"]["namespace"] == vllm["metadata"]["namespace"]
    (trigger,) = scaled["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    promtool_parses([query])
    recorded = {r.record for r in recording_rules(AlertThresholds())}
    assert metric_names(query) == {"model_name:oomguard_capacity_withheld_seqs:sum"}
    assert "model_name:oomguard_capacity_withheld_seqs:sum" in recorded
    model = vllm["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert f'model_name="{model}"' in query
    # an example, not a resource: applying the kustomization must not need KEDA's CRDs
    assert "keda-example.yaml" not in docs(repo_root, "kustomization.yaml")[0]["resources"]
