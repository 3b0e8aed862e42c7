"""The restart actuator's Kubernetes backend: patch the vLLM container's flags in the named
Deployment or StatefulSet with the official client; the workload's own rolling update replaces
the pod (one at a time, as its strategy says).

Least privilege: it only GETs and PATCHes the one named object (deploy/kubernetes/remediator.yaml
grants exactly that). The patch is a JSON Patch guarded by a `test` of the resourceVersion, so a
concurrent edit by someone else fails the patch instead of being overwritten. The flags as first
seen are kept in the object's annotations, so walk-back knows where to return to.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, cast

from oomguard.engine_env import INITIAL_CAP_ENV
from oomguard.remediator.flags import Flags, apply, read
from oomguard.remediator.restart import FlagView, RestartError
from oomguard.remediator.targets import KubernetesRef

if TYPE_CHECKING:
    from urllib3 import BaseHTTPResponse

ORIGINAL = "oomguard.io/original-flags"
CHANGED_AT = "oomguard.io/flags-changed-at"
REASON = "oomguard.io/restart-reason"
RESTARTED_AT = "oomguard.io/restarted-at"
JSON_PATCH = "application/json-patch+json"


def _escape(key: str) -> str:
    """A map key as a JSON Pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _flags(value: dict[str, Any]) -> Flags:
    return Flags(float(value["gpu_memory_utilization"]), int(value["max_num_seqs"]))


class KubernetesBackend:
    def __init__(self, ref: KubernetesRef, api_client: Any) -> None:
        from kubernetes import client

        self.ref = ref
        self.apps = client.AppsV1Api(api_client)
        self.api_client = api_client

    @classmethod
    def from_environment(cls, ref: KubernetesRef) -> KubernetesBackend:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(ref, client.ApiClient())

    # -- reading -------------------------------------------------------------------------------
    def _get(self) -> dict[str, Any]:

        read = (
            self.apps.read_namespaced_deployment
            if self.ref.kind == "Deployment"
            else self.apps.read_namespaced_stateful_set
        )
        try:
            # raw JSON, not the client's models: what we patch is what the server stored
            # (_preload_content=False returns urllib3's response; the annotations name the model)
            response = cast(
                "BaseHTTPResponse", read(self.ref.name, self.ref.namespace, _preload_content=False)
            )
            obj = json.loads(response.data)
        except Exception as exc:
            raise self._failed("GET", exc) from exc
        if not isinstance(obj, dict) or "spec" not in obj:
            raise RestartError("bad_response", f"{self.ref.kind} {self.ref.name}: not an object")
        return obj

    def _container(self, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        containers = obj["spec"]["template"]["spec"]["containers"]
        for i, c in enumerate(containers):
            if c["name"] == self.ref.container:
                return i, c
        raise RestartError(
            "rejected",
            f"{self.ref.kind} {self.ref.name} has no container {self.ref.container!r}",
        )

    def flags(self) -> FlagView:
        obj = self._get()
        _, container = self._container(obj)
        current = read(list(container.get("args") or []), default_seqs=256)
        annotations = obj["metadata"].get("annotations") or {}
        original = _flags(json.loads(annotations[ORIGINAL])) if ORIGINAL in annotations else current
        return FlagView(original, current, float(annotations.get(CHANGED_AT, 0)))

    # -- restarting ----------------------------------------------------------------------------
    def patch_for(
        self, obj: dict[str, Any], flags: Flags, initial_cap: int | None, reason: str
    ) -> list[dict[str, Any]]:
        """The JSON Patch that sets the flags (and the initial cap) and rolls the pods."""
        i, container = self._container(obj)
        args = list(container.get("args") or [])
        env = [e for e in (container.get("env") or []) if e.get("name") != INITIAL_CAP_ENV]
        if initial_cap is not None:
            env.append({"name": INITIAL_CAP_ENV, "value": str(initial_cap)})
        now = f"{time.time():.3f}"
        annotations = obj["metadata"].get("annotations") or {}
        ours = {CHANGED_AT: now, REASON: reason[:200]}
        if ORIGINAL not in annotations:
            original = read(args, default_seqs=256)
            ours[ORIGINAL] = json.dumps(
                {
                    "gpu_memory_utilization": original.gpu_memory_utilization,
                    "max_num_seqs": original.max_num_seqs,
                }
            )
        base = f"/spec/template/spec/containers/{i}"
        ops: list[dict[str, Any]] = [
            # optimistic concurrency: fail rather than overwrite someone else's edit
            {
                "op": "test",
                "path": "/metadata/resourceVersion",
                "value": obj["metadata"]["resourceVersion"],
            },
            {"op": "add", "path": f"{base}/args", "value": apply(args, flags)},
            {"op": "add", "path": f"{base}/env", "value": env},
        ]
        if obj["metadata"].get("annotations") is None:
            ops.append({"op": "add", "path": "/metadata/annotations", "value": ours})
        else:
            ops += [
                {"op": "add", "path": f"/metadata/annotations/{_escape(k)}", "value": v}
                for k, v in ours.items()
            ]
        template_meta = obj["spec"]["template"].get("metadata") or {}
        if template_meta.get("annotations") is None:
            ops.append(
                {
                    "op": "add",
                    "path": "/spec/template/metadata/annotations",
                    "value": {RESTARTED_AT: now},
                }
            )
        else:
            ops.append(
                {
                    "op": "add",
                    "path": f"/spec/template/metadata/annotations/{_escape(RESTARTED_AT)}",
                    "value": now,
                }
            )
        return ops

    def restart(self, flags: Flags, initial_cap: int | None, reason: str) -> None:

        obj = self._get()
        ops = self.patch_for(obj, flags, initial_cap, reason)
        patch = (
            self.apps.patch_namespaced_deployment
            if self.ref.kind == "Deployment"
            else self.apps.patch_namespaced_stateful_set
        )
        try:
            patch(
                self.ref.name,
                self.ref.namespace,
                ops,
                _content_type=JSON_PATCH,
                _preload_content=False,
            )
        except Exception as exc:
            raise self._failed("PATCH", exc) from exc

    def _failed(self, verb: str, exc: Exception) -> RestartError:
        """An API refusal (auth or rejected, with its status) or an unreachable API server."""
        from kubernetes.client.exceptions import ApiException

        if not isinstance(exc, ApiException):  # connection errors surface from urllib3
            return RestartError("unreachable", f"Kubernetes API: {exc}")
        return RestartError(
            "auth" if exc.status in (401, 403) else "rejected",
            f"{verb} {self.ref.kind} {self.ref.namespace}/{self.ref.name}: HTTP "
            f"{exc.status} {str(exc.body)[:200]}",
        )
