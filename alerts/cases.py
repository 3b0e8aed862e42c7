"""promtool unit tests for every alert: at least one firing and one quiet case each, and the
hysteresis (`for`, `keep_firing_for`) where an alert has it. Expected descriptions are written
out by hand: they are the spec of what on-call reads."""

from __future__ import annotations

from oomguard.alerts.rules import Case

ENGINE = 'instance="n1:9848", job="oomguard-exporter", target="llama", model_name="m", engine="0"'
ENGINE_L = {
    "instance": "n1:9848",
    "job": "oomguard-exporter",
    "target": "llama",
    "model_name": "m",
    "engine": "0",
}
GPU = (
    'instance="n1:9848", job="oomguard-exporter", gpu="0", UUID="GPU-a", pci_bus_id="b", '
    'device="nvidia0", modelName="H100", Hostname="node1"'
)
GPU_L = {
    "instance": "n1:9848",
    "job": "oomguard-exporter",
    "gpu": "0",
    "UUID": "GPU-a",
    "modelName": "H100",
    "Hostname": "node1",
}
RANK = (
    'instance="n1:9848", job="oomguard-exporter", Hostname="node1", gpu="0", UUID="GPU-a", '
    'target="llama", engine="0", rank="0", pid="42"'
)
RANK_L = {
    "instance": "n1:9848",
    "job": "oomguard-exporter",
    "Hostname": "node1",
    "gpu": "0",
    "UUID": "GPU-a",
    "target": "llama",
    "engine": "0",
    "rank": "0",
    "pid": "42",
}
ENG = "engine 0 of llama on n1:9848"
GIB = 1024**3


def _level(reason: str, values: str) -> dict[str, str]:
    return {f'oomguard_engine_pressure_level{{{ENGINE}, reason="{reason}"}}': values}


