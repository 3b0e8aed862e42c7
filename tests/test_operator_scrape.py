"""Labels as prometheus-operator renders them (issue 24, item 2): the real Prometheus, with the
scrape configs the operator (v0.92.0, pkg/prometheus/promcfg.go; tests/kube_semantics.py) writes
for the shipped PodMonitors, scrapes the real exporter, the real remediator and a vLLM 0.33
/metrics capture. Only the discovery is swapped: file_sd hands Prometheus the same
__meta_kubernetes_* labels its pod discovery would set for the manifests' pods (on 127.0.0.1),
so the operator's relabelling runs unchanged in Prometheus itself.

Asserted: each target's labels are the ones tests/kube_semantics.py predicts (so the conformance
test's reading of the operator holds in Prometheus), every label a rule selects, groups or joins
on, or names in its description, is on the series it reads, the GPU series attributed to a pod
keep that pod's namespace/pod/container (honorLabels), and no series carries exported_*.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from oomguard.lab.processes import Process
from oomguard.manifests import kubernetes as k8s
from oomguard.thresholds import AlertThresholds
from tests.conftest import DCGM_K8S, VLLM_FIXTURE, free_port
from tests.kube_semantics import pod_monitor_scrape_configs, pod_of, sd_targets, target_labels
from tests.promql import metric_names
from tests.stack import growing_metrics, start_exporter, stop

pytestmark = pytest.mark.slow

T = AlertThresholds()
# labels a rule may use that no scrape sets: the cluster's (an external label of a central
# ruler), histogram buckets, and the series name itself
NOT_SCRAPED = {T.cluster_label, "le", "__name__"}


def _prometheus_config(tmp: Path, pods: list[dict[str, Any]]) -> tuple[dict[str, Any], dict]:
    """Scrape configs as the operator writes them, kubernetes_sd swapped for file_sd carrying
    the same meta labels; also the target labels predicted for each address."""
    objects = [*k8s.exporter(T), *k8s.remediator(T), *k8s.vllm_example(T)]
    scrape_configs, predicted = [], {}
    for monitor in (o for o in objects if o["kind"] == "PodMonitor"):
        for config in pod_monitor_scrape_configs(monitor):
            sd = config.pop("kubernetes_sd_configs")[0]
            groups = []
            for p in pods:
                if p["metadata"]["namespace"] not in sd["namespaces"]["names"]:
                    continue
                for d in sd_targets(p):
                    address = d.pop("__address__")
                    groups.append({"targets": [address], "labels": d})
                    labels = target_labels(config, {**d, "__address__": address})
                    if labels is not None:
                        predicted[(config["job_name"], address)] = labels
            path = tmp / f"{config['job_name'].replace('/', '_')}.json"
            path.write_text(json.dumps(groups))
            config["file_sd_configs"] = [{"files": [str(path)], "refresh_interval": "1s"}]
            config["scrape_interval"] = "1s"  # the test's pace, not the manifests'
            scrape_configs.append(config)
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": scrape_configs,
    }, predicted


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("operator-scrape")
    vllm = growing_metrics(VLLM_FIXTURE.read_text())
    vllm_port = vllm.httpd.server_address[1]
    # one CUDA OOM the plugin recorded a while ago: the incident and lost-request counters are
    # born, so the rules reading them (the SLO's error ratios among them) are checked too
    incidents = tmp / "alloc" / "incidents"
    incidents.mkdir(parents=True)
    (incidents / "oom-4242-1.json").write_text(
        json.dumps(
            {
                "schema": "oomguard.oom_incident.v1",
                "kind": "cuda_oom",
                "timestamp": time.time() - 3600,
                "pid": 4242,
                "rank": 0,
                "target": k8s.VLLM_NAME,
                "engine": "0",
                "model_name": "meta-llama/Llama-3.1-8B-Instruct",
                "requested_bytes": 2**30,
                "in_flight": 12,
                "in_flight_source": "scheduler",
            }
        )
    )
    exporter, exporter_addr = start_exporter(
        "--interval",
        "0.5",
        "--no-nvml",
        "--hostname",
        k8s.NODE,
        "--vllm",
        f"{k8s.VLLM_NAME}={vllm.url}",
        "--dcgm-file",
        str(DCGM_K8S),
        "--allocator-dir",
        str(tmp / "alloc"),
    )
    exporter_port = int(exporter_addr.rsplit(":", 1)[1])
    remediator_port = free_port()
    config = k8s.remediator_config(T)
    config |= {
        "listen": f"127.0.0.1:{remediator_port}",
        "auth": {"allow_unauthenticated": True},
        "audit_log": str(tmp / "audit.jsonl"),
        "targets": [
            {**config["targets"][0], "url": f"http://127.0.0.1:{vllm_port}", "token_file": None}
        ],
    }
    for key in ("alertmanager", "leader_election"):
        config.pop(key, None)
    config["targets"][0].pop("restart", None)
    (tmp / "remediator.yaml").write_text(yaml.safe_dump(config))
    remediator = Process(
        [sys.executable, "-m", "oomguard", "remediator", "--config", str(tmp / "remediator.yaml")],
        tmp / "remediator.log",
    )
    prometheus = None
    try:
        remediator.wait_http(f"http://127.0.0.1:{remediator_port}/healthz", 30)
        workloads = {
            o["metadata"]["name"]: o
            for o in [*k8s.exporter(T), *k8s.remediator(T), *k8s.vllm_example(T)]
            if o["kind"] in {"DaemonSet", "Deployment"}
        }
        pods = [
            pod_of(
                workloads["oomguard-exporter"],
                "oomguard-exporter-7xk2p",
                "127.0.0.1",
                k8s.NODE,
                ports={9848: exporter_port},
            ),
            pod_of(
                workloads["oomguard-remediator"],
                "oomguard-remediator-5d9c8f-q2w7r",
                "127.0.0.1",
                "cpu-node-3",
                ports={9849: remediator_port},
            ),
            pod_of(
                workloads[k8s.VLLM_NAME],
                "vllm-llama-3-8b-6f7d9-x8k2m",
                "127.0.0.1",
                k8s.NODE,
                ports={8000: vllm_port},
            ),
        ]
        prom_config, predicted = _prometheus_config(tmp, pods)
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_config))
        port = free_port()
        prometheus = Process(
            [
                shutil.which("prometheus") or "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            tmp / "prometheus.log",
        )
        url = f"http://127.0.0.1:{port}"
        prometheus.wait_http(f"{url}/-/ready", 30)
        deadline = time.monotonic() + 60
        targets: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            targets = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            if len(targets) == len(predicted) and all(t["health"] == "up" for t in targets):
                break
            time.sleep(0.5)
        time.sleep(3)  # a few scrapes of each, and the exporter's vLLM and dcgm series
        yield url, targets, predicted
    finally:
        if prometheus is not None:
            prometheus.stop()
        remediator.stop()
        stop(exporter)
        vllm.close()


def _series(url: str, match: str) -> list[dict[str, str]]:
    body = httpx.get(f"{url}/api/v1/series", params={"match[]": match}, timeout=10).json()
    return body["data"]


def test_each_target_gets_the_labels_the_operator_reading_predicts(scraped):
    _url, targets, predicted = scraped
    got = {(t["scrapePool"], t["scrapeUrl"].split("/")[2]): t for t in targets}
    assert set(got) == set(predicted), (sorted(got), sorted(predicted))
    for key, target in got.items():
        assert target["health"] == "up", (key, target.get("lastError"))
        assert target["labels"] == predicted[key], key
    jobs = {t["labels"]["job"] for t in targets}
    assert jobs == {T.exporter_job, T.remediator_job, T.vllm_job}
    exporter = next(t for t in targets if t["labels"]["job"] == T.exporter_job)
    assert exporter["labels"]["instance"] == k8s.NODE
    assert exporter["scrapePool"] == "podMonitor/oomguard/oomguard-exporter/0"


def test_pod_attributed_gpu_series_keep_their_own_pod(scraped):
    url, _, _ = scraped
    series = _series(url, "oomguard_gpu_pod_memory_used_bytes")
    assert series
    for s in series:
        # the vLLM pod dcgm-exporter attributed the memory to, not the exporter's own pod
        assert s["namespace"] == "llm-serving" and s["pod"].startswith("vllm-"), s
        assert s["container"] == "vllm" and s["job"] == T.exporter_job, s
    everything = _series(url, '{job=~".+"}')
    exported = sorted({k for s in everything for k in s if k.startswith("exported_")})
    assert exported == []


_GROUPING = re.compile(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_NAME = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_TEMPLATE = re.compile(r"\$labels\.(\w+)")


def rule_labels(rule: dict[str, Any]) -> set[str]:
    """Label names a rule selects, groups or joins on, or names in its annotations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', rule["expr"])
    names: set[str] = set()
    for group in _GROUPING.findall(expr):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    for body in _MATCHERS.findall(expr):
        names |= set(_MATCHER_NAME.findall(body))
    for text in (rule.get("annotations") or {}).values():
        names |= set(_TEMPLATE.findall(text))
    return names


