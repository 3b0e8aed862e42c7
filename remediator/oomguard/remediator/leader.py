"""One active remediator: leader election on a coordination.k8s.io Lease (the official client).

Every replica receives webhooks and resyncs from Alertmanager, so its alert book is warm; only
the replica holding the Lease runs reconcile passes (and so acts). The holder renews the Lease
every `retry_seconds`; a standby takes it over once the holder has not renewed it for
`lease_seconds`, as that standby observed it (its own monotonic clock, so the replicas' clocks
need not agree). A holder that cannot renew for `renew_deadline_seconds` stops acting on its
own, before any standby may take over (renew deadline < lease duration), so two replicas never
act at once. Every write carries the resourceVersion it read: of two standbys racing for an
expired Lease, the API server lets exactly one through (409 Conflict for the other).

Every API call has a timeout (the client has none by default): a connection to the API server
that vanished without a reset held the election thread forever, so this replica never led
again, and with one replica nothing acted while /healthz said 200. The thread beats after each
attempt; one that stops beating is reported stuck (supervised.py).

On one box there is no election: a single replica leads, as before.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from oomguard.supervised import Supervised

if TYPE_CHECKING:
    from urllib3 import BaseHTTPResponse

log = logging.getLogger("oomguard.remediator.leader")


class LeaderElectionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    lease_name: str = Field("oomguard-remediator", pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
    identity: str | None = Field(
        None, min_length=1, description="This replica's name (default: $POD_NAME, the hostname)."
    )
    lease_seconds: float = Field(15.0, gt=0, description="A standby takes over after this.")
    renew_deadline_seconds: float = Field(
        10.0, gt=0, description="A leader that cannot renew this long stops acting."
    )
    retry_seconds: float = Field(2.0, gt=0, description="Renew / try to acquire this often.")

    @model_validator(mode="after")
    def _ordered(self) -> LeaderElectionConfig:
        if not self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError("need retry_seconds < renew_deadline_seconds < lease_seconds")
        return self


def _micro(at: float) -> str:
    """A Kubernetes MicroTime."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    def __init__(
        self,
        config: LeaderElectionConfig,
        identity: str,
        api_client: Any,
        on_change: Callable[[bool], None] = lambda leading: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_death: Callable[[str], None] = lambda name: None,
    ) -> None:
        from kubernetes import client

        self.config = config
        self.identity = identity
        self.api = client.CoordinationV1Api(api_client)
        self.on_change = on_change
        self.clock, self.wall = clock, wall
        self._renewed: float | None = None  # (clock) our last successful acquire or renew
        self._observed: tuple[str, float] | None = None  # (holder's record, when it changed)
        self._was_leading = False
        self._stop = threading.Event()
        # (connect, read) for each API call: an answer later than the renew deadline is of
        # no use to a leader anyway
        read = config.renew_deadline_seconds
        self.timeout = (min(5.0, read), read)
        self.thread = Supervised(
            "leader-election",
            self._run,
            self._stop,
            on_death,
            stall_after=4 * sum(self.timeout) + config.retry_seconds,  # two calls an attempt
        )
        self._started = False

    @classmethod
    def from_environment(
        cls,
        config: LeaderElectionConfig,
        identity: str,
        on_change: Callable[[bool], None],
        on_death: Callable[[str], None] = lambda name: None,
    ) -> LeaseElector:
        from kubernetes import client
        from kubernetes import config as kube_config

        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        return cls(config, identity, client.ApiClient(), on_change, on_death=on_death)

    # -- state ---------------------------------------------------------------------------------
    @property
    def leading(self) -> bool:
        """True while our last renewal is recent enough to act on."""
        renewed = self._renewed
        return renewed is not None and self.clock() - renewed < self.config.renew_deadline_seconds

    def _changed(self) -> None:
        now = self.leading
        if now != self._was_leading:
            log.warning(
                "%s %s the lease %s/%s",
                self.identity,
                "holds" if now else "lost",
                self.config.namespace,
                self.config.lease_name,
            )
            self.on_change(now)
            # only once the change was handled: when on_change raised, the next look (the
            # restarted thread's) hands the change over again instead of losing it
            self._was_leading = now

    # -- one attempt ---------------------------------------------------------------------------
    def _spec(self, acquire: bool, current: dict[str, Any]) -> dict[str, Any]:
        now = _micro(self.wall())
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.config.lease_seconds)),
            "renewTime": now,
            "acquireTime": now if acquire else current.get("acquireTime", now),
            "leaseTransitions": int(current.get("leaseTransitions") or 0) + (1 if acquire else 0),
        }
        return spec

    def try_once(self) -> bool:
        """Acquire or renew the Lease once; True when this replica leads afterwards. API errors
        are logged and count as a failed renewal (never raised: this runs in a loop)."""
        c = self.config
        try:
            lease = self._read()
            if lease is None:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": c.lease_name, "namespace": c.namespace},
                    "spec": {**self._spec(True, {}), "leaseTransitions": 0},
                }
                self.api.create_namespaced_lease(
                    c.namespace,
                    # the client takes a plain dict body at run time; its annotations name V1Lease
                    body,  # type: ignore[arg-type]
                    _preload_content=False,
                    _request_timeout=self.timeout,
                )
                self._renewed = self.clock()
            else:
                spec = lease.get("spec") or {}
                holder = spec.get("holderIdentity") or ""
                record = json.dumps(
                    [holder, spec.get("renewTime"), spec.get("leaseTransitions")], sort_keys=True
                )
                if self._observed is None or self._observed[0] != record:
                    self._observed = (record, self.clock())
                expired = self.clock() - self._observed[1] >= c.lease_seconds
                if holder == self.identity or not holder or expired:
                    body = {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {
                            "name": c.lease_name,
                            "namespace": c.namespace,
                            "resourceVersion": lease["metadata"]["resourceVersion"],
                        },
                        "spec": self._spec(holder != self.identity, spec),
                    }
                    self.api.replace_namespaced_lease(
                        c.lease_name,
                        c.namespace,
                        body,  # type: ignore[arg-type]  # a dict, as above
                        _preload_content=False,
                        _request_timeout=self.timeout,
                    )
                    self._renewed = self.clock()
                elif self._renewed is not None:
                    self._renewed = None  # someone else holds it: we do not
        except Exception as exc:  # 409 (lost a race), API unreachable, ... : try again later
            status = getattr(exc, "status", None)
            if status == 409:
                log.info("lease %s/%s: lost a race (409)", c.namespace, c.lease_name)
            else:
                log.warning("lease %s/%s: %s", c.namespace, c.lease_name, exc)
        self._changed()
        return self.leading

    def _read(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            # _preload_content=False returns urllib3's raw response, not the annotated V1Lease
            r = cast(
                "BaseHTTPResponse",
                self.api.read_namespaced_lease(
                    self.config.lease_name,
                    self.config.namespace,
                    _preload_content=False,
                    _request_timeout=self.timeout,
                ),
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        lease = json.loads(r.data)
        if not isinstance(lease, dict) or "metadata" not in lease:
            raise ValueError("the Lease read back is not an object")
        return lease

    # -- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Renew in a supervised thread: one that dies is restarted (supervised.py)."""
        self._started = True
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.try_once()
            self.thread.beat()
            self._stop.wait(self.config.retry_seconds)
            self._changed()  # a renewal deadline passes while waiting: step down on time

    def stop(self, release: bool = True) -> None:
        """Stop electing; a leader gives the Lease up so a standby takes over at once."""
        self._stop.set()
        if self._started:
            self.thread.join(timeout=10)
        if release and self.leading:
            self._release()
        self._renewed = None
        self._changed()

    def _release(self) -> None:
        c = self.config
        try:
            lease = self._read()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1}
            body = {**lease, "spec": {k: v for k, v in spec.items() if v is not None}}
            self.api.replace_namespaced_lease(
                c.lease_name,
                c.namespace,
                body,  # type: ignore[arg-type]  # a dict: the client's annotations name V1Lease
                _preload_content=False,
                _request_timeout=self.timeout,
            )
        except Exception as exc:  # the standby takes over when the lease expires instead
            log.warning("cannot release the lease %s/%s: %s", c.namespace, c.lease_name, exc)
