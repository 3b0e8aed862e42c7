"""HTTP side of the oomguard plugin, served by vLLM's own API server (`vllm.endpoint_plugins`).

Routes (JSON in and out; docs/vllm-plugin.md has the full contract):
  GET  /oomguard/v1/state      every engine's cap, mode and counters (read-only, no token)
  GET  /oomguard/v1/ready      200 while serving, 503 while draining: a readinessProbe target
  GET  /oomguard/v1/step-guard each engine's step guard: mode, shrinks, its cost per step
  PUT  /oomguard/v1/admission  {"cap": N}: set the live admission cap (clamped to 1..startup)
  POST /oomguard/v1/drain      stop admitting; running requests finish; new ones get 503
  POST /oomguard/v1/resume     admit again

Mutating routes need `Authorization: Bearer <token>`; the token comes from
OOMGUARD_PLUGIN_TOKEN or the file named by OOMGUARD_PLUGIN_TOKEN_FILE (re-read on each call, so
a rotated Kubernetes Secret takes effect). With no token configured they refuse, unless
OOMGUARD_PLUGIN_ALLOW_UNAUTHENTICATED=1 (local experiments only). vLLM's --api-key does not
cover plugin routes.

A drain first takes the replica out of rotation: /ready answers 503 and nothing new starts, but
requests still arriving are queued, not refused, for OOMGUARD_DRAIN_GRACE_SECONDS (0 by default;
set it to the time the router or Kubernetes takes to act on readiness). Then queued and new
POSTs to inference routes are answered 503 with Retry-After (new ones by a middleware, before
they reach the engine); requests already running are never cut. /health stays vLLM's liveness.

Every answer of an inference route gets its status before any body: a streamed response's 200
is held until its first chunk, so a request that ends before its first token (a drain shed it,
the engine refused it) is answered with the error's own status, which a router retries, and
never as an error event inside a 200 stream, which it cannot. Deferrals and drains carry the
status and headers chosen in vllm_plugin/refusals.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from oomguard import bounded
from oomguard import vllm_seam as vllm
from oomguard.actions import ACTIONS, ROUTES
from oomguard.contract import (
    API_PREFIX,
    DRAINING_MESSAGE,
    PLUGIN_ALLOW_UNAUTHENTICATED_ENV,
    PLUGIN_TOKEN_ENV,
    PLUGIN_TOKEN_FILE_ENV,
)
from oomguard.engine_state import EngineState, StateError, parse_core
from oomguard.vllm_plugin.refusals import MAX_DRAIN_GRACE, SHOULD_RETRY, Refusals

log = logging.getLogger("oomguard.vllm_plugin.api")

PREFIX = API_PREFIX
# Every route of vLLM's that puts work on the engine (vllm_seam: GATED_PATHS). While draining,
# a POST to one of these is answered 503 + Retry-After at the door. tests/test_vllm_plugin.py
# checks that each POST route the real server registers is in exactly one of GATED_PATHS and
# CONTROL_PATHS, so a vLLM upgrade that adds an inference route fails the tests instead of
# slipping past the drain.
GATED_PATHS = vllm.GATED_PATHS
# POST routes that never start inference: vLLM's (tokenizer work, aborts and cancels, which must
# keep working while draining, and operator controls) and the plugin's own (oomguard.actions).
CONTROL_PATHS = vllm.CONTROL_PATHS | {
    f"{PREFIX}{path}" for method, path in ROUTES if method == "POST"
}
ENGINE_TIMEOUT_SECONDS = 5.0
DRAIN_CACHE_SECONDS = 1.0
MAX_BODY_BYTES = 8192  # {"cap": N} is a few bytes; anything large is not a cap change
# Larger caps mean "no limit": clamped here, before the value travels to EngineCore (msgpack
# cannot carry integers beyond 64 bits, which answered 503 before).
CAP_CEILING = 2**31 - 1


class AdmissionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cap: StrictInt


class DrainRequest(BaseModel):
    """The drain's optional body: `grace_seconds` overrides OOMGUARD_DRAIN_GRACE_SECONDS (the
    remediator sends 0 once it has removed the replica from its router itself)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    grace_seconds: float | None = Field(None, ge=0, le=MAX_DRAIN_GRACE, allow_inf_nan=False)


