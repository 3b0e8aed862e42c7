"""Conformance of the shipped `deploy/kubernetes` with the two stock prometheus-operator installs.

What each install sets up is recorded in tests/fixtures/kubernetes/stock-installs.yaml (sources
noted there); Kubernetes' RBAC and the operator's selection and configuration rules are in
tests/kube_semantics.py (sources noted there). The manifests are rendered as `kubectl apply -k`
would apply them (`kubectl kustomize`), and the checks fail when the install's Prometheus could
not list and watch the pods of a namespace a PodMonitor scrapes, when a PodMonitor,
PrometheusRule or AlertmanagerConfig would not be selected, when a job the rules select would
not come out of the operator's relabelling, or when an alert would not reach the remediator.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from oomguard.manifests.kubernetes import NODE
from oomguard.remediator.config import RemediatorConfig
from oomguard.thresholds import AlertThresholds
from tests.conftest import FIXTURES
from tests.kube_semantics import (
    Rbac,
    endpoint_ready,
    merged_alertmanager_config,
    pod_monitor_scrape_configs,
    pod_of,
    sd_targets,
    selects,
    target_labels,
)

STOCK = yaml.safe_load((FIXTURES / "kubernetes" / "stock-installs.yaml").read_text())
INSTALLS = {i["name"].split(" (")[0]: i for i in STOCK["installs"]}
T = AlertThresholds()
READS = ("get", "list", "watch")


def render(root: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/kubernetes`, what `kubectl apply -k` applies."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run(
            [kubectl, "kustomize", str(root / "deploy" / "kubernetes")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    return render_resources(root)


def render_resources(root: Path) -> list[dict[str, Any]]:
    """The same for a kustomization that only lists resources (no kubectl on this machine):
    their objects, in order. Anything else in it is refused rather than approximated."""
    base = root / "deploy" / "kubernetes"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    extra = set(kustomization) - {"apiVersion", "kind", "resources"}
    assert not extra, f"kustomization uses {extra}: render it with kubectl kustomize"
    return [
        d
        for name in kustomization["resources"]
        for d in yaml.safe_load_all((base / name).read_text())
        if d
    ]


def pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One pod per workload, on the example's GPU node, as the API server would show it."""
    out = []
    for i, o in enumerate(o for o in objects if o["kind"] in {"DaemonSet", "Deployment"}):
        out.append(pod_of(o, f"{o['metadata']['name']}-x{i}", f"10.0.0.{i + 10}", NODE))
    return out


