"""Incident timelines: what the exporter, the remediator and vLLM export during an incident, as
the code behaves (each choice names where it comes from), with the labels the shipped Kubernetes
manifests give the series (alerts/cases.py `Labels`) and one cluster label per timeline.

- CUDA OOM: the observer writes the hand-off with the OOM counted and an incident record
  (vllm_plugin/oom.py); the engine dies at once; the exporter's level for its GPU holds 3
  (allocator_oom) for `event_hold_seconds` (120 s), its engine reads blind while it cannot be
  scraped (pressure.py), the dead pid's hand-off goes stale after 30 s and leaves the output
  (collectors/allocator.py), the vLLM collector reports up 0 (poller.py); the remediator cannot
  read the engine and counts a reconcile error every 1 s pass (convergence.py `_hold`), one cap
  it tried on the dying engine fails, and with no ready peer its drain for MemoryCritical is
  refused as the last ready replica and answered with a cap (decision.py FALLBACK_LIMITS). vLLM's
  own counters die with the process and start again after the reload.
- Fragmentation creep on a single replica: reserved - allocated grows for hours, the level climbs
  caution, pressure, critical; the remediator caps, then, as the last replica cannot be drained,
  caps lower (the fallback), and requests queue behind the cap.
- SLO burn: a model newly deployed (no history) fails 2 % of its requests for 30 minutes.
"""

from __future__ import annotations

from collections.abc import Callable

from oomguard.alerts.cases import Labels, sel
from oomguard.thresholds import AlertThresholds
from tests.alert_replay import Timeline, Value

T = AlertThresholds()
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
GIB = 1024**3
MODES = ("serving", "capped", "readmitting", "draining", "restarting", "held")


class Fleet:
    """Series of one cluster: nodes with an exporter and an engine each, one remediator."""

    def __init__(self, tl: Timeline) -> None:
        self.tl = tl
        self.L = Labels(T)
        self.cluster = {T.cluster_label: tl.name}
        self.rem = {**self.L.rem, **self.cluster}
        t = tl.times()
        self.t = t
        self.add("up", self.rem, lambda s: 1)
        self.add("oomguard_remediator_leader", self.rem, lambda s: 1)
        self.add("oomguard_remediator_paused", self.rem, lambda s: 0)
        self.add("oomguard_remediator_last_pass_timestamp_seconds", self.rem, lambda s: s)

    def add(self, metric: str, labels: dict[str, str], fn: Callable[[float], Value]) -> None:
        self.tl.add(sel(metric, labels), [fn(s) for s in self.t])

    def counter(
        self, metric: str, labels: dict[str, str], rate: Callable[[float], float], alive=None
    ) -> None:
        """A counter growing at `rate` per second; absent while `alive` is false, and counted
        again from 0 after (a process that restarted)."""
        values: list[Value] = []
        total = 0.0
        for s in self.t:
            if alive is not None and not alive(s):
                values.append(None)
                total = 0.0
                continue
            values.append(round(total, 3))
            total += rate(s) * self.tl.step
        self.tl.add(sel(metric, labels), values)

    def node(self, n: int) -> dict[str, str]:
        name = f"gpu-node-{n}"
        return {**self.L.exp, **self.cluster, "instance": name, "pod": f"oomguard-exporter-{n}"}

    def exporter(self, n: int) -> dict[str, str]:
        exp = self.node(n)
        self.add("up", exp, lambda s: 1)
        self.add("oomguard_exporter_snapshot_timestamp_seconds", exp, lambda s: s)
        for collector in ("nvml", "allocator", "incidents", "cgroup"):
            self.add("oomguard_exporter_collector_up", {**exp, "collector": collector}, lambda s: 1)
        return exp

    def gpu(self, exp: dict[str, str], level: Callable[[float], tuple[int, str]]) -> None:
        gpu = {**self.L.gpu, **exp, "Hostname": exp["instance"]}
        self._levels("oomguard_gpu_pressure_level", gpu, level)

    def _levels(
        self, metric: str, labels: dict[str, str], level: Callable[[float], tuple[int, str]]
    ) -> None:
        """One series per reason: a new reason is a new series, the old one leaves."""
        reasons = sorted({level(s)[1] for s in self.t})
        for reason in reasons:
            self.add(
                metric,
                {**labels, "reason": reason},
                lambda s, r=reason: level(s)[0] if level(s)[1] == r else None,
            )

    def engine(
        self,
        exp: dict[str, str],
        target: str,
        up: Callable[[float], bool],
        level: Callable[[float], tuple[int, str]],
        waiting: Callable[[float], float] = lambda s: 0,
    ) -> dict[str, str]:
        """The exporter's series of one engine, and vLLM's own (scraped from its pod)."""
        engine = {**exp, "target": target, "model_name": MODEL, "engine": "0"}
        self.add("oomguard_vllm_up", {**exp, "target": target}, lambda s: 1 if up(s) else 0)
        self.add(
            "oomguard_exporter_collector_up",
            {**exp, "collector": "vllm", "target": target},
            lambda s: 1 if up(s) else 0,
        )
        self.add("oomguard_vllm_requests_running", engine, lambda s: 20 if up(s) else None)
        self.add("oomguard_vllm_requests_waiting", engine, lambda s: waiting(s) if up(s) else None)
        self.add("oomguard_vllm_kv_cache_usage_ratio", engine, lambda s: 0.5 if up(s) else None)
        self.counter("oomguard_vllm_generation_tokens_total", engine, lambda s: 500, up)
        self.counter(
            "oomguard_vllm_requests_finished_total",
            {**engine, "finished_reason": "stop"},
            lambda s: 10,
            up,
        )
        self.counter("oomguard_vllm_preemptions_total", engine, lambda s: 0, up)
        self._levels("oomguard_engine_pressure_level", engine, level)
        # vLLM's own series, scraped from its pod (job vllm)
        pod = {
            **self.L.vllm,
            **self.cluster,
            "pod": f"{target}-pod",
            "model_name": MODEL,
            "engine": "0",
        }
        self.add(
            "up",
            {k: v for k, v in pod.items() if k not in ("model_name", "engine")},
            lambda s: 1 if up(s) else 0,
        )
        self.counter(
            "vllm:request_success_total", {**pod, "finished_reason": "stop"}, lambda s: 10, up
        )
        self.counter(
            "vllm:request_success_total", {**pod, "finished_reason": "error"}, lambda s: 0, up
        )
        self.counter(
            "vllm:time_to_first_token_seconds_bucket",
            {**pod, "le": repr(T.slo_ttft_seconds)},
            lambda s: 10,
            up,
        )
        self.counter("vllm:time_to_first_token_seconds_count", pod, lambda s: 10, up)
        return engine

    def target(
        self,
        target: str,
        mode: Callable[[float], str],
        cap: Callable[[float], float] = lambda s: 64,
    ) -> dict[str, str]:
        """The remediator's series of one target."""
        rt = {**self.rem, "target": target}
        for m in MODES:
            self.add(
                "oomguard_remediator_target_mode",
                {**rt, "mode": m},
                lambda s, m=m: 1 if mode(s) == m else 0,
            )
        self.add("oomguard_remediator_admission_cap", rt, cap)
        self.add("oomguard_remediator_startup_max_num_seqs", rt, lambda s: 64)
        return rt

    def steps_of(self, fn: Callable[[float], float]) -> Callable[[float], float]:
        """A counter's increments as a per-second rate (an event of `fn(s)` at step s)."""
        return lambda s: fn(s) / self.tl.step


