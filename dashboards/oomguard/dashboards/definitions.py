"""The three oomguard dashboards: fleet overview, node and engine, remediation.

Written for the 3 a.m. reader: every dashboard has the same cluster, node, model, target and
data-parallel engine variables; links between them keep the time range and the variables;
per-engine series link down to the node dashboard; the alerts table links each alert's
runbook. Stats show "no data" when nothing reports, never a reassuring 0.
"""

from __future__ import annotations

from typing import Any

from grafanalib.core import Annotations, Dashboard, Time

from oomguard import vllm_seam
from oomguard.alerts.rules import runbook_url
from oomguard.dashboards.panels import (
    DATASOURCE,
    Layout,
    finish,
    link,
    target,
    variables,
)
from oomguard.thresholds import AlertThresholds

# vLLM's metric names: the newest supported vLLM's, whatever this environment holds (generated)
V = vllm_seam.newest()

TAGS = ["oomguard", "vllm", "gpu"]
MODES = ("serving", "capped", "readmitting", "draining", "restarting", "held")
MODE_COLORS = ("green", "yellow", "blue", "orange", "red", "purple")
MODE_MAPPINGS = [
    {
        "type": "value",
        "options": {
            str(i): {"text": m, "color": c, "index": i}
            for i, (m, c) in enumerate(zip(MODES, MODE_COLORS, strict=True))
        },
    }
]
NODE_UID = "oomguard-node"


class Sel:
    """Label selectors of each component's series, from the thresholds' job and cluster names."""

    def __init__(self, t: AlertThresholds) -> None:
        c = t.cluster_label
        self.c = c
        self.cl = f'{c}=~"$cluster"'
        self.node = f'job="{t.exporter_job}", {self.cl}, instance=~"$node"'
        self.eng = f'{self.node}, model_name=~"$model", target=~"$target", engine=~"$engine"'
        self.rank = f'{self.node}, target=~"$target", engine=~"$engine"'
        # vLLM's own series, scraped from each server (their instance is the pod, not the node)
        self.vllm = f'job="{t.vllm_job}", {self.cl}, model_name=~"$model", engine=~"$engine"'
        self.rem = f'job="{t.remediator_job}", {self.cl}, target=~"$target"'
        # the remediator's own series (leader, passes, pause, webhooks) carry no target label
        self.remediator = f'job="{t.remediator_job}", {self.cl}'
        self.exporters = f'job="{t.exporter_job}", {self.cl}'


def _to_node(
    by: tuple[str, ...] = ("instance", "target"), what: str = "this engine"
) -> list[dict[str, Any]]:
    """Drill down to the node dashboard for the clicked series, keeping time and cluster.

    `by`: the node dashboard's variables the link sets, each from the clicked series' label of
    the same meaning (`node` from `instance`): only labels the panel's series carry, or Grafana
    would pass the literal `${__field.labels...}` and the node dashboard would show nothing.
    """
    variables = {"instance": "node", "target": "target"}
    params = "".join(f"&var-{variables[label]}=${{__field.labels.{label}}}" for label in by)
    return [
        link(
            f"Node and engine: {what}",
            f"/d/{NODE_UID}/?${{__url_time_range}}&${{cluster:queryparam}}{params}",
        )
    ]


def _annotations(s: Sel) -> Annotations:
    return Annotations(
        list=[
            {
                "datasource": DATASOURCE,
                "enable": True,
                "iconColor": "orange",
                "name": "oomguard actions",
                "expr": f"sum by ({s.c}, target, action, result) "
                f"(changes(oomguard_remediator_actions_total{{{s.cl}}}[1m])) > 0",
                "titleFormat": "{{action}} on {{target}}",
                "textFormat": "result: {{result}}",
                "step": "60s",
            },
            {
                "datasource": DATASOURCE,
                "enable": True,
                "iconColor": "red",
                "name": "oomguard pages and tickets",
                "expr": f'ALERTS{{alertstate="firing", alertname=~"Oomguard.*", {s.cl}, '
                'severity=~"critical|warning"}',
                "titleFormat": "{{alertname}}",
                "textFormat": "{{instance}} {{target}} {{model_name}}",
                "step": "60s",
            },
        ]
    )