def problems(objects: list[dict[str, Any]], install: dict[str, Any]) -> list[str]:
    """Everything that would not work on this install, one sentence each (empty: all works)."""
    found: list[str] = []
    prom, am = install["prometheus"], install["alertmanager"]
    sa = (prom["namespace"], prom["serviceAccountName"])
    rbac = Rbac([*install["rbac"], *objects])
    jobs: dict[str, list[dict[str, str]]] = {}
    for pm in (o for o in objects if o["kind"] == "PodMonitor"):
        where = f"PodMonitor {pm['metadata']['namespace']}/{pm['metadata']['name']}"
        if not selects(
            prom["namespace"], prom["podMonitorSelector"], prom["podMonitorNamespaceSelector"], pm
        ):
            found.append(f"{where} is not selected by Prometheus {prom['name']}")
        for config in pod_monitor_scrape_configs(pm):
            for ns in config["kubernetes_sd_configs"][0]["namespaces"]["names"]:
                denied = [v for v in READS if not rbac.allows(sa, v, "", "pods", ns)]
                if denied:
                    found.append(
                        f"{where}: {sa[0]}/{sa[1]} may not {'/'.join(denied)} pods in {ns}"
                    )
            scraped = [
                labels
                for p in pods(objects)
                if p["metadata"]["namespace"]
                in config["kubernetes_sd_configs"][0]["namespaces"]["names"]
                for d in sd_targets(p)
                if (labels := target_labels(config, d)) is not None
            ]
            if not scraped:
                found.append(f"{where} finds no target among the manifests' pods")
            for labels in scraped:
                jobs.setdefault(labels["job"], []).append(labels)
    # the jobs the rules select must come out of the relabelling
    rule = next((o for o in objects if o["kind"] == "PrometheusRule"), None)
    if rule is None:
        return [*found, "no PrometheusRule"]
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    for job in sorted({j for e in exprs for j in re.findall(r'job="([^"]+)"', e)}):
        if job not in jobs and job not in install.get("jobs", []):  # or the install's own
            found.append(f'rules select job="{job}", which no scraped target carries')
    # kube-state-metrics series the rules read name the manifests' workloads
    for kind, label in (("DaemonSet", "daemonset"), ("Deployment", "deployment")):
        named = {o["metadata"]["name"] for o in objects if o["kind"] == kind}
        for name in sorted({n for e in exprs for n in re.findall(rf'{label}="([^"]+)"', e)}):
            if name not in named:
                found.append(f'rules select {label}="{name}"; the manifests have no such {kind}')
    for labels in jobs.get(T.exporter_job, []):
        if labels.get("instance") != NODE:  # the node: alerts and the allowlist name it so
            found.append(f"exporter target instance is {labels.get('instance')!r}, not the node")
    if not selects(prom["namespace"], prom["ruleSelector"], prom["ruleNamespaceSelector"], rule):
        found.append(f"PrometheusRule {rule['metadata']['name']} is not selected")
    # the AlertmanagerConfig: selected, alerts in its namespace, the remediator's receiver
    amcs = [o for o in objects if o["kind"] == "AlertmanagerConfig"]
    picked = [
        a
        for a in amcs
        if selects(
            am["namespace"],
            am["alertmanagerConfigSelector"],
            am["alertmanagerConfigNamespaceSelector"],
            a,
        )
    ]
    if not picked:
        found.append(f"no AlertmanagerConfig is selected by Alertmanager {am['name']}")
    for a in picked:
        namespace = a["metadata"]["namespace"]
        alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
        wrong = sorted({r["labels"].get("namespace", "") for r in alerts} - {namespace})
        if wrong:
            found.append(
                f"alerts carry namespace {wrong}; AlertmanagerConfig {namespace}/"
                f"{a['metadata']['name']} only routes namespace={namespace}"
            )
    config_map = next(
        o for o in objects if o["kind"] == "ConfigMap" and "remediator.yaml" in o.get("data", {})
    )
    config = RemediatorConfig.model_validate(yaml.safe_load(config_map["data"]["remediator.yaml"]))
    names = {f"{a['metadata']['namespace']}/{a['metadata']['name']}/remediator" for a in picked}
    if config.alertmanager and config.alertmanager.receiver not in names:
        found.append(
            f"the remediator's resync asks Alertmanager for receiver "
            f"{config.alertmanager.receiver!r}; the operator names it {sorted(names)}"
        )
    found += unreachable_when_drained(objects, config)
    found += exporter_rollout_gaps(objects)
    return found


def exporter_rollout_gaps(objects: list[dict[str, Any]]) -> list[str]:
    """A DaemonSet rolls a node by deleting its pod first (maxUnavailable) or by starting the
    new one beside it first (maxSurge; apps/v1 RollingUpdateDaemonSet, GA in 1.25). Deleting
    first leaves the node's engines unwatched until the new exporter serves, longer than the
    action alerts' keep_firing_for once an image pull is in it. Surging needs the two pods to
    fit on one node: no hostPort and no hostNetwork (the second pod would wait for the port).
    The surge pod needs room beside the engine: with a priority class that may preempt (the
    built-in system-node-critical and system-cluster-critical do; scheduling.k8s.io/v1
    PriorityClass preemptionPolicy, default PreemptLowerPriority) a full node's vLLM pod would be
    evicted for it. And the old pod must outlive the new one's first scrapes: `minReadySeconds`
    (the new pod counts as available, and the old one is deleted, that long after it is ready)."""
    found = []
    classes = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PriorityClass"}
    for ds in (o for o in objects if o["kind"] == "DaemonSet"):
        if ds["metadata"]["name"] != "oomguard-exporter":
            continue
        rolling = (ds["spec"].get("updateStrategy") or {}).get("rollingUpdate") or {}
        if int(rolling.get("maxSurge", 0)) < 1 or int(rolling.get("maxUnavailable", 1)) != 0:
            found.append(
                "the exporter's DaemonSet deletes a node's pod before its replacement serves: "
                "an exporter rollout leaves the node's engines unwatched"
            )
        spec = ds["spec"]["template"]["spec"]
        ports = [p for c in spec["containers"] for p in c.get("ports", []) if "hostPort" in p]
        if spec.get("hostNetwork") or ports:
            found.append(
                "the exporter's DaemonSet holds a host port: its surge pod cannot start beside "
                "the old one"
            )
        priority = classes.get(spec.get("priorityClassName", ""), {})
        if spec.get("priorityClassName") and priority.get("preemptionPolicy") != "Never":
            found.append(
                f"the exporter's priority class {spec['priorityClassName']} may preempt: on a "
                "full GPU node its pod evicts the vLLM engine"
            )
        if int(ds["spec"].get("minReadySeconds", 0)) < 5:
            found.append(
                "the exporter's old pod stops as soon as the new one is ready, before Prometheus "
                "scraped it"
            )
    return found


