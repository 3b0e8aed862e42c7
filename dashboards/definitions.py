"""The three oomguard dashboards: fleet overview, node and engine, remediation."""

from __future__ import annotations

from typing import Any

from grafanalib.core import Annotations, Dashboard, Time
from oomguard.dashboards.panels import DATASOURCE, Layout, finish, target, variables

GPU = 'job=~"$job", instance=~"$node"'
ENG = 'job=~"$job", instance=~"$node", model_name=~"$model", target=~"$engine"'
RANK = 'job=~"$job", instance=~"$node", target=~"$engine"'
VLLM = 'model_name=~"$model"'  # vLLM's own series, scraped directly (job "vllm")
REM = 'target=~"$engine"'

TAGS = ["oomguard", "vllm", "gpu"]


def _annotations() -> Annotations:
    return Annotations(
        list=[
            {
                "datasource": DATASOURCE,
                "enable": True,
                "iconColor": "orange",
                "name": "oomguard actions",
                "expr": "sum by (target, action, result) "
                "(changes(oomguard_remediator_actions_total[1m])) > 0",
                "titleFormat": "{{action}} on {{target}}",
                "textFormat": "result: {{result}}",
                "step": "60s",
            },
            {
                "datasource": DATASOURCE,
                "enable": True,
                "iconColor": "red",
                "name": "oomguard alerts",
                "expr": 'ALERTS{alertstate="firing", alertname=~"Oomguard.*", '
                'severity=~"critical|warning"}',
                "titleFormat": "{{alertname}}",
                "textFormat": "{{instance}} {{target}}",
                "step": "60s",
            },
        ]
    )


def _dashboard(uid: str, title: str, description: str, layout: Layout) -> dict[str, Any]:
    dashboard = Dashboard(
        title=title,
        uid=uid,
        description=description,
        tags=TAGS,
        panels=layout.panels,
        templating=variables(),
        annotations=_annotations(),
        refresh="10s",
        time=Time("now-1h", "now"),
        timezone="utc",
        editable=True,
    )
    return finish(dashboard, layout.stat_steps)


def fleet() -> dict[str, Any]:
    L = Layout()
    L.stat(
        "Engines at pressure or worse",
        "Engines whose oomguard pressure level is 2 or 3 (oomguard_engine_pressure_level).",
        "none",
        [
            target(
                f"count(max by (instance, target, engine) "
                f"(oomguard_engine_pressure_level{{{ENG}}}) >= 2) or vector(0)"
            )
        ],
        steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
    )
    L.stat(
        "GPUs critical",
        "GPUs at pressure level 3 (oomguard_gpu_pressure_level).",
        "none",
        [
            target(
                f"count(max by (instance, UUID, GPU_I_ID) "
                f"(oomguard_gpu_pressure_level{{{GPU}}}) >= 3) or vector(0)"
            )
        ],
        steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
    )
    L.stat(
        "Firing oomguard alerts",
        "Alerts from the oomguard rules now firing (ALERTS).",
        "none",
        [target('count(ALERTS{alertstate="firing", alertname=~"Oomguard.*"}) or vector(0)')],
        steps=[{"color": "green", "value": None}, {"color": "orange", "value": 1}],
    )
    L.stat(
        "Preemptions per second",
        "Fleet-wide preemption rate (oomguard_vllm_preemptions_total).",
        "ops",
        [target(f"sum(rate(oomguard_vllm_preemptions_total{{{ENG}}}[$__rate_interval]))")],
    )
    L.levels(
        "Pressure level per node",
        "Highest GPU pressure level on each node, 0 ok to 3 "
        "critical (oomguard_gpu_pressure_level).",
        [target(f"max by (instance) (oomguard_gpu_pressure_level{{{GPU}}})", "{{instance}}")],
    )
    L.timeseries(
        "GPU memory per node",
        "Used, driver-reserved and free device memory against "
        "the total, summed over each node's GPUs (oomguard_gpu_memory_used_bytes, "
        "oomguard_gpu_memory_reserved_bytes, oomguard_gpu_memory_free_bytes, "
        "oomguard_gpu_memory_total_bytes).",
        "bytes",
        [
            target(
                f"sum by (instance) (oomguard_gpu_memory_used_bytes{{{GPU}}})",
                "{{instance}} used",
                "A",
            ),
            target(
                f"sum by (instance) (oomguard_gpu_memory_reserved_bytes{{{GPU}}})",
                "{{instance}} reserved",
                "B",
            ),
            target(
                f"sum by (instance) (oomguard_gpu_memory_free_bytes{{{GPU}}})",
                "{{instance}} free",
                "C",
            ),
            target(
                f"sum by (instance) (oomguard_gpu_memory_total_bytes{{{GPU}}})",
                "{{instance}} total",
                "D",
            ),
        ],
    )
    L.timeseries(
        "KV-cache usage per engine",
        "Share of each engine's KV pool in use "
        "(oomguard_vllm_kv_cache_usage_ratio). Near 100 % under load is normal.",
        "percentunit",
        [target(f"oomguard_vllm_kv_cache_usage_ratio{{{ENG}}}", "{{target}}/{{engine}}")],
    )
    L.timeseries(
        "Preemption rate",
        "Preemptions per second per engine "
        "(oomguard_vllm_preemptions_total) and per finished request "
        "(engine:oomguard_vllm_preemption_ratio:rate5m).",
        "ops",
        [
            target(
                f"rate(oomguard_vllm_preemptions_total{{{ENG}}}[$__rate_interval])",
                "{{target}}/{{engine}}",
            )
        ],
    )
    L.timeseries(
        "Running and waiting requests",
        "Requests in the running batch and in the "
        "queue, per engine (oomguard_vllm_requests_running, "
        "oomguard_vllm_requests_waiting).",
        "short",
        [
            target(
                f"oomguard_vllm_requests_running{{{ENG}}}", "{{target}}/{{engine}} running", "A"
            ),
            target(
                f"oomguard_vllm_requests_waiting{{{ENG}}}", "{{target}}/{{engine}} waiting", "B"
            ),
        ],
        w=24,
    )
    L.table(
        "Firing alerts",
        "oomguard alerts firing now, with their labels (ALERTS).",
        [target('ALERTS{alertstate="firing", alertname=~"Oomguard.*|Watchdog"}', instant=True)],
    )
    return _dashboard(
        "oomguard-fleet",
        "oomguard / Fleet overview",
        "GPU memory pressure, KV cache and preemptions across every node and engine.",
        L,
    )