def test_every_label_a_rule_uses_reaches_prometheus(scraped, repo_root):
    """For every rule whose input series this stack produces (the exporter's from vLLM and
    dcgm-exporter, the remediator's, vLLM's own), each label it uses is on those series."""
    url, _, _ = scraped
    rule = next(
        o for o in k8s.monitoring(*_generated(repo_root), T) if o["kind"] == "PrometheusRule"
    )
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    recorded = {r["record"]: r for r in rules if "record" in r}
    labels_of: dict[str, set[str]] = {}

    def labels(metric: str) -> set[str] | None:
        if metric not in labels_of:
            if metric in recorded:
                inputs = [labels(m) for m in metric_names(recorded[metric]["expr"])]
                if any(i is None for i in inputs):
                    return None
                labels_of[metric] = set().union(*inputs)  # type: ignore[arg-type]
            else:
                found = _series(url, metric)
                if not found:
                    return None
                labels_of[metric] = {k for s in found for k in s}
        return labels_of[metric]

    checked, missing = 0, {}
    for r in rules:
        metrics = metric_names(r["expr"]) - {"time", "vector"}
        inputs = [labels(m) for m in metrics]
        if not metrics or any(i is None for i in inputs):
            continue  # this stack does not produce all it reads (allocator files, cgroups...)
        checked += 1
        have = set().union(*inputs) | NOT_SCRAPED  # type: ignore[arg-type]
        lacking = rule_labels(r) - have
        if lacking:
            missing[r.get("alert") or r["record"]] = sorted(lacking)
    assert missing == {}
    assert checked >= 45, f"only {checked} of {len(rules)} rules could be checked"  # 47 of 64


def _generated(repo_root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    rules = yaml.safe_load(
        (repo_root / "alerts/oomguard/alerts/generated/oomguard.rules.yaml").read_text()
    )
    alertmanager = yaml.safe_load((repo_root / "deploy/alertmanager/alertmanager.yml").read_text())
    return rules, alertmanager