def unreachable_when_drained(objects: list[dict[str, Any]], config: RemediatorConfig) -> list[str]:
    """The remediator reads, drains and resumes each static target through its URL: when that
    names a Service, the engine's pod must stay behind it while it is not ready (drained: the
    plugin's readiness answers 503)."""
    found = []
    engines = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["namespace"] == "llm"
    ]
    for target in config.targets:
        host = re.match(r"https?://([^:/]+)", target.url)
        parts = host.group(1).split(".") if host else []
        if len(parts) < 3 or parts[2] != "svc":
            continue  # an address, not a Service name
        name, namespace = parts[0], parts[1]
        service = next(
            (
                o
                for o in objects
                if o["kind"] == "Service"
                and o["metadata"]["name"] == name
                and o["metadata"]["namespace"] == namespace
            ),
            None,
        )
        if service is None:
            found.append(f"target {target.name}: no Service {namespace}/{name}")
            continue
        drained = [pod_of(e, f"{target.name}-0", "10.0.0.5", NODE, ready=False) for e in engines]
        if not any(endpoint_ready(service, p) for p in drained):
            found.append(
                f"target {target.name}: Service {namespace}/{name} drops the engine's pod while "
                "it is drained (not ready): the remediator could not read or resume it"
            )
    return found


@pytest.fixture(scope="module")
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(Path(request.config.rootpath))


@pytest.mark.parametrize("install", sorted(INSTALLS))
def test_the_manifests_work_on_the_stock_install(rendered, install):
    assert problems(rendered, INSTALLS[install]) == []


def test_kubectl_kustomize_renders_the_listed_resources(rendered, repo_root):
    if not shutil.which("kubectl"):
        pytest.skip("kubectl not installed: the conformance tests read the resources directly")
    key = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in rendered]
    plain = render_resources(repo_root)
    assert sorted(key) == sorted(
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in plain
    )


# -- the check finds each defect the manifests had before (issue 24) ----------------------------
def _without_prometheus_rbac(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["name"] != "oomguard-prometheus"]


