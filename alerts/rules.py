"""Alert and recording rules, defined once, generated into Prometheus rule files.

Conventions (monitoring mixins): every alert is named `Oomguard...` (except the conventional
`Watchdog`), has `severity` critical, warning or info, a one-sentence `summary`, a templated
`description`, and a `runbook_url` to runbooks/<Alert>.md. Alerts the remediator acts on carry
`oomguard_action` (lower_cap, drain, restart); their series labels (instance, target, engine)
name the engine. KV-cache usage alone never carries an action: near 100 % is normal for vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomguard.thresholds import AlertThresholds

# Labels that identify an engine in alerts (instance and job come from the scrape).
ENGINE_BY = "instance, job, target, model_name, engine"
GPU_BY = "instance, job, Hostname, gpu, UUID, GPU_I_ID, modelName"


@dataclass(frozen=True)
class RecordingRule:
    record: str
    expr: str


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    for_: str = "0s"
    keep_firing_for: str | None = None
    action: str | None = None

    def labels(self) -> dict[str, str]:
        labels = {"severity": self.severity}
        if self.action:
            labels["oomguard_action"] = self.action
        return labels

    def annotations(self, t: AlertThresholds) -> dict[str, str]:
        return {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": f"{t.runbook_url_base.rstrip('/')}/{self.name}.md",
        }


def recording_rules() -> list[RecordingRule]:
    return [
        RecordingRule(
            "oomguard:engine_pressure_level:max",
            f"max by ({ENGINE_BY}) (oomguard_engine_pressure_level)",
        ),
        RecordingRule(
            "oomguard:gpu_pressure_level:max",
            f"max by ({GPU_BY}) (oomguard_gpu_pressure_level)",
        ),
        RecordingRule(
            "oomguard:vllm_preemption_ratio:rate5m",
            # At least one finished request per 5 minutes in the denominator: a preemption with
            # nothing finishing is a storm, not a division by zero.
            f"sum by ({ENGINE_BY}) (rate(oomguard_vllm_preemptions_total[5m]))\n"
            f"/ clamp_min(sum by ({ENGINE_BY}) "
            "(rate(oomguard_vllm_requests_finished_total[5m])), 1 / 300)",
        ),
        RecordingRule(
            "oomguard:allocator_fragmentation_bytes",
            "oomguard_allocator_reserved_bytes - oomguard_allocator_allocated_bytes",
        ),
        RecordingRule(
            "oomguard:gpu_memory_used_ratio",
            "(oomguard_gpu_memory_total_bytes - oomguard_gpu_memory_free_bytes)\n"
            "/ oomguard_gpu_memory_total_bytes",
        ),
    ]


_ENGINE = "engine {{ $labels.engine }} of {{ $labels.target }} on {{ $labels.instance }}"
_GPU = "GPU {{ $labels.gpu }} ({{ $labels.UUID }}) on {{ $labels.Hostname }}"


def alerts(t: AlertThresholds) -> list[Alert]:
    return [
        Alert(
            "OomguardKVCacheUsageHigh",
            f"oomguard_vllm_kv_cache_usage_ratio > {t.kv_usage_high_ratio}",
            "info",
            "A vLLM engine has kept its KV cache nearly full for a long time.",
            f"The KV cache of {_ENGINE} is {{{{ $value | humanizePercentage }}}} full. "
            "This is normal under load and is not a danger sign by itself; sustained, it "
            "means the engine runs at capacity.",
            for_=t.kv_usage_high_for,
        ),
        Alert(
            "OomguardMemoryCaution",
            "oomguard:engine_pressure_level:max >= 1",
            "info",
            "A vLLM engine has been at memory pressure level caution or higher.",
            f"The pressure level of {_ENGINE} is {{{{ $value }}}} (1 caution, 2 pressure, "
            "3 critical).",
            for_=t.caution_for,
        ),
        Alert(
            "OomguardPreemptionRateHigh",
            f"oomguard:vllm_preemption_ratio:rate5m > {t.preemption_ratio}",
            "warning",
            "A vLLM engine preempts a high share of its requests.",
            f"{_ENGINE} preempted {{{{ $value | humanizePercentage }}}} of its finished "
            "requests over 5 minutes: the precursor of an out-of-memory crash.",
            for_=t.preemption_for,
            keep_firing_for=t.keep_firing_for,
            action="lower_cap",
        ),
        Alert(
            "OomguardMemoryPressure",
            "oomguard:engine_pressure_level:max >= 2",
            "warning",
            "A vLLM engine is under GPU memory pressure.",
            f"The pressure level of {_ENGINE} is {{{{ $value }}}}: free device memory is low "
            "or the allocator had to retry. oomguard lowers its admission cap.",
            for_=t.pressure_for,
            keep_firing_for=t.keep_firing_for,
            action="lower_cap",
        ),
        Alert(
            "OomguardMemoryCritical",
            "oomguard:engine_pressure_level:max >= 3",
            "critical",
            "A vLLM engine is about to run out of GPU memory.",
            f"The pressure level of {_ENGINE} is {{{{ $value }}}}: free device memory is below "
            "the critical floor or the allocator reported an out-of-memory error. oomguard "
            "drains the engine.",
            for_=t.critical_for,
            keep_firing_for=t.keep_firing_for,
            action="drain",
        ),
        Alert(
            "OomguardGpuMemoryPressure",
            "oomguard:gpu_pressure_level:max == 2",
            "warning",
            "A GPU is low on free memory.",
            f"{_GPU} is at pressure level 2: free memory is under twice its critical floor.",
            for_="1m",
            keep_firing_for=t.keep_firing_for,
        ),
        Alert(
            "OomguardGpuMemoryCritical",
            "oomguard:gpu_pressure_level:max >= 3",
            "critical",
            "A GPU is about to run out of memory.",
            f"{_GPU} is at pressure level 3: free memory is below its critical floor or a "
            "process on it hit a CUDA out-of-memory error.",
            for_=t.critical_for,
            keep_firing_for=t.keep_firing_for,
        ),
        Alert(
            "OomguardAllocatorFragmentationGrowing",
            f"delta(oomguard:allocator_fragmentation_bytes[{t.growth_window}]) "
            f"> {t.fragmentation_growth_bytes}",
            "warning",
            "PyTorch allocator fragmentation in a vLLM worker keeps growing.",
            "Reserved minus allocated memory of rank {{ $labels.rank }} (pid {{ $labels.pid }}) "
            f"on {{{{ $labels.Hostname }}}} grew by {{{{ $value | humanize1024 }}}}B over "
            f"{t.growth_window}.",
            for_="30m",
        ),
        Alert(
            "OomguardAllocatorLeak",
            f"min_over_time(oomguard_allocator_allocated_bytes[30m])\n"
            f"- min_over_time(oomguard_allocator_allocated_bytes[30m] offset {t.growth_window})\n"
            f"> {t.leak_growth_bytes}",
            "warning",
            "Memory held by live tensors in a vLLM worker keeps rising.",
            "The lowest allocated memory of rank {{ $labels.rank }} (pid {{ $labels.pid }}) on "
            f"{{{{ $labels.Hostname }}}} rose by {{{{ $value | humanize1024 }}}}B in "
            f"{t.growth_window}: a leak.",
            for_="30m",
        ),
        Alert(
            "OomguardCudaOomObserved",
            "increase(oomguard_allocator_ooms_total[5m]) > 0",
            "critical",
            "A vLLM worker hit a CUDA out-of-memory error.",
            "Rank {{ $labels.rank }} (pid {{ $labels.pid }}) of {{ $labels.target }} on "
            "{{ $labels.Hostname }} raised {{ $value | humanize }} CUDA out-of-memory errors in "
            "5 minutes.",
            keep_firing_for="10m",
            action="restart",
        ),
        Alert(
            "OomguardEngineRestarted",
            "resets(oomguard_vllm_generation_tokens_total[15m]) > 0",
            "warning",
            "A vLLM engine restarted.",
            f"The counters of {_ENGINE} reset {{{{ $value }}}} times in 15 minutes: the engine "
            "restarted, often after a crash.",
        ),
        Alert(
            "OomguardHostOomKill",
            "increase(oomguard_host_oom_kills_total[10m]) > 0",
            "critical",
            "The kernel OOM killer killed a process in a serving cgroup.",
            "The kernel killed {{ $value | humanize }} processes of cgroup {{ $labels.cgroup }} on "
            "{{ $labels.Hostname }} for exceeding host memory: exit code 137, no traceback.",
        ),
        Alert(
            "OomguardEngineDown",
            "oomguard_vllm_up == 0",
            "critical",
            "A vLLM engine does not answer.",
            "The exporter on {{ $labels.instance }} cannot scrape vLLM target "
            "{{ $labels.target }}.",
            for_=t.engine_down_for,
        ),
        Alert(
            "OomguardExporterDown",
            f'up{{job="{t.exporter_job}"}} == 0',
            "critical",
            "An oomguard exporter cannot be scraped.",
            "Prometheus cannot scrape the oomguard exporter on {{ $labels.instance }}: GPU "
            "memory on that node is not watched.",
            for_="2m",
        ),
        Alert(
            "OomguardCollectorDown",
            "oomguard_exporter_collector_up == 0",
            "warning",
            "An oomguard exporter collector fails.",
            "Collector {{ $labels.collector }} {{ $labels.target }} of the exporter on "
            "{{ $labels.instance }} has failed for a while.",
            for_=t.collector_down_for,
        ),
        Alert(
            "OomguardMetricsStale",
            f"time() - oomguard_exporter_snapshot_timestamp_seconds > {t.stale_after_seconds}",
            "warning",
            "An oomguard exporter serves an old snapshot.",
            "The exporter on {{ $labels.instance }} last collected {{ $value | humanizeDuration "
            "}} ago: its polling is stuck.",
            for_="2m",
        ),
        Alert(
            "OomguardRequestsQueueing",
            f"(max by ({ENGINE_BY}) (oomguard_vllm_requests_waiting) > {t.queueing_waiting})\n"
            "and on (target)\n"
            "(max by (target) (oomguard_remediator_admission_cap)\n"
            " < max by (target) (oomguard_remediator_startup_max_num_seqs))",
            "warning",
            "Requests queue on a vLLM engine whose admission cap oomguard lowered.",
            f"{{{{ $value }}}} requests wait on {_ENGINE} while its admission cap is below the "
            "startup max_num_seqs.",
            for_="10m",
        ),
        Alert(
            "OomguardRemediationFailing",
            'increase(oomguard_remediator_actions_total{result="failed"}[10m]) > 0\n'
            "or increase(oomguard_remediator_reconcile_errors_total[10m]) > 2",
            "critical",
            "The oomguard remediator fails to act on an engine.",
            "The remediator on {{ $labels.instance }} failed {{ $value | humanize }} times in 10 "
            "minutes on target {{ $labels.target }}: the engine is not protected.",
        ),
        Alert(
            "OomguardRemediationLimited",
            "sum by (instance, job, target, limit) "
            "(increase(oomguard_remediator_safety_limited_total[15m])) > 0",
            "warning",
            "A safety limit stopped the oomguard remediator from acting.",
            "The remediator on {{ $labels.instance }} held back {{ $value | humanize }} actions on "
            "{{ $labels.target }} because of its {{ $labels.limit }} limit.",
        ),
        Alert(
            "Watchdog",
            "vector(1)",
            "none",
            "An alert that always fires, to prove the alerting pipeline works.",
            "This alert always fires. If it stops arriving, Prometheus or Alertmanager is down.",
        ),
    ]


def rule_groups(t: AlertThresholds) -> dict[str, object]:
    def alert_rule(a: Alert) -> dict[str, object]:
        rule: dict[str, object] = {"alert": a.name, "expr": a.expr}
        if a.for_ != "0s":
            rule["for"] = a.for_
        if a.keep_firing_for:
            rule["keep_firing_for"] = a.keep_firing_for
        rule["labels"] = a.labels()
        rule["annotations"] = a.annotations(t)
        return rule

    # One group: rules in a group run in order, so every alert sees the recording rules of the
    # same evaluation (across groups there is no order, and a for: 0s alert would lag a cycle).
    recorded: list[dict[str, object]] = [
        {"record": r.record, "expr": r.expr} for r in recording_rules()
    ]
    return {
        "groups": [{"name": "oomguard", "rules": recorded + [alert_rule(a) for a in alerts(t)]}]
    }


@dataclass
class Case:
    """One promtool test: input series, an evaluation time, the alerts expected then."""

    alert: str
    eval_time: str
    series: dict[str, str]
    firing: list[dict[str, str]] = field(default_factory=list)  # labels incl. description
    interval: str = "1m"