def cuda_oom(reload_minutes: int, ready_peer: bool) -> Timeline:
    """A CUDA OOM kills engine llama-a at 4m; it reloads for `reload_minutes`. With a ready
    peer, engine llama-b on another node serves the model throughout."""
    name = f"cuda-oom-{reload_minutes}m-{'peer' if ready_peer else 'alone'}"
    tl = Timeline(name, 15, 25, note=f"CUDA OOM, reload in {reload_minutes} min")
    f = Fleet(tl)
    oom = 240.0
    back = oom + 60 * reload_minutes

    def up(s: float) -> bool:
        return not oom <= s < back

    def engine_level(s: float) -> tuple[int, str]:
        if s < oom:
            return 0, "ok"
        if s < oom + 15:
            return 3, "allocator_oom"  # the hand-off counted the OOM; the engine is going
        return (-1, "blind") if s < back else (0, "ok")

    def gpu_level(s: float) -> tuple[int, str]:
        return (3, "allocator_oom") if oom <= s < oom + 120 else (0, "ok")

    exp = f.exporter(1)
    f.gpu(exp, gpu_level)
    f.engine(exp, "llama-a", up, engine_level)
    rank = {**f.L.rank, **exp, "Hostname": exp["instance"], "target": "llama-a"}
    # the dying process's last hand-off counts the OOM; stale 30 s later, it leaves
    f.add(
        "oomguard_allocator_ooms_total",
        {**rank, "pid": "4242"},
        lambda s: None if s >= oom + 30 else (1 if s >= oom else 0),
    )
    f.add(
        "oomguard_allocator_ooms_total", {**rank, "pid": "5151"}, lambda s: 0 if s >= back else None
    )
    f.add(
        "oomguard_incidents_total",
        {
            **exp,
            "Hostname": exp["instance"],
            "target": "llama-a",
            "engine": "0",
            "type": "under_load",
        },
        lambda s: 1 if s >= oom + 15 else None,
    )
    f.target("llama-a", lambda s: "held" if oom + 15 <= s < back else "serving")
    rt = {**f.rem, "target": "llama-a"}
    f.counter(
        "oomguard_remediator_reconcile_errors_total", rt, lambda s: 1 if oom + 15 <= s < back else 0
    )
    f.counter(
        "oomguard_remediator_actions_total",
        {**rt, "action": "lower_cap", "result": "failed"},
        f.steps_of(lambda s: 1 if s == oom else 0),
    )
    if ready_peer:
        peer = f.exporter(2)
        f.gpu(peer, lambda s: (0, "ok"))
        f.engine(peer, "llama-b", lambda s: True, lambda s: (0, "ok"))
        f.target("llama-b", lambda s: "serving")
    else:
        # MemoryCritical's drain refused: the model's only engine (safety.py); capped instead,
        # and RemediationLimited pages for it (one engine: nothing else relieves it), joining
        # the OOM's pager incident: the same model
        f.counter(
            "oomguard_remediator_safety_limited_total",
            {**rt, "limit": "single_replica"},
            f.steps_of(lambda s: 1 if s == oom else 0),
        )
    return tl


