"""promtool unit tests for every alert: at least one firing and one quiet case each, and the
hysteresis (`for`, `keep_firing_for`) where an alert has it. Expected descriptions are written
out by hand: they are the spec of what on-call reads.

The input series carry the labels a Prometheus gets from the shipped Kubernetes manifests
(`manifests.scrape_labels()` applies their PodMonitors' relabelings) plus the cluster label a
central ruler adds, so a rule that selects a label the manifests do not set fails here.
"""

from __future__ import annotations

from oomguard.alerts.rules import Case, ExprCase, V
from oomguard.contract import FRAGMENTATION_REASON
from oomguard.manifests import kubernetes as k8s
from oomguard.thresholds import AlertThresholds

GIB = 1024**3
NODE = k8s.NODE
MODEL = k8s.MODEL
# replacement pods in the rollout cases (a DaemonSet or Deployment rollout)
NEW_EXPORTER_POD = "oomguard-exporter-9mq4t"
NEW_REMEDIATOR_POD = "oomguard-remediator-5d9c8f-h6n2v"
NEW_VLLM_POD = "vllm-llama-3-8b-6f7d9-p4z7c"


def _arg(container_args: list[str], flag: str) -> str:
    """The NAME of a `--flag=NAME=value` argument of the exporter."""
    (value,) = [a.removeprefix(f"--{flag}=") for a in container_args if a.startswith(f"--{flag}=")]
    return value.split("=", 1)[0]


def sel(metric: str, labels: dict[str, str]) -> str:
    return metric + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


