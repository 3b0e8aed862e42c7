"""Kubernetes' and prometheus-operator's rules, as far as oomguard's manifests meet them, for the
conformance tests (tests/test_kube_conformance.py, tests/test_operator_scrape.py).

Read from the upstream sources, not guessed; where each rule comes from:

- Label selectors: k8s.io/apimachinery pkg/apis/meta/v1 LabelSelector ("An empty label selector
  matches all objects. A null label selector matches no objects."; matchLabels and
  matchExpressions ANDed; In/NotIn/Exists/DoesNotExist, NotIn and DoesNotExist also true when the
  key is absent) and LabelSelectorAsSelector (nil -> labels.Nothing(), empty -> Everything()).
- Which monitors, rules and AlertmanagerConfigs an operator picks, prometheus-operator v0.92.0:
  pkg/operator/operator.go SelectNamespacesFromCache (a nil namespace selector = the Prometheus'
  own namespace only), pkg/prometheus/resource_selector.go selectObjects (the resource selector
  through LabelSelectorAsSelector), pkg/prometheus/server/rules.go (rules alike),
  pkg/alertmanager/operator.go selectAlertmanagerConfigs (the same two rules for
  AlertmanagerConfigs), pkg/alertmanager/amcfg.go (receivers renamed <ns>/<name>/<receiver>;
  the default matcher strategy OnNamespace adds namespace="<AlertmanagerConfig's namespace>" to
  its top route and to both sides of its inhibit rules; the top route gets continue: true).
- The scrape config of a PodMonitor, prometheus-operator v0.92.0 pkg/prometheus/promcfg.go
  generatePodMonitorConfig: job_name podMonitor/<ns>/<name>/<i>; honor_labels as the endpoint
  says; kubernetes_sd_configs role pod in the monitor's namespace (getNamespacesFromNamespace
  Selector); relabelings in this order: job -> __tmp_prometheus_job_name (initRelabelings), drop
  Failed/Succeeded pods (generateRunningFilter), keep on each matchLabels pair
  (label;labelpresent), keep on the port name, namespace/container/pod from the meta labels, job
  = <ns>/<name>, endpoint = the port name, the endpoint's own relabelings, then the shard filter
  (appendShardingRelabelingWithLabel: __address__ hashed into __tmp_hash, keep $(SHARD), which
  the config reloader sets to 0 on a one-shard Prometheus).
- Pod discovery's labels, Prometheus discovery/kubernetes/pod.go (one target per container port,
  __meta_kubernetes_pod_* and _labelpresent_ with sanitized names).
- Relabelling, Prometheus model/relabel/relabel.go: the regex anchored at both ends, source
  labels joined by ';', replace/keep/drop/hashmod/labelmap/labeldrop/labelkeep, a replace to an
  empty value removes the label; scrape/target.go: job, __address__, __metrics_path__, __scheme__
  set before relabelling, `instance` defaults to __address__, `__` labels dropped after.
- RBAC, Kubernetes plugin/pkg/auth/authorizer/rbac (rbac.go, RuleAllows in
  pkg/apis/rbac/v1/evaluation_helpers.go, appliesTo in pkg/registry/rbac/validation/rule.go): a
  RoleBinding grants its Role's or ClusterRole's rules in its own namespace, a ClusterRoleBinding
  everywhere; a subject is a ServiceAccount by name and namespace, the groups
  system:serviceaccounts and system:serviceaccounts:<ns>, or the user
  system:serviceaccount:<ns>:<name>; "*" matches any group, resource or verb; resourceNames
  limit a rule to those objects (so it grants no list or watch of all).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

# -- label selectors ---------------------------------------------------------------------------


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False  # null: nothing
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req["key"], req["operator"], req.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in {"In", "NotIn", "Exists", "DoesNotExist"}:
            raise ValueError(f"selector operator {op!r}")
    return True


def namespace_labels(name: str) -> dict[str, str]:
    """A namespace's labels as the API server sets them (kubernetes.io/metadata.name, 1.22+)."""
    return {"kubernetes.io/metadata.name": name}


