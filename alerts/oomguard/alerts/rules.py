"""Alert and recording rules, defined once, generated into Prometheus rule files.

Conventions (monitoring mixins): every alert is named `Oomguard...` (except the conventional
`Watchdog`), has `severity` critical, warning or info, a one-sentence `summary`, a templated
`description`, and a `runbook_url` to runbooks/<Alert>.md. Recording rules are named
`level:metric:operations`, and every aggregation keeps the cluster label, so one central ruler
(Thanos, Mimir) never merges same-named nodes of different clusters.

Paging on outcomes: alerts that carry `oomguard_action` (lower_cap, drain, restart) are work orders
for the remediator and reach only it, except a CUDA OOM, which is also the incident page.
On-call is paged (severity critical) once per incident: a CUDA OOM, remediation failing or
held back by a safety limit, a model with no ready engine, an SLO burning fast, the remediator
down. The rest is a ticket (warning) or nothing (info). KV-cache usage alone never carries an
action: near 100 % is normal for vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomguard import vllm_seam
from oomguard.actions import ACTION_ALERTS, POD_LABEL, across_pods
from oomguard.catalog import CATALOG
from oomguard.thresholds import AlertThresholds

# vLLM's metric names: the newest supported vLLM's, whatever this environment holds (generated)
V = vllm_seam.newest()

# The burn-rate windows of the SRE Workbook (chapter 5, "Alerting on SLOs"), for a 30-day SLO:
# (severity, long window, short window, burn-rate factor).
BURN_RATES: tuple[tuple[str, str, str, float], ...] = (
    ("critical", "1h", "5m", 14.4),  # 2 % of the budget in an hour
    ("critical", "6h", "30m", 6.0),  # 5 % in six hours
    ("warning", "1d", "2h", 3.0),  # 10 % in a day
    ("warning", "3d", "6h", 1.0),  # 10 % in three days
)
SLO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
# Remediator modes in which a target admits nothing new.
NOT_ADMITTING = "draining|restarting"


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
    runbook_anchor: str | None = None  # a section of the runbook (may be templated)
    doc: str = ""  # when it fires, in a few words: the docs' alerts table (`oomguard generate`)
    extra_labels: tuple[tuple[str, str], ...] = ()  # labels the rule adds (an action alert's)

    def labels(self) -> dict[str, str]:
        labels = {"severity": self.severity}
        if self.action:
            labels["oomguard_action"] = self.action
        return {**labels, **dict(self.extra_labels)}

    def annotations(self, t: AlertThresholds) -> dict[str, str]:
        return {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": runbook_url(t, self.name)
            + (f"#{self.runbook_anchor}" if self.runbook_anchor else ""),
        }


def runbook_url(t: AlertThresholds, name: str) -> str:
    return f"{t.runbook_url_base.rstrip('/')}/{name}.md"


def new_or_increased(metric: str, window: str) -> str:
    """True for a process's own counter that grew within the window, including a series born
    non-zero.

    `increase()` needs two samples, so a counter whose first sample is already 1 (a remediator
    that failed its first action) is invisible to it. The second arm catches that first sample:
    non-zero now, and no series `window` ago. For counters a process keeps in memory (the
    remediator's): a new pod is a new process whose counters start again, so a new series is a
    new counter and the scrape's identity (`pod`, `instance`) belongs to it.
    """
    return f"(increase({metric}[{window}]) > 0 or ({metric} > 0 unless {metric} offset {window}))"


def rose_since(metric: str, window: str, identity: tuple[str, ...]) -> str:
    """True for a counter that rose within the window, judged by `identity`, not by the scrape.

    For counters the exporter reads from files that outlive it (the allocator hand-off, incident
    records, cgroup files): a new exporter pod serves the same values under a new `pod` label, a
    new series for Prometheus. Comparing series by series would call every such counter "born
    non-zero" at each rollout. Instead, the value now is compared with the highest one `window`
    ago of any series with the same identity (the exporter's own labels plus cluster, job and
    instance), 0 where there was none: a counter born non-zero (a process that died of its first
    OOM) still counts, and so does an event during the rollout itself (old pod at 1, new at 2).
    `increase()` covers a rise within one series, counter resets included. The result is
    taken across the pods (`across_pods`): while the DaemonSet surges, the old pod's series
    rises by `increase()` and the new one's by the comparison, and one event is one alert (one
    restart order), not two.
    """
    on = ", ".join(identity)
    return across_pods(
        f"increase({metric}[{window}]) > 0\n"
        f" or {metric} - on ({on}) group_left ()\n"
        f"   max by ({on}) ({metric} offset {window} or 0 * {metric}) > 0"
    )


def exporter_identity(t: AlertThresholds, metric: str) -> tuple[str, ...]:
    """What names one of the exporter's series whichever pod serves it: the cluster, the job, the
    node (`instance`; the manifests set it to the node's name) and the labels the exporter
    writes itself (the catalog's)."""
    return (t.cluster_label, "job", "instance", *CATALOG[metric].labels)


ENGINE_MODEL = "engine:oomguard_vllm_model:info"
ALLOCATED = "rank:oomguard_allocator_allocated_bytes:max"
PREEMPTIONS = "engine:oomguard_vllm_preemptions_total:max"
FINISHED = "engine:oomguard_vllm_requests_finished_total:max"
VLLM_UP = "target:oomguard_vllm_up:max"
# The safety limits under which the remediator caps instead of draining (or restarting) while
# other replicas serve the model: the designed fallback, nothing held back
# (remediator/decision.py FALLBACK_LIMITS; tests/test_alert_rules.py checks they agree). Its
# third, `single_replica` (a model's only engine: a single box), pages: nothing relieves it but
# a person (docs/single-box.md).
FALLBACK_LIMITS = ("disruption_budget", "last_ready")


def with_model(expr: str, c: str, on: tuple[str, ...]) -> str:
    """`expr` with the `model_name` of the engine its series name (ENGINE_MODEL, joined `on`
    those labels); a series whose engine never reported a model is kept without one."""
    by = ", ".join((c, *on))
    model = f"topk by ({by}) (1, {ENGINE_MODEL})"
    return (
        f"(\n{expr}\n)\n+ on ({by}) group_left (model_name) (0 * {model})\n"
        f"or\n(\n{expr}\n)\nunless on ({by}) {ENGINE_MODEL}"
    )


def _num(x: float) -> str:
    return f"{x:.10g}"


def recording_rules(t: AlertThresholds | None = None) -> list[RecordingRule]:
    """The fast group: pressure, ratios and capacity, evaluated every `rule_interval`."""
    t = t or AlertThresholds()
    c = t.cluster_label
    running = f'oomguard_vllm_requests_running{{job="{t.exporter_job}"}}'
    return [
        RecordingRule(
            "engine:oomguard_engine_pressure_level:max",
            f"max without (reason, {POD_LABEL}) (oomguard_engine_pressure_level)",
        ),
        RecordingRule(
            "gpu:oomguard_gpu_pressure_level:max",
            f"max without (reason, {POD_LABEL}) (oomguard_gpu_pressure_level)",
        ),
        # vLLM's counters as the exporter relays them, one series whichever exporter pod serves
        # it (every pod relays the same count): rates over these go on across a rollout, where
        # a rate over each pod's own series would start again from nothing
        RecordingRule(PREEMPTIONS, across_pods("oomguard_vllm_preemptions_total")),
        RecordingRule(FINISHED, across_pods("oomguard_vllm_requests_finished_total")),
        # whether any exporter pod reaches the engine (a new pod's first answer says no)
        RecordingRule(VLLM_UP, across_pods(f'oomguard_vllm_up{{job="{t.exporter_job}"}}')),
        RecordingRule(
            "engine:oomguard_vllm_preemption_ratio:rate5m",
            # At least one finished request per 5 minutes in the denominator: a preemption with
            # nothing finishing is a storm, not a division by zero.
            f"rate({PREEMPTIONS}[5m])\n"
            "/ clamp_min(sum without (finished_reason) "
            f"(rate({FINISHED}[5m])), 1 / 300)",
        ),
        # The model each engine serves now, else the one it served within the hour (a crashed
        # engine has no series while it reloads): pages about an engine carry its model, so a
        # CUDA OOM, the model's unavailability and its error budget are one incident
        # (Alertmanager's pager route groups by model). topk keeps one model per engine.
        RecordingRule(
            ENGINE_MODEL,
            f"group by ({c}, instance, target, engine, model_name) (\n"
            f"  topk by ({c}, instance, target, engine) (1,\n"
            f"    2 * group by ({c}, instance, target, engine, model_name) ({running})\n"
            f"    or group by ({c}, instance, target, engine, model_name) "
            f"(last_over_time({running}[1h]))\n"
            "  )\n"
            ")",
        ),
        RecordingRule(
            "rank:oomguard_allocator_fragmentation_bytes:diff",
            across_pods("oomguard_allocator_reserved_bytes - oomguard_allocator_allocated_bytes"),
        ),
        RecordingRule(ALLOCATED, across_pods("oomguard_allocator_allocated_bytes")),
        RecordingRule(
            "gpu:oomguard_gpu_memory_used:ratio",
            across_pods(
                "(oomguard_gpu_memory_total_bytes - oomguard_gpu_memory_free_bytes)\n"
                "/ oomguard_gpu_memory_total_bytes"
            ),
        ),
        # Capacity withheld: admission slots an engine (a remediator target) does not offer now,
        # startup max_num_seqs minus the live cap, or all of it while draining or restarting.
        # Autoscalers and inference gateways act on it (deploy/kubernetes/keda-example.yaml).
        RecordingRule(
            "target:oomguard_capacity_withheld_seqs:max",
            f"max by ({c}, target) (\n"
            "  (oomguard_remediator_startup_max_num_seqs - oomguard_remediator_admission_cap)\n"
            "  unless on (instance, job, target)\n"
            f'  (oomguard_remediator_target_mode{{mode=~"{NOT_ADMITTING}"}} == 1)\n'
            "  or oomguard_remediator_startup_max_num_seqs and on (instance, job, target)\n"
            f'  (oomguard_remediator_target_mode{{mode=~"{NOT_ADMITTING}"}} == 1)\n'
            ")",
        ),
        RecordingRule(
            # per model: the remediator names a target as the exporter does (`target`), and the
            # exporter's engine series carry vLLM's model_name: the model a target serves now,
            # else the one it served within the hour (a restarting engine has no series). topk
            # keeps one model per target, so a model change never makes the join ambiguous.
            "model_name:oomguard_capacity_withheld_seqs:sum",
            f"sum by ({c}, model_name) (\n"
            "  target:oomguard_capacity_withheld_seqs:max\n"
            f"  + on ({c}, target) group_left (model_name)\n"
            f"  0 * topk by ({c}, target) (1,\n"
            f"    2 * group by ({c}, target, model_name) ({running})\n"
            f"    or group by ({c}, target, model_name) (last_over_time({running}[1h]))\n"
            "  )\n"
            ")",
        ),
    ]


def slo_recording_rules(t: AlertThresholds | None = None) -> list[RecordingRule]:
    """The SLO group: error and slow-first-token ratios per model over the burn-rate windows."""
    t = t or AlertThresholds()
    by = f"{t.cluster_label}, model_name"
    job = f'job="{t.vllm_job}"'
    out = []
    for w in SLO_WINDOWS:
        # requests lost in engine crashes count as errors, and as requests: vLLM's counters die
        # with the process and never see them. The exporter's series carry another job than
        # vLLM's, so `or` keeps both and the sum adds them (0 where no crash was recorded).
        lost = lost_rate(t, w)
        out.append(
            RecordingRule(
                f"model_name:vllm_request_errors:ratio_rate{w}",
                f"sum by ({by}) (\n"
                f'  rate({V.FINISHED}{{{job}, finished_reason="error"}}[{w}])\n'
                f"  or {lost}\n"
                ")\n"
                f"/ sum by ({by}) (\n"
                f"  rate({V.FINISHED}{{{job}}}[{w}])\n"
                f"  or {lost}\n"
                ")",
            )
        )
    for w in SLO_WINDOWS:
        out.append(
            RecordingRule(
                f"model_name:vllm_ttft_slow:ratio_rate{w}",
                f"1 - sum by ({by}) (rate({V.TTFT}_bucket"
                f'{{{job}, le="{t.slo_ttft_seconds!r}"}}[{w}]))\n'
                f"/ sum by ({by}) (rate({V.TTFT}_count{{{job}}}[{w}]))",
            )
        )
    return out


def lost_rate(t: AlertThresholds, window: str) -> str:
    """Requests lost in engine crashes per second over `window`, per engine: the rise of
    `oomguard_requests_lost_total` since `window` ago, judged by the exporter's identity (a new
    exporter pod serves the same count from the same records, and a first crash's series is
    born non-zero: `rate()` would miss it)."""
    metric = f'oomguard_requests_lost_total{{job="{t.exporter_job}"}}'
    on = ", ".join(exporter_identity(t, "oomguard_requests_lost_total"))
    # across the pods: during a surge both serve the same count, which the sum would add twice
    return across_pods(
        f"clamp_min({metric} - on ({on}) group_left ()\n"
        f"    max by ({on}) ({metric} offset {window} or 0 * {metric}), 0)\n"
        f"    / {_seconds(window)}"
    )


def _seconds(window: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return int(window[:-1]) * units[window[-1]]


def all_recording_rules(t: AlertThresholds | None = None) -> list[RecordingRule]:
    t = t or AlertThresholds()
    return recording_rules(t) + slo_recording_rules(t)


_ENGINE = "engine {{ $labels.engine }} of {{ $labels.target }} on {{ $labels.instance }}"
_GPU = "GPU {{ $labels.gpu }} ({{ $labels.UUID }}) on {{ $labels.Hostname }}"
_REASON = "(reason {{ $labels.reason }})"


def action_alerts(t: AlertThresholds | None = None) -> list[Alert]:
    """The work orders the remediator acts on at once, on the exporter's level series alone,
    evaluated every `action_rule_interval` (a quarter second: cheap comparisons of one gauge,
    so that an engine about to run out of memory is drained within a scrape of the exporter
    detecting it)."""
    t = t or AlertThresholds()
    return [
        Alert(
            a.name,
            a.expr,
            a.severity,
            a.summary,
            a.description,
            for_=a.for_duration(t),
            keep_firing_for=a.keep_duration(t),
            action=a.action,
            doc=a.describe(t),
            extra_labels=tuple(a.labels.items()),
        )
        for a in ACTION_ALERTS  # defined once, in oomguard.actions
    ]


def alerts(t: AlertThresholds | None = None) -> list[Alert]:
    """The main group's alerts (work orders on raw levels are in `action_alerts`, SLO
    burn-rate alerts in `slo_alerts`)."""
    t = t or AlertThresholds()
    exp, rem = f'job="{t.exporter_job}"', f'job="{t.remediator_job}"'
    c = t.cluster_label
    ksm, ksm_job = "kube_", f'job="{t.kube_state_metrics_job}"'
    ds = "kube_daemonset_status"
    ds_sel = f'{ksm_job}, daemonset="{t.exporter_daemonset}"'
    return [
        # -- the remediator's work orders (no page: the remediator acts on them) ---------------
        Alert(
            "OomguardPreemptionRateHigh",
            f"engine:oomguard_vllm_preemption_ratio:rate5m > {t.preemption_ratio}\n"
            f"and increase({PREEMPTIONS}[5m]) >= {t.preemption_min_count}",
            "warning",
            "A vLLM engine preempts a high share of its requests.",
            f"{_ENGINE} preempted {{{{ $value | humanizePercentage }}}} of its finished "
            "requests over 5 minutes. Preemption is how vLLM meets a full KV cache; sustained, "
            "it costs latency and throughput, so oomguard lowers the admission cap.",
            for_=t.preemption_for,
            keep_firing_for=t.action_keep_firing_for,
            action="lower_cap",
            doc="preemptions > 1 % of finished requests and ≥ 10 in 5m, for 5m",
        ),
        # -- pages: one per incident -----------------------------------------------------------
        Alert(
            "OomguardCudaOomObserved",
            with_model(
                rose_since(
                    "oomguard_allocator_ooms_total",
                    "5m",
                    exporter_identity(t, "oomguard_allocator_ooms_total"),
                ),
                c,
                ("instance", "target", "engine"),
            ),
            "critical",
            "A vLLM worker hit a CUDA out-of-memory error.",
            "Rank {{ $labels.rank }} (pid {{ $labels.pid }}) of {{ $labels.target }} on "
            "{{ $labels.instance }} hit a CUDA out-of-memory error ({{ $value | humanize }}) "
            "in the last 5 minutes.",
            keep_firing_for=t.action_keep_firing_for,
            action="restart",
            doc="an allocator OOM counter rose in 5m, or appeared non-zero",
        ),
        # the forensics that follow (a ticket): which type of OOM, and the runbook section
        Alert(
            "OomguardIncidentClassified",
            rose_since(
                "oomguard_incidents_total", "15m", exporter_identity(t, "oomguard_incidents_total")
            ),
            "warning",
            "An OOM incident was recorded and its type named.",
            "An incident of type {{ $labels.type }} was recorded for {{ $labels.target }} "
            "engine {{ $labels.engine }} on {{ $labels.Hostname }}: `oomguard incidents` there "
            "shows its evidence and fix.",
            runbook_anchor="{{ $labels.type }}",
            doc=(
                "a new classified OOM incident in 15m (`oomguard_incidents_total`); "
                "`type` label, runbook link to that type's section"
            ),
        ),
        Alert(
            "OomguardModelUnavailable",
            f"group by ({c}, model_name) "
            f"(last_over_time(oomguard_vllm_requests_running{{{exp}}}[1h]))\n"
            f"unless on ({c}, model_name)\n"
            f"group by ({c}, model_name) (\n"
            f"  oomguard_vllm_requests_running{{{exp}}}\n"
            f"  and on ({c}, instance, target) ({VLLM_UP} == 1)\n"
            f"  unless on ({c}, target)\n"
            f'  (oomguard_remediator_target_mode{{mode=~"{NOT_ADMITTING}"}} == 1)\n'
            ")",
            "critical",
            "A model has no ready vLLM engine.",
            "No engine serving model {{ $labels.model_name }} has been up and admitting "
            f"requests for {t.model_unavailable_for}: every request for it fails.",
            for_=t.model_unavailable_for,
            doc="a model served in the last hour has no engine up and admitting for 5m",
        ),
        Alert(
            "OomguardRemediationFailing",
            # an engine that crashed cannot be read or changed: that is its own incident (the
            # OOM page, ModelUnavailable), not the remediator failing. Errors on a target whose
            # engine the exporter could not scrape either, within the window, do not count.
            with_model(
                "(\n"
                + new_or_increased('oomguard_remediator_actions_total{result="failed"}', "10m")
                + "\nor increase(oomguard_remediator_reconcile_errors_total[10m]) > 2\n)\n"
                f"unless on ({c}, target) "
                f"(min_over_time({VLLM_UP}[10m]) == 0)",
                c,
                ("target",),
            ),
            "critical",
            "The oomguard remediator fails to act on an engine.",
            "The remediator on {{ $labels.instance }} failed on target {{ $labels.target }} "
            "({{ $value | humanize }} in 10 minutes): the engine is not protected.",
            keep_firing_for=t.keep_firing_for,
            doc=(
                "a remediator action failed (first failure included) or reconciles "
                "erred more than twice in 10m, on a target whose engine the exporter "
                "could scrape throughout"
            ),
        ),
        Alert(
            "OomguardRemediationLimited",
            # a drain or restart refused for the last ready replica (or the disruption budget)
            # is answered with a lower cap: the designed fallback, not an engine left alone
            with_model(
                new_or_increased(
                    "oomguard_remediator_safety_limited_total"
                    f'{{limit!~"{"|".join(FALLBACK_LIMITS)}"}}',
                    "15m",
                ),
                c,
                ("target",),
            ),
            "critical",
            "A safety limit stopped the oomguard remediator from acting.",
            "The remediator on {{ $labels.instance }} held back an action on "
            "{{ $labels.target }} because of its {{ $labels.limit }} limit: the engine is in "
            "danger and the action it needed was not taken.",
            keep_firing_for=t.keep_firing_for,
            doc=(
                "a safety limit held back an action (first one included); not the cap "
                "fallback for the last ready replica"
            ),
        ),
        Alert(
            "OomguardRemediatorDown",
            f"up{{{rem}}} == 0",
            "critical",
            "The oomguard remediator cannot be scraped.",
            "Prometheus cannot scrape the remediator at {{ $labels.instance }}: no engine is "
            "protected from out-of-memory crashes.",
            for_=t.remediator_down_for,
            doc="the remediator cannot be scraped for 5m",
        ),
        Alert(
            "OomguardRemediatorNoLeader",
            f"max by ({c}) (oomguard_remediator_leader{{{rem}}}) == 0",
            "critical",
            "No oomguard remediator replica leads.",
            "Every remediator replica scraped is a standby: none holds the leader Lease, so "
            "nothing acts on oomguard alerts.",
            for_=t.remediator_down_for,
            doc="every remediator replica scraped is a standby (no Lease holder) for 5m",
        ),
        Alert(
            "OomguardRemediatorAuditFailing",
            f"oomguard_remediator_audit_writable{{{rem}}} == 0",
            "critical",
            "The oomguard remediator cannot write its audit log, so it takes no action.",
            "The remediator on {{ $labels.instance }} cannot append to its audit log (disk "
            "full or read-only): no action is taken without a durable record, so no engine is "
            "protected, and webhooks are refused.",
            for_="1m",
            doc="the remediator cannot append to its audit log for 1m: it takes no action",
        ),
        # -- tickets -----------------------------------------------------------------------------
        Alert(
            "OomguardGpuMemoryPressure",
            "gpu:oomguard_gpu_pressure_level:max == 2",
            "warning",
            "A GPU is low on free memory.",
            f"{_GPU} is at pressure level 2: its headroom at the engines' planned peak is low.",
            for_="5m",
            keep_firing_for=t.keep_firing_for,
            doc="GPU pressure level 2 for 5m",
        ),
        Alert(
            "OomguardGpuMemoryCritical",
            "gpu:oomguard_gpu_pressure_level:max >= 3",
            "warning",
            "A GPU is about to run out of memory.",
            f"{_GPU} is at pressure level 3: its headroom at the engines' planned peak is "
            "nearly gone or a process on it hit a CUDA out-of-memory error. Engines on it are "
            "handled by their own alerts; look for a process that is not one of them.",
            for_="1m",
            keep_firing_for=t.keep_firing_for,
            doc="GPU pressure level 3 for 1m (engines on it have their own alerts)",
        ),
        Alert(
            "OomguardAllocatorFragmentationGrowing",
            f"delta(rank:oomguard_allocator_fragmentation_bytes:diff[{t.growth_window}]) "
            f"> {t.fragmentation_growth_bytes}",
            "warning",
            "PyTorch allocator fragmentation in a vLLM worker keeps growing.",
            "Reserved minus allocated memory of rank {{ $labels.rank }} (pid {{ $labels.pid }}) "
            f"on {{{{ $labels.Hostname }}}} grew by {{{{ $value | humanize1024 }}}}B over "
            f"{t.growth_window}.",
            for_="30m",
            doc="reserved − allocated grew > 2 GiB in 2h",
        ),
        Alert(
            "OomguardAllocatorLeak",
            f"min_over_time({ALLOCATED}[30m])\n"
            f"- min_over_time({ALLOCATED}[30m] offset {t.growth_window})\n"
            f"> {t.leak_growth_bytes}",
            "warning",
            "Memory held by live tensors in a vLLM worker keeps rising.",
            "The lowest allocated memory of rank {{ $labels.rank }} (pid {{ $labels.pid }}) on "
            f"{{{{ $labels.Hostname }}}} rose by {{{{ $value | humanize1024 }}}}B in "
            f"{t.growth_window}: a leak.",
            for_="30m",
            doc="the 30m minimum of allocated rose > 1 GiB in 2h",
        ),
        Alert(
            "OomguardEngineRestarted",
            # restarts nothing else explains: not one with a recorded incident (its
            # IncidentClassified ticket, the OOM page), not one oomguard made itself
            across_pods("resets(oomguard_vllm_generation_tokens_total[15m])") + " > 0\n"
            f"unless on ({c}, instance, target) (\n"
            + rose_since(
                "oomguard_incidents_total", "30m", exporter_identity(t, "oomguard_incidents_total")
            )
            + "\n)\n"
            f"unless on ({c}, target) (max_over_time("
            'oomguard_remediator_target_mode{mode="restarting"}[15m]) == 1)',
            "warning",
            "A vLLM engine restarted.",
            f"The counters of {_ENGINE} reset {{{{ $value }}}} times in 15 minutes: the engine "
            "restarted (a rollout, oomguard's own restart, or a crash).",
            doc=(
                "an engine's counters reset in 15m, with no incident recorded and no "
                "restart by oomguard"
            ),
        ),
        Alert(
            "OomguardHostOomKill",
            rose_since(
                "oomguard_host_oom_kills_total",
                "10m",
                exporter_identity(t, "oomguard_host_oom_kills_total"),
            ),
            "warning",
            "The kernel OOM killer killed a process in a serving cgroup.",
            "The kernel killed a process of cgroup {{ $labels.cgroup }} on "
            "{{ $labels.instance }} for exceeding host memory ({{ $value | humanize }}): "
            "exit code 137, no traceback.",
            keep_firing_for=t.keep_firing_for,
            doc="cgroup `oom_kill` rose in 10m, or appeared non-zero (exit 137)",
        ),
        Alert(
            "OomguardEngineDown",
            # down when no exporter pod reaches it (a rollout does not start the 15 m again)
            f"{VLLM_UP} == 0",
            "warning",
            "A vLLM engine has not answered for a long time.",
            "The exporter on {{ $labels.instance }} has not been able to scrape vLLM target "
            f"{{{{ $labels.target }}}} for {t.engine_down_for}.",
            for_=t.engine_down_for,
            doc="the exporter cannot scrape a vLLM target for 15m (rollouts take minutes)",
        ),
        Alert(
            "OomguardExporterDown",
            f"up{{{exp}}} == 0",
            "warning",
            "An oomguard exporter cannot be scraped.",
            "Prometheus cannot scrape the oomguard exporter on {{ $labels.instance }}: GPU "
            "memory on that node is not watched and the remediator holds its engines.",
            for_="5m",
            doc="Prometheus cannot scrape an exporter for 5m",
        ),
        Alert(
            "OomguardExporterAbsent",
            f"absent(up{{{exp}}})",
            "warning",
            "Prometheus scrapes no oomguard exporter at all.",
            f'Prometheus has no target with job="{t.exporter_job}": the scrape config or the '
            "PodMonitor does not find the exporters, so no GPU memory is watched.",
            for_="15m",
            doc="no target with the exporter job at all for 15m",
        ),
        Alert(
            "OomguardVllmScrapeAbsent",
            f'absent(up{{job="{t.vllm_job}"}})',
            "warning",
            "Prometheus scrapes no vLLM server at all.",
            f'Prometheus has no target with job="{t.vllm_job}": the scrape config or the '
            "PodMonitor does not find vLLM's own /metrics, so the SLO alerts cannot fire and "
            "requests lost in a crash are the only errors counted.",
            for_="15m",
            doc="no target with the vLLM job at all for 15m (the SLOs read vLLM's own series)",
        ),
        # -- on Kubernetes, from kube-state-metrics (both stock installs run it) ----------------
        Alert(
            "OomguardExporterNotScheduled",
            # GPU nodes (kube_node_status_capacity of the GPU resource) beyond the exporter pods
            # scheduled: the DaemonSet's nodeSelector misses them; or pods the DaemonSet wants
            # but cannot place (taints, resources), as kubernetes-mixin's
            # KubeDaemonSetNotScheduled reads it
            f"count by ({c}) ({ksm}node_status_capacity{{{ksm_job}, "
            f'resource="{t.gpu_node_resource}"}} > 0)\n'
            f"- on ({c}) group_right ()\n"
            f"  max by ({c}, namespace, daemonset) "
            f"({ds}_current_number_scheduled{{{ds_sel}}}) > 0\n"
            f"or\nmax by ({c}, namespace, daemonset) (\n"
            f"  {ds}_desired_number_scheduled{{{ds_sel}}}\n"
            f"  - {ds}_current_number_scheduled{{{ds_sel}}}\n"
            ") > 0",
            "warning",
            "GPU nodes run no oomguard exporter.",
            "{{ $value }} GPU nodes of cluster {{ $labels." + c + " }} have no pod of DaemonSet "
            "{{ $labels.namespace }}/{{ $labels.daemonset }}: GPU memory there is not "
            "watched and nothing protects their engines.",
            for_="10m",
            doc=(
                "GPU nodes (kube-state-metrics' GPU capacity) outnumber the exporter "
                "DaemonSet's pods, or pods it cannot place, for 10m"
            ),
        ),
        Alert(
            "OomguardExporterRolloutStuck",
            # kubernetes-mixin's KubeDaemonSetRolloutStuck, for the exporter's DaemonSet
            f"max by ({c}, namespace, daemonset) (\n"
            f"  ({ds}_current_number_scheduled{{{ds_sel}}}\n"
            f"   != {ds}_desired_number_scheduled{{{ds_sel}}})\n"
            f"  or ({ds}_number_misscheduled{{{ds_sel}}} != 0)\n"
            f"  or ({ds}_updated_number_scheduled{{{ds_sel}}}\n"
            f"   != {ds}_desired_number_scheduled{{{ds_sel}}})\n"
            f"  or ({ds}_number_available{{{ds_sel}}}\n"
            f"   != {ds}_desired_number_scheduled{{{ds_sel}}})\n"
            ")\n"
            f"and on ({c}, namespace, daemonset)\n"
            f"max by ({c}, namespace, daemonset) "
            f"(changes({ds}_updated_number_scheduled{{{ds_sel}}}[5m])) == 0",
            "warning",
            "The oomguard exporter's rollout is stuck.",
            "DaemonSet {{ $labels.namespace }}/{{ $labels.daemonset }} has not finished or "
            "progressed its rollout for 15 minutes: some GPU nodes run an old exporter, or "
            "none.",
            for_="15m",
            doc=(
                "the exporter DaemonSet's rollout has not finished nor progressed for "
                "15m (kubernetes-mixin's reading)"
            ),
        ),
        Alert(
            "OomguardRemediatorCrashLooping",
            f"max by ({c}, namespace, pod, container) (increase("
            f"{ksm}pod_container_status_restarts_total{{{ksm_job}, "
            f'pod=~"{t.remediator_deployment}-.+", container="remediator"}}[15m])) > 2',
            "critical",
            "The oomguard remediator keeps restarting.",
            "Container {{ $labels.container }} of pod {{ $labels.namespace }}/{{ $labels.pod }} "
            "restarted {{ $value | humanize }} times in 15 minutes: between crashes it is not "
            "up long enough to act, and OomguardRemediatorDown may never fire.",
            doc=(
                "the remediator's container restarted more than twice in 15m (kube-state-metrics)"
            ),
        ),
        Alert(
            "OomguardRemediatorAbsent",
            f"absent(up{{{rem}}})",
            "warning",
            "Prometheus scrapes no oomguard remediator.",
            f'Prometheus has no target with job="{t.remediator_job}": the remediator is not '
            "deployed or not discovered, so nothing acts on oomguard alerts.",
            for_="15m",
            doc="no target with the remediator job at all for 15m",
        ),
        Alert(
            "OomguardCollectorDown",
            # a vLLM target the exporter cannot scrape is OomguardEngineDown's (15 minutes: a
            # reload after a crash or a rollout takes minutes and is no collector failure)
            'oomguard_exporter_collector_up{collector!="vllm"} == 0',
            "warning",
            "An oomguard exporter collector fails.",
            "Collector {{ $labels.collector }} {{ $labels.target }} of the exporter on "
            "{{ $labels.instance }} has failed for a while.",
            for_=t.collector_down_for,
            doc="a collector other than a vLLM target's failed for 5m",
        ),
        Alert(
            "OomguardMetricsStale",
            f"time() - oomguard_exporter_snapshot_timestamp_seconds > {t.stale_after_seconds}",
            "warning",
            "An oomguard exporter serves an old snapshot.",
            "The exporter on {{ $labels.instance }} last collected {{ $value | humanizeDuration "
            "}} ago: its polling is stuck.",
            for_="2m",
            doc="the exporter's snapshot is > 30 s old for 2m",
        ),
        Alert(
            "OomguardRequestsQueueing",
            f"({across_pods(f'oomguard_vllm_requests_waiting{{{exp}}}')} > {t.queueing_waiting})\n"
            f"and on ({c}, target)\n"
            f"(max by ({c}, target) (oomguard_remediator_admission_cap)\n"
            f" < max by ({c}, target) (oomguard_remediator_startup_max_num_seqs))",
            "warning",
            "Requests queue on a vLLM engine whose admission cap oomguard lowered.",
            f"{{{{ $value }}}} requests wait on {_ENGINE} while its admission cap is below the "
            "startup max_num_seqs.",
            for_="10m",
            doc="> 10 waiting for 10m while the cap is below startup",
        ),
        Alert(
            "OomguardRemediationPaused",
            "oomguard_remediator_paused == 1",
            "warning",
            "The oomguard remediator has been paused for a long time.",
            f"The remediator on {{{{ $labels.instance }}}} has been paused for {t.paused_for}: "
            "it decides and records but acts on no engine.",
            for_=t.paused_for,
            doc="the remediator has been paused for 1h",
        ),
        Alert(
            "OomguardRemediatorPassesBehind",
            f"(time() - oomguard_remediator_last_pass_timestamp_seconds{{{rem}}} > "
            f"{t.pass_behind_seconds})\nand oomguard_remediator_leader{{{rem}}} == 1",
            "warning",
            "The leading oomguard remediator's reconcile passes fall behind.",
            "The remediator on {{ $labels.instance }} leads but completed no reconcile pass for "
            f"{t.pass_behind_seconds}s: actions wait (a slow or failing pass, too many engines "
            "read per pass).",
            for_="2m",
            doc="the leading remediator completed no reconcile pass for 60 s, for 2m",
        ),
        Alert(
            "OomguardRemediationHeld",
            # an engine that is down (a long model load, a crash loop) is held because it
            # cannot be read: OomguardEngineDown is that cause's one ticket
            'oomguard_remediator_target_mode{mode="held"} == 1\n'
            f"unless on ({c}, target) ({VLLM_UP} == 0)",
            "warning",
            "The oomguard remediator holds a target it cannot read or converge.",
            "The remediator on {{ $labels.instance }} has held target {{ $labels.target }} for "
            f"{t.held_for}: it cannot read or change the engine, so it does nothing.",
            for_=t.held_for,
            doc=(
                "the remediator has held a target for 15m (not while its engine is "
                "down: OomguardEngineDown)"
            ),
        ),
        Alert(
            "OomguardRemediatorUnauthorized",
            'increase(oomguard_remediator_webhook_requests_total{outcome="unauthorized"}[10m]) > 0',
            "warning",
            "The oomguard remediator refused unauthenticated calls.",
            "The remediator on {{ $labels.instance }} refused {{ $value | humanize }} calls "
            "without a valid token in 10 minutes: a misconfigured Alertmanager or a probe.",
            doc="the remediator refused calls without a valid token",
        ),
        Alert(
            "OomguardThreadRestarting",
            "\nor ".join(
                new_or_increased(f"oomguard_{c}_thread_restarts_total", "15m")
                for c in ("exporter", "remediator", "supervisor")
            ),
            "warning",
            "A background thread of oomguard died and was restarted.",
            "Thread {{ $labels.thread }} of {{ $labels.job }} on {{ $labels.instance }} died "
            "and was restarted ({{ $value | humanize }} in 15 minutes): its loop lost time, "
            "and a bug or a hostile input killed it.",
            doc=(
                "a supervised thread of the exporter, the remediator or `oomguard "
                "serve` died and was restarted in 15m (first death included)"
            ),
        ),
        Alert(
            "OomguardAlertmanagerWebhookFailing",
            'increase(alertmanager_notifications_failed_total{integration="webhook"}[10m]) > 0',
            "warning",
            "Alertmanager fails to deliver webhook notifications.",
            "Alertmanager {{ $labels.instance }} failed {{ $value | humanize }} webhook "
            "deliveries in 10 minutes: the remediator (or a webhook pager) misses alerts and "
            "relies on its resync.",
            for_="5m",
            doc="Alertmanager failed webhook deliveries for 5m",
        ),
        # -- nothing (info): shown on dashboards, routed nowhere --------------------------------
        Alert(
            "OomguardKVCacheUsageHigh",
            across_pods("oomguard_vllm_kv_cache_usage_ratio") + f" > {t.kv_usage_high_ratio}",
            "info",
            "A vLLM engine has kept its KV cache nearly full for a long time.",
            f"The KV cache of {_ENGINE} is {{{{ $value | humanizePercentage }}}} full. "
            "This is normal under load and is not a danger sign by itself; sustained, it "
            "means the engine runs at capacity.",
            for_=t.kv_usage_high_for,
            doc="KV usage > 90 % for 15m (capacity signal)",
        ),
        Alert(
            "OomguardMemoryCaution",
            across_pods("oomguard_engine_pressure_level") + " >= 1",
            "info",
            "A vLLM engine has been at memory pressure level caution or higher.",
            f"The pressure level of {_ENGINE} is {{{{ $value }}}} {_REASON} (1 caution, "
            "2 pressure, 3 critical).",
            for_=t.caution_for,
            doc="engine pressure level ≥ 1 for 10m",
        ),
        Alert(
            "Watchdog",
            "vector(1)",
            "none",
            "An alert that always fires, to prove the alerting pipeline works.",
            "This alert always fires. If it stops arriving, Prometheus or Alertmanager is down.",
            doc="always (dead man's switch)",
        ),
    ]


def slo_alerts(t: AlertThresholds | None = None) -> list[Alert]:
    """Multi-window, multi-burn-rate alerts: a page when the budget burns fast, else a ticket."""
    t = t or AlertThresholds()
    out = []
    for name, series, objective, what, doc in (
        (
            "OomguardRequestErrorBudgetBurn",
            "model_name:vllm_request_errors:ratio_rate",
            t.slo_success_objective,
            "requests finishing with an error",
            'vLLM requests with `finished_reason="error"` burn the success SLO (99.9 %) at '
            "14.4x (1h and 5m) or 6x (6h and 30m) / 3x (1d and 2h) or 1x (3d and 6h)",
        ),
        (
            "OomguardTTFTBudgetBurn",
            "model_name:vllm_ttft_slow:ratio_rate",
            t.slo_ttft_objective,
            f"requests waiting over {t.slo_ttft_seconds:g} s for their first token",
            "requests slower than 2.5 s to the first token burn the TTFT SLO (95 %), same windows",
        ),
    ):
        budget = 1 - objective
        for severity in ("critical", "warning"):
            arms = [
                f"({series}{long} > {_num(f * budget)} and {series}{short} > {_num(f * budget)})"
                for sev, long, short, f in BURN_RATES
                if sev == severity
            ]
            fast = severity == "critical"
            expr = "\nor ".join(arms)
            if not fast:
                # one burn is a page or a ticket: a model whose fast burn paged in the last 6h
                # (the longest short window here) gets no ticket for its tail
                expr = (
                    f"(\n{expr}\n)\nunless on ({t.cluster_label}, model_name)\n"
                    f'max_over_time(ALERTS{{alertname="{name}", alertstate="firing", '
                    f'severity="critical"}}[6h])'
                )
            out.append(
                Alert(
                    name,
                    expr,
                    severity,
                    "A model burns its SLO error budget fast."
                    if fast
                    else "A model burns its SLO error budget.",
                    f"Model {{{{ $labels.model_name }}}} has {{{{ $value | humanizePercentage }}}} "
                    f"{what} (objective {_num(objective * 100)} % good): at this rate the 30-day "
                    f"budget lasts {'hours' if fast else 'days'}.",
                    for_="2m" if fast else "15m",
                    doc=doc,
                )
            )
    return out


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

    def group(
        name: str, interval: str, recorded: list[RecordingRule], fired: list[Alert]
    ) -> dict[str, object]:
        # Rules in a group run in order, so every alert sees the recording rules of the same
        # evaluation; the interval is set here so `for` means the same on every server.
        return {
            "name": name,
            "interval": interval,
            "rules": [{"record": r.record, "expr": r.expr} for r in recorded]
            + [alert_rule(a) for a in fired],
        }

    return {
        "groups": [
            group("oomguard-actions", t.action_rule_interval, [], action_alerts(t)),
            group("oomguard", t.rule_interval, recording_rules(t), alerts(t)),
            # long windows (up to 3 days) cost more and change slowly: once a minute
            group("oomguard-slo", "1m", slo_recording_rules(t), slo_alerts(t)),
        ]
    }


def all_alerts(t: AlertThresholds | None = None) -> list[Alert]:
    t = t or AlertThresholds()
    return action_alerts(t) + alerts(t) + slo_alerts(t)


@dataclass
class Case:
    """One promtool test: input series, an evaluation time, the alerts expected then."""

    alert: str
    eval_time: str
    series: dict[str, str]
    firing: list[dict[str, str]] = field(default_factory=list)  # labels incl. description
    interval: str = "1m"


@dataclass
class ExprCase:
    """One promtool expression test: a recorded series' exact samples at an evaluation time."""

    expr: str
    eval_time: str
    series: dict[str, str]
    samples: list[tuple[dict[str, str], str]]  # (labels without __name__, value)
    interval: str = "1m"