def node() -> dict[str, Any]:
    L = Layout()
    L.timeseries(
        "Allocator vs budget vs device, per GPU",
        "Per GPU: bytes held by tensors (oomguard_allocator_allocated_bytes), held by "
        "the PyTorch cache (oomguard_allocator_reserved_bytes), vLLM's budget "
        "(oomguard_gpu_memory_total_bytes x oomguard_vllm_gpu_memory_utilization_ratio)"
        " and the device total.",
        "bytes",
        [
            target(
                f"sum by (UUID) (oomguard_allocator_allocated_bytes{{{RANK}}})",
                "{{UUID}} allocated",
                "A",
            ),
            target(
                f"sum by (UUID) (oomguard_allocator_reserved_bytes{{{RANK}}})",
                "{{UUID}} reserved",
                "B",
            ),
            target(
                f"max by (UUID) (oomguard_gpu_memory_total_bytes{{{GPU}}}) * scalar("
                f"max(oomguard_vllm_gpu_memory_utilization_ratio{{{ENG}}}))",
                "{{UUID}} vLLM budget",
                "C",
            ),
            target(
                f"max by (UUID) (oomguard_gpu_memory_total_bytes{{{GPU}}})", "{{UUID}} total", "D"
            ),
        ],
    )
    L.timeseries(
        "Free memory vs critical floor",
        "Free device memory per GPU "
        "(oomguard_gpu_memory_free_bytes) against the floor below which oomguard calls "
        "it critical (oomguard_gpu_free_floor_bytes).",
        "bytes",
        [
            target(f"oomguard_gpu_memory_free_bytes{{{GPU}}}", "GPU {{gpu}} free", "A"),
            target(f"oomguard_gpu_free_floor_bytes{{{GPU}}}", "GPU {{gpu}} floor", "B"),
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
                f"rank:oomguard_allocator_fragmentation_bytes:diff{{{RANK}}}",
                "rank {{rank}} reserved-allocated",
                "A",
            ),
            target(
                f"oomguard_allocator_inactive_split_bytes{{{RANK}}}",
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
                f"increase(oomguard_allocator_alloc_retries_total{{{RANK}}}[$__rate_interval])",
                "rank {{rank}} retries",
                "A",
            ),
            target(
                f"increase(oomguard_allocator_ooms_total{{{RANK}}}[$__rate_interval])",
                "rank {{rank}} OOMs",
                "B",
            ),
        ],
    )
    L.levels(
        "Pressure level per engine",
        "oomguard pressure level of each engine, 0 ok to 3 "
        "critical (engine:oomguard_engine_pressure_level:max).",
        [target(f"engine:oomguard_engine_pressure_level:max{{{ENG}}}", "{{target}}/{{engine}}")],
    )
    L.timeseries(
        "KV-cache usage and projected demand",
        "KV pool in use "
        "(oomguard_vllm_kv_cache_usage_ratio) and the projected demand of running plus "
        "waiting requests (oomguard_vllm_kv_projected_demand_ratio).",
        "percentunit",
        [
            target(
                f"oomguard_vllm_kv_cache_usage_ratio{{{ENG}}}", "{{target}}/{{engine}} used", "A"
            ),
            target(
                f"oomguard_vllm_kv_projected_demand_ratio{{{ENG}}}",
                "{{target}}/{{engine}} projected",
                "B",
            ),
        ],
    )
    L.timeseries(
        "Preemptions per finished request",
        "Preemptions per finished request over 5 minutes (engine:oomguard_vllm_preemption_ratio:rate5m).",
        "percentunit",
        [target(f"engine:oomguard_vllm_preemption_ratio:rate5m{{{ENG}}}", "{{target}}/{{engine}}")],
    )
    for name, metric in (
        ("Time to first token", "vllm:time_to_first_token_seconds"),
        ("Inter-token latency", "vllm:inter_token_latency_seconds"),
    ):
        L.timeseries(
            f"{name} p50 / p95 / p99",
            f"{name} quantiles from vLLM's histogram "
            f"({metric}_bucket, scraped from vLLM directly).",
            "s",
            [
                target(
                    f"histogram_quantile({q}, sum by (le, model_name) "
                    f"(rate({metric}_bucket{{{VLLM}}}[$__rate_interval])))",
                    f"{{{{model_name}}}} p{int(q * 100)}",
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
            target(f"oomguard_host_memory_used_bytes{{{GPU}}}", "{{cgroup}} used", "A"),
            target(f"oomguard_host_memory_limit_bytes{{{GPU}}}", "{{cgroup}} limit", "B"),
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
                f"topk(10, oomguard_gpu_process_memory_used_bytes{{{GPU}}})",
                "GPU {{gpu}} pid {{pid}}",
                "A",
            ),
            target(
                f"oomguard_gpu_pod_memory_used_bytes{{{GPU}}}",
                "GPU {{gpu}} {{namespace}}/{{pod}}",
                "B",
            ),
        ],
    )
    return _dashboard(
        "oomguard-node",
        "oomguard / Node and engine",
        "One node's GPUs, allocator, engines, latency and host memory.",
        L,
    )


