"""Taking an engine out of its router's rotation before a drain, and back after a resume.

Opt-in, per target (`router:` in the target's config names one of the top-level `routers:`;
docs/remediator.md). The router's URL comes only from that allowlist, never from an alert, and
the worker is named by the URL the router knows it by (`worker_url`, default the target's URL).

Supported: vllm-router's admin API (0.1.17, measured in tests/test_routers.py):
`POST /remove_worker?url=<worker>` takes the worker out at once and is idempotent (200 again for
a worker already gone); `POST /add_worker?url=<worker>` waits for the worker's /health, then
answers 200, or 400 "already exists" (taken as done). A drain then asks the plugin for no grace
(`grace_seconds: 0`): the router sends nothing more, so there is nothing to queue for. When the
router cannot be reached the drain still happens with the plugin's own grace (its readiness is
the router's other way to learn of it), and the failure is counted in the drain's answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from oomguard.remediator.actuator import Actuator, ActuatorError, Target

log = logging.getLogger("oomguard.remediator.router")


class RouterConfig(BaseModel):
    """A router the remediator may tell to take workers out of rotation (the allowlist)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    kind: Literal["vllm-router"] = "vllm-router"
    url: str = Field(pattern=r"^https?://", description="The router's admin base URL.")
    timeout_seconds: float = Field(
        10.0, gt=0, le=600, description="For each admin call (add_worker waits for /health)."
    )


class RouterRef(BaseModel):
    """A target's router: which one (by name) and the URL it knows the engine by."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    worker_url: str | None = Field(
        None, pattern=r"^https?://", description="Default: the target's url."
    )


@dataclass(frozen=True)
class Route:
    router: RouterConfig
    worker_url: str


class VllmRouterAdmin:
    """vllm-router's admin API (one httpx client; every call bounded by the router's timeout)."""

    def __init__(self, client: httpx.Client | None = None) -> None:
        self.client = client or httpx.Client()

    def _post(self, route: Route, path: str) -> httpx.Response:
        url = f"{route.router.url.rstrip('/')}/{path}"
        try:
            return self.client.post(
                url, params={"url": route.worker_url}, timeout=route.router.timeout_seconds
            )
        except httpx.TimeoutException:
            raise ActuatorError("router_timeout", f"POST {url}: no answer") from None
        except httpx.HTTPError as exc:
            raise ActuatorError("router_unreachable", f"POST {url}: {exc}") from None

    def remove(self, route: Route) -> None:
        r = self._post(route, "remove_worker")
        if r.status_code != 200:
            raise ActuatorError(
                "router_refused", f"remove_worker {route.worker_url}: HTTP {r.status_code}"
            )

    def add(self, route: Route) -> None:
        r = self._post(route, "add_worker")
        if r.status_code == 200 or (r.status_code == 400 and "already exists" in r.text):
            return
        raise ActuatorError(
            "router_refused",
            f"add_worker {route.worker_url}: HTTP {r.status_code} {r.text[:200]}",
        )

    def close(self) -> None:
        self.client.close()


class RoutedActuator:
    """The plugin actuator with a router step around drain and resume for routed targets;
    everything else, and every other target, goes straight to `inner`."""

    def __init__(
        self, inner: Any, routes: dict[str, Route], admin: VllmRouterAdmin | None = None
    ) -> None:
        self.inner, self.routes = inner, routes
        self.admin = admin or VllmRouterAdmin()

    def __getattr__(self, name: str) -> Any:
        # every other call (state, states, set_cap, an action's call oomguard.actions names)
        # goes straight to the plugin actuator: a new action needs no method here
        if name in ("inner", "routes", "admin"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def drain(self, target: Target) -> dict[str, Any]:
        route = self.routes.get(target.name)
        if route is None:
            out: dict[str, Any] = self.inner.drain(target)
            return out
        try:
            self.admin.remove(route)
        except ActuatorError as exc:
            # the plugin's grace and readiness still take it out of rotation
            log.warning("oomguard: %s: router did not remove it: %s", target.name, exc)
            out = self.inner.drain(target)
            return {**out, "router": {"removed": False, "error": str(exc)}}
        out = self.inner.drain(target, grace_seconds=0.0)
        return {**out, "router": {"removed": True}}

    def resume(self, target: Target) -> dict[str, Any]:
        out: dict[str, Any] = self.inner.resume(target)
        route = self.routes.get(target.name)
        if route is None:
            return out
        # after the plugin admits again: the router sends nothing it cannot take
        self.admin.add(route)
        return {**out, "router": {"added": True}}

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
        self.admin.close()


def routes(routers: list[RouterConfig], targets: list[Any]) -> dict[str, Route]:
    """Each routed target's router and worker URL (targets: the config's TargetConfig list)."""
    by_name = {r.name: r for r in routers}
    out: dict[str, Route] = {}
    for t in targets:
        ref = getattr(t, "router", None)
        if ref is not None:
            out[t.name] = Route(by_name[ref.name], ref.worker_url or t.url)
    return out


def with_routers(actuator: Actuator, routers: list[RouterConfig], targets: list[Any]) -> Actuator:
    """`actuator` with the router step for the targets that name a router (unchanged if none)."""
    table = routes(routers, targets)
    if not table:
        return actuator
    wrapped: Actuator = RoutedActuator(actuator, table)
    return wrapped
