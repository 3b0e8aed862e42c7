"""A local stand-in for the Kubernetes API server (no cluster can run here).

It serves the workloads it is given, applies JSON Patches (RFC 6902) to them, and checks every
request the way the API server would: the bearer token, the verb and object against the Role in
deploy/kubernetes/remediator.yaml, the patch's content type and form, and the patched object
against the Kubernetes OpenAPI schema (kubernetes-validate, strict). Every request is recorded.

It also serves pods (list, and watch from a resourceVersion, as the API server streams it: one
JSON event per line; a version older than the retained history answers 410 Gone) and
coordination.k8s.io Leases (get, create, update with optimistic concurrency: a stale
resourceVersion answers 409 Conflict), each checked against the Roles it is given.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes_validate

K8S_VERSION = "1.33"
PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/(deployments|statefulsets)/([^/?]+)")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:\?(.*))?$")
LEASES = re.compile(r"^/apis/coordination.k8s.io/v1/namespaces/([^/]+)/leases(?:/([^/?]+))?")


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: Any
    status: int


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def apply_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        kind = op["op"]
        if kind == "test":
            current = node[int(last)] if isinstance(node, list) else node.get(last)
            if current != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        elif kind in ("add", "replace"):
            if kind == "replace" and (isinstance(node, dict) and last not in node):
                raise ValueError(f"replace of a missing member {op['path']}")
            if isinstance(node, list):
                node.insert(int(last), op["value"]) if kind == "add" else node.__setitem__(
                    int(last), op["value"]
                )
            else:
                node[last] = op["value"]
        elif kind == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise ValueError(f"unsupported op {kind}")
    return doc


class KubeStandIn:
    def __init__(
        self,
        objects: list[dict[str, Any]],
        role: dict[str, Any],
        token: str = "kube-token",
        on_patch: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.objects = {
            (o["metadata"]["namespace"], o["kind"], o["metadata"]["name"]): copy.deepcopy(o)
            for o in objects
        }
        for o in self.objects.values():
            o["metadata"].setdefault("resourceVersion", "1")
            o["metadata"].setdefault("generation", 1)
        self.role, self.token, self.on_patch = role, token, on_patch
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.roles: list[dict[str, Any]] = [role]  # more with allow(): one Role per namespace
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, ns, type, pod)
        self.version = 100  # the cluster's resourceVersion counter (pods and leases)
        self.oldest = 0  # events before this version are compacted away (410 Gone)
        self.changed = threading.Condition(self.lock)
        self.watching = 0  # watch requests open now
        self.down = False  # answer 503 to everything (an API server outage)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                if method == "GET" and outer.stream(self):
                    return
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                ctype = self.headers.get("Content-Type", "")
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                status, answer = outer.serve(
                    method, self.path, ctype, body, self.headers.get("Authorization", "")
                )
                with outer.lock:
                    outer.requests.append(Request(method, self.path, ctype, body, status))
                self._send(status, answer)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def do_PUT(self) -> None:
                self._handle("PUT")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

            def do_POST(self) -> None:
                self._handle("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _allowed(self, verb: str, resource: str, namespace: str, name: str) -> bool:
        if namespace != self.role["metadata"]["namespace"]:
            return False
        return any(
            "apps" in rule["apiGroups"]
            and resource in rule["resources"]
            and verb in rule["verbs"]
            and name in rule.get("resourceNames", [name])
            for rule in self.role["rules"]
        )

    def serve(
        self, method: str, path: str, ctype: str, body: Any, auth: str
    ) -> tuple[int, dict[str, Any]]:
        if auth != f"Bearer {self.token}":
            return 401, {"kind": "Status", "code": 401, "reason": "Unauthorized"}
        if self.down:
            return 503, {"kind": "Status", "code": 503, "reason": "ServiceUnavailable"}
        if PODS.match(path) or LEASES.match(path):
            return self._serve_more(method, path, body)
        m = PATH.match(path)
        verb = {"GET": "get", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(
            method, "create"
        )
        if m is None:
            return 403, {"kind": "Status", "code": 403, "reason": "Forbidden", "message": path}
        namespace, resource, name = m.groups()
        if not self._allowed(verb, resource, namespace, name):
            return 403, {"kind": "Status", "code": 403, "reason": "Forbidden"}
        kind = "Deployment" if resource == "deployments" else "StatefulSet"
        key = (namespace, kind, name)
        with self.lock:
            obj = self.objects.get(key)
            if obj is None:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
            if method == "GET":
                return 200, obj
            if ctype.split(";")[0] != "application/json-patch+json" or not isinstance(body, list):
                return 415, {"kind": "Status", "code": 415, "message": f"content type {ctype}"}
            if not all(isinstance(op, dict) and {"op", "path"} <= set(op) for op in body):
                return 400, {"kind": "Status", "code": 400, "message": "malformed JSON patch"}
            try:
                patched = apply_patch(obj, body)
            except (ValueError, KeyError, IndexError) as exc:
                return 422, {"kind": "Status", "code": 422, "message": str(exc)}
            try:
                kubernetes_validate.validate(
                    {k: v for k, v in patched.items() if k != "status"}, K8S_VERSION, strict=True
                )
            except kubernetes_validate.ValidationError as exc:
                return 422, {"kind": "Status", "code": 422, "message": str(exc)[:500]}
            patched["metadata"]["resourceVersion"] = str(
                int(obj["metadata"]["resourceVersion"]) + 1
            )
            patched["metadata"]["generation"] = obj["metadata"]["generation"] + 1
            self.objects[key] = patched
        if self.on_patch:
            self.on_patch(patched)
        return 200, patched

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- pods, watch and Leases (additions; the workloads above behave as before) -------------
    def allow(self, role: dict[str, Any]) -> None:
        """Another Role (e.g. in the engines' namespace) the remediator's account is bound to."""
        self.roles.append(role)

    def _may(self, group: str, resource: str, verb: str, namespace: str, name: str) -> bool:
        return any(
            role["metadata"]["namespace"] == namespace
            and any(
                group in rule.get("apiGroups", [])
                and resource in rule.get("resources", [])
                and verb in rule.get("verbs", [])
                and name in rule.get("resourceNames", [name])
                for rule in role["rules"]
            )
            for role in self.roles
        )

    def _bump(self) -> str:
        self.version += 1
        return str(self.version)

    def put_pod(self, pod: dict[str, Any]) -> None:
        """Create or update a pod (as the kubelet and the scheduler would): an event."""
        pod = copy.deepcopy(pod)
        meta = pod["metadata"]
        with self.lock:
            key = (meta["namespace"], meta["name"])
            kind = "MODIFIED" if key in self.pods else "ADDED"
            meta["resourceVersion"] = self._bump()
            self.pods[key] = pod
            self.events.append((self.version, key[0], kind, copy.deepcopy(pod)))
            self.changed.notify_all()

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.lock:
            pod = self.pods.pop((namespace, name))
            pod["metadata"]["resourceVersion"] = self._bump()
            self.events.append((self.version, namespace, "DELETED", pod))
            self.changed.notify_all()

    def compact(self) -> None:
        """Forget the event history (etcd compaction): older watch versions answer 410."""
        with self.lock:
            self.oldest = self.version
            self.events.clear()
            self.changed.notify_all()

    def end_watches(self) -> None:
        """End every open watch request now (as an API server restart would)."""
        with self.lock:
            self.oldest_end = self.version
            self.changed.notify_all()

    @staticmethod
    def _selected(pod: dict[str, Any], selector: str) -> bool:
        labels = pod["metadata"].get("labels") or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    def _serve_more(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        forbidden = {"kind": "Status", "code": 403, "reason": "Forbidden", "message": path}
        if m := PODS.match(path):
            namespace, query = m.group(1), urllib.parse.parse_qs(m.group(2) or "")
            if method != "GET" or not self._may("", "pods", "list", namespace, ""):
                return 403, forbidden
            selector = query.get("labelSelector", [""])[0]
            with self.lock:
                items = [
                    copy.deepcopy(p)
                    for (ns, _), p in sorted(self.pods.items())
                    if ns == namespace and self._selected(p, selector)
                ]
                version = str(self.version)
            return 200, {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": version},
                "items": items,
            }
        m = LEASES.match(path)
        assert m is not None
        namespace, name = m.group(1), m.group(2)
        verb = {"GET": "get", "POST": "create", "PUT": "update"}.get(method, "")
        if not self._may("coordination.k8s.io", "leases", verb, namespace, name or ""):
            return 403, forbidden
        with self.lock:
            if method == "POST":
                name = (body or {}).get("metadata", {}).get("name")
            key = (namespace, str(name))
            current = self.leases.get(key)
            if method == "GET":
                if current is None:
                    return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
                return 200, copy.deepcopy(current)
            if not isinstance(body, dict):
                return 400, {"kind": "Status", "code": 400, "message": "not an object"}
            try:
                kubernetes_validate.validate(body, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                return 422, {"kind": "Status", "code": 422, "message": str(exc)[:500]}
            if method == "POST" and current is not None:
                return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"}
            if method == "PUT":
                if current is None:
                    return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
                sent = body.get("metadata", {}).get("resourceVersion")
                if sent != current["metadata"]["resourceVersion"]:
                    return 409, {"kind": "Status", "code": 409, "reason": "Conflict"}
            lease = copy.deepcopy(body)
            lease["metadata"]["resourceVersion"] = self._bump()
            lease["metadata"]["namespace"] = namespace
            self.leases[key] = lease
            return (201 if method == "POST" else 200), copy.deepcopy(lease)

    def stream(self, handler: BaseHTTPRequestHandler) -> bool:
        """Serve a pod watch (GET ...?watch=true) as a stream; False for anything else."""
        m = PODS.match(handler.path)
        query = urllib.parse.parse_qs((m.group(2) or "") if m else "")
        if m is None or query.get("watch", [""])[0].lower() not in ("true", "1"):
            return False
        namespace = m.group(1)
        auth = handler.headers.get("Authorization", "")
        status = 200
        if auth != f"Bearer {self.token}":
            status = 401
        elif self.down:
            status = 503
        elif not self._may("", "pods", "watch", namespace, ""):
            status = 403
        with self.lock:
            self.requests.append(Request("GET", handler.path, "", None, status))
        if status != 200:
            data = json.dumps({"kind": "Status", "code": status}).encode()
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
            return True
        selector = query.get("labelSelector", [""])[0]
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        deadline = time.monotonic() + float(query.get("timeoutSeconds", ["30"])[0])
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Connection", "close")
        handler.end_headers()
        sent = since
        end_mark = getattr(self, "oldest_end", 0)
        with self.lock:
            self.watching += 1
        try:
            while time.monotonic() < deadline:
                with self.lock:
                    if since < self.oldest:
                        gone = {
                            "kind": "Status",
                            "code": 410,
                            "reason": "Expired",
                            "message": f"too old resource version: {since}",
                        }
                        lines = [{"type": "ERROR", "object": gone}]
                        deadline = 0.0
                    else:
                        lines = [
                            {"type": kind, "object": pod}
                            for rv, ns, kind, pod in self.events
                            if rv > sent and ns == namespace and self._selected(pod, selector)
                        ]
                        sent = max([sent, *(rv for rv, *_ in self.events if rv > sent)])
                    if not lines and deadline:
                        if getattr(self, "oldest_end", 0) != end_mark:
                            break
                        self.changed.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                for line in lines:
                    handler.wfile.write(json.dumps(line).encode() + b"\n")
                handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self.lock:
                self.watching -= 1
        return True
