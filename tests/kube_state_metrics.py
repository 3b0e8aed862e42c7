"""The kube-state-metrics series oomguard's rules read, with their labels.

Source: kube-state-metrics v2 documentation (docs/daemonset-metrics.md, docs/node-metrics.md,
docs/pod-metrics.md in kubernetes/kube-state-metrics): every DaemonSet series carries `namespace`
and `daemonset`; `kube_node_status_capacity` carries `node`, `resource` (sanitised:
`nvidia.com/gpu` is `nvidia_com_gpu`) and `unit`; container status series carry `namespace`,
`pod`, `uid` and `container`. kube-prometheus and kube-prometheus-stack scrape it with
honorLabels, so these labels reach Prometheus as they are.
"""

from __future__ import annotations

_DAEMONSET = frozenset({"namespace", "daemonset"})

KSM_LABELS: dict[str, frozenset[str]] = {
    "kube_daemonset_status_current_number_scheduled": _DAEMONSET,
    "kube_daemonset_status_desired_number_scheduled": _DAEMONSET,
    "kube_daemonset_status_number_available": _DAEMONSET,
    "kube_daemonset_status_number_misscheduled": _DAEMONSET,
    "kube_daemonset_status_updated_number_scheduled": _DAEMONSET,
    "kube_node_status_capacity": frozenset({"node", "resource", "unit"}),
    "kube_pod_container_status_restarts_total": frozenset({"namespace", "pod", "uid", "container"}),
}