def selects(
    owner_namespace: str,
    selector: Mapping[str, Any] | None,
    namespace_selector: Mapping[str, Any] | None,
    obj: Mapping[str, Any],
) -> bool:
    """Whether a Prometheus/Alertmanager in `owner_namespace` with these two selectors picks the
    object (a PodMonitor, PrometheusRule or AlertmanagerConfig)."""
    meta = obj["metadata"]
    namespace = meta.get("namespace", "default")
    if namespace_selector is None:
        in_namespace = namespace == owner_namespace
    else:
        in_namespace = selector_matches(namespace_selector, namespace_labels(namespace))
    return in_namespace and selector_matches(selector, meta.get("labels") or {})


# -- RBAC --------------------------------------------------------------------------------------


class Rbac:
    def __init__(self, objects: Iterable[Mapping[str, Any]]) -> None:
        objs = [o for o in objects if o.get("apiVersion", "").startswith("rbac.authorization")]
        self.roles = {
            (o["metadata"].get("namespace"), o["metadata"]["name"]): o
            for o in objs
            if o["kind"] == "Role"
        }
        self.cluster_roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRole"}
        self.bindings = [o for o in objs if o["kind"] in {"RoleBinding", "ClusterRoleBinding"}]

    @staticmethod
    def _subject(subject: Mapping[str, Any], sa_namespace: str, sa_name: str) -> bool:
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "ServiceAccount":
            return name == sa_name and subject.get("namespace") == sa_namespace
        if kind == "User":
            return name == f"system:serviceaccount:{sa_namespace}:{sa_name}"
        if kind == "Group":
            return name in {
                "system:serviceaccounts",
                f"system:serviceaccounts:{sa_namespace}",
                "system:authenticated",
            }
        return False

    @staticmethod
    def _rule_allows(rule: Mapping[str, Any], verb: str, group: str, resource: str) -> bool:
        if "nonResourceURLs" in rule:
            return False
        return (
            bool({verb, "*"} & set(rule.get("verbs") or []))
            and bool({group, "*"} & set(rule.get("apiGroups") or []))
            and bool({resource, "*"} & set(rule.get("resources") or []))
            and not rule.get("resourceNames")  # names only: no list/watch of all, no get of any
        )

    def allows(
        self,
        sa: tuple[str, str],
        verb: str,
        group: str,
        resource: str,
        namespace: str,
    ) -> bool:
        """Whether ServiceAccount `sa` = (namespace, name) may `verb` `resource` in `namespace`
        (every object of it, as an informer's list and watch need)."""
        for b in self.bindings:
            if not any(self._subject(s, *sa) for s in b.get("subjects") or []):
                continue
            bound_in = b["metadata"].get("namespace")
            if b["kind"] == "RoleBinding" and bound_in != namespace:
                continue
            ref = b["roleRef"]
            if ref["kind"] == "Role":
                if b["kind"] != "RoleBinding":
                    continue
                role = self.roles.get((bound_in, ref["name"]))
            else:
                role = self.cluster_roles.get(ref["name"])
            if role and any(
                self._rule_allows(r, verb, group, resource) for r in role.get("rules") or []
            ):
                return True
        return False


# -- pods as discovery sees them ---------------------------------------------------------------
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def sanitize(name: str) -> str:
    return _INVALID.sub("_", name)