def fragmentation_creep(replicas: int) -> Timeline:
    """An engine's allocator fragments (reserved - allocated grows 4 GiB in 80 minutes); the
    level climbs to caution at 30m, pressure at 40m, critical at 50m. The remediator caps at
    40m30s, and at 50m caps lower instead of draining (the fallback): with two replicas because
    the other one drains already (`disruption_budget`), with one because it is the model's only
    engine (`single_replica`, which pages: a single box). Requests queue behind the cap from
    51m."""
    name = "fragmentation-creep" + ("" if replicas > 1 else "-one-engine")
    tl = Timeline(name, 30, 80, note=f"fragmentation creep, {replicas} replica(s)")
    f = Fleet(tl)
    m = 60.0

    def level(s: float) -> tuple[int, str]:
        if s < 30 * m:
            return 0, "ok"
        if s < 40 * m:
            return 1, "headroom_caution"
        if s < 50 * m:
            return 2, "headroom_low"
        return 3, "headroom_exhausted"

    exp = f.exporter(1)
    f.gpu(exp, level)
    f.engine(exp, "llama-a", lambda s: True, level, waiting=lambda s: 25 if s >= 51 * m else 0)
    rank = {**f.L.rank, **exp, "Hostname": exp["instance"], "target": "llama-a"}
    f.add("oomguard_allocator_allocated_bytes", rank, lambda s: 18 * GIB)
    f.add("oomguard_allocator_reserved_bytes", rank, lambda s: 20 * GIB + s / (80 * m) * 4 * GIB)
    f.add("oomguard_allocator_ooms_total", rank, lambda s: 0)

    def cap(s: float) -> float:
        return 64 if s < 40.5 * m else 48 if s < 50 * m else 24

    f.target("llama-a", lambda s: "capped" if s >= 40.5 * m else "serving", cap)
    rt = {**f.rem, "target": "llama-a"}
    f.counter(
        "oomguard_remediator_actions_total",
        {**rt, "action": "lower_cap", "result": "ok"},
        f.steps_of(lambda s: 1 if s in (40.5 * m, 50 * m) else 0),
    )
    f.counter(
        "oomguard_remediator_safety_limited_total",
        {**rt, "limit": "disruption_budget" if replicas > 1 else "single_replica"},
        f.steps_of(lambda s: 1 if s == 50 * m else 0),
    )
    if replicas > 1:
        # the other replica, on another node, drained (a rollout, its own memory) from 45m
        peer = f.exporter(2)
        f.gpu(peer, lambda s: (0, "ok"))
        f.engine(peer, "llama-b", lambda s: True, lambda s: (0, "ok"))
        f.target("llama-b", lambda s: "draining" if s >= 45 * m else "serving")
    return tl


def slo_burn() -> Timeline:
    """A newly deployed model fails 2 % of its requests for 30 minutes, then recovers."""
    tl = Timeline("slo-burn-2pct", 15, 60, note="2 % errors for 30 min")
    f = Fleet(tl)
    exp = f.exporter(1)
    f.gpu(exp, lambda s: (0, "ok"))
    f.target("llama-a", lambda s: "serving")
    engine_labels = f.engine(exp, "llama-a", lambda s: True, lambda s: (0, "ok"))
    del engine_labels
    pod = {**f.L.vllm, **f.cluster, "pod": "llama-a-pod", "model_name": MODEL, "engine": "0"}
    # replace the healthy error counter with the burning one
    del tl.series[sel("vllm:request_success_total", {**pod, "finished_reason": "error"})]
    del tl.series[sel("vllm:request_success_total", {**pod, "finished_reason": "stop"})]
    f.counter(
        "vllm:request_success_total",
        {**pod, "finished_reason": "error"},
        lambda s: 0.2 if s < 1800 else 0,
    )
    f.counter(
        "vllm:request_success_total",
        {**pod, "finished_reason": "stop"},
        lambda s: 9.8 if s < 1800 else 10,
    )
    return tl


def timelines() -> list[Timeline]:
    return [
        cuda_oom(3, False),
        cuda_oom(8, False),
        cuda_oom(3, True),
        cuda_oom(8, True),
        fragmentation_creep(2),
        fragmentation_creep(1),
        slo_burn(),
    ]