def _links(t: AlertThresholds) -> list[dict[str, Any]]:
    common = {"icon": "external link", "tooltip": "", "targetBlank": False, "tags": []}
    return [
        {
            **common,
            "title": "oomguard dashboards",
            "type": "dashboards",
            "tags": ["oomguard"],
            "asDropdown": True,
            # the same cluster, node, model, target and time range on the next dashboard
            "includeVars": True,
            "keepTime": True,
        },
        {
            **common,
            "title": "Runbooks",
            "type": "link",
            "url": runbook_url(t, "README"),
            "targetBlank": True,
            "asDropdown": False,
            "includeVars": False,
            "keepTime": False,
        },
    ]


def _dashboard(
    t: AlertThresholds, uid: str, title: str, description: str, layout: Layout
) -> dict[str, Any]:
    dashboard = Dashboard(
        title=title,
        uid=uid,
        description=description,
        tags=TAGS,
        panels=layout.panels,
        templating=variables(t),
        annotations=_annotations(Sel(t)),
        refresh="30s",
        time=Time("now-3h", "now"),
        timezone="utc",
        editable=True,
    )
    return finish(dashboard, layout, _links(t))


def _none_or(expr: str, of: str) -> str:
    """A count that reads 0 when the series are there and none match, and nothing (the stat's
    "no data") when nothing reports at all: not `or vector(0)`, which shows a green 0 then."""
    return f"{expr} or 0 * count({of})"


RED_FROM_1: list[dict[str, Any]] = [{"color": "green", "value": None}, {"color": "red", "value": 1}]
ORANGE_FROM_1: list[dict[str, Any]] = [
    {"color": "green", "value": None},
    {"color": "orange", "value": 1},
]
RED_BELOW_1: list[dict[str, Any]] = [
    {"color": "red", "value": None},
    {"color": "green", "value": 1},
]