def remediation() -> dict[str, Any]:
    L = Layout()
    L.stat(
        "Remediation paused",
        "1 while the remediator's global pause is on (oomguard_remediator_paused).",
        "bool_on_off",
        [target("max(oomguard_remediator_paused)")],
        steps=[{"color": "green", "value": None}, {"color": "orange", "value": 1}],
    )
    L.stat(
        "Actions in the last hour",
        "Actions taken (oomguard_remediator_actions_total).",
        "none",
        [target(f"sum(increase(oomguard_remediator_actions_total{{{REM}}}[1h]))")],
    )
    L.stat(
        "Withheld by safety limits",
        "Actions a safety limit held back in the last hour "
        "(oomguard_remediator_safety_limited_total).",
        "none",
        [target(f"sum(increase(oomguard_remediator_safety_limited_total{{{REM}}}[1h]))")],
        steps=[{"color": "green", "value": None}, {"color": "orange", "value": 1}],
    )
    L.stat(
        "Reconcile errors in the last hour",
        "Reconcile passes that failed (oomguard_remediator_reconcile_errors_total).",
        "none",
        [target(f"sum(increase(oomguard_remediator_reconcile_errors_total{{{REM}}}[1h]))")],
        steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
    )
    L.timeseries(
        "Actions by kind and result",
        "Remediator actions over time (oomguard_remediator_actions_total by action and result).",
        "short",
        [
            target(
                f"sum by (action, result) (increase(oomguard_remediator_actions_total"
                f"{{{REM}}}[$__rate_interval]))",
                "{{action}} {{result}}",
            )
        ],
        stack=True,
    )
    L.timeseries(
        "Admission cap vs startup max_num_seqs",
        "The cap in effect per engine "
        "(oomguard_remediator_admission_cap) against its ceiling "
        "(oomguard_remediator_startup_max_num_seqs).",
        "short",
        [
            target(f"oomguard_remediator_admission_cap{{{REM}}}", "{{target}} cap", "A"),
            target(f"oomguard_remediator_startup_max_num_seqs{{{REM}}}", "{{target}} startup", "B"),
        ],
    )
    L.levels(
        "Mode per engine (draining, capped, readmitting)",
        "1 for the mode each target is in (oomguard_remediator_target_mode).",
        [
            target(
                f"max by (target, mode) (oomguard_remediator_target_mode{{{REM}}}) > 0",
                "{{target}} {{mode}}",
            )
        ],
    )
    L.timeseries(
        "Re-admission progress",
        "Cap of the current staged re-admission stage, 0 when "
        "not re-admitting (oomguard_remediator_readmission_stage).",
        "short",
        [target(f"oomguard_remediator_readmission_stage{{{REM}}}", "{{target}}")],
    )
    L.timeseries(
        "Webhook requests by outcome",
        "Alertmanager webhooks received (oomguard_remediator_webhook_requests_total by outcome).",
        "reqps",
        [
            target(
                "sum by (outcome) (rate(oomguard_remediator_webhook_requests_total"
                "[$__rate_interval]))",
                "{{outcome}}",
            )
        ],
    )
    return _dashboard(
        "oomguard-remediation",
        "oomguard / Remediation",
        "What the remediator did, what it holds back, and where each engine is.",
        L,
    )


DASHBOARDS = {"fleet": fleet, "node": node, "remediation": remediation}
