"""Thresholds: the one definition of "how much is too much" for the exporter, alerts and dashboards.

Defaults come from field figures (docs/pressure.md cites them). Every value can be overridden in
the `pressure:` section of the exporter's YAML config; the alert generator reads the same model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from oomguard import vllm_seam

GIB = 1024**3


class PressureThresholds(BaseModel):
    """When a GPU or an engine is in danger of a CUDA out-of-memory error (docs/pressure.md).

    A GPU that runs vLLM engines is judged against their memory plan: each engine may use
    `gpu_memory_utilization x usable memory` at its peak, so the danger is the free memory left
    once every engine reaches that peak (the headroom). A healthy engine keeps
    `(1 - gmu) x usable` of headroom by design: 8 % at vLLM's default 0.92, 5 % at 0.95. The
    levels sit below that, as shares of the device's usable memory. A GPU with no engine on it
    keeps a plain free-memory floor and never goes past caution. KV-cache usage is deliberately
    not an input: near 100 % under load is how vLLM normally runs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    headroom_caution_ratio: float = Field(
        0.03,
        ge=0,
        le=0.5,
        description="Level 1 when the headroom at the engines' planned peak is below this share "
        "of the GPU's usable memory.",
    )
    headroom_pressure_ratio: float = Field(
        0.02, ge=0, le=0.5, description="Level 2 below this share of usable memory."
    )
    headroom_critical_ratio: float = Field(
        0.01,
        ge=-0.5,
        le=0.5,
        description="Level 3 below this share of usable memory: the next planned peak is about "
        "to stop fitting.",
    )
    floor_bytes: int = Field(
        2 * GIB, gt=0, description="Free-memory floor of a GPU without a planned engine."
    )
    floor_ratio: float = Field(
        0.08, gt=0, le=0.5, description="The same floor as a share of device memory (smaller wins)."
    )
    rate_window_seconds: float = Field(
        60.0, gt=0, description="Window over which the preemption ratio is computed."
    )
    event_hold_seconds: float = Field(
        120.0,
        ge=0,
        description="How long a new allocator OOM (level 3) or retry (level 2) holds the level.",
    )
    blind_retention_seconds: float = Field(
        600.0,
        gt=0,
        description="How long a GPU or engine that can no longer be read is reported blind "
        "before it is forgotten.",
    )
    kv_budget_margin: float = Field(
        0.15, ge=0, description="Safety margin on the projected per-request KV budget."
    )

    @model_validator(mode="after")
    def _ordered(self) -> PressureThresholds:
        if not (
            self.headroom_critical_ratio
            <= self.headroom_pressure_ratio
            <= self.headroom_caution_ratio
        ):
            raise ValueError("headroom ratios must be ordered: critical <= pressure <= caution")
        return self

    def floor_for(self, total_bytes: float) -> float:
        return min(float(self.floor_bytes), self.floor_ratio * total_bytes)


_DURATION = r"^([0-9]+(ms|s|m|h|d|w|y))+$"
_K8S_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a namespace or ServiceAccount (RFC 1123 label)