def fleet(t: AlertThresholds | None = None) -> dict[str, Any]:
    t = t or AlertThresholds()
    s = Sel(t)
    L = Layout()
    exporters_up = f"up{{{s.exporters}}}"
    L.stat(
        "Exporters up",
        "Exporters Prometheus scrapes now (up) out of those it knows: up / all. Fewer up than "
        "all means GPUs nobody watches.",
        "none",
        [
            target(f"sum({exporters_up})", "up", "A"),
            target(f"count({exporters_up})", "of", "B"),
        ],
        steps=[{"color": "red", "value": None}, {"color": "green", "value": 1}],
    )
    L.stat(
        "Oldest snapshot",
        "Age of the oldest snapshot an exporter serves "
        "(time() - oomguard_exporter_snapshot_timestamp_seconds); over 30 s, polling is stuck.",
        "s",
        [
            target(
                "max(time() - oomguard_exporter_snapshot_timestamp_seconds"
                f'{{{s.exporters}, instance=~"$node"}})'
            )
        ],
        steps=[{"color": "green", "value": None}, {"color": "orange", "value": 30}],
    )
    level = f"engine:oomguard_engine_pressure_level:max{{{s.eng}}}"
    L.stat(
        "Engines at pressure or worse",
        "Engines whose pressure level is 2 or 3 (engine:oomguard_engine_pressure_level:max, "
        "from oomguard_engine_pressure_level).",
        "none",
        [target(_none_or(f"count({level} >= 2)", level))],
        steps=RED_FROM_1,
    )
    L.stat(
        "Blind engines",
        "Engines whose pressure oomguard cannot judge, level -1 "
        "(engine:oomguard_engine_pressure_level:max): the remediator holds them.",
        "none",
        [target(_none_or(f"count({level} < 0)", level))],
        steps=ORANGE_FROM_1,
    )
    gpu_level = f"gpu:oomguard_gpu_pressure_level:max{{{s.node}}}"
    L.stat(
        "GPUs critical",
        "GPUs at pressure level 3 (gpu:oomguard_gpu_pressure_level:max, from "
        "oomguard_gpu_pressure_level).",
        "none",
        [target(_none_or(f"count({gpu_level} >= 3)", gpu_level))],
        steps=RED_FROM_1,
    )
    L.stat(
        "Pages firing",
        "oomguard alerts that page (severity critical) firing now (ALERTS); no data when no "
        "exporter is scraped (up).",
        "none",
        [
            target(
                _none_or(
                    f'count(ALERTS{{alertstate="firing", severity="critical", {s.cl}, '
                    'alertname=~"Oomguard.*"})',
                    exporters_up,
                )
            )
        ],
        steps=RED_FROM_1,
    )
    L.timeseries(
        "Lowest headroom per GPU",
        "Per GPU, the lowest headroom in each interval: free memory left once every engine on "
        "it reaches its planned peak (oomguard_gpu_headroom_bytes; below 0 the next peak does "
        "not fit). A minimum, so a short dip is not averaged away.",
        "bytes",
        [
            target(
                f"min by ({s.c}, instance, gpu, UUID, GPU_I_ID) "
                f"(min_over_time(oomguard_gpu_headroom_bytes{{{s.node}}}[$__interval]))",
                "{{instance}} GPU {{gpu}} {{GPU_I_ID}}",
            )
        ],
        links=_to_node(("instance",), "this node"),
    )
    L.timeseries(
        "Free memory of the fullest GPU per node",
        "Per node, the free device memory of its fullest GPU (min of "
        "oomguard_gpu_memory_free_bytes), against that GPU's total "
        "(oomguard_gpu_memory_total_bytes): one full GPU is not hidden by empty ones.",
        "bytes",
        [
            target(
                f"min by ({s.c}, instance) (oomguard_gpu_memory_free_bytes{{{s.node}}})",
                "{{instance}} lowest free",
                "A",
            ),
            target(
                f"max by ({s.c}, instance) (oomguard_gpu_memory_total_bytes{{{s.node}}})",
                "{{instance}} GPU total",
                "B",
            ),
        ],
        links=_to_node(("instance",), "this node"),
    )
    L.levels(
        "Pressure level per node",
        "Highest GPU pressure level on each node: -1 blind, 0 ok to 3 critical "
        "(gpu:oomguard_gpu_pressure_level:max).",
        [target(f"max by ({s.c}, instance) ({gpu_level})", "{{instance}}")],
        links=_to_node(("instance",), "this node"),
    )
    L.table(
        "Engines now: pressure level and reason",
        "Each engine's pressure level and the signal that set it, the `reason` label of "
        "oomguard_engine_pressure_level (docs/pressure.md lists them).",
        [target(f"oomguard_engine_pressure_level{{{s.eng}}}", instant=True)],
        h=8,
    )
    L.timeseries(
        "Capacity withheld per model",
        "Admission slots oomguard does not offer now, per model: startup max_num_seqs minus the "
        "live cap, or all of it while draining or restarting "
        "(model_name:oomguard_capacity_withheld_seqs:sum). Autoscalers scale out on it.",
        "short",
        [
            target(
                f'model_name:oomguard_capacity_withheld_seqs:sum{{{s.cl}, model_name=~"$model"}}',
                "{{model_name}}",
            )
        ],
    )
    L.timeseries(
        "Requests lost in engine crashes",
        "Requests the engines of each model held, running or queued, when they died of a CUDA "
        "out-of-memory error, recorded by the OOM observer (oomguard_requests_lost_total; a "
        "step up at each crash). vLLM's own counters die with the engine: the error-budget SLO "
        "adds these.",
        "short",
        [
            target(
                f"sum by ({s.c}, model_name) (max by ({s.c}, instance, target, model_name, engine) "
                f'(oomguard_requests_lost_total{{{s.exporters}, model_name=~"$model"}}))',
                "{{model_name}}",
            )
        ],
    )
    L.timeseries(
        "Waiting requests by reason",
        f"Requests queued in each vLLM engine by reason ({V.WAITING_BY_REASON}): "
        "capacity = no room in the batch or the KV cache, deferred = transient constraints.",
        "short",
        [
            target(
                f"sum by ({s.c}, model_name, engine, reason) ({V.WAITING_BY_REASON}{{{s.vllm}}})",
                "{{model_name}}/{{engine}} {{reason}}",
            )
        ],
    )
    L.timeseries(
        "KV-cache usage per engine",
        "Share of each engine's KV pool in use "
        "(oomguard_vllm_kv_cache_usage_ratio). Near 100 % under load is normal.",
        "percentunit",
        [
            target(
                f"oomguard_vllm_kv_cache_usage_ratio{{{s.eng}}}",
                "{{instance}} {{target}}/{{engine}}",
            )
        ],
        links=_to_node(),
    )
    L.timeseries(
        "Preemption rate",
        "Preemptions per second per engine (oomguard_vllm_preemptions_total). vLLM preempts "
        "when its KV cache is full; sustained, it costs latency.",
        "ops",
        [
            target(
                f"rate(oomguard_vllm_preemptions_total{{{s.eng}}}[$__rate_interval])",
                "{{instance}} {{target}}/{{engine}}",
            )
        ],
        links=_to_node(),
    )
    L.timeseries(
        "Running and waiting requests",
        "Requests in the running batch and in the queue, per engine "
        "(oomguard_vllm_requests_running, oomguard_vllm_requests_waiting).",
        "short",
        [
            target(
                f"oomguard_vllm_requests_running{{{s.eng}}}",
                "{{instance}} {{target}}/{{engine}} running",
                "A",
            ),
            target(
                f"oomguard_vllm_requests_waiting{{{s.eng}}}",
                "{{instance}} {{target}}/{{engine}} waiting",
                "B",
            ),
        ],
        links=_to_node(),
    )
    L.timeseries(
        "Prefix-cache hit rate",
        "Share of prompt tokens served from vLLM's prefix cache "
        f"({V.PREFIX_CACHE_HITS} over {V.PREFIX_CACHE_QUERIES}). A drop means more "
        "prefill work and more KV memory per request.",
        "percentunit",
        [
            target(
                f"sum by ({s.c}, model_name, engine) "
                f"(rate({V.PREFIX_CACHE_HITS}{{{s.vllm}}}[$__rate_interval]))\n"
                f"/ sum by ({s.c}, model_name, engine) "
                f"(rate({V.PREFIX_CACHE_QUERIES}{{{s.vllm}}}[$__rate_interval]))",
                "{{model_name}}/{{engine}}",
            )
        ],
    )
    runbook = t.runbook_url_base.rstrip("/")
    L.table(
        "Firing alerts",
        "oomguard alerts firing now, with their labels (ALERTS); click a row for its runbook.",
        [
            target(
                f'ALERTS{{alertstate="firing", alertname=~"Oomguard.*|Watchdog", {s.cl}}}',
                instant=True,
            )
        ],
        # every cell of a row links the runbook of that row's alert
        links=[
            link(
                "Runbook: ${__data.fields.alertname}",
                f"{runbook}/${{__data.fields.alertname}}.md",
                True,
            )
        ],
    )
    return _dashboard(
        t,
        "oomguard-fleet",
        "oomguard / Fleet overview",
        "GPU headroom, pressure and its reasons, queues and capacity across every node and engine.",
        L,
    )