def pod_of(
    workload: Mapping[str, Any],
    name: str,
    ip: str,
    node: str,
    ready: bool = True,
    phase: str = "Running",
    ports: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """A pod the API server would show for a Deployment's or DaemonSet's template (`ports`
    maps a template's containerPort to another, for a test that listens elsewhere)."""
    template = workload["spec"]["template"]
    spec = dict(template["spec"])
    spec["nodeName"] = node
    containers = []
    for c in spec["containers"]:
        c = dict(c)
        c["ports"] = [
            {
                **p,
                "containerPort": (ports or {}).get(p["containerPort"], p["containerPort"]),
                "protocol": p.get("protocol", "TCP"),
            }
            for p in c.get("ports") or []
        ]
        containers.append(c)
    spec["containers"] = containers
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": workload["metadata"]["namespace"],
            "labels": dict(template["metadata"].get("labels") or {}),
            "annotations": dict(template["metadata"].get("annotations") or {}),
        },
        "spec": spec,
        "status": {
            "phase": phase,
            "podIP": ip,
            "hostIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def sd_targets(pod: Mapping[str, Any]) -> list[dict[str, str]]:
    """Prometheus's kubernetes_sd role pod: one label set per container port (group labels and
    target labels merged)."""
    meta, status, spec = pod["metadata"], pod["status"], pod["spec"]
    if not status.get("podIP"):
        return []
    ready = next(
        (c["status"].lower() for c in status.get("conditions") or [] if c["type"] == "Ready"),
        "unknown",
    )
    group = {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": status["podIP"],
        "__meta_kubernetes_pod_ready": ready,
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
        "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
        "__meta_kubernetes_pod_uid": meta.get("uid", ""),
    }
    for k, v in (meta.get("labels") or {}).items():
        group[f"__meta_kubernetes_pod_label_{sanitize(k)}"] = v
        group[f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}"] = "true"
    for k, v in (meta.get("annotations") or {}).items():
        group[f"__meta_kubernetes_pod_annotation_{sanitize(k)}"] = v
        group[f"__meta_kubernetes_pod_annotationpresent_{sanitize(k)}"] = "true"
    out = []
    for c in spec["containers"]:
        for p in c.get("ports") or []:
            out.append(
                {
                    **group,
                    "__address__": f"{status['podIP']}:{p['containerPort']}",
                    "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
                    "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                    "__meta_kubernetes_pod_container_port_protocol": p.get("protocol", "TCP"),
                }
            )
        if not c.get("ports"):
            out.append(
                {
                    **group,
                    "__address__": status["podIP"],
                    "__meta_kubernetes_pod_container_name": c["name"],
                }
            )
    return out


# -- the operator's scrape config for a PodMonitor ---------------------------------------------
_ENDPOINT_FIELDS = {
    "port",
    "interval",
    "relabelings",
    "honorLabels",
    "path",
    "scheme",
    "scrapeTimeout",
    "metricRelabelings",
}
_MONITOR_FIELDS = {"selector", "podMetricsEndpoints", "namespaceSelector"}


def _relabel_yaml(r: Mapping[str, Any]) -> dict[str, Any]:
    """generateRelabelConfig: the CR's camelCase fields, action lowercased."""
    out: dict[str, Any] = {}
    if r.get("sourceLabels"):
        out["source_labels"] = list(r["sourceLabels"])
    if "separator" in r:
        out["separator"] = r["separator"]
    if r.get("targetLabel"):
        out["target_label"] = r["targetLabel"]
    if r.get("regex"):
        out["regex"] = r["regex"]
    if r.get("modulus"):
        out["modulus"] = r["modulus"]
    if "replacement" in r:
        out["replacement"] = r["replacement"]
    if r.get("action"):
        out["action"] = r["action"].lower()
    return out


def pod_monitor_scrape_configs(monitor: Mapping[str, Any], shard: int = 0) -> list[dict[str, Any]]:
    """What prometheus-operator v0.92.0 writes for a PodMonitor (one job per endpoint), on a
    one-shard Prometheus without scrape classes, enforced labels or attach_metadata; a field it
    would act on that is not modelled here fails loudly."""
    meta, spec = monitor["metadata"], monitor["spec"]
    namespace, name = meta["namespace"], meta["name"]
    if set(spec) - _MONITOR_FIELDS:
        raise ValueError(f"PodMonitor field not modelled: {set(spec) - _MONITOR_FIELDS}")
    if spec["selector"].get("matchExpressions"):
        raise ValueError("matchExpressions in a PodMonitor selector: not modelled")
    ns_sel = spec.get("namespaceSelector") or {}
    if ns_sel.get("any"):
        raise ValueError("namespaceSelector any: not modelled")
    namespaces = ns_sel.get("matchNames") or [namespace]
    out = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        if set(ep) - _ENDPOINT_FIELDS:
            raise ValueError(f"endpoint field not modelled: {set(ep) - _ENDPOINT_FIELDS}")
        relabel: list[dict[str, Any]] = [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            {
                "action": "drop",
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
            },
        ]
        for k in sorted(spec["selector"].get("matchLabels") or {}):
            relabel.append(
                {
                    "action": "keep",
                    "source_labels": [
                        f"__meta_kubernetes_pod_label_{sanitize(k)}",
                        f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}",
                    ],
                    "regex": f"({spec['selector']['matchLabels'][k]});true",
                }
            )
        if ep.get("port"):
            relabel.append(
                {
                    "action": "keep",
                    "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                    "regex": ep["port"],
                }
            )
        relabel += [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {
                "source_labels": ["__meta_kubernetes_pod_container_name"],
                "target_label": "container",
            },
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{namespace}/{name}"},
        ]
        if ep.get("port"):
            relabel.append({"target_label": "endpoint", "replacement": ep["port"]})
        relabel += [_relabel_yaml(r) for r in ep.get("relabelings") or []]
        relabel += [
            {
                "source_labels": ["__address__", "__tmp_hash"],
                "target_label": "__tmp_hash",
                "regex": "(.+);",
                "replacement": "$1",
                "action": "replace",
            },
            {
                "source_labels": ["__tmp_hash"],
                "target_label": "__tmp_hash",
                "modulus": 1,
                "action": "hashmod",
            },
            {
                "source_labels": ["__tmp_hash", "__tmp_disable_sharding"],
                # the reloader substitutes $(SHARD)
                "regex": f"{shard};|.+;.+",
                "action": "keep",
            },
        ]
        config: dict[str, Any] = {
            "job_name": f"podMonitor/{namespace}/{name}/{i}",
            "honor_labels": bool(ep.get("honorLabels", False)),
            "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": namespaces}}],
        }
        for field, key in (
            ("interval", "scrape_interval"),
            ("scrapeTimeout", "scrape_timeout"),
            ("path", "metrics_path"),
            ("scheme", "scheme"),
        ):
            if ep.get(field):
                config[key] = ep[field]
        config["relabel_configs"] = relabel
        if ep.get("metricRelabelings"):
            config["metric_relabel_configs"] = [_relabel_yaml(r) for r in ep["metricRelabelings"]]
        out.append(config)
    return out


