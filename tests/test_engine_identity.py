"""One engine identity across the exporter's series, the remediator's targets, the rules and the
dashboards, in static and in discovery mode (issue 24, item 4).

The names come from the code that gives them, on the generated manifests: the exporter's name is
its `--vllm` argument in the DaemonSet, the remediator's is the static target in its ConfigMap or
what pod discovery (`pod_target`) names the example's pod. promtool then runs the rules that join
the two sides on `target` with series carrying exactly those names: requests queueing behind a
lowered cap, a model whose only engine is drained (ModelUnavailable), and the capacity withheld
per target and per model. With the names discovery used to give (`<namespace>:<pod>`) they fail.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from oomguard.manifests import kubernetes as k8s
from oomguard.remediator.config import RemediatorConfig
from oomguard.remediator.discovery import DiscoveryConfig, pod_target
from oomguard.thresholds import AlertThresholds
from tests.kube_semantics import pod_of

T = AlertThresholds()
RULES = (
    Path(__file__).resolve().parent.parent / "alerts/oomguard/alerts/generated/oomguard.rules.yaml"
)
CLUSTER = {T.cluster_label: "prod-eu-1"}
POD = "vllm-llama-3-8b-6f7d9-x8k2m"


def exporter_name() -> str:
    ds = next(o for o in k8s.exporter(T) if o["kind"] == "DaemonSet")
    (arg,) = [a for a in ds["spec"]["template"]["spec"]["containers"][0]["args"] if "--vllm=" in a]
    return arg.removeprefix("--vllm=").split("=", 1)[0]


def static_name() -> str:
    config_map = next(o for o in k8s.remediator(T) if o["kind"] == "ConfigMap")
    config = RemediatorConfig.model_validate(yaml.safe_load(config_map["data"]["remediator.yaml"]))
    (target,) = config.targets
    return target.name


def discovered_name() -> str:
    """The example's pod as the API server shows it, named by pod discovery."""
    deployment = next(o for o in k8s.vllm_example(T) if o["kind"] == "Deployment")
    pod = pod_of(deployment, POD, "10.0.0.7", k8s.NODE, ready=False)  # drained: still a target
    target = pod_target(pod, DiscoveryConfig(namespaces=[k8s.VLLM_NS]))
    assert target is not None
    return target.name


def annotations(alert: str, description: str) -> dict[str, str]:
    from oomguard.alerts.rules import alerts

    (rule,) = [a for a in alerts(T) if a.name == alert]
    return {**rule.annotations(T), "description": description}


def sel(metric: str, labels: dict[str, str]) -> str:
    return metric + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def cases(engine: str, remediator: str) -> dict[str, Any]:
    """promtool tests: the exporter names its engine `engine`, the remediator `remediator`."""
    exp = {**CLUSTER, **k8s.scrape_labels(k8s.exporter(T), "oomguard-exporter-7xk2p")}
    rem = {**CLUSTER, **k8s.scrape_labels(k8s.remediator(T), "oomguard-remediator-5d9c8f-q2w7r")}
    series = {**exp, "target": engine, "model_name": k8s.MODEL, "engine": "0"}
    target = {**rem, "target": remediator}
    capped = {
        sel("oomguard_remediator_admission_cap", target): "8x20",
        sel("oomguard_remediator_startup_max_num_seqs", target): "64x20",
    }
    draining = {
        **{
            sel("oomguard_remediator_target_mode", {**target, "mode": m}): "0x20"
            for m in ("serving",)
        },
        sel("oomguard_remediator_target_mode", {**target, "mode": "draining"}): "1x20",
        sel("oomguard_remediator_startup_max_num_seqs", target): "64x20",
        sel("oomguard_remediator_admission_cap", target): "64x20",
    }
    running = {
        sel("oomguard_vllm_requests_running", series): "3x20",
        sel("oomguard_vllm_up", {**exp, "target": engine}): "1x20",
    }

    def test(inputs: dict[str, str], **check: Any) -> dict[str, Any]:
        return {
            "interval": "1m",
            "input_series": [{"series": k, "values": v} for k, v in inputs.items()],
            **check,
        }

    return {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            test(
                {sel("oomguard_vllm_requests_waiting", series): "40x20", **capped},
                alert_rule_test=[
                    {
                        "eval_time": "15m",
                        "alertname": "OomguardRequestsQueueing",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    # across the exporter pods that serve it (no `pod`)
                                    **{k: v for k, v in series.items() if k != "pod"},
                                    "severity": "warning",
                                    "namespace": "oomguard",
                                },
                                "exp_annotations": annotations(
                                    "OomguardRequestsQueueing",
                                    f"40 requests wait on engine 0 of {engine} on {k8s.NODE} "
                                    "while its admission cap is below the startup max_num_seqs.",
                                ),
                            }
                        ],
                    }
                ],
            ),
            test(
                {**running, **draining},
                alert_rule_test=[
                    {
                        "eval_time": "10m",
                        "alertname": "OomguardModelUnavailable",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    **CLUSTER,
                                    "model_name": k8s.MODEL,
                                    "severity": "critical",
                                },
                                "exp_annotations": annotations(
                                    "OomguardModelUnavailable",
                                    f"No engine serving model {k8s.MODEL} has been up and "
                                    f"admitting requests for {T.model_unavailable_for}: every "
                                    "request for it fails.",
                                ),
                            }
                        ],
                    }
                ],
            ),
            test(
                {**running, **capped},
                promql_expr_test=[
                    {
                        "expr": "target:oomguard_capacity_withheld_seqs:max",
                        "eval_time": "10m",
                        "exp_samples": [
                            {
                                "labels": "target:oomguard_capacity_withheld_seqs:max"
                                + "{"
                                + f'{T.cluster_label}="prod-eu-1", target="{remediator}"'
                                + "}",
                                "value": 56,
                            }
                        ],
                    },
                    {
                        "expr": "model_name:oomguard_capacity_withheld_seqs:sum",
                        "eval_time": "10m",
                        "exp_samples": [
                            {
                                "labels": "model_name:oomguard_capacity_withheld_seqs:sum"
                                + "{"
                                + f'{T.cluster_label}="prod-eu-1", model_name="{k8s.MODEL}"'
                                + "}",
                                "value": 56,
                            }
                        ],
                    },
                ],
            ),
        ],
    }


def promtool(tmp_path: Path, tests: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "identity.test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )


def test_every_side_names_the_engine_alike():
    assert exporter_name() == static_name() == discovered_name() == k8s.VLLM_NAME


@pytest.mark.parametrize("mode", ["static", "discovery"])
def test_the_rules_that_join_on_target_match_in_each_mode(mode, tmp_path):
    remediator = static_name() if mode == "static" else discovered_name()
    r = promtool(tmp_path, cases(exporter_name(), remediator))
    assert r.returncode == 0, r.stdout + r.stderr


def test_with_the_names_discovery_used_to_give_they_do_not(tmp_path):
    """Before issue 24 a discovered pod was `<namespace>:<pod>`: no rule joined it."""
    r = promtool(tmp_path, cases(exporter_name(), f"{k8s.VLLM_NS}:{POD}"))
    assert r.returncode != 0
    for alert in ("OomguardRequestsQueueing", "OomguardModelUnavailable"):
        assert f"alertname: {alert}" in r.stdout + r.stderr
    assert "model_name:oomguard_capacity_withheld_seqs:sum" in r.stdout + r.stderr