def cases() -> list[Case]:
    c: list[Case] = []
    add = c.append

    # KV usage high: a capacity signal after 15 minutes, never before
    kv = {f"oomguard_vllm_kv_cache_usage_ratio{{{ENGINE}}}": "0.95x30"}
    add(Case("OomguardKVCacheUsageHigh", "10m", kv))
    add(
        Case(
            "OomguardKVCacheUsageHigh",
            "20m",
            kv,
            [
                {
                    **ENGINE_L,
                    "severity": "info",
                    "description": f"The KV cache of {ENG} is 95% full. This is normal under load and is "
                    "not a danger sign by itself; sustained, it means the engine runs at capacity.",
                }
            ],
        )
    )
    add(
        Case(
            "OomguardKVCacheUsageHigh",
            "20m",
            {f"oomguard_vllm_kv_cache_usage_ratio{{{ENGINE}}}": "0.85x30"},
        )
    )

    # caution: level >= 1 for 10 minutes
    add(Case("OomguardMemoryCaution", "5m", _level("free_caution", "1x20")))
    add(
        Case(
            "OomguardMemoryCaution",
            "15m",
            _level("free_caution", "1x20"),
            [
                {
                    **ENGINE_L,
                    "severity": "info",
                    "description": f"The pressure level of {ENG} is 1 (1 caution, 2 pressure, 3 critical).",
                }
            ],
        )
    )

    # preemption ratio over 5 minutes: 10 preemptions per 100 finished requests
    storm = {
        f"oomguard_vllm_preemptions_total{{{ENGINE}}}": "0+10x20",
        f'oomguard_vllm_requests_finished_total{{{ENGINE}, finished_reason="stop"}}': "0+100x20",
    }
    calm = {**storm, f"oomguard_vllm_preemptions_total{{{ENGINE}}}": "0+0.5x20"}
    add(Case("OomguardPreemptionRateHigh", "15m", calm))
    add(
        Case(
            "OomguardPreemptionRateHigh",
            "15m",
            storm,
            [
                {
                    **ENGINE_L,
                    "severity": "warning",
                    "oomguard_action": "lower_cap",
                    "description": f"{ENG} preempted 10% of its finished requests over 5 minutes: the "
                    "precursor of an out-of-memory crash.",
                }
            ],
        )
    )

    # pressure: 30 s to fire, keeps firing 2 minutes after the level drops
    pressure = _level("free_low", "0 2x5 0x10")  # level 2 from 1m to 6m, then 0
    add(Case("OomguardMemoryPressure", "1m", pressure, interval="1m"))  # not yet 30 s
    fired = [
        {
            **ENGINE_L,
            "severity": "warning",
            "oomguard_action": "lower_cap",
            "description": f"The pressure level of {ENG} is 2: free device memory is low or "
            "the allocator had to retry. oomguard lowers its admission cap.",
        }
    ]
    add(Case("OomguardMemoryPressure", "3m", pressure, fired))
    # the level dropped to 0 at 6m; keep_firing_for keeps the last value in the description
    add(Case("OomguardMemoryPressure", "7m", pressure, fired))  # dropped at 6m: still firing
    add(Case("OomguardMemoryPressure", "9m", pressure))  # resolved after keep_firing_for

    # critical: fires at once, drains
    critical = _level("free_below_floor", "0 3x3 0x10")
    add(Case("OomguardMemoryCritical", "0m", critical))
    add(
        Case(
            "OomguardMemoryCritical",
            "1m",
            critical,
            [
                {
                    **ENGINE_L,
                    "severity": "critical",
                    "oomguard_action": "drain",
                    "description": f"The pressure level of {ENG} is 3: free device memory is below the "
                    "critical floor or the allocator reported an out-of-memory error. oomguard drains the "
                    "engine.",
                }
            ],
        )
    )
    add(Case("OomguardMemoryCritical", "10m", critical))

    gpu_level = lambda v: {f'oomguard_gpu_pressure_level{{{GPU}, reason="x"}}': v}  # noqa: E731
    add(
        Case(
            "OomguardGpuMemoryPressure",
            "5m",
            gpu_level("2x10"),
            [
                {
                    **GPU_L,
                    "severity": "warning",
                    "description": "GPU 0 (GPU-a) on node1 is at pressure level 2: free memory is under "
                    "twice its critical floor.",
                }
            ],
        )
    )
    add(Case("OomguardGpuMemoryPressure", "5m", gpu_level("3x10")))  # critical instead
    add(
        Case(
            "OomguardGpuMemoryCritical",
            "1m",
            gpu_level("3x10"),
            [
                {
                    **GPU_L,
                    "severity": "critical",
                    "description": "GPU 0 (GPU-a) on node1 is at pressure level 3: free memory is below its "
                    "critical floor or a process on it hit a CUDA out-of-memory error.",
                }
            ],
        )
    )
    add(Case("OomguardGpuMemoryCritical", "1m", gpu_level("1x10")))

    # fragmentation: reserved - allocated grows by 3 GiB over 2 hours (every 10 minutes)
    frag = {
        f"oomguard_allocator_reserved_bytes{{{RANK}}}": f"{20 * GIB}+{GIB // 4}x40",
        f"oomguard_allocator_allocated_bytes{{{RANK}}}": f"{18 * GIB}x40",
    }
    add(
        Case(
            "OomguardAllocatorFragmentationGrowing",
            "170m",
            frag,
            [
                {
                    **RANK_L,
                    "severity": "warning",
                    "description": "Reserved minus allocated memory of rank 0 (pid 42) on node1 grew by "
                    "3GiB over 2h.",
                }
            ],
            interval="10m",
        )
    )
    add(
        Case(
            "OomguardAllocatorFragmentationGrowing",
            "170m",
            {**frag, f"oomguard_allocator_reserved_bytes{{{RANK}}}": f"{20 * GIB}x40"},
            interval="10m",
        )
    )

    # leak: the floor of allocated memory rises by 1.5 GiB in 2 hours
    leak = {f"oomguard_allocator_allocated_bytes{{{RANK}}}": f"{10 * GIB}+{GIB // 8}x40"}
    add(
        Case(
            "OomguardAllocatorLeak",
            "170m",
            leak,
            [
                {
                    **RANK_L,
                    "severity": "warning",
                    "description": "The lowest allocated memory of rank 0 (pid 42) on node1 rose by 1.5GiB "
                    "in 2h: a leak.",
                }
            ],
            interval="10m",
        )
    )
    add(
        Case(
            "OomguardAllocatorLeak",
            "170m",
            {f"oomguard_allocator_allocated_bytes{{{RANK}}}": f"{10 * GIB}x40"},
            interval="10m",
        )
    )

    ooms = {f"oomguard_allocator_ooms_total{{{RANK}}}": "0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1"}
    add(Case("OomguardCudaOomObserved", "2m", ooms))
    add(
        Case(
            "OomguardCudaOomObserved",
            "5m",
            ooms,
            [
                {
                    **RANK_L,
                    "severity": "critical",
                    "oomguard_action": "restart",
                    "description": "Rank 0 (pid 42) of llama on node1 raised 1 CUDA out-of-memory "
                    "errors in 5 minutes.",
                }
            ],
        )
    )

    tokens = f"oomguard_vllm_generation_tokens_total{{{ENGINE}}}"
    add(
        Case(
            "OomguardEngineRestarted",
            "10m",
            {tokens: "0+100x5 0+100x10"},
            [
                {
                    **ENGINE_L,
                    "severity": "warning",
                    "description": f"The counters of {ENG} reset 1 times in 15 minutes: the engine "
                    "restarted, often after a crash.",
                }
            ],
        )
    )
    add(Case("OomguardEngineRestarted", "10m", {tokens: "0+100x15"}))

    host = (
        'oomguard_host_oom_kills_total{instance="n1:9848", job="oomguard-exporter", '
        'Hostname="node1", cgroup="vllm"}'
    )
    host_l = {
        "instance": "n1:9848",
        "job": "oomguard-exporter",
        "Hostname": "node1",
        "cgroup": "vllm",
    }
    add(
        Case(
            "OomguardHostOomKill",
            "5m",
            {host: "0 0 1 1 1 1 1 1 1 1 1 1"},
            [
                {
                    **host_l,
                    "severity": "critical",
                    "description": "The kernel killed 1 processes of cgroup vllm on node1 for exceeding "
                    "host memory: exit code 137, no traceback.",
                }
            ],
        )
    )
    add(Case("OomguardHostOomKill", "5m", {host: "2x12"}))

    up = 'oomguard_vllm_up{instance="n1:9848", job="oomguard-exporter", target="llama"}'
    up_l = {"instance": "n1:9848", "job": "oomguard-exporter", "target": "llama"}
    add(
        Case(
            "OomguardEngineDown",
            "3m",
            {up: "0x5"},
            [
                {
                    **up_l,
                    "severity": "critical",
                    "description": "The exporter on n1:9848 cannot scrape vLLM target llama.",
                }
            ],
        )
    )
    add(Case("OomguardEngineDown", "3m", {up: "1 1 0 1 1"}))  # one failed scrape is not down

    exp_up = 'up{instance="n1:9848", job="oomguard-exporter"}'
    add(
        Case(
            "OomguardExporterDown",
            "5m",
            {exp_up: "0x6"},
            [
                {
                    "instance": "n1:9848",
                    "job": "oomguard-exporter",
                    "severity": "critical",
                    "description": "Prometheus cannot scrape the oomguard exporter on n1:9848: GPU memory "
                    "on that node is not watched.",
                }
            ],
        )
    )
    add(Case("OomguardExporterDown", "5m", {exp_up: "1x6"}))

    col = (
        'oomguard_exporter_collector_up{instance="n1:9848", job="oomguard-exporter", '
        'collector="nvml"}'
    )
    add(
        Case(
            "OomguardCollectorDown",
            "10m",
            {col: "0x12"},
            [
                {
                    "instance": "n1:9848",
                    "job": "oomguard-exporter",
                    "collector": "nvml",
                    "severity": "warning",
                    "description": "Collector nvml  of the exporter on n1:9848 has failed for a while.",
                }
            ],
        )
    )
    add(Case("OomguardCollectorDown", "10m", {col: "1x12"}))

    snap = (
        'oomguard_exporter_snapshot_timestamp_seconds{instance="n1:9848", job="oomguard-exporter"}'
    )
    add(
        Case(
            "OomguardMetricsStale",
            "5m",
            {snap: "0x6"},
            [
                {
                    "instance": "n1:9848",
                    "job": "oomguard-exporter",
                    "severity": "warning",
                    "description": "The exporter on n1:9848 last collected 5m 0s ago: its polling is "
                    "stuck.",
                }
            ],
        )
    )
    add(Case("OomguardMetricsStale", "5m", {snap: "0+60x6"}))

    rem = 'instance="r1:9849", job="oomguard-remediator", target="llama"'
    queue = {
        f"oomguard_vllm_requests_waiting{{{ENGINE}}}": "40x20",
        f"oomguard_remediator_admission_cap{{{rem}}}": "8x20",
        f"oomguard_remediator_startup_max_num_seqs{{{rem}}}": "64x20",
    }
    add(
        Case(
            "OomguardRequestsQueueing",
            "15m",
            queue,
            [
                {
                    **ENGINE_L,
                    "severity": "warning",
                    "description": f"40 requests wait on {ENG} while its admission cap is below the startup "
                    "max_num_seqs.",
                }
            ],
        )
    )
    add(
        Case(
            "OomguardRequestsQueueing",
            "15m",
            {**queue, f"oomguard_remediator_admission_cap{{{rem}}}": "64x20"},
        )
    )

    failed = f'oomguard_remediator_actions_total{{{rem}, action="lower_cap", result="failed"}}'
    add(
        Case(
            "OomguardRemediationFailing",
            "5m",
            {failed: "0 0 1 1 1 1 1 1 1 1 1 1"},
            [
                {
                    "instance": "r1:9849",
                    "job": "oomguard-remediator",
                    "target": "llama",
                    "action": "lower_cap",
                    "result": "failed",
                    "severity": "critical",
                    "description": "The remediator on r1:9849 failed 1 times in 10 "
                    "minutes on target llama: the engine is not protected.",
                }
            ],
        )
    )
    add(Case("OomguardRemediationFailing", "5m", {failed: "0x12"}))

    limited = f'oomguard_remediator_safety_limited_total{{{rem}, limit="cooldown"}}'
    add(
        Case(
            "OomguardRemediationLimited",
            "5m",
            {limited: "0 0 1 1 1 1 1 1 1 1 1 1"},
            [
                {
                    "instance": "r1:9849",
                    "job": "oomguard-remediator",
                    "target": "llama",
                    "limit": "cooldown",
                    "severity": "warning",
                    "description": "The remediator on r1:9849 held back 1 actions on llama "
                    "because of its cooldown limit.",
                }
            ],
        )
    )
    add(Case("OomguardRemediationLimited", "5m", {limited: "3x12"}))

    add(
        Case(
            "Watchdog",
            "1m",
            {},
            [
                {
                    "severity": "none",
                    "description": "This alert always fires. If it stops arriving, Prometheus or "
                    "Alertmanager is down.",
                }
            ],
        )
    )
    return c