class Labels:
    """Label sets of the series each component exports, as scraped on Kubernetes."""

    def __init__(self, t: AlertThresholds) -> None:
        cluster = {t.cluster_label: "prod-eu-1"}
        exporter = k8s.exporter(t)
        args = next(o for o in exporter if o["kind"] == "DaemonSet")["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        self.target = _arg(args, "vllm")
        self.cgroup = _arg(args, "cgroup")
        self.exp = {**cluster, **k8s.scrape_labels(exporter, "oomguard-exporter-7xk2p")}
        self.rem = {
            **cluster,
            **k8s.scrape_labels(k8s.remediator(t), "oomguard-remediator-5d9c8f-q2w7r"),
        }
        self.vllm = {
            **cluster,
            **k8s.scrape_labels(k8s.vllm_example(t), "vllm-llama-3-8b-6f7d9-x8k2m"),
        }
        self.cluster = cluster
        self.engine = {**self.exp, "target": self.target, "model_name": MODEL, "engine": "0"}
        self.gpu = {
            **self.exp,
            "gpu": "0",
            "UUID": "GPU-a",
            "pci_bus_id": "00000000:3B:00.0",
            "device": "nvidia0",
            "modelName": "NVIDIA H100 80GB HBM3",
            "Hostname": NODE,
        }
        self.rank = {
            **self.exp,
            "Hostname": NODE,
            "gpu": "0",
            "UUID": "GPU-a",
            "target": self.target,
            "engine": "0",
            "rank": "0",
            "pid": "42",
        }
        self.rem_target = {**self.rem, "target": self.target}
        self.vllm_engine = {**self.vllm, "model_name": MODEL, "engine": "0"}
        # on Kubernetes `instance` of the exporter's series is the node's name
        self.eng = f"engine 0 of {self.target} on {self.exp['instance']}"

    @staticmethod
    def one(labels: dict[str, str]) -> dict[str, str]:
        """An alert's labels on an exporter gauge: the level as any pod that serves it sees
        it (oomguard.actions.across_pods), so without the pod's name."""
        return {k: v for k, v in labels.items() if k != "pod"}

    @staticmethod
    def rolled(labels: dict[str, str], pod: str, ip: str | None = None) -> dict[str, str]:
        """The same series served by a replacement pod: a new `pod` label (and, where the
        instance is the pod's address, a new address)."""
        out = {**labels, "pod": pod}
        if ip is not None:
            out["instance"] = f"{ip}:{labels['instance'].rsplit(':', 1)[1]}"
        return out


def cases(t: AlertThresholds | None = None) -> list[Case]:
    t = t or AlertThresholds()
    L = Labels(t)
    c: list[Case] = []
    add = c.append
    ENG = L.eng

    def level(reason: str, values: str) -> dict[str, str]:
        return {sel("oomguard_engine_pressure_level", {**L.engine, "reason": reason}): values}

    # KV usage high: a capacity signal after 15 minutes, never before; info (no ticket)
    kv = {sel("oomguard_vllm_kv_cache_usage_ratio", L.engine): "0.95x30"}
    add(Case("OomguardKVCacheUsageHigh", "10m", kv))
    add(
        Case(
            "OomguardKVCacheUsageHigh",
            "20m",
            kv,
            [
                {
                    **L.one(L.engine),
                    "severity": "info",
                    "description": f"The KV cache of {ENG} is 95% full. This is normal under load "
                    "and is not a danger sign by itself; sustained, it means the engine runs at "
                    "capacity.",
                }
            ],
        )
    )
    add(
        Case(
            "OomguardKVCacheUsageHigh",
            "20m",
            {sel("oomguard_vllm_kv_cache_usage_ratio", L.engine): "0.85x30"},
        )
    )

    # caution: level >= 1 for 10 minutes, with the reason
    add(Case("OomguardMemoryCaution", "5m", level("headroom_caution", "1x20")))
    add(
        Case(
            "OomguardMemoryCaution",
            "15m",
            level("headroom_caution", "1x20"),
            [
                {
                    **L.one(L.engine),
                    "reason": "headroom_caution",
                    "severity": "info",
                    "description": f"The pressure level of {ENG} is 1 (reason headroom_caution) "
                    "(1 caution, 2 pressure, 3 critical).",
                }
            ],
        )
    )
    add(Case("OomguardMemoryCaution", "15m", level("blind", "-1x20")))  # blind is not caution

    # preemption ratio over 5 minutes: 10 preemptions per 100 finished requests
    finished = sel("oomguard_vllm_requests_finished_total", {**L.engine, "finished_reason": "stop"})
    preempted = sel("oomguard_vllm_preemptions_total", L.engine)
    storm = {preempted: "0+10x20", finished: "0+100x20"}
    calm = {**storm, preempted: "0+0.5x20"}
    # an idle engine: one preemption every 4 minutes, two requests: a 50 % "ratio" of nothing
    idle = {preempted: "0+0.25x40", finished: "0+0.5x40"}
    add(Case("OomguardPreemptionRateHigh", "15m", calm))
    add(Case("OomguardPreemptionRateHigh", "30m", idle))
    new_engine = L.rolled(L.engine, NEW_EXPORTER_POD)

    def relayed(old: tuple[str, str], new: tuple[str, str]) -> dict[str, str]:
        """(preemptions, finished) from the old exporter pod and from its replacement."""
        new_finished = {**new_engine, "finished_reason": "stop"}
        return {
            preempted: old[0],
            finished: old[1],
            sel("oomguard_vllm_preemptions_total", new_engine): new[0],
            sel("oomguard_vllm_requests_finished_total", new_finished): new[1],
        }

    # the exporter rolls at 10m: counters already high, unchanged, under a new pod label
    rolled = relayed(("900x10 stale", "9000x10 stale"), ("_x10 900x20", "_x10 9000x20"))
    add(Case("OomguardPreemptionRateHigh", "16m", rolled))
    # a storm that goes on while the exporter surges at 10m (both pods relay the same counts
    # until 12m): the alert goes on, its 5 minutes not started again
    storm_rolled = relayed(
        ("0+10x12 stale", "0+100x12 stale"), ("_x10 100+10x20", "_x10 1000+100x20")
    )
    storm_fired = [
        {
            **L.one(L.engine),
            "severity": "warning",
            "oomguard_action": "lower_cap",
            "description": f"{ENG} preempted 10% of its finished requests over 5 minutes. "
            "Preemption is how vLLM meets a full KV cache; sustained, it costs latency and "
            "throughput, so oomguard lowers the admission cap.",
        }
    ]
    add(Case("OomguardPreemptionRateHigh", "15m", storm, storm_fired))

    add(Case("OomguardPreemptionRateHigh", "14m", storm_rolled, storm_fired))

    # pressure: 30 s to fire, a short hysteresis (action_keep_firing_for) after the level drops
    pressure = level("headroom_low", "0 2x5 0x10")  # level 2 from 1m to 6m, 0 from 7m
    add(Case("OomguardMemoryPressure", "1m", pressure))  # not yet 30 s

    # the alert judges the engine, whatever its reason (its labels have no `reason`)
    why = "(the `reason` of its oomguard_engine_pressure_level series says why)"
    fired = [
        {
            **L.one(L.engine),
            "severity": "warning",
            "oomguard_action": "lower_cap",
            "description": f"The pressure level of {ENG} is 2 {why}: the memory left on its GPU "
            "once every engine reaches its planned peak is low, or the allocator had to retry. "
            "oomguard lowers its admission cap.",
        }
    ]
    add(Case("OomguardMemoryPressure", "3m", pressure, fired))
    add(Case("OomguardMemoryPressure", "7m", pressure, fired))  # dropped at 7m: still firing
    add(Case("OomguardMemoryPressure", "8m", pressure))  # resolved after action_keep_firing_for
    add(Case("OomguardMemoryPressure", "3m", level("blind", "-1x10")))
    # a reason that changes while the level stays at 2 (a step-guard shrink's hold, then
    # headroom_low again, every 20 s) neither restarts the `for` nor resolves the alert: each
    # series leaves with a staleness marker, as a scrape that no longer has it writes one
    flap = {
        sel("oomguard_engine_pressure_level", {**L.engine, "reason": "headroom_low"}): (
            "2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2"
        ),
        sel("oomguard_engine_pressure_level", {**L.engine, "reason": "step_guard_shrink"}): (
            "_ _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _"
        ),
    }
    add(Case("OomguardMemoryPressure", "25s", flap, interval="5s"))  # not yet 30 s
    add(Case("OomguardMemoryPressure", "135s", flap, fired, "5s"))
    add(Case("OomguardMemoryPressure", "70s", flap, fired, "5s"))

    # the engine's own allocator fragmentation: the engine-wide alert fires as for any reason,
    # and OomguardFragmentationPressure carries the reason to the remediator, which answers it
    # with a restart at a quiet moment instead of a cap (decision.py)
    fragmented = level(FRAGMENTATION_REASON, "0 2x5 0x10")
    add(Case("OomguardMemoryPressure", "3m", fragmented, fired))
    add(Case("OomguardFragmentationPressure", "1m", fragmented))  # not yet 30 s
    fragmentation_fired = [
        {
            **L.one(L.engine),
            "reason": FRAGMENTATION_REASON,
            "severity": "warning",
            "oomguard_action": "lower_cap",
            "description": f"The pressure level of {ENG} is 2 because of free blocks stranded "
            "in its own PyTorch allocator (reason allocator_fragmentation), which only a new "
            "process gives back. With a restart backend oomguard drains it and restarts it at "
            "the first quiet moment; without one it lowers its admission cap.",
        }
    ]
    add(Case("OomguardFragmentationPressure", "3m", fragmented, fragmentation_fired))
    add(Case("OomguardFragmentationPressure", "7m", fragmented, fragmentation_fired))
    add(Case("OomguardFragmentationPressure", "8m", fragmented))  # after action_keep_firing_for
    add(Case("OomguardFragmentationPressure", "3m", pressure))  # another reason: not this one
    # the reason leaves while the level stays: the engine-wide alert goes on, this one resolves
    moved = {
        sel("oomguard_engine_pressure_level", {**L.engine, "reason": FRAGMENTATION_REASON}): (
            "0 2x3 stale"
        ),
        sel("oomguard_engine_pressure_level", {**L.engine, "reason": "headroom_low"}): ("_x4 2x6"),
    }
    add(Case("OomguardFragmentationPressure", "3m", moved, fragmentation_fired))
    add(Case("OomguardFragmentationPressure", "6m", moved))
    add(Case("OomguardMemoryPressure", "8m", moved, fired))

    # critical: fires at once; the remediator drains, nobody is paged
    critical = level("headroom_exhausted", "0 3x3 0x10")
    add(Case("OomguardMemoryCritical", "0m", critical))
    critical_fired = [
        {
            **L.one(L.engine),
            "severity": "warning",
            "oomguard_action": "drain",
            "description": f"The pressure level of {ENG} is 3 {why}: "
            "the memory left on its GPU at the engines' planned peak is nearly gone, or the "
            "allocator reported an out-of-memory error. oomguard drains the engine.",
        }
    ]
    add(Case("OomguardMemoryCritical", "1m", critical, critical_fired))
    add(Case("OomguardMemoryCritical", "10m", critical))
    # the exporter rolls with a surge while the engine is critical: one alert, one drain
    critical_surge = {
        sel("oomguard_engine_pressure_level", {**L.engine, "reason": "headroom_exhausted"}): (
            "3x10 stale"
        ),
        sel(
            "oomguard_engine_pressure_level",
            {**L.rolled(L.engine, NEW_EXPORTER_POD), "reason": "headroom_exhausted"},
        ): "_x9 3x10",
    }
    add(Case("OomguardMemoryCritical", "10m", critical_surge, critical_fired))
    add(Case("OomguardMemoryCritical", "12m", critical_surge, critical_fired))

    # blind: the exporter cannot judge the engine (level -1)
    blind = level("blind", "0 -1x3 0x10")  # blind from 1m to 4m
    blind_fired = [
        {
            **L.one(L.engine),
            "severity": "warning",
            "oomguard_action": "hold",
            "description": f"The exporter on {NODE} lacks the data to judge {ENG} {why}; "
            "the remediator holds it (blind is not healthy).",
        }
    ]
    add(Case("OomguardPressureBlind", "1m", blind, blind_fired))
    add(Case("OomguardPressureBlind", "5m", blind))  # clears at once: no hysteresis
    add(Case("OomguardPressureBlind", "12m", level("headroom_caution", "1x15")))

    # the exporter's DaemonSet rolls (a new `pod` label on the same level): an action alert
    # judges the engine whichever pod serves it, so a rollout neither starts its `for` again
    # nor makes it a new alert (a new episode the remediator would answer again)
    def served_by(pod: str | None, reason: str, values: str) -> dict[str, str]:
        labels = {**(L.rolled(L.engine, pod) if pod else L.engine), "reason": reason}
        return {sel("oomguard_engine_pressure_level", labels): values}

    # every 5 s: level 2 from the old pod until 295 s; with maxUnavailable the new pod serves
    # from 310 s (a gap within action_keep_firing_for); with maxSurge from 250 s
    gap = {
        **served_by(None, "headroom_low", "2x59 stale"),
        **served_by(NEW_EXPORTER_POD, "headroom_low", "_x62 2x60"),
    }
    add(Case("OomguardMemoryPressure", "305s", gap, fired, "5s"))
    add(Case("OomguardMemoryPressure", "330s", gap, fired, "5s"))  # not pending again
    surge = {
        **served_by(None, "headroom_low", "2x59 stale"),
        **served_by(NEW_EXPORTER_POD, "headroom_low", "_x50 2x60"),
    }
    add(Case("OomguardMemoryPressure", "290s", surge, fired, "5s"))  # one alert, not two
    add(Case("OomguardMemoryPressure", "330s", surge, fired, "5s"))
    fragments_gap = {
        **served_by(None, FRAGMENTATION_REASON, "2x59 stale"),
        **served_by(NEW_EXPORTER_POD, FRAGMENTATION_REASON, "_x62 2x60"),
    }
    add(Case("OomguardFragmentationPressure", "330s", fragments_gap, fragmentation_fired, "5s"))
    # a new pod that cannot judge the engine yet does not make it blind while the old one can
    # (nor the other way round); blind is what every pod serving it says
    # (every minute: the old pod serves until 10m, the new one from 8m, blind at 8m and 9m)
    blind_start = {
        **served_by(None, "headroom_ok", "0x10 stale"),
        **served_by(NEW_EXPORTER_POD, "blind", "_x8 -1x1 stale"),
        **served_by(NEW_EXPORTER_POD, "headroom_ok", "_x10 0x10"),
    }
    add(Case("OomguardPressureBlind", "9m", blind_start))
    blind_both = {
        **served_by(None, "blind", "-1x10 stale"),
        **served_by(NEW_EXPORTER_POD, "blind", "_x8 -1x10"),
    }
    add(Case("OomguardPressureBlind", "9m", blind_both, blind_fired))
    add(Case("OomguardPressureBlind", "12m", blind_both, blind_fired))

    def gpu_level(v: str) -> dict[str, str]:
        return {sel("oomguard_gpu_pressure_level", {**L.gpu, "reason": "headroom_low"}): v}

    gpu_text = f"GPU 0 (GPU-a) on {NODE}"
    add(
        Case(
            "OomguardGpuMemoryPressure",
            "6m",
            gpu_level("2x10"),
            [
                {
                    **L.one(L.gpu),
                    "severity": "warning",
                    "description": f"{gpu_text} is at pressure level 2: its headroom at the "
                    "engines' planned peak is low.",
                }
            ],
        )
    )
    add(Case("OomguardGpuMemoryPressure", "6m", gpu_level("3x10")))  # critical instead
    # the exporter rolls at 11m: the GPU's level from the new pod goes on with the same alert
    # (its 5 minutes do not start again)
    gpu_rolled = {
        sel("oomguard_gpu_pressure_level", {**L.gpu, "reason": "headroom_low"}): "2x10 stale",
        sel(
            "oomguard_gpu_pressure_level",
            {**L.rolled(L.gpu, NEW_EXPORTER_POD), "reason": "headroom_low"},
        ): "_x11 2x20",
    }
    gpu_fired = [
        {
            **L.one(L.gpu),
            "severity": "warning",
            "description": f"{gpu_text} is at pressure level 2: its headroom at the "
            "engines' planned peak is low.",
        }
    ]
    add(Case("OomguardGpuMemoryPressure", "14m", gpu_rolled, gpu_fired))
    add(
        Case(
            "OomguardGpuMemoryCritical",
            "2m",
            gpu_level("3x10"),
            [
                {
                    **L.one(L.gpu),
                    "severity": "warning",
                    "description": f"{gpu_text} is at pressure level 3: its headroom at the "
                    "engines' planned peak is nearly gone or a process on it hit a CUDA "
                    "out-of-memory error. Engines on it are handled by their own alerts; look for "
                    "a process that is not one of them.",
                }
            ],
        )
    )
    add(Case("OomguardGpuMemoryCritical", "2m", gpu_level("1x10")))

    # fragmentation: reserved - allocated grows by 3 GiB over 2 hours (every 10 minutes)
    reserved = sel("oomguard_allocator_reserved_bytes", L.rank)
    allocated = sel("oomguard_allocator_allocated_bytes", L.rank)
    frag = {reserved: f"{20 * GIB}+{GIB // 4}x40", allocated: f"{18 * GIB}x40"}
    add(
        Case(
            "OomguardAllocatorFragmentationGrowing",
            "170m",
            frag,
            [
                {
                    **L.one(L.rank),
                    "severity": "warning",
                    "description": f"Reserved minus allocated memory of rank 0 (pid 42) on {NODE} "
                    "grew by 3GiB over 2h.",
                }
            ],
            interval="10m",
        )
    )
    add(
        Case(
            "OomguardAllocatorFragmentationGrowing",
            "170m",
            {**frag, reserved: f"{20 * GIB}x40"},
            interval="10m",
        )
    )

    # leak: the floor of allocated memory rises by 1.5 GiB in 2 hours
    add(
        Case(
            "OomguardAllocatorLeak",
            "170m",
            {allocated: f"{10 * GIB}+{GIB // 8}x40"},
            [
                {
                    **L.one(L.rank),
                    "severity": "warning",
                    "description": f"The lowest allocated memory of rank 0 (pid 42) on {NODE} rose "
                    "by 1.5GiB in 2h: a leak.",
                }
            ],
            interval="10m",
        )
    )
    add(Case("OomguardAllocatorLeak", "170m", {allocated: f"{10 * GIB}x40"}, interval="10m"))

    # CUDA OOM: the page of the incident, and the remediator's restart order. The counter of a
    # process that dies of its first OOM is born at 1: increase() alone never sees it.
    ooms = sel("oomguard_allocator_ooms_total", L.rank)

    def oom_fired(n: str, labels: dict[str, str] | None = None) -> list[dict[str, str]]:
        return [
            {
                **L.one(labels or L.rank),
                "severity": "critical",
                "oomguard_action": "restart",
                "description": f"Rank 0 (pid 42) of {L.target} on {NODE} hit a CUDA out-of-memory "
                f"error ({n}) in the last 5 minutes.",
            }
        ]

    add(Case("OomguardCudaOomObserved", "2m", {ooms: "0 0 0 1x15"}))
    add(Case("OomguardCudaOomObserved", "5m", {ooms: "0 0 0 1x15"}, oom_fired("1")))
    add(Case("OomguardCudaOomObserved", "5m", {ooms: "_x3 1x15"}, oom_fired("1")))  # born at 1
    add(Case("OomguardCudaOomObserved", "12m", {ooms: "_x3 1x15"}))  # the same OOM, long ago
    add(Case("OomguardCudaOomObserved", "8m", {ooms: "2x12"}))  # old OOMs of a live process
    # the exporter's DaemonSet rolls at 10m: the same counter under a new `pod` label is no OOM,
    # a rise after it pages at once, and so does an OOM during the rollout (old 1, new 2)
    ooms_new = sel("oomguard_allocator_ooms_total", L.rolled(L.rank, NEW_EXPORTER_POD))
    rank_new = L.rolled(L.rank, NEW_EXPORTER_POD)
    rolled = {ooms: "1x10 stale", ooms_new: "_x10 1x20"}
    add(Case("OomguardCudaOomObserved", "11m", rolled))
    add(Case("OomguardCudaOomObserved", "14m", rolled))
    rose = {**rolled, ooms_new: "_x10 1x7 2x10"}  # the next OOM at 17m
    add(Case("OomguardCudaOomObserved", "18m", rose, oom_fired("1", rank_new)))
    seam = {**rolled, ooms_new: "_x10 2x20"}
    # an OOM at 5m, the DaemonSet surges at 7m (the old pod serves until 10m): one OOM, one
    # alert (one restart order), not one per pod
    surge = {ooms: "0x4 1x5 stale", ooms_new: "_x7 1x20"}
    add(Case("OomguardCudaOomObserved", "8m", surge, oom_fired("1", rank_new)))
    add(Case("OomguardCudaOomObserved", "12m", seam, oom_fired("1", rank_new)))
    # the engine served a model: the page carries it, so the model's other pages (no ready
    # engine while it reloads, its error budget) are the same incident in Alertmanager. The
    # engine's series stop when it dies (2m); the model it served in the hour still counts.
    served = {
        ooms: "0 0 0 1x15",
        sel("oomguard_vllm_requests_running", L.engine): "5 5 5",
    }
    add(
        Case(
            "OomguardCudaOomObserved",
            "5m",
            served,
            [{**oom_fired("1")[0], "model_name": MODEL}],
        )
    )

    # the classified incident: a ticket whose runbook link opens the section of its type
    def incident(kind: str, pod: str | None = None) -> str:
        exp = L.rolled(L.exp, pod) if pod else L.exp
        return sel(
            "oomguard_incidents_total",
            {**exp, "Hostname": NODE, "target": L.target, "engine": "0", "type": kind},
        )

    def incident_fired(kind: str, pod: str | None = None) -> list[dict[str, str]]:
        return [
            {
                **L.one(L.rolled(L.exp, pod) if pod else L.exp),
                "Hostname": NODE,
                "target": L.target,
                "engine": "0",
                "type": kind,
                "severity": "warning",
                "description": f"An incident of type {kind} was recorded for {L.target} engine 0 "
                f"on {NODE}: `oomguard incidents` there shows its evidence and fix.",
                "runbook_url": f"{t.runbook_url_base.rstrip('/')}/OomguardIncidentClassified.md"
                f"#{kind}",
            }
        ]

    spike = incident("long_prompt")
    add(
        Case("OomguardIncidentClassified", "5m", {spike: "0 0 1x10"}, incident_fired("long_prompt"))
    )
    # the first incident of a new exporter: the series is born at 1
    killed = incident("host_oom")
    add(Case("OomguardIncidentClassified", "5m", {killed: "_ _ 1x10"}, incident_fired("host_oom")))
    add(Case("OomguardIncidentClassified", "30m", {spike: "1x40"}))  # an old incident
    # an exporter rollout at 20m serves the same records under a new pod: no new incident; the
    # next one (at 30m) alerts at once
    spike_new = incident("long_prompt", NEW_EXPORTER_POD)
    rolled = {spike: "1x20 stale", spike_new: "_x20 1x30"}
    add(Case("OomguardIncidentClassified", "21m", rolled))
    add(Case("OomguardIncidentClassified", "28m", rolled))
    add(
        Case(
            "OomguardIncidentClassified",
            "31m",
            {**rolled, spike_new: "_x20 1x10 2x10"},
            incident_fired("long_prompt", NEW_EXPORTER_POD),
        )
    )

    tokens = sel("oomguard_vllm_generation_tokens_total", L.engine)
    add(
        Case(
            "OomguardEngineRestarted",
            "10m",
            {tokens: "0+100x5 0+100x10"},
            [
                {
                    **L.one(L.engine),
                    "severity": "warning",
                    "description": f"The counters of {ENG} reset 1 times in 15 minutes: the engine "
                    "restarted (a rollout, oomguard's own restart, or a crash).",
                }
            ],
        )
    )
    add(Case("OomguardEngineRestarted", "10m", {tokens: "0+100x15"}))
    tokens_new = sel("oomguard_vllm_generation_tokens_total", L.rolled(L.engine, NEW_EXPORTER_POD))
    # the exporter rolled at 5m; the engine did not restart
    add(
        Case(
            "OomguardEngineRestarted",
            "10m",
            {tokens: "0+100x5 stale", tokens_new: "_x5 600+100x10"},
        )
    )
    # a restart with a recorded incident is that incident's (its ticket, its page); one the
    # remediator made itself (mode restarting) is no news either
    reset = {tokens: "0+100x5 0+100x10"}
    recorded = sel(
        "oomguard_incidents_total",
        {**L.exp, "Hostname": NODE, "target": L.target, "engine": "0", "type": "under_load"},
    )
    add(Case("OomguardEngineRestarted", "10m", {**reset, recorded: "0x5 1x10"}))
    restarting = sel("oomguard_remediator_target_mode", {**L.rem_target, "mode": "restarting"})
    add(Case("OomguardEngineRestarted", "10m", {**reset, restarting: "0x4 1 1 0x10"}))

    # host OOM kills, read from the kubepods cgroup the DaemonSet mounts (the v2 root has none)
    host = sel("oomguard_host_oom_kills_total", {**L.exp, "Hostname": NODE, "cgroup": L.cgroup})

    def host_fired(n: str, labels: dict[str, str] | None = None) -> list[dict[str, str]]:
        return [
            {
                **L.one(labels or {**L.exp, "Hostname": NODE, "cgroup": L.cgroup}),
                "severity": "warning",
                "description": f"The kernel killed a process of cgroup {L.cgroup} on {NODE} for "
                f"exceeding host memory ({n}): exit code 137, no traceback.",
            }
        ]

    add(Case("OomguardHostOomKill", "5m", {host: "0 0 1x10"}, host_fired("1")))
    add(Case("OomguardHostOomKill", "5m", {host: "_ _ 1x10"}, host_fired("1")))  # born at 1
    add(Case("OomguardHostOomKill", "25m", {host: "2x30"}))
    host_labels_new = {**L.rolled(L.exp, NEW_EXPORTER_POD), "Hostname": NODE, "cgroup": L.cgroup}
    host_new = sel("oomguard_host_oom_kills_total", host_labels_new)
    rolled = {host: "2x20 stale", host_new: "_x20 2x20"}  # the exporter rolled at 20m
    add(Case("OomguardHostOomKill", "21m", rolled))
    add(Case("OomguardHostOomKill", "25m", rolled))
    add(
        Case(
            "OomguardHostOomKill",
            "33m",
            {**rolled, host_new: "_x20 2x12 3x5"},  # a kill at 33m
            host_fired("1", host_labels_new),
        )
    )

    up = sel("oomguard_vllm_up", {**L.exp, "target": L.target})
    add(
        Case(
            "OomguardEngineDown",
            "16m",
            {up: "0x20"},
            [
                {
                    **L.one(L.exp),
                    "target": L.target,
                    "severity": "warning",
                    "description": f"The exporter on {NODE} has not been able to scrape vLLM target "
                    f"{L.target} for 15m.",
                }
            ],
        )
    )
    add(Case("OomguardEngineDown", "10m", {up: "0x20"}))  # a rollout: model load takes minutes

    # a model with no ready engine for 5 minutes pages; a restart that comes back in time does not
    running = sel("oomguard_vllm_requests_running", L.engine)
    add(
        Case(
            "OomguardModelUnavailable",
            "20m",
            {running: "5x10", up: "1x10 0x20"},
            [
                {
                    **L.cluster,
                    "model_name": MODEL,
                    "severity": "critical",
                    "description": f"No engine serving model {MODEL} has been up and admitting "
                    "requests for 5m: every request for it fails.",
                }
            ],
        )
    )
    add(Case("OomguardModelUnavailable", "15m", {running: "5x30", up: "1x10 0x3 1x20"}))
    draining = sel("oomguard_remediator_target_mode", {**L.rem_target, "mode": "draining"})
    add(
        Case(
            "OomguardModelUnavailable",
            "15m",
            {running: "5x30", up: "1x30", draining: "0x3 1x20"},  # drained by oomguard
            [
                {
                    **L.cluster,
                    "model_name": MODEL,
                    "severity": "critical",
                    "description": f"No engine serving model {MODEL} has been up and admitting "
                    "requests for 5m: every request for it fails.",
                }
            ],
        )
    )

    exp_up = sel("up", L.exp)
    add(
        Case(
            "OomguardExporterDown",
            "5m",
            {exp_up: "0x6"},
            [
                {
                    **L.exp,
                    "severity": "warning",
                    "description": f"Prometheus cannot scrape the oomguard exporter on {NODE}: GPU "
                    "memory on that node is not watched and the remediator holds its engines.",
                }
            ],
        )
    )
    add(Case("OomguardExporterDown", "5m", {exp_up: "1x6"}))

    # absent: no target with the job the rules select, e.g. a PodMonitor without its relabeling
    # (prometheus-operator's default job is <namespace>/<name>)
    default_job = {**L.exp, "job": f"{k8s.NS}/oomguard-exporter"}
    add(
        Case(
            "OomguardExporterAbsent",
            "16m",
            {sel("up", default_job): "1x20"},
            [
                {
                    "job": t.exporter_job,
                    "severity": "warning",
                    "description": f'Prometheus has no target with job="{t.exporter_job}": the '
                    "scrape config or the PodMonitor does not find the exporters, so no GPU memory "
                    "is watched.",
                }
            ],
        )
    )
    add(Case("OomguardExporterAbsent", "16m", {exp_up: "1x20"}))
    rem_up = sel("up", L.rem)
    add(
        Case(
            "OomguardRemediatorAbsent",
            "16m",
            {exp_up: "1x20"},
            [
                {
                    "job": t.remediator_job,
                    "severity": "warning",
                    "description": f'Prometheus has no target with job="{t.remediator_job}": the '
                    "remediator is not deployed or not discovered, so nothing acts on oomguard "
                    "alerts.",
                }
            ],
        )
    )
    add(Case("OomguardRemediatorAbsent", "16m", {rem_up: "1x20"}))

    # vLLM's own /metrics not scraped at all (the SLOs read it)
    vllm_up = sel("up", L.vllm)
    add(
        Case(
            "OomguardVllmScrapeAbsent",
            "16m",
            {exp_up: "1x20", sel("up", {**L.vllm, "job": "llm/vllm-llama-3-8b"}): "1x20"},
            [
                {
                    "job": t.vllm_job,
                    "severity": "warning",
                    "description": f'Prometheus has no target with job="{t.vllm_job}": the scrape '
                    "config or the PodMonitor does not find vLLM's own /metrics, so the SLO alerts "
                    "cannot fire and requests lost in a crash are the only errors counted.",
                }
            ],
        )
    )
    add(Case("OomguardVllmScrapeAbsent", "16m", {vllm_up: "1x20"}))

    # -- kube-state-metrics, as kube-prometheus scrapes it (honorLabels: the object's own
    # namespace and pod) -----------------------------------------------------------------------
    ksm = {**L.cluster, "job": t.kube_state_metrics_job, "instance": "10.0.9.4:8443"}
    ds = {**ksm, "namespace": k8s.NS, "daemonset": t.exporter_daemonset}
    ds_out = {**L.cluster, "namespace": k8s.NS, "daemonset": t.exporter_daemonset}

    def daemonset(**values: str) -> dict[str, str]:
        return {sel(f"kube_daemonset_status_{k}", ds): v for k, v in values.items()}

    def gpu_nodes(n: int) -> dict[str, str]:
        return {
            sel(
                "kube_node_status_capacity",
                {
                    **ksm,
                    "node": f"gpu-node-{i}",
                    "resource": t.gpu_node_resource,
                    "unit": "integer",
                },
            ): "8x20"
            for i in range(1, n + 1)
        }

    def unscheduled(n: str) -> list[dict[str, str]]:
        return [
            {
                **ds_out,
                "severity": "warning",
                "description": f"{n} GPU nodes of cluster prod-eu-1 have no pod of DaemonSet "
                f"{k8s.NS}/{t.exporter_daemonset}: GPU memory there is not watched and nothing "
                "protects their engines.",
            }
        ]

    healthy = {
        **gpu_nodes(4),
        **daemonset(
            desired_number_scheduled="4x20",
            current_number_scheduled="4x20",
            updated_number_scheduled="4x20",
            number_available="4x20",
            number_misscheduled="0x20",
        ),
    }
    add(Case("OomguardExporterNotScheduled", "12m", healthy))
    # a pod that cannot be placed (a taint the DaemonSet does not tolerate, no room)
    pending = {**healthy, **daemonset(current_number_scheduled="3x20")}
    add(Case("OomguardExporterNotScheduled", "8m", pending))  # for 10m
    add(Case("OomguardExporterNotScheduled", "12m", pending, unscheduled("1")))
    # two GPU nodes lack the label the DaemonSet's nodeSelector asks for: not even desired
    unselected = {
        **healthy,
        **gpu_nodes(6),
    }
    add(Case("OomguardExporterNotScheduled", "12m", unselected, unscheduled("2")))

    stuck = {
        **healthy,
        **daemonset(updated_number_scheduled="2x20", number_available="3x20"),
    }
    add(Case("OomguardExporterRolloutStuck", "12m", stuck))  # for 15m
    add(
        Case(
            "OomguardExporterRolloutStuck",
            "17m",
            stuck,
            [
                {
                    **ds_out,
                    "severity": "warning",
                    "description": f"DaemonSet {k8s.NS}/{t.exporter_daemonset} has not finished "
                    "or progressed its rollout for 15 minutes: some GPU nodes run an old exporter, "
                    "or none.",
                }
            ],
        )
    )
    # a rollout that progresses one node every 2 minutes is not stuck
    rolling = {**healthy, **daemonset(updated_number_scheduled="0 0 1 1 2 2 3 3 4x13")}
    add(Case("OomguardExporterRolloutStuck", "17m", rolling))
    add(Case("OomguardExporterRolloutStuck", "17m", healthy))

    restarts_pod = {
        **ksm,
        "namespace": k8s.NS,
        "pod": L.rem["pod"],
        "uid": "6f1e0c9a-3b52-4f0e-9d7a-2c8e4b1f7a10",
        "container": "remediator",
    }
    restarts = sel("kube_pod_container_status_restarts_total", restarts_pod)
    add(
        Case(
            "OomguardRemediatorCrashLooping",
            "20m",
            {restarts: "0x5 1x3 2x3 3x10"},  # restarts 6, 10, 14 minutes in
            [
                {
                    **L.cluster,
                    "namespace": k8s.NS,
                    "pod": L.rem["pod"],
                    "container": "remediator",
                    "severity": "critical",
                    "description": f"Container remediator of pod {k8s.NS}/{L.rem['pod']} "
                    "restarted 3 times in 15 minutes: between crashes it is not up long enough to "
                    "act, and OomguardRemediatorDown may never fire.",
                }
            ],
        )
    )
    # one restart (an OOM kill, a node drain) is not a loop; nor is a rollout's new pod
    add(Case("OomguardRemediatorCrashLooping", "20m", {restarts: "0x5 1x20"}))
    add(
        Case(
            "OomguardRemediatorCrashLooping",
            "20m",
            {
                restarts: "0x10 stale",
                sel(
                    "kube_pod_container_status_restarts_total",
                    {**restarts_pod, "pod": NEW_REMEDIATOR_POD},
                ): "_x10 0x15",
            },
        )
    )
    add(
        Case(
            "OomguardRemediatorDown",
            "6m",
            {rem_up: "0x10"},
            [
                {
                    **L.rem,
                    "severity": "critical",
                    "description": f"Prometheus cannot scrape the remediator at {L.rem['instance']}"
                    ": no engine is protected from out-of-memory crashes.",
                }
            ],
        )
    )
    add(Case("OomguardRemediatorDown", "6m", {rem_up: "1x10"}))

    leader = sel("oomguard_remediator_leader", L.rem)
    add(
        Case(
            "OomguardRemediatorNoLeader",
            "6m",
            {leader: "0x10"},
            [
                {
                    **L.cluster,
                    "severity": "critical",
                    "description": "Every remediator replica scraped is a standby: none holds the "
                    "leader Lease, so nothing acts on oomguard alerts.",
                }
            ],
        )
    )
    add(Case("OomguardRemediatorNoLeader", "6m", {leader: "1x10"}))

    writable = sel("oomguard_remediator_audit_writable", L.rem)
    add(
        Case(
            "OomguardRemediatorAuditFailing",
            "5m",
            {writable: "1 1 0x10"},
            [
                {
                    **L.rem,
                    "severity": "critical",
                    "description": f"The remediator on {L.rem['instance']} cannot append to its "
                    "audit log (disk full or read-only): no action is taken without a durable "
                    "record, so no engine is protected, and webhooks are refused.",
                }
            ],
        )
    )
    add(Case("OomguardRemediatorAuditFailing", "5m", {writable: "1 0 1x10"}))  # one blip

    col = sel("oomguard_exporter_collector_up", {**L.exp, "collector": "cgroup"})
    add(
        Case(
            "OomguardCollectorDown",
            "10m",
            {col: "0x12"},
            [
                {
                    **L.exp,
                    "collector": "cgroup",
                    "severity": "warning",
                    "description": f"Collector cgroup  of the exporter on {NODE} has failed for a "
                    "while.",
                }
            ],
        )
    )
    add(Case("OomguardCollectorDown", "10m", {col: "1x12"}))

    snap = sel("oomguard_exporter_snapshot_timestamp_seconds", L.exp)
    add(
        Case(
            "OomguardMetricsStale",
            "5m",
            {snap: "0x6"},
            [
                {
                    **L.exp,
                    "severity": "warning",
                    "description": f"The exporter on {NODE} last collected 5m 0s ago: its polling "
                    "is stuck.",
                }
            ],
        )
    )
    add(Case("OomguardMetricsStale", "5m", {snap: "0+60x6"}))

    # queueing behind a lowered cap: exporter and remediator series join on `target`, which the
    # manifests name alike (the exporter's --vllm name and the remediator's target)
    queue = {
        sel("oomguard_vllm_requests_waiting", L.engine): "40x20",
        sel("oomguard_remediator_admission_cap", L.rem_target): "8x20",
        sel("oomguard_remediator_startup_max_num_seqs", L.rem_target): "64x20",
    }
    add(
        Case(
            "OomguardRequestsQueueing",
            "15m",
            queue,
            [
                {
                    **L.one(L.engine),
                    "severity": "warning",
                    "description": f"40 requests wait on {ENG} while its admission cap is below "
                    "the startup max_num_seqs.",
                }
            ],
        )
    )
    add(
        Case(
            "OomguardRequestsQueueing",
            "15m",
            {**queue, sel("oomguard_remediator_admission_cap", L.rem_target): "64x20"},
        )
    )

    # remediation failing: the first failure pages, even when its counter is born at 1
    failed = sel(
        "oomguard_remediator_actions_total",
        {**L.rem_target, "action": "lower_cap", "result": "failed"},
    )
    failing = [
        {
            **L.rem_target,
            "action": "lower_cap",
            "result": "failed",
            "severity": "critical",
            "description": f"The remediator on {L.rem['instance']} failed on target {L.target} (1 "
            "in 10 minutes): the engine is not protected.",
        }
    ]
    add(Case("OomguardRemediationFailing", "5m", {failed: "0 0 1x10"}, failing))
    add(Case("OomguardRemediationFailing", "5m", {failed: "_ _ 1x10"}, failing))
    add(Case("OomguardRemediationFailing", "5m", {failed: "0x12"}))
    # a crashed engine cannot be read: the remediator counts a reconcile error each pass while
    # it reloads (8 minutes here, from 2m). That is the crash's incident, not a failing
    # remediator: quiet while the exporter could not scrape the engine within the window; an
    # engine up again for 10 minutes that still cannot be read or changed pages.
    errors = sel("oomguard_remediator_reconcile_errors_total", L.rem_target)
    vllm_up = sel("oomguard_vllm_up", {**L.exp, "target": L.target})
    crashed = {
        errors: "0 0 60+60x8 540x20",
        vllm_up: "1 1 0x8 1x20",
        sel("oomguard_vllm_requests_running", L.engine): "5 5 _x8 5x20",
    }
    add(Case("OomguardRemediationFailing", "6m", crashed))
    add(Case("OomguardRemediationFailing", "15m", crashed))
    still = {**crashed, errors: "0 0 60+60x8 540+60x20"}  # errors go on once it is back
    add(
        Case(
            "OomguardRemediationFailing",
            "22m",
            still,
            [
                {
                    **L.rem_target,
                    "model_name": MODEL,
                    "severity": "critical",
                    "description": f"The remediator on {L.rem['instance']} failed on target "
                    f"{L.target} (600 in 10 minutes): the engine is not protected.",
                }
            ],
        )
    )
    # the remediator's Deployment rolls at 30m: its counters live in the process, so the new
    # pod (a new address too) starts again at 0: nothing new; its own first failure pages
    new_rem = L.rolled(L.rem_target, NEW_REMEDIATOR_POD, "10.0.4.2")
    failed_new = sel(
        "oomguard_remediator_actions_total", {**new_rem, "action": "lower_cap", "result": "failed"}
    )
    errors_old = sel("oomguard_remediator_reconcile_errors_total", L.rem_target)
    errors_new = sel("oomguard_remediator_reconcile_errors_total", new_rem)
    rolled = {
        failed: "3x30 stale",
        errors_old: "7x30 stale",
        failed_new: "_x30 0x20",
        errors_new: "_x30 0x20",
    }
    add(Case("OomguardRemediationFailing", "32m", rolled))
    add(
        Case(
            "OomguardRemediationFailing",
            "32m",
            {**rolled, failed_new: "_x30 1x20"},
            [
                {
                    **failing[0],
                    **new_rem,
                    "description": f"The remediator on {new_rem['instance']} failed on target "
                    f"{L.target} (1 in 10 minutes): the engine is not protected.",
                }
            ],
        )
    )

    limited = sel("oomguard_remediator_safety_limited_total", {**L.rem_target, "limit": "cooldown"})
    held_back = [
        {
            **L.rem_target,
            "limit": "cooldown",
            "severity": "critical",
            "description": f"The remediator on {L.rem['instance']} held back an action on "
            f"{L.target} because of its cooldown limit: the engine is in danger and the action "
            "it needed was not taken.",
        }
    ]
    add(Case("OomguardRemediationLimited", "5m", {limited: "0 0 1x10"}, held_back))
    add(Case("OomguardRemediationLimited", "5m", {limited: "_ _ 1x10"}, held_back))
    add(Case("OomguardRemediationLimited", "25m", {limited: "3x30"}))
    # the last ready replica of its model: the drain is refused and the remediator caps
    # instead, as designed; nothing is held back
    for fallback in ("last_ready", "disruption_budget"):
        fell_back = sel(
            "oomguard_remediator_safety_limited_total", {**L.rem_target, "limit": fallback}
        )
        add(Case("OomguardRemediationLimited", "5m", {fell_back: "0 0 1x10"}))
    # a model's only engine (a single box) capped instead of drained pages: nothing else
    # relieves it (issue 29, docs/single-box.md)
    only = sel(
        "oomguard_remediator_safety_limited_total", {**L.rem_target, "limit": "single_replica"}
    )
    add(
        Case(
            "OomguardRemediationLimited",
            "5m",
            {only: "0 0 1x10"},
            [
                {
                    **L.rem_target,
                    "limit": "single_replica",
                    "severity": "critical",
                    "description": f"The remediator on {L.rem['instance']} held back an action on "
                    f"{L.target} because of its single_replica limit: the engine is in danger and "
                    "the action it needed was not taken.",
                }
            ],
        )
    )
    limited_new = sel(
        "oomguard_remediator_safety_limited_total",
        {**L.rolled(L.rem_target, NEW_REMEDIATOR_POD, "10.0.4.2"), "limit": "cooldown"},
    )
    add(
        Case("OomguardRemediationLimited", "32m", {limited: "3x30 stale", limited_new: "_x30 0x20"})
    )

    paused = sel("oomguard_remediator_paused", L.rem)
    add(
        Case(
            "OomguardRemediationPaused",
            "65m",
            {paused: "1x70"},
            [
                {
                    **L.rem,
                    "severity": "warning",
                    "description": f"The remediator on {L.rem['instance']} has been paused for 1h: "
                    "it decides and records but acts on no engine.",
                }
            ],
        )
    )
    add(Case("OomguardRemediationPaused", "65m", {paused: "1x30 0x40"}))

    last_pass = sel("oomguard_remediator_last_pass_timestamp_seconds", L.rem)
    # passes stop completing at t=0 (the gauge stays at 0 s): behind from 60 s, alert after 2m more
    add(
        Case(
            "OomguardRemediatorPassesBehind",
            "4m",
            {last_pass: "0x10", leader: "1x10"},
            [
                {
                    **L.rem,
                    "severity": "warning",
                    "description": f"The remediator on {L.rem['instance']} leads but completed no "
                    f"reconcile pass for {t.pass_behind_seconds}s: actions wait (a slow or "
                    "failing pass, too many engines read per pass).",
                }
            ],
        )
    )
    # a standby's last pass never moves: no alert
    add(Case("OomguardRemediatorPassesBehind", "4m", {last_pass: "0x10", leader: "0x10"}))
    held = sel("oomguard_remediator_target_mode", {**L.rem_target, "mode": "held"})
    add(
        Case(
            "OomguardRemediationHeld",
            "16m",
            {held: "1x20"},
            [
                {
                    **L.rem_target,
                    "mode": "held",
                    "severity": "warning",
                    "description": f"The remediator on {L.rem['instance']} has held target "
                    f"{L.target} for 15m: it cannot read or change the engine, so it does nothing.",
                }
            ],
        )
    )
    add(Case("OomguardRemediationHeld", "16m", {held: "0x20"}))
    # held because its engine is down (a 20-minute model load): EngineDown's ticket, not two
    engine_up = sel("oomguard_vllm_up", {**L.exp, "target": L.target})
    add(Case("OomguardRemediationHeld", "16m", {held: "1x20", engine_up: "0x20"}))
    # the exporter surges at 8m: the new pod's first answer says vLLM is down (it has not
    # polled it yet) while the old one reaches it; the hold's 15 minutes go on
    engine_up_new = sel(
        "oomguard_vllm_up", {**L.rolled(L.exp, NEW_EXPORTER_POD), "target": L.target}
    )
    surge_up = {held: "1x20", engine_up: "1x10 stale", engine_up_new: "_x8 0 1x20"}
    add(
        Case(
            "OomguardRemediationHeld",
            "16m",
            {held: "1x20", engine_up: "1x20"},  # the engine serves: the hold is the remediator's
            [
                {
                    **L.rem_target,
                    "mode": "held",
                    "severity": "warning",
                    "description": f"The remediator on {L.rem['instance']} has held target "
                    f"{L.target} for 15m: it cannot read or change the engine, so it does nothing.",
                }
            ],
        )
    )
    add(
        Case(
            "OomguardRemediationHeld",
            "16m",
            surge_up,
            [
                {
                    **L.rem_target,
                    "mode": "held",
                    "severity": "warning",
                    "description": f"The remediator on {L.rem['instance']} has held target "
                    f"{L.target} for 15m: it cannot read or change the engine, so it does nothing.",
                }
            ],
        )
    )

    unauth = sel("oomguard_remediator_webhook_requests_total", {**L.rem, "outcome": "unauthorized"})
    add(
        Case(
            "OomguardRemediatorUnauthorized",
            "5m",
            {unauth: "0 0 3x10"},
            [
                {
                    **L.rem,
                    "outcome": "unauthorized",
                    "severity": "warning",
                    "description": f"The remediator on {L.rem['instance']} refused 3 calls without "
                    "a valid token in 10 minutes: a misconfigured Alertmanager or a probe.",
                }
            ],
        )
    )
    add(Case("OomguardRemediatorUnauthorized", "5m", {unauth: "0x10"}))
    unauth_new = sel(
        "oomguard_remediator_webhook_requests_total",
        {**L.rolled(L.rem, NEW_REMEDIATOR_POD, "10.0.4.2"), "outcome": "unauthorized"},
    )
    add(
        Case(
            "OomguardRemediatorUnauthorized", "12m", {unauth: "3x10 stale", unauth_new: "_x10 0x20"}
        )
    )

    def thread(labels: dict[str, str], name: str) -> str:
        metric = "remediator" if labels is L.rem else "exporter"
        return sel(f"oomguard_{metric}_thread_restarts_total", {**labels, "thread": name})

    def restarted(labels: dict[str, str], name: str, n: str) -> list[dict[str, str]]:
        return [
            {
                **labels,
                "thread": name,
                "severity": "warning",
                "description": f"Thread {name} of {labels['job']} on {labels['instance']} died "
                f"and was restarted ({n} in 15 minutes): its loop lost time, and a bug or a "
                "hostile input killed it.",
            }
        ]

    leader_thread = thread(L.rem, "leader-election")
    add(
        Case(
            "OomguardThreadRestarting",
            "5m",
            {leader_thread: "0 0 1x10"},
            restarted(L.rem, "leader-election", "1"),
        )
    )
    collector = thread(L.exp, "collector-nvml-")
    add(
        Case(
            "OomguardThreadRestarting",
            "5m",
            {collector: "_ _ 2x10"},  # born non-zero: a thread that died before the first scrape
            restarted(L.exp, "collector-nvml-", "2"),
        )
    )
    add(Case("OomguardThreadRestarting", "5m", {leader_thread: "0x10", collector: "0x10"}))
    # `oomguard serve` on one box: its reader of vLLM's output (job as the single-box config)
    serve = {"instance": "127.0.0.1:9851", "job": "oomguard-supervisor"}
    reader = sel("oomguard_supervisor_thread_restarts_total", {**serve, "thread": "log-reader"})
    add(
        Case(
            "OomguardThreadRestarting",
            "5m",
            {reader: "0 0 1x10"},
            [
                {
                    **serve,
                    "thread": "log-reader",
                    "severity": "warning",
                    "description": "Thread log-reader of oomguard-supervisor on 127.0.0.1:9851 "
                    "died and was restarted (1 in 15 minutes): its loop lost time, and a bug or "
                    "a hostile input killed it.",
                }
            ],
        )
    )
    # a rollout: the new remediator pod starts its counters again at 0; nothing died
    leader_new = sel(
        "oomguard_remediator_thread_restarts_total",
        {**L.rolled(L.rem, NEW_REMEDIATOR_POD, "10.0.4.2"), "thread": "leader-election"},
    )
    add(
        Case(
            "OomguardThreadRestarting",
            "32m",
            {leader_thread: "1x30 stale", leader_new: "_x30 0x20"},
        )
    )

    am = {**L.cluster, "instance": "10.0.3.4:9093", "job": "alertmanager-main"}
    am_failed = sel("alertmanager_notifications_failed_total", {**am, "integration": "webhook"})
    add(
        Case(
            "OomguardAlertmanagerWebhookFailing",
            "8m",
            {am_failed: "0 0 2x10"},
            [
                {
                    **am,
                    "integration": "webhook",
                    "severity": "warning",
                    "description": "Alertmanager 10.0.3.4:9093 failed 2 webhook deliveries in 10 "
                    "minutes: the remediator (or a webhook pager) misses alerts and relies on its "
                    "resync.",
                }
            ],
        )
    )
    add(Case("OomguardAlertmanagerWebhookFailing", "8m", {am_failed: "0x10"}))
    am_new = {**am, "instance": "10.0.3.9:9093", "pod": "alertmanager-main-1"}
    am_failed_new = sel(
        "alertmanager_notifications_failed_total", {**am_new, "integration": "webhook"}
    )
    rolled = {
        sel(
            "alertmanager_notifications_failed_total",
            {**am, "pod": "alertmanager-main-0", "integration": "webhook"},
        ): "2x10 stale",
        am_failed_new: "_x10 2x20",
    }
    add(Case("OomguardAlertmanagerWebhookFailing", "18m", rolled))

    # -- SLOs on vLLM's own series (job vllm) ---------------------------------------------------
    def success(reason: str, pod: str | None = None) -> str:
        engine = L.rolled(L.vllm_engine, pod, "10.0.5.3") if pod else L.vllm_engine
        return sel(V.FINISHED, {**engine, "finished_reason": reason})

    model = {**L.cluster, "model_name": MODEL}

    def burn(severity: str, value: str, what: str, objective: str, lasts: str) -> dict[str, str]:
        return {
            **model,
            "severity": severity,
            "description": f"Model {MODEL} has {value} {what} (objective {objective} % good): at "
            f"this rate the 30-day budget lasts {lasts}.",
        }

    errors = "requests finishing with an error"
    add(
        Case(
            "OomguardRequestErrorBudgetBurn",
            "65m",
            {success("error"): "0+10x70", success("stop"): "0+90x70"},
            [burn("critical", "10%", errors, "99.9", "hours")],  # the page covers the ticket
        )
    )
    add(
        Case(
            "OomguardRequestErrorBudgetBurn",
            "65m",
            {success("error"): "0+1x70", success("stop"): "0+199x70"},
            [burn("warning", "0.5%", errors, "99.9", "days")],  # slow burn: a ticket
        )
    )
    add(
        Case(
            "OomguardRequestErrorBudgetBurn",
            "65m",
            {success("error"): "0x70", success("abort"): "0+5x70", success("stop"): "0+95x70"},
        )
    )
    # a crash loses 600 requests at 60m of a model serving 1 request a second: vLLM never counts
    # them (its counters die with it), the exporter does (oomguard_requests_lost_total, born at
    # 600): over the last hour 1 in 7 requests failed
    lost = sel(
        "oomguard_requests_lost_total",
        {**L.exp, "Hostname": NODE, "target": L.target, "model_name": MODEL, "engine": "0"},
    )
    crash = {success("stop"): "0+60x70", lost: "_x60 600x10"}
    add(
        Case(
            "OomguardRequestErrorBudgetBurn",
            "63m",
            crash,
            [burn("critical", "14.29%", errors, "99.9", "hours")],
        )
    )
    add(Case("OomguardRequestErrorBudgetBurn", "55m", crash))  # before the crash
    # the vLLM pod is replaced at 30m: its counters start again on the new pod; no burn
    add(
        Case(
            "OomguardRequestErrorBudgetBurn",
            "65m",
            {
                success("error"): "0x30 stale",
                success("stop"): "0+100x30 stale",
                success("error", NEW_VLLM_POD): "_x30 0x40",
                success("stop", NEW_VLLM_POD): "_x30 0+100x40",
            },
        )
    )

    def ttft(good: str, pod: str | None = None, values: str = "0+{}x70") -> dict[str, str]:
        engine = L.rolled(L.vllm_engine, pod, "10.0.5.3") if pod else L.vllm_engine
        bucket = {**engine, "le": repr(t.slo_ttft_seconds)}
        return {
            sel(f"{V.TTFT}_bucket", bucket): values.format(good),
            sel(f"{V.TTFT}_count", engine): values.format(100),
        }

    slow = f"requests waiting over {t.slo_ttft_seconds:g} s for their first token"
    add(
        Case(
            "OomguardTTFTBudgetBurn",
            "65m",
            ttft("10"),
            [burn("critical", "90%", slow, "95", "hours")],
        )
    )
    add(
        Case(
            "OomguardTTFTBudgetBurn",
            "65m",
            ttft("80"),
            [burn("warning", "20%", slow, "95", "days")],
        )
    )
    add(Case("OomguardTTFTBudgetBurn", "65m", ttft("99")))
    # the vLLM pod is replaced at 30m, its histogram starting again: no burn
    rolled = {**ttft("99", values="0+{}x30 stale"), **ttft("99", NEW_VLLM_POD, "_x30 0+{}x40")}
    add(Case("OomguardTTFTBudgetBurn", "65m", rolled))

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


def model_e(engine: dict[str, str]) -> dict[str, str]:
    return {**engine, "model_name": MODEL}


def expr_cases(t: AlertThresholds | None = None) -> list[ExprCase]:
    """Recording rules other systems act on (capacity withheld), checked value by value."""
    t = t or AlertThresholds()
    L = Labels(t)
    startup = sel("oomguard_remediator_startup_max_num_seqs", L.rem_target)
    cap = sel("oomguard_remediator_admission_cap", L.rem_target)
    mode = sel("oomguard_remediator_target_mode", {**L.rem_target, "mode": "draining"})
    running = sel("oomguard_vllm_requests_running", L.engine)
    target = {**L.cluster, "target": L.target}
    model = {**L.cluster, "model_name": MODEL}
    capped = {startup: "64x10", cap: "16x10", mode: "0x10", running: "5x10"}
    drained = {**capped, mode: "0 0 0 1x7"}
    engine = {**L.cluster, "instance": L.exp["instance"], "target": L.target, "engine": "0"}
    running_old = sel("oomguard_vllm_requests_running", {**L.engine, "model_name": "old/model"})
    lost = sel(
        "oomguard_requests_lost_total",
        {**L.exp, "Hostname": NODE, "target": L.target, "model_name": MODEL, "engine": "0"},
    )
    lost_new = sel(
        "oomguard_requests_lost_total",
        {
            **L.rolled(L.exp, NEW_EXPORTER_POD),
            "Hostname": NODE,
            "target": L.target,
            "model_name": MODEL,
            "engine": "0",
        },
    )
    stop = sel(V.FINISHED, {**L.vllm_engine, "finished_reason": "stop"})
    # 0.8 requests a second succeed; a crash at 10m loses 60: 0.2 a second over 5 minutes
    crashed = {stop: "0+48x25", lost: "_x10 60x15"}
    rolled = {stop: "0+48x25", lost: "_x10 60x3 stale", lost_new: "_x13 60x12"}
    errors_5m = "model_name:vllm_request_errors:ratio_rate5m"
    return [
        ExprCase(errors_5m, "12m", crashed, [(model, "0.2")]),
        ExprCase(errors_5m, "20m", crashed, [(model, "0")]),  # the crash left the window
        # the exporter rolled at 13m: the same count from a new pod is no new loss
        ExprCase(errors_5m, "14m", rolled, [(model, "0.2")]),
        ExprCase(errors_5m, "20m", rolled, [(model, "0")]),
        # the model an engine serves now; while it reloads after a crash, the one it served
        ExprCase(
            "engine:oomguard_vllm_model:info", "5m", {running: "5x10"}, [(model_e(engine), "1")]
        ),
        ExprCase(
            "engine:oomguard_vllm_model:info", "8m", {running: "5x3"}, [(model_e(engine), "1")]
        ),
        # redeployed with another model 5 minutes ago: the one it serves now, only
        ExprCase(
            "engine:oomguard_vllm_model:info",
            "10m",
            {running_old: "5x5 stale", running: "_x5 5x5"},
            [(model_e(engine), "1")],
        ),
        ExprCase("target:oomguard_capacity_withheld_seqs:max", "5m", capped, [(target, "48")]),
        ExprCase("model_name:oomguard_capacity_withheld_seqs:sum", "5m", capped, [(model, "48")]),
        # draining admits nothing: the whole startup capacity is withheld
        ExprCase("target:oomguard_capacity_withheld_seqs:max", "5m", drained, [(target, "64")]),
        ExprCase("model_name:oomguard_capacity_withheld_seqs:sum", "5m", drained, [(model, "64")]),
        # the target was redeployed with another model 10 minutes ago: all of it counts for the
        # model it serves now, and the old model's series in the last hour breaks nothing
        ExprCase(
            "model_name:oomguard_capacity_withheld_seqs:sum",
            "20m",
            {
                startup: "64x20",
                cap: "16x20",
                mode: "0x20",
                sel("oomguard_vllm_requests_running", {**L.engine, "model_name": "old/model"}): (
                    "5x10"
                ),
                running: "_x10 5x10",
            },
            [(model, "48")],
        ),
        # restarting: no engine series now; the model it served within the hour still counts
        ExprCase(
            "model_name:oomguard_capacity_withheld_seqs:sum",
            "20m",
            {
                startup: "64x20",
                cap: "16x20",
                mode: "0x20",
                sel("oomguard_remediator_target_mode", {**L.rem_target, "mode": "restarting"}): (
                    "0x10 1x10"
                ),
                running: "5x10",
            },
            [(model, "64")],
        ),
        # uncapped and serving: nothing withheld (0, not absent: an autoscaler reads a number)
        ExprCase(
            "model_name:oomguard_capacity_withheld_seqs:sum",
            "5m",
            {**capped, cap: "64x10"},
            [(model, "0")],
        ),
    ]
