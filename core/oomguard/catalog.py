"""The metric catalog: every metric oomguard exports, in one place.

The exporter builds its families from these specs, the alert rules and dashboards take their
names from here, and a test fails when a rule or a panel names a metric that nothing exports.
Names follow Prometheus conventions: an `oomguard_` prefix, base units (bytes, seconds, ratios
0-1) in the name, `_total` on counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricType = Literal["gauge", "counter"]
Component = Literal["exporter", "remediator", "plugin", "supervisor"]

# Identity labels of a GPU, spelled as dcgm-exporter spells them so that oomguard's series join
# with dcgm-exporter's. MIG instances fill GPU_I_ID/GPU_I_PROFILE; whole GPUs leave them empty
# (an empty label is an absent label in Prometheus).
GPU_LABELS: tuple[str, ...] = (
    "gpu",
    "UUID",
    "pci_bus_id",
    "device",
    "modelName",
    "Hostname",
    "GPU_I_ID",
    "GPU_I_PROFILE",
)
# One vLLM engine: `target` is the name given to the vLLM endpoint in the exporter's config (and
# the remediator's allowlist key); `engine` is vLLM's own engine index (data parallel rank).
ENGINE_LABELS: tuple[str, ...] = ("target", "model_name", "engine")
# One PyTorch process (rank) inside vLLM, as published by the oomguard vLLM plugin.
ALLOCATOR_LABELS: tuple[str, ...] = ("Hostname", "gpu", "UUID", "target", "engine", "rank", "pid")
HOST_LABELS: tuple[str, ...] = ("Hostname", "cgroup")
COLLECTOR_LABELS: tuple[str, ...] = ("collector", "target")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    help: str
    unit: str
    labels: tuple[str, ...]
    component: Component = "exporter"


def _gauge(
    name: str, help: str, unit: str, labels: tuple[str, ...], component: Component = "exporter"
) -> MetricSpec:
    return MetricSpec(name, "gauge", help, unit, labels, component)


def _counter(
    name: str, help: str, unit: str, labels: tuple[str, ...], component: Component = "exporter"
) -> MetricSpec:
    return MetricSpec(name, "counter", help, unit, labels, component)


_SPECS: tuple[MetricSpec, ...] = (
    # --- GPU memory (NVML or dcgm-exporter) -------------------------------------------------
    _gauge(
        "oomguard_gpu_memory_total_bytes",
        "Total device memory of the GPU or MIG instance.",
        "bytes",
        GPU_LABELS,
    ),
    _gauge(
        "oomguard_gpu_memory_used_bytes",
        "Device memory in use by processes (excludes driver-reserved memory).",
        "bytes",
        GPU_LABELS,
    ),
    _gauge(
        "oomguard_gpu_memory_free_bytes",
        "Device memory free for new allocations.",
        "bytes",
        GPU_LABELS,
    ),
    _gauge(
        "oomguard_gpu_memory_reserved_bytes",
        "Device memory reserved by the driver and firmware.",
        "bytes",
        GPU_LABELS,
    ),
    _gauge(
        "oomguard_gpu_info",
        "Constant 1 for each GPU seen; `source` tells which collector reported it.",
        "",
        (*GPU_LABELS, "source"),
    ),
    _gauge(
        "oomguard_gpu_process_memory_used_bytes",
        "Device memory used by one process (host PID), from NVML.",
        "bytes",
        (*GPU_LABELS, "pid"),
    ),
    _gauge(
        "oomguard_gpu_pod_memory_used_bytes",
        "Device memory used by one Kubernetes pod, from dcgm-exporter's pod mapping. "
        "Never sum with the device series.",
        "bytes",
        (*GPU_LABELS, "namespace", "pod", "container"),
    ),
    _gauge(
        "oomguard_gpu_last_xid",
        "Code of the last XID error the GPU reported (a code, not a count), from dcgm-exporter.",
        "",
        GPU_LABELS,
    ),
    _gauge(
        "oomguard_gpu_xid_errors",
        "XID errors of one code the GPU reported in dcgm-exporter's last XID window "
        "(DCGM_EXP_XID_ERRORS_COUNT; a count per window, not cumulative).",
        "",
        (*GPU_LABELS, "xid"),
    ),
    _gauge(
        "oomguard_gpu_free_floor_bytes",
        "Free-memory floor of a GPU with no planned vLLM engine: below it the GPU is at "
        "caution (level 1), never higher.",
        "bytes",
        GPU_LABELS,
    ),
    _gauge(
        "oomguard_gpu_planned_bytes",
        "Device memory the vLLM engines on this GPU plan to use at their peak: the sum of "
        "gpu_memory_utilization x usable memory over its engines.",
        "bytes",
        GPU_LABELS,
    ),
    _gauge(
        "oomguard_gpu_headroom_bytes",
        "Free device memory left once every engine on this GPU reaches its planned peak "
        "(negative: the next peak does not fit). Pressure levels compare it with shares of "
        "usable memory.",
        "bytes",
        GPU_LABELS,
    ),
    _gauge(
        "oomguard_gpu_pressure_level",
        "Danger of a CUDA out-of-memory error on this GPU: -1 blind (cannot be read), 0 ok, "
        "1 caution, 2 pressure, 3 critical; `reason` names the signal that set the level.",
        "",
        (*GPU_LABELS, "reason"),
    ),
    # --- PyTorch caching allocator, per rank (vLLM plugin hand-off) -------------------------
    _gauge(
        "oomguard_allocator_allocated_bytes",
        "Bytes held by live tensors in the PyTorch caching allocator.",
        "bytes",
        ALLOCATOR_LABELS,
    ),
    _gauge(
        "oomguard_allocator_reserved_bytes",
        "Bytes the PyTorch caching allocator holds from the device (allocated plus cached).",
        "bytes",
        ALLOCATOR_LABELS,
    ),
    _gauge(
        "oomguard_allocator_allocated_peak_bytes",
        "Peak of allocated bytes since the process started or the peak was reset.",
        "bytes",
        ALLOCATOR_LABELS,
    ),
    _gauge(
        "oomguard_allocator_reserved_peak_bytes",
        "Peak of reserved bytes since the process started or the peak was reset.",
        "bytes",
        ALLOCATOR_LABELS,
    ),
    _gauge(
        "oomguard_allocator_inactive_split_bytes",
        "Bytes in inactive, split cached blocks: a measure of fragmentation.",
        "bytes",
        ALLOCATOR_LABELS,
    ),
    _counter(
        "oomguard_allocator_alloc_retries_total",
        "Allocations that failed once and succeeded after the allocator freed its cache.",
        "",
        ALLOCATOR_LABELS,
    ),
    _counter(
        "oomguard_allocator_ooms_total",
        "CUDA out-of-memory errors raised by the PyTorch allocator.",
        "",
        ALLOCATOR_LABELS,
    ),
    _gauge(
        "oomguard_allocator_free_after_gc_bytes",
        "Free device memory measured right after the plugin emptied the allocator cache.",
        "bytes",
        ALLOCATOR_LABELS,
    ),
    _gauge(
        "oomguard_allocator_report_timestamp_seconds",
        "Unix time at which the rank last published its allocator statistics.",
        "seconds",
        ALLOCATOR_LABELS,
    ),
    _counter(
        "oomguard_step_guard_shrinks_total",
        "Steps the plugin's step guard shrank because the full step would not fit the memory "
        "the engine could get (action: fewer_prefill_tokens, decode_only, wait; reason: what "
        "did not fit: activations, prompt_logprobs_logits, sampling_logits).",
        "",
        (*ALLOCATOR_LABELS, "action", "reason"),
    ),
    # --- vLLM engines (scraped from vLLM's /metrics) ----------------------------------------
    _gauge(
        "oomguard_vllm_up",
        "1 when the last scrape of the vLLM endpoint succeeded.",
        "",
        ("target",),
    ),
    _gauge(
        "oomguard_vllm_scrape_duration_seconds",
        "Time the last scrape of the vLLM endpoint took.",
        "seconds",
        ("target",),
    ),
    _gauge(
        "oomguard_vllm_kv_cache_usage_ratio",
        "Fraction of the KV-cache pool in use (0-1). Near 1 under load is normal for vLLM.",
        "ratio",
        ENGINE_LABELS,
    ),
    _gauge(
        "oomguard_vllm_requests_running",
        "Requests in the engine's running batch.",
        "",
        ENGINE_LABELS,
    ),
    _gauge(
        "oomguard_vllm_requests_waiting",
        "Requests queued in the engine, not yet running.",
        "",
        ENGINE_LABELS,
    ),
    _counter(
        "oomguard_vllm_preemptions_total",
        "Running requests the scheduler evicted back to the queue (recompute).",
        "",
        ENGINE_LABELS,
    ),
    _counter(
        "oomguard_vllm_requests_finished_total",
        "Requests the engine finished, by vLLM's finished_reason.",
        "",
        (*ENGINE_LABELS, "finished_reason"),
    ),
    _counter(
        "oomguard_vllm_prompt_tokens_total", "Prompt (prefill) tokens processed.", "", ENGINE_LABELS
    ),
    _counter(
        "oomguard_vllm_generation_tokens_total", "Generated (decode) tokens.", "", ENGINE_LABELS
    ),
    _gauge(
        "oomguard_vllm_kv_cache_blocks",
        "KV-cache blocks in the engine's GPU pool.",
        "",
        ENGINE_LABELS,
    ),
    _gauge(
        "oomguard_vllm_kv_cache_block_size_tokens", "Tokens per KV-cache block.", "", ENGINE_LABELS
    ),
    _gauge(
        "oomguard_vllm_kv_cache_capacity_tokens",
        "Tokens the KV-cache pool can hold.",
        "",
        ENGINE_LABELS,
    ),
    _gauge(
        "oomguard_vllm_gpu_memory_utilization_ratio",
        "The engine's --gpu-memory-utilization (share of device memory vLLM may use).",
        "ratio",
        ENGINE_LABELS,
    ),
    _gauge(
        "oomguard_vllm_preemption_ratio",
        "Preemptions per finished request over the exporter's rate window.",
        "ratio",
        ENGINE_LABELS,
    ),
    _gauge(
        "oomguard_vllm_kv_projected_demand_ratio",
        "Projected KV demand of running and waiting requests (average prompt plus output "
        "tokens each, with a safety margin) over the pool's capacity. Can exceed 1.",
        "ratio",
        ENGINE_LABELS,
    ),
    _gauge(
        "oomguard_engine_pressure_level",
        "Danger of a CUDA out-of-memory error for this engine (its own allocator events and "
        "its GPUs' levels): -1 blind (the engine or one of its GPUs cannot be read), 0 ok, "
        "1 caution, 2 pressure, 3 critical; `reason` names the signal.",
        "",
        (*ENGINE_LABELS, "reason"),
    ),
    _gauge(
        "oomguard_engine_gpu_info",
        "The GPUs an engine runs on (1 per GPU), and where oomguard learned it: `source` "
        "config, allocator (its ranks' reports) or single_gpu (the node's only GPU).",
        "",
        (*ENGINE_LABELS, "gpu", "UUID", "GPU_I_ID", "source"),
    ),
    # --- Host memory (cgroup) ---------------------------------------------------------------
    _gauge(
        "oomguard_host_memory_used_bytes",
        "Memory charged to the cgroup (memory.current).",
        "bytes",
        HOST_LABELS,
    ),
    _gauge(
        "oomguard_host_memory_limit_bytes",
        "Memory limit of the cgroup (memory.max); the host's MemTotal when unlimited.",
        "bytes",
        HOST_LABELS,
    ),
    _counter(
        "oomguard_host_oom_kills_total",
        "Processes the kernel OOM killer killed in the cgroup (memory.events oom_kill): "
        "the exit-137 class of OOM.",
        "",
        HOST_LABELS,
    ),
    # --- OOM forensics (incident records, forensics/oomguard/forensics/)
    # -----------------------------
    _counter(
        "oomguard_incidents_total",
        "Incident records in the node's incident directory, by the taxonomy type the "
        "classifier gave them (startup, long_prompt, under_load, after_hours, host_oom, "
        "not_oom, unknown). Records are kept; removing them reads as a counter reset.",
        "",
        ("Hostname", "target", "engine", "type"),
    ),
    _counter(
        "oomguard_requests_lost_total",
        "Requests an engine held, running or queued, when it died of a CUDA out-of-memory error "
        "(from the OOM observer's records; one count per death, whatever ranks recorded it). "
        "vLLM's own request counters die with the process and never count them: the "
        "error-budget SLO adds these.",
        "",
        ("Hostname", "target", "model_name", "engine"),
    ),
    # --- The exporter itself ----------------------------------------------------------------
    _gauge(
        "oomguard_exporter_build_info",
        "Constant 1, labelled with the oomguard version.",
        "",
        ("version",),
    ),
    _gauge(
        "oomguard_exporter_collector_up",
        "1 when the collector's last poll succeeded, 0 when it failed or timed out.",
        "",
        COLLECTOR_LABELS,
    ),
    _gauge(
        "oomguard_exporter_collector_duration_seconds",
        "Time the collector's last poll took.",
        "seconds",
        COLLECTOR_LABELS,
    ),
    _counter(
        "oomguard_exporter_collector_errors_total",
        "Failed polls of a collector, by reason.",
        "",
        (*COLLECTOR_LABELS, "reason"),
    ),
    _counter(
        "oomguard_exporter_invalid_samples_total",
        "Samples a collector read and dropped (NaN, blank sentinels, out of range).",
        "",
        (*COLLECTOR_LABELS, "reason"),
    ),
    _gauge(
        "oomguard_exporter_collector_last_success_timestamp_seconds",
        "Unix time of the collector's last successful poll.",
        "seconds",
        COLLECTOR_LABELS,
    ),
    _gauge(
        "oomguard_exporter_snapshot_timestamp_seconds",
        "Unix time at which the snapshot being served was collected.",
        "seconds",
        (),
    ),
    _counter("oomguard_exporter_polls_total", "Poll cycles completed.", "", ()),
    _counter(
        "oomguard_exporter_thread_restarts_total",
        "Background threads (collectors, render) that died and were restarted.",
        "",
        ("thread",),
    ),
    _gauge(
        "oomguard_exporter_render_duration_seconds",
        "Time spent rendering the last snapshot to the exposition format.",
        "seconds",
        (),
    ),
    # --- The remediator (names reserved here; the remediator exports them) ------------------
    _counter(
        "oomguard_remediator_actions_total",
        "Actions the remediator took or decided, by kind and result.",
        "",
        ("target", "action", "result"),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_admission_cap",
        "Admission cap (live max_num_seqs in effect) the remediator observes on the engine.",
        "",
        ("target",),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_startup_max_num_seqs",
        "The engine's startup max_num_seqs: the ceiling of every cap.",
        "",
        ("target",),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_target_mode",
        "1 for the mode the target is in (serving, capped, draining, readmitting, restarting, "
        "held).",
        "",
        ("target", "mode"),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_readmission_stage",
        "Staged re-admission progress: the current stage's cap (0 when not re-admitting).",
        "",
        ("target",),
        component="remediator",
    ),
    _counter(
        "oomguard_remediator_webhook_requests_total",
        "Alertmanager webhook requests received, by outcome.",
        "",
        ("outcome",),
        component="remediator",
    ),
    _counter(
        "oomguard_remediator_reconcile_errors_total",
        "Reconcile passes that could not read or converge a target.",
        "",
        ("target",),
        component="remediator",
    ),
    _counter(
        "oomguard_remediator_safety_limited_total",
        "Actions withheld by a safety limit (cooldown, rate limit, disruption budget, pause).",
        "",
        ("target", "limit"),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_paused",
        "1 while the global pause switch is on.",
        "",
        (),
        component="remediator",
    ),
    _counter(
        "oomguard_remediator_pass_failures_total",
        "Reconcile passes that failed as a whole (nothing was converged in them).",
        "",
        (),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_last_pass_timestamp_seconds",
        "When the last reconcile pass completed (Unix time); stops moving when passes fail.",
        "seconds",
        (),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_pass_duration_seconds",
        "How long the last reconcile pass took (reads, decision, actions).",
        "seconds",
        (),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_engines_read",
        "Engines whose state the last reconcile pass read (attention plus the quiet resync).",
        "",
        (),
        component="remediator",
    ),
    _counter(
        "oomguard_remediator_engine_reads_total",
        "Engine state reads made by reconcile passes.",
        "",
        (),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_resync_period_seconds",
        "Longest interval between two reads of a quiet engine: quiet_resync_seconds, longer "
        "where resync_reads_per_second paces a large fleet.",
        "seconds",
        (),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_targets",
        "Targets by read schedule: quiet (read on the slow resync) or attention (every pass).",
        "",
        ("state",),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_targets_discovered",
        "Targets discovered from Kubernetes pods (0 with a static list).",
        "",
        (),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_leader",
        "1 while this replica holds the leader Lease and acts; 0 on a standby.",
        "",
        (),
        component="remediator",
    ),
    _counter(
        "oomguard_remediator_thread_restarts_total",
        "Background threads (leader election, discovery watch, standalone watch) that died and "
        "were restarted.",
        "",
        ("thread",),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_audit_writable",
        "1 while the audit log takes appends; 0 after one failed (disk full, read-only): no "
        "action is taken without a durable intent.",
        "",
        (),
        component="remediator",
    ),
    _counter(
        "oomguard_remediator_audit_write_errors_total",
        "Appends to the audit log that failed (each one an action or a webhook not taken).",
        "",
        (),
        component="remediator",
    ),
    _gauge(
        "oomguard_remediator_audit_skipped_lines",
        "Lines of the audit log the last replay (start, taking the lead) could not read and "
        "skipped, by reason.",
        "",
        ("reason",),
        component="remediator",
    ),
    # --- `oomguard serve`, the supervisor of one vLLM (its GET /metrics) ---------------------
    _counter(
        "oomguard_supervisor_thread_restarts_total",
        "Threads of `oomguard serve` (the reader of vLLM's output) that died and were restarted.",
        "",
        ("thread",),
        component="supervisor",
    ),
    _counter(
        "oomguard_supervisor_log_dropped_lines_total",
        "Lines of vLLM's output not written to its log (full disk): the pipe is still drained.",
        "",
        (),
        component="supervisor",
    ),
    _counter(
        "oomguard_supervisor_state_write_errors_total",
        "Writes of `oomguard serve`'s state (flags, restart record) that failed; a requested "
        "restart is refused then.",
        "",
        (),
        component="supervisor",
    ),
    # --- served on vLLM's own /metrics by the plugin's request guard -------------------------
    _counter(
        "oomguard_guard_decisions_total",
        "Request guard decisions by mode, action (admit, defer, reject) and reason.",
        "",
        ("mode", "action", "reason"),
        component="plugin",
    ),
    _gauge(
        "oomguard_guard_headroom_bytes",
        "Room for one request's extra transient GPU memory, as the engine last reported it "
        "(`kind` now or idle).",
        "bytes",
        ("engine", "kind"),
        component="plugin",
    ),
    _gauge(
        "oomguard_guard_reserved_bytes",
        "Transient GPU memory the request guard admitted for requests whose prefill is not "
        "done yet (its ledger); later decisions see the headroom minus this.",
        "bytes",
        (),
        component="plugin",
    ),
    _counter(
        "oomguard_guard_reservations_released_total",
        "Request guard reservations ended, by how (prefilled, ended, dropped, expired: no "
        "path released it in time, which says a path leaks).",
        "",
        ("how",),
        component="plugin",
    ),
)

CATALOG: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}


def spec(name: str) -> MetricSpec:
    """Return the spec of a catalogued metric; a KeyError names the unknown metric."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not in the oomguard catalog") from None


def exported_names(component: Component | None = None) -> set[str]:
    """Every series name a component exposes (counters keep their `_total` name)."""
    return {s.name for s in _SPECS if component is None or s.component == component}