def node(t: AlertThresholds | None = None) -> dict[str, Any]:
    t = t or AlertThresholds()
    s = Sel(t)
    L = Layout()
    L.levels(
        "Pressure level and reason per engine",
        "oomguard pressure level of each engine, -1 blind, 0 ok to 3 critical, one row per "
        "reason that set it (oomguard_engine_pressure_level, label reason).",
        [
            target(
                f"max by ({s.c}, instance, target, engine, reason) "
                f"(oomguard_engine_pressure_level{{{s.eng}}})",
                "{{target}}/{{engine}} {{reason}}",
            )
        ],
    )
    L.timeseries(
        "Headroom per GPU",
        "Free memory left once every engine on the GPU reaches its planned peak "
        "(oomguard_gpu_headroom_bytes), against what the engines plan to use "
        "(oomguard_gpu_planned_bytes).",
        "bytes",
        [
            target(
                f"min_over_time(oomguard_gpu_headroom_bytes{{{s.node}}}[$__interval])",
                "GPU {{gpu}} {{GPU_I_ID}} headroom",
                "A",
            ),
            target(
                f"oomguard_gpu_planned_bytes{{{s.node}}}", "GPU {{gpu}} {{GPU_I_ID}} planned", "B"
            ),
        ],
    )
    L.timeseries(
        "Allocator vs device, per GPU",
        "Per GPU: bytes held by tensors (oomguard_allocator_allocated_bytes), held by "
        "the PyTorch cache (oomguard_allocator_reserved_bytes), and the device total "
        "(oomguard_gpu_memory_total_bytes).",
        "bytes",
        [
            target(
                f"sum by (UUID) (oomguard_allocator_allocated_bytes{{{s.rank}}})",
                "{{UUID}} allocated",
                "A",
            ),
            target(
                f"sum by (UUID) (oomguard_allocator_reserved_bytes{{{s.rank}}})",
                "{{UUID}} reserved",
                "B",
            ),
            target(
                f"max by (UUID) (oomguard_gpu_memory_total_bytes{{{s.node}}})",
                "{{UUID}} total",
                "C",
            ),
        ],
    )
    L.timeseries(
        "Free memory per GPU",
        "Free device memory per GPU (oomguard_gpu_memory_free_bytes) and, for GPUs without a "
        "planned engine, the floor below which they are at caution "
        "(oomguard_gpu_free_floor_bytes).",
        "bytes",
        [
            target(f"oomguard_gpu_memory_free_bytes{{{s.node}}}", "GPU {{gpu}} free", "A"),
            target(f"oomguard_gpu_free_floor_bytes{{{s.node}}}", "GPU {{gpu}} floor", "B"),
        ],
    )
    L.timeseries(
        "Allocator fragmentation",
        "Reserved minus allocated bytes per rank "
        "(rank:oomguard_allocator_fragmentation_bytes:diff) and inactive split blocks "
        "(oomguard_allocator_inactive_split_bytes).",
        "bytes",
        [
            target(
                f"rank:oomguard_allocator_fragmentation_bytes:diff{{{s.rank}}}",
                "rank {{rank}} reserved-allocated",
                "A",
            ),
            target(
                f"oomguard_allocator_inactive_split_bytes{{{s.rank}}}",
                "rank {{rank}} inactive split",
                "B",
            ),
        ],
    )
    L.timeseries(
        "Allocator retries and OOMs",
        "Allocations retried after a cache flush "
        "(oomguard_allocator_alloc_retries_total) and CUDA out-of-memory errors "
        "(oomguard_allocator_ooms_total), per rank.",
        "short",
        [
            target(
                f"increase(oomguard_allocator_alloc_retries_total{{{s.rank}}}[$__rate_interval])",
                "rank {{rank}} retries",
                "A",
            ),
            target(
                f"increase(oomguard_allocator_ooms_total{{{s.rank}}}[$__rate_interval])",
                "rank {{rank}} OOMs",
                "B",
            ),
        ],
    )
    L.timeseries(
        "Step guard shrinks",
        "Steps the plugin's step guard ran smaller than vLLM planned because the full step "
        "would not fit the memory the engine could get, by action (fewer_prefill_tokens, "
        "decode_only, wait) and reason (oomguard_step_guard_shrinks_total). Any shrink means "
        "memory beyond the engine's plan is gone (a neighbour, fragmentation, logits): the "
        "engine's pressure level rises with it.",
        "short",
        [
            target(
                f"sum by (target, engine, action, reason) (increase("
                f"oomguard_step_guard_shrinks_total{{{s.rank}}}[$__rate_interval]))",
                "{{target}}/{{engine}} {{action}} ({{reason}})",
            ),
        ],
    )
    L.timeseries(
        "KV-cache usage and projected demand",
        "KV pool in use "
        "(oomguard_vllm_kv_cache_usage_ratio) and the projected demand of running plus "
        "waiting requests (oomguard_vllm_kv_projected_demand_ratio).",
        "percentunit",
        [
            target(
                f"oomguard_vllm_kv_cache_usage_ratio{{{s.eng}}}", "{{target}}/{{engine}} used", "A"
            ),
            target(
                f"oomguard_vllm_kv_projected_demand_ratio{{{s.eng}}}",
                "{{target}}/{{engine}} projected",
                "B",
            ),
        ],
    )
    L.timeseries(
        "Preemptions per finished request",
        "Preemptions per finished request over 5 minutes "
        "(engine:oomguard_vllm_preemption_ratio:rate5m).",
        "percentunit",
        [
            target(
                f"engine:oomguard_vllm_preemption_ratio:rate5m{{{s.eng}}}", "{{target}}/{{engine}}"
            )
        ],
    )
    L.timeseries(
        "Waiting requests by reason",
        f"Requests queued per engine by reason ({V.WAITING_BY_REASON}): capacity "
        "= no room, deferred = transient constraints.",
        "short",
        [
            target(
                f"{V.WAITING_BY_REASON}{{{s.vllm}}}",
                "{{model_name}}/{{engine}} {{reason}}",
            )
        ],
    )
    L.levels(
        "Engine sleep state",
        f"vLLM's sleep state per engine ({V.SLEEP_STATE}): 1 awake; a sleeping engine "
        "holds no KV cache (weights_offloaded = level 1, discard_all = level 2).",
        [
            target(
                f'{V.SLEEP_STATE}{{{s.vllm}, sleep_state="awake"}}',
                "{{model_name}}/{{engine}}",
            )
        ],
        w=12,
        h=8,
        mappings=[
            {
                "type": "value",
                "options": {
                    "0": {"text": "asleep", "color": "orange", "index": 0},
                    "1": {"text": "awake", "color": "green", "index": 1},
                },
            }
        ],
    )
    for name, metric in (
        ("Time to first token", V.TTFT),
        ("Inter-token latency", V.INTER_TOKEN_LATENCY),
    ):
        L.timeseries(
            f"{name} p50 / p95 / p99",
            f"{name} quantiles per model and engine from vLLM's histogram "
            f"({metric}_bucket, scraped from vLLM directly).",
            "s",
            [
                target(
                    f"histogram_quantile({q}, sum by ({s.c}, le, model_name, engine) "
                    f"(rate({metric}_bucket{{{s.vllm}}}[$__rate_interval])))",
                    f"{{{{model_name}}}}/{{{{engine}}}} p{int(q * 100)}",
                    ref,
                )
                for q, ref in ((0.5, "A"), (0.95, "B"), (0.99, "C"))
            ],
        )
    L.timeseries(
        "Host memory against its limit",
        "Memory charged to each watched cgroup "
        "(oomguard_host_memory_used_bytes) against its limit "
        "(oomguard_host_memory_limit_bytes); kernel OOM kills in "
        "oomguard_host_oom_kills_total.",
        "bytes",
        [
            target(f"oomguard_host_memory_used_bytes{{{s.node}}}", "{{cgroup}} used", "A"),
            target(f"oomguard_host_memory_limit_bytes{{{s.node}}}", "{{cgroup}} limit", "B"),
        ],
    )
    L.timeseries(
        "GPU memory per process and pod",
        "Device memory of the largest processes on the node's GPUs "
        "(oomguard_gpu_process_memory_used_bytes, from NVML) and of each pod "
        "(oomguard_gpu_pod_memory_used_bytes, from dcgm-exporter).",
        "bytes",
        [
            target(
                f"topk(10, oomguard_gpu_process_memory_used_bytes{{{s.node}}})",
                "GPU {{gpu}} pid {{pid}}",
                "A",
            ),
            target(
                f"oomguard_gpu_pod_memory_used_bytes{{{s.node}}}",
                "GPU {{gpu}} {{namespace}}/{{pod}}",
                "B",
            ),
        ],
    )
    return _dashboard(
        t,
        NODE_UID,
        "oomguard / Node and engine",
        "One node's GPUs, allocator, engines, latency and host memory.",
        L,
    )