def configured_token() -> str | None:
    token = os.environ.get(PLUGIN_TOKEN_ENV)
    path = os.environ.get(PLUGIN_TOKEN_FILE_ENV)
    if not token and path:
        # Read on every mutating call (a rotated Secret takes effect), inside the API server's
        # event loop: through the bounded reader, so a FIFO cannot block the loop and bad
        # UTF-8 is "no token" (403), not a 500 on every call or a failed start.
        try:
            token = bounded.read_text(path, bounded.TOKEN).strip()
        except bounded.InputError as exc:
            log.warning("oomguard: cannot use %s: %s", PLUGIN_TOKEN_FILE_ENV, exc)
            token = None
    return token or None


def _unauthorized() -> HTTPException:
    return HTTPException(
        401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
    )


def authorize(request: Request) -> None:
    """Raise 401/403 unless the request carries the configured bearer token.

    Compared as bytes: any header a client can send (non-ASCII included) is a wrong token (401),
    never an error of its own.
    """
    token = configured_token()
    if token is None:
        if os.environ.get(PLUGIN_ALLOW_UNAUTHENTICATED_ENV) == "1":
            return
        raise HTTPException(
            403,
            "oomguard mutating routes are disabled: no token configured "
            f"(set {PLUGIN_TOKEN_ENV} or {PLUGIN_TOKEN_FILE_ENV})",
        )
    raw = dict(request.scope.get("headers") or []).get(b"authorization", b"")
    scheme, _, given = bytes(raw).partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), token.encode("utf-8")):
        raise _unauthorized()


def _bad_request(message: str) -> HTTPException:
    return HTTPException(400, message)


async def _json_body(request: Request, empty: Any = ...) -> Any:
    """The JSON body of an already authorised request (`empty`: what no body at all means;
    unset, a body is required): 400 or 413 naming the problem."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(413, f"body larger than {MAX_BODY_BYTES} bytes")
    if not body.strip() and empty is not ...:
        return empty
    try:
        return json.loads(body)
    except RecursionError:
        raise _bad_request("body is nested too deeply") from None
    except ValueError as exc:  # not JSON, bad UTF-8, or an integer beyond Python's digit limit
        raise _bad_request(f"body is not valid JSON: {exc}") from None


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
    )


async def admission_body(request: Request) -> AdmissionRequest:
    """Parse `{"cap": <int>}` from an already authorised request: 400 or 413 naming the problem."""
    data = await _json_body(request)
    try:
        return AdmissionRequest.model_validate(data)
    except ValidationError as exc:
        raise _bad_request(f"bad admission request: {_problems(exc)}") from None


async def drain_body(request: Request) -> DrainRequest:
    """Parse the drain's optional `{"grace_seconds": <number>}` (no body: the default)."""
    data = await _json_body(request, empty={})
    try:
        return DrainRequest.model_validate(data)
    except ValidationError as exc:
        raise _bad_request(f"bad drain request: {_problems(exc)}") from None


def aggregate(engines: list[dict[str, Any]]) -> dict[str, Any]:
    """One view of all engines behind this API server (several with data parallelism): the
    state document (oomguard.engine_state.EngineState) every reader of the route parses."""
    try:
        return EngineState.of([parse_core(e) for e in engines]).document()
    except StateError as exc:  # an engine core answered outside the contract: say so
        raise HTTPException(502, f"engine state: {exc}") from None


