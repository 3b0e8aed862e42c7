"""Targets discovered from Kubernetes pods, with the static allowlist's guarantees.

A pod is a target when it is in one of the configured namespaces, matches the label selector,
runs, and has an IP. Its address is the pod IP the API server reports and the plugin port (the
pod's `oomguard.io/plugin-port` annotation, or the configured port); its plugin token is the
configured token file, or one of the configured Secrets (mounted as files) that the pod's
`oomguard.io/plugin-token-secret` annotation names: an annotation can choose among the Secrets
the operator listed, never name another one, so a pod cannot make the remediator send it some
other Secret's token. Alerts still only select among these targets by labels (by default
`instance`, which the exporter's alerts set to the node name, against the pod's node); they never
supply an address. The address is the pod's own, ready or not: a drained engine answers its
readiness probe with 503 and leaves its Service, and the remediator must still read and resume it.

A target's name is the engine's one name, the `target` label of the exporter's series that the
rules join the remediator's on: the pod's `oomguard.io/target` label (the generated vLLM example
sets it, and OOMGUARD_TARGET from it), or with `target_name: node` the pod's node (one engine per
GPU node, an exporter started with `--vllm=$(NODE_NAME)=...`). A pod without that label is named
`<namespace>:<pod>`, which no exporter series carries. Two pods claiming one name are neither a
target: an alert for that engine could not tell them apart.

Each namespace is listed once, then watched from the list's resourceVersion through the official
client (no polling of the whole list); a watch that ends is resumed from the last
resourceVersion seen. A 410 Gone (the version was compacted away) lists again, and so does any
other failure of a watch: an event the client cannot read (it rejects a field) would otherwise
be requested again from the same version forever, and every pod added or deleted after it would
be missed. Each namespace's loop runs in a supervised thread (supervised.py).

Every call has a client-side timeout (the client has none by default): a watch whose connection
vanished without a reset (an API server failover behind a load balancer) waited forever, so pods
added later were never targets and a deleted pod stayed one, while /healthz said 200. A list
gets LIST_TIMEOUT; a watch may be silent until the server ends it after `watch_seconds`, so its
reads wait that long and WATCH_SLACK more. The loop beats at every event and every new request;
one that stops beating is reported stuck.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from oomguard.digits import decimal
from oomguard.remediator.targets import TargetConfig
from oomguard.supervised import Supervised

if TYPE_CHECKING:
    from urllib3 import BaseHTTPResponse

log = logging.getLogger("oomguard.remediator.discovery")

PORT_ANNOTATION = "oomguard.io/plugin-port"
TARGET_LABEL = "oomguard.io/target"
_TARGET_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # the exporter's target names
TOKEN_ANNOTATION = "oomguard.io/plugin-token-secret"
MODEL_ANNOTATION = "oomguard.io/model"
CONNECT_TIMEOUT = 5.0
LIST_TIMEOUT = 60.0  # a list of every selected pod of one namespace
WATCH_SLACK = 30.0  # beyond watch_seconds, before a silent watch is given up
PodField = Literal["namespace", "pod", "node", "target"]


def _default_match() -> dict[str, PodField]:
    return {"instance": "node"}


class DiscoveryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespaces: list[str] = Field(
        min_length=1, description="Namespaces whose pods may be targets (a Role in each)."
    )
    label_selector: str = Field(
        "oomguard.io/remediate=true", min_length=1, description="Pods that may be targets."
    )
    port: int = Field(8000, ge=1, le=65535, description="Plugin (vLLM server) port.")
    scheme: Literal["http", "https"] = "http"
    token_file: str | None = Field(None, description="Default plugin token (a mounted Secret).")
    token_secrets: dict[str, str] = Field(
        default_factory=dict,
        description="Secret name -> its mounted file: the only Secrets a pod's "
        f"{TOKEN_ANNOTATION} annotation may name.",
    )
    model_label: str = Field(
        "app.kubernetes.io/name",
        description=f"Pod label giving the model (or the {MODEL_ANNOTATION} annotation).",
    )
    match: dict[str, PodField] = Field(
        default_factory=_default_match,
        description="Alert label -> pod field that selects the pod. Default: the node, as "
        "the exporter's alerts name it in `instance` (one engine per GPU node; two on a node "
        "make its alerts ambiguous, and they act on neither); {namespace: namespace, pod: pod} "
        "for alerts on series scraped from the vLLM pods themselves.",
    )
    watch_seconds: int = Field(300, ge=1, description="Each watch request's server timeout.")
    target_name: Literal["label", "node"] = Field(
        "label",
        description=f"How a pod's target is named, as the exporter names its engine: the pod's "
        f"{TARGET_LABEL} label (pods without it: <namespace>:<pod>), or its node's name.",
    )


def _name(namespace: str, pod: str) -> str:
    return f"{namespace}:{pod}"  # target names allow ':'; pod and namespace names do not


def _target_name(
    namespace: str, pod: str, node: str, labels: Mapping[str, Any], config: DiscoveryConfig
) -> str | None:
    """The engine's name (module docstring), or None when the pod cannot be named."""
    if config.target_name == "node":
        if not _TARGET_NAME.match(node):
            log.warning("pod %s/%s has no usable node name %r: not a target", namespace, pod, node)
            return None
        return node
    if TARGET_LABEL not in labels:
        return _name(namespace, pod)
    value = str(labels[TARGET_LABEL])
    if not _TARGET_NAME.match(value):
        log.warning("pod %s/%s: bad %s %r: not a target", namespace, pod, TARGET_LABEL, value)
        return None
    return value