def _mode_code(s: Sel) -> str:
    """One number per target for the mode it is in (the remediator sets exactly one mode to 1),
    so that the state timeline can name each mode."""
    return "\n+ ".join(
        f'{i} * max by ({s.c}, target) (oomguard_remediator_target_mode{{{s.rem}, mode="{m}"}})'
        for i, m in enumerate(MODES)
    )


def remediation(t: AlertThresholds | None = None) -> dict[str, Any]:
    t = t or AlertThresholds()
    s = Sel(t)
    L = Layout()
    L.stat(
        "Remediation paused",
        "1 while the remediator's global pause is on (oomguard_remediator_paused).",
        "bool_on_off",
        [target(f"max(oomguard_remediator_paused{{{s.remediator}}})")],
        steps=ORANGE_FROM_1,
        w=6,
    )
    L.stat(
        "Actions in the last hour",
        "Actions taken (oomguard_remediator_actions_total).",
        "none",
        [target(f"sum(increase(oomguard_remediator_actions_total{{{s.rem}}}[1h]))")],
        w=6,
    )
    L.stat(
        "Withheld by safety limits",
        "Actions a safety limit held back in the last hour "
        "(oomguard_remediator_safety_limited_total).",
        "none",
        [target(f"sum(increase(oomguard_remediator_safety_limited_total{{{s.rem}}}[1h]))")],
        steps=ORANGE_FROM_1,
        w=6,
    )
    L.stat(
        "Reconcile errors in the last hour",
        "Reconcile passes that failed (oomguard_remediator_reconcile_errors_total).",
        "none",
        [target(f"sum(increase(oomguard_remediator_reconcile_errors_total{{{s.rem}}}[1h]))")],
        steps=RED_FROM_1,
        w=6,
    )
    L.levels(
        "Mode per engine",
        "The mode each target is in: serving, capped, readmitting, draining, restarting, held "
        "(oomguard_remediator_target_mode).",
        [target(_mode_code(s), "{{target}}")],
        mappings=MODE_MAPPINGS,
        # the remediator's series name the target, not the node it runs on
        links=_to_node(("target",)),
    )
    L.timeseries(
        "Capacity withheld per engine",
        "Admission slots each target does not offer now: startup max_num_seqs minus the live "
        "cap, or all of it while draining or restarting "
        "(target:oomguard_capacity_withheld_seqs:max).",
        "short",
        [
            target(
                f'target:oomguard_capacity_withheld_seqs:max{{{s.cl}, target=~"$target"}}',
                "{{target}}",
            )
        ],
    )
    L.timeseries(
        "Admission cap vs startup max_num_seqs",
        "The cap in effect per engine "
        "(oomguard_remediator_admission_cap) against its ceiling "
        "(oomguard_remediator_startup_max_num_seqs).",
        "short",
        [
            target(f"oomguard_remediator_admission_cap{{{s.rem}}}", "{{target}} cap", "A"),
            target(
                f"oomguard_remediator_startup_max_num_seqs{{{s.rem}}}", "{{target}} startup", "B"
            ),
        ],
    )
    L.timeseries(
        "Actions by kind and result",
        "Remediator actions over time (oomguard_remediator_actions_total by action and result).",
        "short",
        [
            target(
                f"sum by (action, result) (increase(oomguard_remediator_actions_total"
                f"{{{s.rem}}}[$__rate_interval]))",
                "{{action}} {{result}}",
            )
        ],
        stack=True,
    )
    L.timeseries(
        "Re-admission progress",
        "Cap of the current staged re-admission stage, 0 when "
        "not re-admitting (oomguard_remediator_readmission_stage).",
        "short",
        [target(f"oomguard_remediator_readmission_stage{{{s.rem}}}", "{{target}}")],
    )
    L.timeseries(
        "Webhook requests by outcome",
        "Alertmanager webhooks received (oomguard_remediator_webhook_requests_total by "
        "outcome); `unauthorized` means a caller without the token.",
        "reqps",
        [
            target(
                f"sum by (outcome) (rate(oomguard_remediator_webhook_requests_total"
                f"{{{s.remediator}}}[$__rate_interval]))",
                "{{outcome}}",
            )
        ],
        w=24,
    )
    L.stat(
        "Leading replicas",
        "Remediator replicas that hold the leader Lease and act (oomguard_remediator_leader): "
        "1 is right, 0 means nothing acts.",
        "none",
        [target(f"sum(oomguard_remediator_leader{{{s.remediator}}})")],
        steps=RED_BELOW_1,
        w=6,
    )
    L.timeseries(
        "Reconcile passes",
        "How long the last pass took (oomguard_remediator_pass_duration_seconds) and how many "
        "engines it read (oomguard_remediator_engines_read, right axis in the legend).",
        "s",
        [
            target(
                f"oomguard_remediator_pass_duration_seconds{{{s.remediator}}}", "pass seconds", "A"
            ),
            target(f"oomguard_remediator_engines_read{{{s.remediator}}}", "engines read", "B"),
        ],
        w=18,
    )
    return _dashboard(
        t,
        "oomguard-remediation",
        "oomguard / Remediation",
        "What the remediator did, what it holds back, and where each engine is.",
        L,
    )


DASHBOARDS = {"fleet": fleet, "node": node, "remediation": remediation}