class OomguardEndpointPlugin:
    """The `vllm.endpoint_plugins` entry point (named `oomguard`)."""

    name = "oomguard"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.engine_client: Any = None
        try:
            self.refusals = Refusals.from_env()
        except ValueError as exc:  # a bad setting must not keep vLLM from serving
            log.error("oomguard: %s; using the defaults", exc)
            self.refusals = Refusals()
        self.retry_after = self.refusals.drain_retry_after
        self._draining = False
        self._shedding = False
        self._draining_checked = 0.0
        self.guard: Any = None
        self._guard_task: asyncio.Task[None] | None = None
        self._shed_task: asyncio.Task[None] | None = None

    # -- engine calls ------------------------------------------------------------------------
    async def call_engines(self, method: str, *args: Any) -> list[Any]:
        if self.engine_client is None:
            raise HTTPException(503, "no engine behind this server")
        core = self.engine_client.engine_core
        call_all = getattr(core, "call_utility_all_async", None)
        try:
            if call_all is not None:
                coro = call_all(method, *args)
            else:
                coro = asyncio.gather(core.call_utility_async(method, *args))
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # arrives as the call finishes (a dead engine fails at once), so the guard's refresh
            # task outlived the server's shutdown and vLLM never exited (CPython gh-86296)
            async with asyncio.timeout(ENGINE_TIMEOUT_SECONDS):
                results = await coro
        except TimeoutError as exc:
            raise HTTPException(
                504, f"engine did not answer {method} within {ENGINE_TIMEOUT_SECONDS}s"
            ) from exc
        except HTTPException:
            raise
        except Exception as exc:  # engine dead or the plugin missing in EngineCore
            raise HTTPException(503, f"engine call {method} failed: {exc}") from exc
        return list(results)

    async def state(self) -> dict[str, Any]:
        view = aggregate(await self.call_engines("oomguard_state"))
        self._remember(view["mode"] == "draining", view["shedding"])
        return view

    def _remember(self, draining: bool, shedding: bool) -> None:
        self._draining, self._shedding = draining, shedding
        self._draining_checked = time.monotonic()

    async def _refresh(self) -> None:
        """Cached for a second, so other API server processes learn of a drain within 1 s."""
        if time.monotonic() - self._draining_checked > DRAIN_CACHE_SECONDS:
            try:
                await self.state()
            except HTTPException:
                self._draining_checked = time.monotonic()  # keep the last known mode

    async def is_draining(self) -> bool:
        """Out of rotation (readiness fails), within its grace or past it."""
        await self._refresh()
        return self._draining

    async def is_shedding(self) -> bool:
        """Draining past its grace: new requests are refused at the door."""
        await self._refresh()
        return self._shedding

    def _shed_later(self, grace: float) -> None:
        """Read the state when the grace ends: the engine sheds then (it also does so at any
        earlier state read past the deadline, so a lost timer only delays it to the next)."""

        async def later() -> None:
            await asyncio.sleep(grace + 0.05)  # past the engine's deadline, set just before
            try:
                await self.state()
            except HTTPException as exc:
                log.warning("oomguard: could not complete the drain: %s", exc.detail)

        self._cancel_shed()
        self._shed_task = asyncio.get_running_loop().create_task(later())

    def _cancel_shed(self) -> None:
        if self._shed_task is not None:
            self._shed_task.cancel()
            self._shed_task = None

    def _start_guard(self) -> None:
        """The request-level OOM guard (vllm_plugin/admission.py): hook plus headroom refresh."""
        from oomguard.vllm_plugin import admission

        try:
            guard = admission.Guard.from_env()
        except ValueError as exc:
            log.error("oomguard: request guard off: %s", exc)
            return
        self.guard = guard
        if admission.install(guard):
            self._guard_task = asyncio.get_running_loop().create_task(
                guard.run(lambda: self.call_engines("oomguard_headroom"))
            )
            log.info("oomguard: request guard in %s mode", guard.mode)

    # -- wiring ------------------------------------------------------------------------------
    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter(prefix=PREFIX, tags=["oomguard"])
        plugin = self

        @router.get("/state")
        async def get_state() -> dict[str, Any]:
            return await plugin.state()

        @router.get("/step-guard")
        async def get_step_guard() -> dict[str, Any]:
            """Each engine's step guard: mode, steps looked at, shrinks by kind, its own cost
            and the steps' time (read-only, like /state)."""
            return {"engines": await plugin.call_engines("oomguard_step_guard")}

        @router.get("/ready")
        async def ready() -> JSONResponse:
            try:
                view = await plugin.state()
            except HTTPException as exc:
                return JSONResponse({"ready": False, "reason": exc.detail}, status_code=503)
            if view["mode"] != "serving":
                return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
            return JSONResponse({"ready": True})

        @router.put("/admission")
        async def set_admission(request: Request) -> dict[str, Any]:
            authorize(request)  # before reading the body: strangers learn nothing of it
            body = await admission_body(request)
            cap = max(-1, min(body.cap, CAP_CEILING))
            results = await plugin.call_engines("oomguard_set_admission_cap", cap)
            applied = min(r["admission_cap"] for r in results)
            out: dict[str, Any] = {
                "requested": body.cap,
                "admission_cap": applied,
                "clamped": applied != body.cap,
                "state": aggregate([r["state"] for r in results]),
            }
            if out["clamped"]:
                startup = out["state"]["startup_max_num_seqs"]
                out["message"] = (
                    f"cap {body.cap} is outside 1..{startup} (the startup "
                    f"max_num_seqs); applied {applied}"
                )
            log.info("oomguard: admission cap -> %d", applied)
            return out

        @router.post("/drain")
        async def drain(request: Request) -> dict[str, Any]:
            authorize(request)
            body = await drain_body(request)
            grace = plugin.refusals.drain_grace_seconds
            grace = grace if body.grace_seconds is None else body.grace_seconds
            # out of rotation at once; without a grace, new requests are refused at once too
            plugin._remember(True, grace == 0 or plugin._shedding)
            view = aggregate(await plugin.call_engines("oomguard_drain", float(grace)))
            plugin._remember(True, view["shedding"])
            if not view["shedding"]:
                plugin._shed_later(grace)
            return view

        @router.post("/resume")
        async def resume(request: Request) -> dict[str, Any]:
            authorize(request)
            plugin._cancel_shed()
            view = aggregate(await plugin.call_engines("oomguard_resume"))
            plugin._remember(False, False)
            return view

        for spec in ACTIONS:  # actions the registry routes straight to an engine utility
            if spec.route and spec.engine_call:
                method, path = spec.route.split(" ", 1)
                handler = engine_call_route(self, spec.engine_call, spec.body)
                router.add_api_route(path, handler, methods=[method])

        app.include_router(router)
        app.add_middleware(DrainGate, plugin=self)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        self.engine_client = engine_client
        self._start_guard()
        if configured_token() is None and os.environ.get(PLUGIN_ALLOW_UNAUTHENTICATED_ENV) != "1":
            log.warning(
                "oomguard: no %s set; admission, drain and resume routes will refuse every call",
                PLUGIN_TOKEN_ENV,
            )