def pod_target(pod: Mapping[str, Any], config: DiscoveryConfig) -> TargetConfig | None:
    """The target a pod is, or None (not running, no IP, bad annotations, or deleted)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    namespace, name = meta.get("namespace"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        return None
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    pod_ip = status.get("podIP")
    if not isinstance(pod_ip, str):
        return None
    try:  # the API server's podIP, and only an IP address: never a host name or a path
        ip = str(ipaddress.ip_address(pod_ip))
    except ValueError:
        return None
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    port = config.port
    if PORT_ANNOTATION in annotations:
        raw = str(annotations[PORT_ANNOTATION])
        number = decimal(raw)
        if number is None or not 1 <= number <= 65535:
            log.warning("pod %s/%s: bad %s %r: not a target", namespace, name, PORT_ANNOTATION, raw)
            return None
        port = int(raw)
    token_file = config.token_file
    if TOKEN_ANNOTATION in annotations:
        secret = str(annotations[TOKEN_ANNOTATION])
        if secret not in config.token_secrets:
            log.warning(
                "pod %s/%s names Secret %r, which is not in discovery.token_secrets: not a target",
                namespace,
                name,
                secret,
            )
            return None
        token_file = config.token_secrets[secret]
    host = f"[{ip}]" if ":" in ip else ip
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    target = _target_name(namespace, name, node, labels, config)
    if target is None:
        return None
    fields = {"namespace": namespace, "pod": name, "node": node, "target": target}
    model = annotations.get(MODEL_ANNOTATION) or labels.get(config.model_label) or ""
    try:
        return TargetConfig(
            name=target,
            url=f"{config.scheme}://{host}:{port}",
            model=str(model),
            token_file=token_file,
            match={label: fields[field] for label, field in config.match.items()},
        )
    except ValueError as exc:  # e.g. a pod IP that is no address
        log.warning("pod %s/%s is not a valid target: %s", namespace, name, exc)
        return None


class PodDiscovery:
    """Watches the configured namespaces; `targets()` is the discovered allowlist now and
    `version` changes whenever it does."""

    def __init__(
        self,
        config: DiscoveryConfig,
        api_client: Any,
        on_change: Callable[[], None] = lambda: None,
        backoff: float = 1.0,
        on_death: Callable[[str], None] = lambda name: None,
    ) -> None:
        from kubernetes import client

        self.config = config
        self.core = client.CoreV1Api(api_client)
        self.on_change = on_change
        self.backoff = backoff
        self.version = 0
        self.lists = 0  # full lists made (at start, and after a 410 Gone)
        self._pods: dict[str, dict[str, TargetConfig | None]] = {ns: {} for ns in config.namespaces}
        self._synced = {ns: threading.Event() for ns in config.namespaces}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watches: list[Any] = []
        quiet = config.watch_seconds + WATCH_SLACK + CONNECT_TIMEOUT
        self.threads = [
            Supervised(
                f"discovery-{ns}",
                functools.partial(self._run, ns),
                self._stop,
                on_death,
                stall_after=2 * (quiet + LIST_TIMEOUT + CONNECT_TIMEOUT) + backoff,
            )
            for ns in config.namespaces
        ]
        self._beats = {ns: t.beat for ns, t in zip(config.namespaces, self.threads, strict=True)}
        self._started = False

    @classmethod
    def from_environment(
        cls, config: DiscoveryConfig, on_death: Callable[[str], None] = lambda name: None
    ) -> PodDiscovery:
        from kubernetes import client
        from kubernetes import config as kube_config

        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        return cls(config, client.ApiClient(), on_death=on_death)

    def targets(self) -> list[TargetConfig]:
        with self._lock:
            found = [t for pods in self._pods.values() for t in pods.values() if t is not None]
        names = [t.name for t in found]
        claimed = {n for n in names if names.count(n) > 1}
        if claimed:  # an alert for that engine could not tell the pods apart
            log.warning("several pods claim target names %s: none of them is a target", claimed)
        return sorted((t for t in found if t.name not in claimed), key=lambda t: t.name)

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self._synced.values())

    # -- one namespace -------------------------------------------------------------------------
    def _set(self, namespace: str, pods: dict[str, TargetConfig | None], replace: bool) -> None:
        with self._lock:
            before = self._pods[namespace]
            after = dict(pods) if replace else {**before, **pods}
            after = {k: v for k, v in after.items() if v is not None}
            changed = after != before
            self._pods[namespace] = after
            if changed:
                self.version += 1
        if changed:
            self.on_change()

    def _list(self, namespace: str) -> str:
        # _preload_content=False returns urllib3's raw response, not the annotated V1PodList
        r = cast(
            "BaseHTTPResponse",
            self.core.list_namespaced_pod(
                namespace,
                label_selector=self.config.label_selector,
                _preload_content=False,
                _request_timeout=(CONNECT_TIMEOUT, LIST_TIMEOUT),
            ),
        )
        body = json.loads(r.data)
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise ValueError("the pod list is not a list object")
        version = body["metadata"].get("resourceVersion")
        if not isinstance(version, str) or not version:
            raise ValueError("the pod list carries no resourceVersion")
        self.lists += 1
        items = body.get("items")
        pods = {
            item["metadata"]["name"]: _target(item, self.config)
            for item in (items if isinstance(items, list) else [])
            if isinstance(item, dict)
            and isinstance(item.get("metadata"), dict)
            and isinstance(item["metadata"].get("name"), str)
        }
        self._set(namespace, pods, replace=True)
        self._synced[namespace].set()
        return version

    def _watch(self, namespace: str, version: str) -> str:
        """Watch from `version` until the server ends the request; the last version seen."""
        from kubernetes import watch

        w = watch.Watch()
        self._watches.append(w)
        try:
            for event in w.stream(
                self.core.list_namespaced_pod,
                namespace,
                label_selector=self.config.label_selector,
                resource_version=version,
                timeout_seconds=self.config.watch_seconds,
                allow_watch_bookmarks=True,
                _request_timeout=(CONNECT_TIMEOUT, self.config.watch_seconds + WATCH_SLACK),
            ):
                self._beats[namespace]()
                if self._stop.is_set():
                    break
                kind, obj = event.get("type"), event.get("raw_object")
                meta = obj.get("metadata") if isinstance(obj, dict) else None
                if not isinstance(meta, dict):
                    continue
                version = str(meta.get("resourceVersion") or version)
                name = meta.get("name")
                if kind == "BOOKMARK" or not isinstance(name, str):
                    continue
                target = None if kind == "DELETED" else _target(obj, self.config)
                self._set(namespace, {name: target}, replace=False)
        finally:
            self._watches.remove(w)
        return version

    def _run(self, namespace: str) -> None:
        from kubernetes.client.exceptions import ApiException

        version: str | None = None
        while not self._stop.is_set():
            self._beats[namespace]()
            try:
                if version is None:
                    version = self._list(namespace)
                version = self._watch(namespace, version)
            except ApiException as exc:
                if exc.status == 410:  # compacted away: list again, then watch from there
                    log.info("pods in %s: resourceVersion %s gone, listing", namespace, version)
                    version = None
                    continue
                # list again: the watch may have stopped at an event it cannot get past
                log.warning("pods in %s: %s (listing again; targets kept)", namespace, exc)
                version = None
                self._stop.wait(self.backoff)
            except Exception as exc:  # unreachable API, bad answer: keep what is known
                log.warning("pods in %s: %s (listing again; targets kept)", namespace, exc)
                version = None
                self._stop.wait(self.backoff)

    def start(self) -> None:
        self._started = True
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for w in list(self._watches):
            w.stop()
        if self._started:
            for t in self.threads:
                t.join(timeout=5)


def _target(pod: Mapping[str, Any], config: DiscoveryConfig) -> TargetConfig | None:
    """`pod_target`, for a pod from the API: one of a shape nothing sends is not a target."""
    try:
        return pod_target(pod, config)
    except Exception as exc:  # e.g. annotations that are a list: the API server's input, too
        log.warning("a pod the API listed cannot be read (not a target): %s", exc)
        return None