# -- Prometheus relabelling --------------------------------------------------------------------
_GROUP = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def _expand(template: str, m: re.Match[str]) -> str:
    def one(g: re.Match[str]) -> str:
        ref = g.group(1) or g.group(2)
        try:
            value = m.group(int(ref)) if ref.isdigit() else m.group(ref)
        except IndexError:  # no such group: Go's Expand gives ""
            return ""
        return value or ""

    return _GROUP.sub(one, template)


def relabel(labels: Mapping[str, str], configs: list[Mapping[str, Any]]) -> dict[str, str] | None:
    """Prometheus's relabelling of one label set; None when a keep/drop drops it."""
    lset = dict(labels)
    for c in configs:
        action = c.get("action", "replace")
        regex = re.compile(f"^(?:{c.get('regex', '(.*)')})$")
        value = c.get("separator", ";").join(lset.get(s, "") for s in c.get("source_labels", []))
        if action == "replace":
            m = regex.match(value)
            if m:
                target = _expand(c["target_label"], m)
                new = _expand(str(c.get("replacement", "$1")), m)
                if new:
                    lset[target] = new
                else:
                    lset.pop(target, None)
        elif action == "keep":
            if not regex.match(value):
                return None
        elif action == "drop":
            if regex.match(value):
                return None
        elif action == "hashmod":
            digest = hashlib.md5(value.encode()).digest()
            lset[c["target_label"]] = str(int.from_bytes(digest[8:], "big") % int(c["modulus"]))
        elif action == "labelmap":
            for k, v in list(lset.items()):
                m = regex.match(k)
                if m:
                    lset[_expand(str(c.get("replacement", "$1")), m)] = v
        elif action == "labeldrop":
            lset = {k: v for k, v in lset.items() if not regex.match(k)}
        elif action == "labelkeep":
            lset = {k: v for k, v in lset.items() if regex.match(k)}
        else:
            raise ValueError(f"relabel action not modelled: {action}")
    return lset


def target_labels(
    config: Mapping[str, Any], discovered: Mapping[str, str]
) -> dict[str, str] | None:
    """The labels Prometheus gives a discovered target of this scrape config (None: dropped)."""
    base = {
        "job": config["job_name"],
        "__metrics_path__": config.get("metrics_path", "/metrics"),
        "__scheme__": config.get("scheme", "http"),
        "__scrape_interval__": config.get("scrape_interval", "1m"),
        "__scrape_timeout__": config.get("scrape_timeout", "10s"),
        **discovered,
    }
    out = relabel(base, config.get("relabel_configs", []))
    if out is None:
        return None
    out.setdefault("instance", out["__address__"])
    return {k: v for k, v in out.items() if not k.startswith("__")}