def engine_call_route(
    plugin: OomguardEndpointPlugin, name: str, body: type[BaseModel] | None = None
) -> Any:
    """The handler of an action's route that is one call of `name` on every engine (its
    `engine_call` in oomguard.actions): authorized; the body its `body` model checks (400 naming
    the field; none without a model), handed to the engines in the model's field order; the
    engines' state as the answer."""

    async def call(request: Request) -> dict[str, Any]:
        authorize(request)
        args: tuple[Any, ...] = ()
        data = await _json_body(request, empty={})
        if body is None:
            if data != {}:
                raise _bad_request(f"{request.url.path} takes no body")
        else:
            try:
                args = tuple(body.model_validate(data).model_dump().values())
            except ValidationError as exc:
                raise _bad_request(f"bad request: {_problems(exc)}") from None
        return aggregate(await plugin.call_engines(name, *args))

    return call


def gate_path(scope: dict[str, Any]) -> str:
    """The route path of a request: without the app's root_path and a trailing slash."""
    path = str(scope.get("path") or "")
    root = str(scope.get("root_path") or "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/") or "/"


class DrainGate:
    """ASGI middleware for inference POSTs.

    A draining replica past its grace answers them 503 + Retry-After at the door. At any time,
    their answers get their status before any body (`StatusFirst`), and a refusal (429, 503)
    gets its Retry-After and `x-should-retry` (vllm_plugin/refusals.py), so a router knows to go
    elsewhere and a client when to come back.
    """

    def __init__(self, app: Any, plugin: OomguardEndpointPlugin) -> None:
        self.app = app
        self.plugin = plugin

    def refusal(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": DRAINING_MESSAGE,
                    "type": "ServiceUnavailable",
                    "code": 503,
                }
            },
            status_code=503,
            headers={
                "Retry-After": str(self.plugin.refusals.drain_retry_after),
                SHOULD_RETRY[0].decode(): SHOULD_RETRY[1].decode(),
            },
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or gate_path(scope) not in GATED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        if await self.plugin.is_shedding():
            await self.refusal()(scope, receive, send)
            return
        await self.app(scope, receive, StatusFirst(send, self.plugin.refusals))


