"""HTTP side of the oomguard plugin, served by vLLM's own API server (`vllm.endpoint_plugins`).

Routes (JSON in and out; docs/vllm-plugin.md has the full contract):
  GET  /oomguard/v1/state      every engine's cap, mode and counters (read-only, no token)
  GET  /oomguard/v1/ready      200 while serving, 503 while draining: a readinessProbe target
  PUT  /oomguard/v1/admission  {"cap": N}: set the live admission cap (clamped to 1..startup)
  POST /oomguard/v1/drain      stop admitting; running requests finish; new ones get 503
  POST /oomguard/v1/resume     admit again

Mutating routes need `Authorization: Bearer <token>`; the token comes from
OOMGUARD_PLUGIN_TOKEN or the file named by OOMGUARD_PLUGIN_TOKEN_FILE (re-read on each call, so
a rotated Kubernetes Secret takes effect). With no token configured they refuse, unless
OOMGUARD_PLUGIN_ALLOW_UNAUTHENTICATED=1 (local experiments only). vLLM's --api-key does not
cover plugin routes.

While draining, POSTs to inference routes are answered 503 with Retry-After by a middleware,
before they reach the engine; requests already in flight are never cut.
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
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from oomguard import bounded
from oomguard.contract import (
    API_PREFIX,
    DRAINING_MESSAGE,
    PLUGIN_ALLOW_UNAUTHENTICATED_ENV,
    PLUGIN_RETRY_AFTER_ENV,
    PLUGIN_TOKEN_ENV,
    PLUGIN_TOKEN_FILE_ENV,
)
from oomguard.engine_state import EngineState, StateError, parse_core

log = logging.getLogger("oomguard.vllm_plugin.api")

PREFIX = API_PREFIX
# Every route that puts work on the engine (vLLM 0.33). While draining, a POST to one of these is
# answered 503 + Retry-After at the door. tests/test_vllm_plugin.py checks that each POST route
# the real server registers is in exactly one of GATED_PATHS and CONTROL_PATHS, so a vLLM upgrade
# that adds an inference route fails the tests instead of slipping past the drain.
GATED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/v1/decisions",
        "/v1/systemone",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/v1/classify",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v2/embed",
        "/v2/rerank",
        "/cohere/v2/chat",
        "/generate",
        "/generative_scoring",
        "/inference/v1/generate",
        "/invocations",  # SageMaker: dispatches to completions, chat, embeddings, ...
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
    }
)
# POST routes that never start inference: tokenizer work, aborts and cancels (they must keep
# working while draining), and operator controls.
CONTROL_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/v1/messages/count_tokens",
        "/v1/completions/render",
        "/v1/completions/derender",
        "/v1/chat/completions/render",
        "/v1/chat/completions/derender",
        "/v1/messages/render",
        "/v1/responses/render",
        "/cohere/v2/chat/render",
        "/v1/responses/{response_id}/cancel",
        "/abort_requests",
        "/inference/v1/abort_requests",
        "/ping",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/pause",
        "/resume",
        "/sleep",
        "/wake_up",
        "/release_kv_cache_memory",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/collective_rpc",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/fault_tolerance/apply",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/shutdown_weight_transfer_engine",
        "/weight_checker",
        f"{PREFIX}/drain",
        f"{PREFIX}/resume",
    }
)
ENGINE_TIMEOUT_SECONDS = 5.0
DRAIN_CACHE_SECONDS = 1.0
MAX_BODY_BYTES = 8192  # {"cap": N} is a few bytes; anything large is not a cap change
# Larger caps mean "no limit": clamped here, before the value travels to EngineCore (msgpack
# cannot carry integers beyond 64 bits, which answered 503 before).
CAP_CEILING = 2**31 - 1


class AdmissionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cap: StrictInt


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


async def admission_body(request: Request) -> AdmissionRequest:
    """Parse `{"cap": <int>}` from an already authorised request: 400 or 413 naming the problem."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(413, f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(body)
    except RecursionError:
        raise _bad_request("body is nested too deeply") from None
    except ValueError as exc:  # not JSON, bad UTF-8, or an integer beyond Python's digit limit
        raise _bad_request(f"body is not valid JSON: {exc}") from None
    try:
        return AdmissionRequest.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise _bad_request(f"bad admission request: {problems}") from None


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
        self.retry_after = int(os.environ.get(PLUGIN_RETRY_AFTER_ENV, "10"))
        self._draining = False
        self._draining_checked = 0.0
        self.guard: Any = None
        self._guard_task: asyncio.Task[None] | None = None

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
            results = await asyncio.wait_for(coro, ENGINE_TIMEOUT_SECONDS)
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
        self._remember(view["mode"] == "draining")
        return view

    def _remember(self, draining: bool) -> None:
        self._draining = draining
        self._draining_checked = time.monotonic()

    async def is_draining(self) -> bool:
        """Cached for a second, so other API server processes learn of a drain within 1 s."""
        if time.monotonic() - self._draining_checked > DRAIN_CACHE_SECONDS:
            try:
                await self.state()
            except HTTPException:
                self._draining_checked = time.monotonic()  # keep the last known mode
        return self._draining

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
            plugin._remember(True)  # gate new requests at once, before the engine answers
            return aggregate(await plugin.call_engines("oomguard_drain"))

        @router.post("/resume")
        async def resume(request: Request) -> dict[str, Any]:
            authorize(request)
            view = aggregate(await plugin.call_engines("oomguard_resume"))
            plugin._remember(False)
            return view

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


def gate_path(scope: dict[str, Any]) -> str:
    """The route path of a request: without the app's root_path and a trailing slash."""
    path = str(scope.get("path") or "")
    root = str(scope.get("root_path") or "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/") or "/"


class DrainGate:
    """ASGI middleware for inference POSTs.

    While draining they get 503 + Retry-After at the door. At any time, a 503 that vLLM answers
    on one of them (a queued request ended by the drain, a request that reached a paused engine)
    gets the same Retry-After, so a gateway knows to go elsewhere and when to come back.
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
            headers={"Retry-After": str(self.plugin.retry_after)},
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or gate_path(scope) not in GATED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        if await self.plugin.is_draining():
            await self.refusal()(scope, receive, send)
            return
        retry_after = str(self.plugin.retry_after).encode()

        async def send_with_retry_after(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message.get("status") == 503:
                headers = list(message.get("headers") or [])
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", retry_after)]}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)