def series_labels(
    target: Mapping[str, str], exposed: Mapping[str, str], honor: bool
) -> dict[str, str]:
    """A scraped series' labels: with honor_labels the series' own win, without them a clash
    renames the series' label to exported_<name> (scrape/scrape.go mutateSampleLabels)."""
    out = dict(exposed)
    for k, v in target.items():
        if k in out and not honor:
            out[f"exported_{k}"] = out[k]
            out[k] = v
        elif k not in out or not honor:
            out[k] = v
    return {k: v for k, v in out.items() if v != ""}


# -- the Alertmanager configuration the operator builds ----------------------------------------
def _matcher(m: Mapping[str, Any]) -> str:
    """monitoringv1alpha1.Matcher.String(): name, match type (= by default), quoted value."""
    value = str(m["value"]).replace("\\", "\\\\").replace('"', '\\"')
    return f'{m["name"]}{m.get("matchType", "=")}"{value}"'


def _amc_route(route: Mapping[str, Any], ns: str, name: str) -> dict[str, Any]:
    keys = {
        "groupBy": "group_by",
        "groupWait": "group_wait",
        "groupInterval": "group_interval",
        "repeatInterval": "repeat_interval",
        "continue": "continue",
    }
    out: dict[str, Any] = {"receiver": f"{ns}/{name}/{route['receiver']}"}
    out |= {plain: route[camel] for camel, plain in keys.items() if camel in route}
    if route.get("matchers"):
        out["matchers"] = [_matcher(m) for m in route["matchers"]]
    if route.get("routes"):
        out["routes"] = [_amc_route(r, ns, name) for r in route["routes"]]
    return out


def merged_alertmanager_config(
    base: Mapping[str, Any],
    alertmanager: Mapping[str, Any],
    amcs: list[Mapping[str, Any]],
) -> dict[str, Any]:
    """amcfg.go AddAlertmanagerConfigs: each selected AlertmanagerConfig's route (receivers
    renamed <ns>/<name>/<receiver>, the strategy's namespace matcher, continue: true) goes
    before the base routes, in <namespace>/<name> order; its inhibit rules after the base ones.
    Receivers keep their names only (routing, not delivery, is what this reads)."""
    import copy

    config = copy.deepcopy(dict(base))
    config.pop("templates", None)
    strategy = (alertmanager.get("alertmanagerConfigMatcherStrategy") or {}).get(
        "type", "OnNamespace"
    )
    sub_routes = []
    for amc in sorted(amcs, key=lambda a: (a["metadata"]["namespace"], a["metadata"]["name"])):
        ns, name = amc["metadata"]["namespace"], amc["metadata"]["name"]
        enforce = strategy == "OnNamespace" or (
            strategy == "OnNamespaceExceptForAlertmanagerNamespace"
            and ns != alertmanager["namespace"]
        )
        scope = [f'namespace="{ns}"'] if enforce else []
        for rule in amc["spec"].get("inhibitRules") or []:
            source = [_matcher(m) for m in rule.get("sourceMatch") or []]
            target = [_matcher(m) for m in rule.get("targetMatch") or []]
            config.setdefault("inhibit_rules", []).append(
                {
                    "source_matchers": source + [s for s in scope if s not in source],
                    "target_matchers": target + [s for s in scope if s not in target],
                    "equal": list(rule.get("equal") or []),
                }
            )
        if amc["spec"].get("route"):
            route = _amc_route(amc["spec"]["route"], ns, name)
            route["matchers"] = route.get("matchers", []) + scope
            route["continue"] = True
            sub_routes.append(route)
        for r in amc["spec"].get("receivers") or []:
            config.setdefault("receivers", []).append({"name": f"{ns}/{name}/{r['name']}"})
    config["route"]["routes"] = sub_routes + list(config["route"].get("routes") or [])
    return config


# -- Services ----------------------------------------------------------------------------------
def endpoint_ready(service: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether a Service sends traffic (and, headless, its DNS name resolves) to this pod: the
    EndpointSlice controller's podToEndpoint (k8s.io/endpointslice utils.go):
    ready = publishNotReadyAddresses || (pod Ready && not terminating)."""
    spec = service["spec"]
    if service["metadata"]["namespace"] != pod["metadata"]["namespace"]:
        return False
    if not spec.get("selector") or not all(
        pod["metadata"]["labels"].get(k) == v for k, v in spec["selector"].items()
    ):
        return False
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
    terminating = bool(pod["metadata"].get("deletionTimestamp"))
    return bool(spec.get("publishNotReadyAddresses")) or (ready and not terminating)