class KubernetesInstall(BaseModel):
    """Where the cluster's prometheus-operator stack runs, for the Kubernetes manifests.

    The defaults fit both stock installs (docs/kubernetes.md): kube-prometheus (jsonnet) runs
    Prometheus as ServiceAccount `monitoring/prometheus-k8s` with Roles in three namespaces only,
    so the manifests bind it a read-only Role in each namespace a PodMonitor scrapes;
    kube-prometheus-stack (Helm) selects only PodMonitors and PrometheusRules labelled
    `release: <its Helm release>`, so they carry that label.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    prometheus_service_account: str = Field(
        "prometheus-k8s",
        pattern=_K8S_NAME,
        description="Prometheus's ServiceAccount (kube-prometheus: prometheus-k8s; "
        "kube-prometheus-stack: <release>-kube-prometheus-stack-prometheus, whose ClusterRole "
        "already reads every namespace).",
    )
    prometheus_namespace: str = Field(
        "monitoring", pattern=_K8S_NAME, description="The namespace of that ServiceAccount."
    )
    helm_release: str = Field(
        "kube-prometheus-stack",
        pattern=r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$",
        max_length=63,
        description="kube-prometheus-stack's Helm release name: the `release` label its default "
        "selectors require on PodMonitors and PrometheusRules (empty: no label).",
    )
    alertmanager_namespace: str = Field(
        "monitoring",
        pattern=_K8S_NAME,
        description="The namespace of the cluster's Alertmanager: the AlertmanagerConfig goes "
        "there, which both stock installs select without a change to the Alertmanager.",
    )


class AlertThresholds(BaseModel):
    """Thresholds, timings and scrape names of the rules (`oomguard generate --thresholds`).

    Job names and the cluster label are here so that the rules, the Prometheus config and the
    Kubernetes PodMonitors come from one place: the manifests relabel `job` to exactly these names.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    runbook_url_base: str = Field(
        "https://oomguard.example/runbooks",
        description="Where your team publishes runbooks/; each alert links <base>/<Alert>.md.",
    )
    exporter_job: str = Field("oomguard-exporter", description="Prometheus job of the exporters.")
    remediator_job: str = Field(
        "oomguard-remediator", description="Prometheus job of the remediator."
    )
    vllm_job: str = Field("vllm", description="Prometheus job scraping vLLM's own /metrics.")
    kubernetes: KubernetesInstall = Field(
        default_factory=KubernetesInstall,
        description="The prometheus-operator install the Kubernetes manifests are made for.",
    )
    kube_state_metrics_job: str = Field(
        "kube-state-metrics",
        description="Prometheus job of kube-state-metrics (kube-prometheus and "
        "kube-prometheus-stack both name it so); the DaemonSet and crash-loop alerts read it.",
    )
    exporter_daemonset: str = Field(
        "oomguard-exporter", description="Name of the exporter's DaemonSet (deploy/kubernetes)."
    )
    remediator_deployment: str = Field(
        "oomguard-remediator",
        description="Name of the remediator's Deployment (deploy/kubernetes).",
    )
    gpu_node_resource: str = Field(
        "nvidia_com_gpu",
        pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$",
        description="The GPU resource as kube-state-metrics spells it in kube_node_status_capacity "
        "(nvidia.com/gpu becomes nvidia_com_gpu): nodes that have it should run an exporter.",
    )
    cluster_label: str = Field(
        "cluster",
        pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$",
        description="Label naming the cluster (an external label); every aggregation keeps it.",
    )
    rule_interval: str = Field(
        "5s",
        pattern=_DURATION,
        description="Evaluation interval of the rule group, set in the group itself so that "
        "`for` and hysteresis hold whatever the server's global evaluation_interval is.",
    )
    action_rule_interval: str = Field(
        "250ms",
        pattern=_DURATION,
        description="Evaluation interval of the work orders on the exporter's level series "
        "(MemoryPressure, FragmentationPressure, MemoryCritical, PressureBlind): one max or min "
        "of one gauge per engine, cheap at any fleet size, so that detection is not held up by "
        "the rule schedule.",
    )
    remediator_group_interval: str = Field(
        "100ms",
        pattern=_DURATION,
        description="group_interval of Alertmanager's remediator route: every alert is its own "
        "group there (new ones go out at once); an alert that fires again while its group "
        "still exists (about 30 s after it resolved) waits at most this long. Alertmanager "
        "sends only what changed, so a short interval sends no more webhooks.",
    )
    kv_usage_high_ratio: float = Field(0.9, gt=0, le=1)
    kv_usage_high_for: str = Field("15m", pattern=_DURATION)
    preemption_ratio: float = Field(0.01, gt=0, description="Preemptions per finished request.")
    preemption_min_count: int = Field(
        10, ge=1, description="Preemptions in 5 minutes before the ratio counts (idle engines)."
    )
    preemption_for: str = Field("5m", pattern=_DURATION)
    caution_for: str = Field("10m", pattern=_DURATION)
    pressure_for: str = Field("30s", pattern=_DURATION)
    critical_for: str = Field("0s", pattern=_DURATION)
    keep_firing_for: str = Field(
        "2m", pattern=_DURATION, description="Hysteresis on GPU and on-call alerts."
    )
    action_keep_firing_for: str = Field(
        "15s",
        pattern=_DURATION,
        description="Hysteresis on alerts that carry an action (the remediator's recovery "
        "starts only once they resolve, so keep it short: the staged re-admission, not this, "
        "guards against memory that comes back only for a moment).",
    )
    fragmentation_growth_bytes: int = Field(2 * GIB, gt=0)
    leak_growth_bytes: int = Field(1 * GIB, gt=0)
    growth_window: str = Field("2h", pattern=_DURATION)
    queueing_waiting: int = Field(10, ge=1, description="Waiting requests that count as a queue.")
    engine_down_for: str = Field(
        "15m", pattern=_DURATION, description="Rollouts and model loads take minutes: a ticket."
    )
    model_unavailable_for: str = Field(
        "5m", pattern=_DURATION, description="A model with no ready engine this long pages."
    )
    collector_down_for: str = Field("5m", pattern=_DURATION)
    stale_after_seconds: int = Field(30, gt=0)
    remediator_down_for: str = Field("5m", pattern=_DURATION)
    paused_for: str = Field("1h", pattern=_DURATION, description="A pause this long is a ticket.")
    held_for: str = Field("15m", pattern=_DURATION, description="A target held this long.")
    pass_behind_seconds: int = Field(
        60, gt=0, description="The leading remediator completed no reconcile pass this long."
    )
    # SLOs on vLLM's own metrics (multi-window, multi-burn-rate alerts, SRE Workbook ch. 5)
    slo_success_objective: float = Field(
        0.999, gt=0, lt=1, description="Share of finished requests without finished_reason=error."
    )
    slo_ttft_objective: float = Field(
        0.95, gt=0, lt=1, description="Share of requests whose first token comes within slo_ttft."
    )
    slo_ttft_seconds: float = Field(
        2.5, description="TTFT threshold: one of vLLM's histogram bucket bounds."
    )

    @model_validator(mode="after")
    def _ttft_is_a_bucket(self) -> AlertThresholds:
        if self.slo_ttft_seconds not in VLLM_TTFT_BUCKETS:
            raise ValueError(
                f"slo_ttft_seconds must be one of vLLM's TTFT buckets {VLLM_TTFT_BUCKETS}"
            )
        return self


# vLLM's time_to_first_token_seconds buckets (vllm_seam; the newest supported vLLM's, as the
# generated rules are): an SLO threshold must be one of them, since PromQL reads the bucket whose
# `le` label equals it.
VLLM_TTFT_BUCKETS: tuple[float, ...] = vllm_seam.newest().TTFT_BUCKETS