def _without_release_label(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(objects)
    for o in out:
        o["metadata"].get("labels", {}).pop("release", None)
    return out


def _amc_in_own_namespace(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where it was: in oomguard, with the alerts labelled namespace=oomguard."""
    out = copy.deepcopy(objects)
    for o in out:
        if o["kind"] == "AlertmanagerConfig":
            o["metadata"]["namespace"] = "oomguard"
        if o["kind"] == "PrometheusRule":
            for g in o["spec"]["groups"]:
                for r in g["rules"]:
                    if "alert" in r:
                        r["labels"]["namespace"] = "oomguard"
    return out


def test_the_check_fails_on_each_defect_the_manifests_had(rendered):
    kp, helm = INSTALLS["kube-prometheus v0.18.0"], INSTALLS["kube-prometheus-stack 88.5.3"]
    # kube-prometheus: no Role for its Prometheus in oomguard and llm, nothing is scraped
    found = problems(_without_prometheus_rbac(rendered), kp)
    assert any("may not get/list/watch pods in oomguard" in p for p in found), found
    assert any("may not get/list/watch pods in llm" in p for p in found), found
    assert problems(_without_prometheus_rbac(rendered), helm) == []  # its ClusterRole reads all
    # kube-prometheus-stack: monitors and rules without its release label are not selected
    found = problems(_without_release_label(rendered), helm)
    assert sum("is not selected by Prometheus" in p for p in found) == 3, found
    assert any("PrometheusRule oomguard is not selected" in p for p in found), found
    assert problems(_without_release_label(rendered), kp) == []
    # kube-prometheus >= 0.17: an AlertmanagerConfig outside monitoring is not selected
    found = problems(_amc_in_own_namespace(rendered), kp)
    assert "no AlertmanagerConfig is selected by Alertmanager main" in found, found
    # a job the rules select that the relabelling does not produce
    broken = copy.deepcopy(rendered)
    monitor = next(
        o
        for o in broken
        if o["kind"] == "PodMonitor" and o["metadata"]["name"] == "oomguard-exporter"
    )
    monitor["spec"]["podMetricsEndpoints"][0]["relabelings"] = []
    found = problems(broken, kp)
    assert f'rules select job="{T.exporter_job}", which no scraped target carries' in found
    # a DaemonSet the kube-state-metrics rules would not find
    broken = copy.deepcopy(rendered)
    next(o for o in broken if o["kind"] == "DaemonSet")["metadata"]["name"] = "gpu-exporter"
    found = problems(broken, kp)
    assert (
        'rules select daemonset="oomguard-exporter"; the manifests have no such DaemonSet' in found
    )
    # the remediator through the engine's own Service: a drained engine drops out of it
    broken = copy.deepcopy(rendered)
    config_map = next(
        o for o in broken if o["kind"] == "ConfigMap" and "remediator.yaml" in o["data"]
    )
    config_map["data"]["remediator.yaml"] = config_map["data"]["remediator.yaml"].replace(
        "vllm-llama-3-8b-control.llm.svc", "vllm-llama-3-8b.llm.svc"
    )
    found = problems(broken, kp)
    assert any("drops the engine's pod while it is drained" in p for p in found), found
    # the exporter rolled by deleting first (what the manifests had), or surging on a host port
    broken = copy.deepcopy(rendered)
    ds = next(o for o in broken if o["kind"] == "DaemonSet")
    ds["spec"]["updateStrategy"]["rollingUpdate"] = {"maxUnavailable": 1}
    assert any("leaves the node's engines unwatched" in p for p in problems(broken, kp))
    broken = copy.deepcopy(rendered)
    ds = next(o for o in broken if o["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["hostPort"] = 9848
    assert any("cannot start beside the old one" in p for p in problems(broken, kp))
    # system-node-critical (what the manifests had): a surge pod evicts the engine
    broken = copy.deepcopy(rendered)
    ds = next(o for o in broken if o["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["priorityClassName"] = "system-node-critical"
    assert any("may preempt" in p for p in problems(broken, kp))
    broken = copy.deepcopy(rendered)
    next(o for o in broken if o["kind"] == "DaemonSet")["spec"].pop("minReadySeconds")
    assert any("before Prometheus scraped it" in p for p in problems(broken, kp))


def test_older_kube_prometheus_needs_the_documented_patch(rendered, repo_root):
    """Before v0.17.0 the Alertmanager has no AlertmanagerConfig selector (null: none); the
    patch in docs/kubernetes.md is what makes it select ours."""
    older = {**INSTALLS["kube-prometheus v0.18.0"], "alertmanager": STOCK["older_alertmanager"]}
    assert "no AlertmanagerConfig is selected by Alertmanager main" in problems(rendered, older)
    docs = (repo_root / "docs" / "kubernetes.md").read_text()
    (patch,) = re.findall(r"patch alertmanager main --type merge -p \\\n\s*'(\{.*?\})'", docs)
    patched = {**older, "alertmanager": {**older["alertmanager"], **yaml.safe_load(patch)["spec"]}}
    assert problems(rendered, patched) == []


# -- the merged Alertmanager configuration routes oomguard's alerts, and only those -------------
def _routes(config_path: Path, labels: dict[str, str]) -> set[str]:
    out = subprocess.run(
        [
            "amtool",
            "config",
            "routes",
            "test",
            f"--config.file={config_path}",
            *(f"{k}={v}" for k, v in labels.items()),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return set(out.stdout.strip().split(","))


@pytest.mark.parametrize("install", sorted(INSTALLS))
def test_the_operator_merged_alertmanager_config_routes_oomguard_alerts(
    rendered, install, tmp_path
):
    stock = INSTALLS[install]
    am = stock["alertmanager"]
    amcs = [
        o
        for o in rendered
        if o["kind"] == "AlertmanagerConfig"
        and selects(
            am["namespace"],
            am["alertmanagerConfigSelector"],
            am["alertmanagerConfigNamespaceSelector"],
            o,
        )
    ]
    merged = merged_alertmanager_config(stock["alertmanager_base_config"], am, amcs)
    path = tmp_path / "alertmanager.yaml"
    path.write_text(yaml.safe_dump(merged))
    check = subprocess.run(
        ["amtool", "check-config", str(path)], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr
    rule = next(o for o in rendered if o["kind"] == "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    prefix = f"{amcs[0]['metadata']['namespace']}/{amcs[0]['metadata']['name']}/"

    def fired(name: str, **labels: str) -> set[str]:
        return _routes(path, {"alertname": name, **alerts[name]["labels"], **labels})

    # a work order reaches the remediator (and falls through to the cluster's own routes)
    assert prefix + "remediator" in fired("OomguardMemoryCritical", instance=NODE)
    restart = fired("OomguardCudaOomObserved", instance=NODE)
    assert {prefix + "remediator", prefix + "oncall-pager"} <= restart
    assert prefix + "oncall-ticket" in fired("OomguardEngineDown", instance=NODE)
    # the cluster's own alerts in that namespace pass oomguard's route by
    theirs = _routes(
        path,
        {"alertname": "KubePodCrashLooping", "namespace": am["namespace"], "severity": "warning"},
    )
    assert not any(r.startswith(prefix) for r in theirs), theirs