def _with_refusal_headers(headers: list[Any], status: int, refusals: Refusals) -> list[Any]:
    """A refusal's headers: Retry-After (unless the app set one) and x-should-retry."""
    retry_after = refusals.retry_after(status)
    if retry_after is None:
        return headers
    names = {bytes(k).lower() for k, _ in headers}
    extra = [] if b"retry-after" in names else [(b"retry-after", str(retry_after).encode())]
    if SHOULD_RETRY[0] not in names:
        extra.append(SHOULD_RETRY)
    return [*headers, *extra]


def stream_error(body: bytes) -> tuple[int, bytes] | None:
    """The status and JSON error of a server-sent-events body whose first event is an error
    (vLLM's `data: {"error": {..., "code": 503}}`), else None."""
    first = body.lstrip().split(b"\n", 1)[0]
    if not first.startswith(b"data: {"):
        return None
    try:
        event = json.loads(first[6:])
        error = event["error"]
        code = int(error["code"])
    except (ValueError, KeyError, TypeError):
        return None
    if not 400 <= code <= 599:
        code = 500
    return code, json.dumps({"error": error}).encode()


class StatusFirst:
    """The `send` of one inference request: a streamed 200's start is held until its first
    non-empty chunk; if that chunk is an error event, the client gets the error's own status
    and JSON body instead, before any byte of a stream (vLLM starts a streamed response before
    the engine has the request: a shed or refused request would be a 200 that then errors,
    which no router retries). A streamed response that reached its first token is unchanged,
    only its headers come with that token; refusals get their headers."""

    def __init__(self, send: Any, refusals: Refusals) -> None:
        self.send, self.refusals = send, refusals
        self.held: dict[str, Any] | None = None
        self.replaced = False  # the stream was answered with its error: drop the rest

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.replaced:
            return
        kind = message["type"]
        if kind == "http.response.start":
            status = int(message.get("status", 200))
            headers = _with_refusal_headers(
                list(message.get("headers") or []), status, self.refusals
            )
            message = {**message, "headers": headers}
            if status == 200 and _is_event_stream(headers):
                self.held = message
                return
            await self.send(message)
            return
        if kind == "http.response.body" and self.held is not None:
            body = bytes(message.get("body", b""))
            if not body and message.get("more_body", False):
                return  # nothing to judge yet
            held, self.held = self.held, None
            error = stream_error(body)
            if error is not None:
                status, payload = error
                self.replaced = True
                headers = _with_refusal_headers(
                    [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                    status,
                    self.refusals,
                )
                await self.send(
                    {"type": "http.response.start", "status": status, "headers": headers}
                )
                await self.send({"type": "http.response.body", "body": payload, "more_body": False})
                return
            await self.send(held)
        await self.send(message)


def _is_event_stream(headers: list[Any]) -> bool:
    return any(
        bytes(k).lower() == b"content-type" and bytes(v).lower().startswith(b"text/event-stream")
        for k, v in headers
    )
