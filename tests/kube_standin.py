"""A local stand-in for the Kubernetes API server (no cluster can run here).

It serves the workloads it is given, applies JSON Patches (RFC 6902) to them, and checks every
request the way the API server would: the bearer token, the verb and object against the Role in
deploy/kubernetes/remediator.yaml, the patch's content type and form, and the patched object
against the Kubernetes OpenAPI schema (kubernetes-validate, strict). Every request is recorded.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes_validate

K8S_VERSION = "1.33"
PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/(deployments|statefulsets)/([^/?]+)")


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
