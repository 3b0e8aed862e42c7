"""How the plugin says "not here, not now" so that the router in front acts on it and loses
nothing (docs/vllm-plugin.md, "Behind a router", has the measurements behind each choice).

Two kinds of refusal, answered differently because routers treat status codes differently:

- a **deferral** (the request guard: this request fits this engine later, not now) is
  `OOMGUARD_DEFER_STATUS`, 429 by default, with `Retry-After: OOMGUARD_DEFER_RETRY_AFTER`
  (2 s). vllm-router 0.1.17 counts every 5xx towards its circuit breaker (10 in a window open it
  for 60 s, short requests included) and retries 429 without counting it; nginx passes a 429 it
  is not told to retry to the client with its headers, and does not eject the upstream for it.
  503 remains selectable for a gateway that retries only 5xx.
- a **drain** (this replica is leaving rotation) is 503 with `Retry-After:
  OOMGUARD_PLUGIN_RETRY_AFTER` (10 s): every router retries it on a peer (nginx with
  `http_503 non_idempotent`), and a breaker that opens on a draining engine costs nothing.

Both carry `x-should-retry: true`, which OpenAI's clients read as "retry this one".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from http import HTTPStatus

from oomguard.contract import (
    DEFER_RETRY_AFTER_ENV,
    DEFER_STATUS_ENV,
    DRAIN_GRACE_ENV,
    PLUGIN_RETRY_AFTER_ENV,
)
from oomguard.vllm_plugin.envvars import env_float, env_int

DEFER_STATUSES = (429, 503)
DEFAULT_DEFER_STATUS = 429
DEFAULT_DEFER_RETRY_AFTER = 2
DEFAULT_DRAIN_RETRY_AFTER = 10
MAX_RETRY_AFTER = 3600
MAX_DRAIN_GRACE = 600.0
SHOULD_RETRY = (b"x-should-retry", b"true")


@dataclass(frozen=True)
class Refusals:
    """The statuses and delays this server answers with (from its environment)."""

    defer_status: int = DEFAULT_DEFER_STATUS
    defer_retry_after: int = DEFAULT_DEFER_RETRY_AFTER
    drain_retry_after: int = DEFAULT_DRAIN_RETRY_AFTER
    drain_grace_seconds: float = 0.0

    @classmethod
    def from_env(cls) -> Refusals:
        """The settings as the environment gives them; a ValueError names the bad variable."""
        status = env_int(DEFER_STATUS_ENV, DEFAULT_DEFER_STATUS, 400, 599)
        if status not in DEFER_STATUSES:
            raise ValueError(f"{DEFER_STATUS_ENV} must be one of {DEFER_STATUSES}, not {status}")
        return cls(
            defer_status=status,
            defer_retry_after=env_int(
                DEFER_RETRY_AFTER_ENV, DEFAULT_DEFER_RETRY_AFTER, 1, MAX_RETRY_AFTER
            ),
            drain_retry_after=env_int(
                PLUGIN_RETRY_AFTER_ENV, DEFAULT_DRAIN_RETRY_AFTER, 1, MAX_RETRY_AFTER
            ),
            drain_grace_seconds=env_float(DRAIN_GRACE_ENV, 0.0, 0.0, MAX_DRAIN_GRACE),
        )

    def retry_after(self, status: int) -> int | None:
        """Retry-After for an answer with this status: the deferral's or the drain's (a 503
        that is not the plugin's, e.g. vLLM's queue overflow, is told the drain's)."""
        if status == self.defer_status and status != 503:
            return self.defer_retry_after
        if status == 503:
            return self.drain_retry_after
        return None


@functools.cache
def defer_status() -> HTTPStatus:
    """The deferral status for this process (the request guard raises it); a bad setting
    falls back to the default, loudly, at the plugin's start (api.py reads it first)."""
    try:
        return HTTPStatus(Refusals.from_env().defer_status)
    except ValueError:
        return HTTPStatus(DEFAULT_DEFER_STATUS)
