"""The remediator's HTTP API (a small Starlette app, served by uvicorn).

  POST /v1/alertmanager   Alertmanager webhook (v4). 200 once durably recorded; 400 malformed;
                          401 unauthenticated; 413 too large; 503 when a retry would help.
  GET  /v1/targets        every allowlisted target's desired and observed state (authenticated)
  PUT  /v1/pause          {"paused": bool, "reason": str}: the global pause switch (authenticated)
  GET  /metrics           the remediator's own metrics
  GET  /healthz           200 ok; 503 `failing` after `unhealthy_after_failed_passes` failed
                          passes in a row; 503 `degraded` while the audit log takes no appends
                          (no action is taken then) or a background thread died (restarting)

TLS: terminate it in front (ingress, service mesh, or a local proxy); Alertmanager's `http_config`
carries the same credentials either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from oomguard.digits import decimal
from oomguard.remediator.auth import Authenticator
from oomguard.remediator.config import AuthConfig
from oomguard.remediator.controller import Controller
from oomguard.remediator.webhook import BodyTooLarge, PayloadError, load_json, parse

log = logging.getLogger("oomguard.remediator.server")


class TooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    size = decimal(declared)
    if size is not None and size > limit:
        raise TooLarge(f"body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut for sending too slowly (httpserve.py)
        raise PayloadError("the client went away before its body arrived") from None
    return b"".join(chunks)


def create_app(
    controller: Controller,
    auth: AuthConfig,
    max_body_bytes: int,
    unhealthy_after: int = 3,
    problems: Callable[[], list[str]] | None = None,
) -> Starlette:
    """`problems`: what makes the remediator degraded now (default: the controller's own)."""
    degraded = problems or controller.problems
    authn = Authenticator(auth)
    webhooks = controller.metrics.webhooks

    def refuse(status: int, outcome: str, message: str, **headers: str) -> JSONResponse:
        webhooks.labels(outcome).inc()
        return JSONResponse({"error": message}, status, headers=headers or None)

    def unauthorized() -> JSONResponse:
        return JSONResponse(
            {"error": "missing or wrong credentials"},
            401,
            headers={"WWW-Authenticate": authn.challenge()},
        )

    async def alertmanager(request: Request) -> Response:
        started = time.perf_counter()
        if not authn.allows(request.headers.get("authorization", "")):
            webhooks.labels("unauthorized").inc()
            return unauthorized()
        try:
            body = await read_body(request, max_body_bytes)
        except TooLarge as exc:
            return refuse(413, "too_large", str(exc))
        try:
            webhook = parse(body, max_body_bytes)
        except BodyTooLarge as exc:
            return refuse(413, "too_large", str(exc))
        except PayloadError as exc:
            log.warning("refused a webhook: %s", exc)
            return refuse(400, "invalid", str(exc))
        try:
            receipt = await run_in_threadpool(controller.receive, webhook)
        except OSError as exc:
            # not recorded, so not applied: a retry will help once the disk is writable again
            log.error("cannot record a webhook in the audit log: %s", exc)
            return refuse(503, "error", f"audit log unavailable: {exc}", **{"Retry-After": "5"})
        outcome = "duplicate" if receipt.alerts and not receipt.new else "accepted"
        webhooks.labels(outcome).inc()
        took_ms = (time.perf_counter() - started) * 1e3
        return JSONResponse(
            {
                "alerts": receipt.alerts,
                "new": receipt.new,
                "duplicates": receipt.duplicates,
                "ignored": receipt.ignored,
            },
            # read, parse, record durably, apply: what handling this payload took here
            headers={"Server-Timing": f"handle;dur={took_ms:.3f}"},
        )

    async def targets(request: Request) -> Response:
        if not authn.allows(request.headers.get("authorization", "")):
            return unauthorized()
        return JSONResponse(controller.view())

    async def pause(request: Request) -> Response:
        if not authn.allows(request.headers.get("authorization", "")):
            return unauthorized()
        try:
            data: Any = load_json(await read_body(request, 4096))
        except (TooLarge, PayloadError):
            data = None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("paused"), bool)
            or not isinstance(data.get("reason", ""), str)
        ):
            return JSONResponse(
                {"error": 'body must be {"paused": true|false, "reason": "..."}'}, 400
            )
        reason = data.get("reason") or "no reason given"
        try:
            await run_in_threadpool(controller.set_paused, data["paused"], f"API: {reason}")
        except OSError as exc:
            return JSONResponse({"error": f"audit log unavailable: {exc}"}, 503)
        return JSONResponse({"paused": controller.paused})

    async def metrics(_: Request) -> Response:
        return Response(
            generate_latest(controller.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    async def healthz(_: Request) -> Response:
        failed = controller.failed_passes
        found = degraded()
        body: dict[str, Any] = {
            "status": "ok",
            "failed_passes": failed,
            "paused": controller.paused,
            "problems": found,
        }
        if failed >= unhealthy_after:
            return JSONResponse({**body, "status": "failing"}, 503)
        if found:
            return JSONResponse({**body, "status": "degraded"}, 503)
        return JSONResponse(body)

    return Starlette(
        routes=[
            Route("/v1/alertmanager", alertmanager, methods=["POST"]),
            Route("/v1/targets", targets, methods=["GET"]),
            Route("/v1/pause", pause, methods=["PUT"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )
