"""The request guard's ledger: transient memory admitted and not yet used up.

The guard decides each request against headroom an engine reported up to a refresh ago. Without
a ledger, two requests decided a millisecond apart both see the same headroom and are both
admitted, though only one fits: both wait behind a long prefill, land in the same step, and the
engine dies of a CUDA OOM (issue 25, defect 1). So what the guard admits is held here, from the
decision until the request's prefill is complete, and every later decision sees the room minus
what is held.

A reservation ends (never leaks) when:
- the engine's first output for the request arrives in the API server (`prefilled`: EngineCore
  sends no output for a partial prefill, so any output means the prompt is computed; an error or
  an abort reported by the engine is an output too);
- the request's `generate` ends in the API server (`ended`: completion, abort, client disconnect,
  error, engine death) or its unread stream is dropped (`dropped`);
- it is older than `ttl` seconds (`expired`): the last resort for a caller that bypassed both
  (e.g. an `add_request` that never reached an engine). An expiry is counted; a non-zero count
  says a path leaks.

Keys are vLLM's internal request ids once `assign_request_id` has made them (unique: external id
plus a random suffix); a request decided before that (a streamed one, decided when `generate` is
called) is held under its external id until then (`rekey`).

Pure and thread-safe (one lock; a few dict operations per reserving request); no vLLM import.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

RELEASE_HOWS = ("prefilled", "ended", "dropped", "expired")


@dataclass
class Reservation:
    need: int
    at: float


class Ledger:
    def __init__(self, ttl: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._held: dict[str, Reservation] = {}
        self._alias: dict[str, str] = {}  # external id -> internal id (its `generate` ends)
        self._total = 0
        self._oldest = float("inf")
        self._lock = threading.Lock()
        self.released = dict.fromkeys(RELEASE_HOWS, 0)
        self.reserved_count = 0

    # -- what decisions read ---------------------------------------------------------------------
    def held(self) -> int:
        """Bytes held now (expired reservations dropped first)."""
        if not self._held:
            return 0
        if self.clock() - self._oldest > self.ttl:
            self._expire()
        return self._total

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    # -- changes ---------------------------------------------------------------------------------
    def reserve(self, key: str, need: int) -> None:
        """Hold `need` bytes for request `key` (a second reservation under the same key adds)."""
        if need <= 0:
            return
        with self._lock:
            now = self.clock()
            r = self._held.get(key)
            if r is None:
                self._held[key] = Reservation(need, now)
            else:
                r.need += need
            self._total += need
            self._oldest = min(self._oldest, now)
            self.reserved_count += 1

    def rekey(self, external: str, internal: str) -> None:
        """The request held under `external` got its internal id."""
        with self._lock:
            r = self._held.pop(external, None)
            if r is None:
                return
            other = self._held.get(internal)
            if other is not None:
                other.need += r.need
            else:
                self._held[internal] = r
            self._alias[external] = internal

    def alias(self, external: str, internal: str) -> None:
        """`generate(external)` will end the reservation held under `internal`."""
        with self._lock:
            if internal in self._held:
                self._alias[external] = internal

    def release(self, key: str, how: str = "prefilled") -> int:
        """End the reservation held under `key`; the bytes it held (0: none held)."""
        if key not in self._held:
            return 0
        with self._lock:
            r = self._held.pop(key, None)
            if r is None:
                return 0
            self._total -= r.need
            self.released[how] = self.released.get(how, 0) + 1
            if not self._held:
                self._oldest = float("inf")
                self._alias.clear()
            return r.need

    def release_request(self, external: str, how: str = "ended") -> int:
        """`generate(external)` ended: end its reservation, under whichever key it is held."""
        with self._lock:
            internal = self._alias.pop(external, None)
        freed = self.release(internal, how) if internal is not None else 0
        return freed + self.release(external, how)

    def _expire(self) -> None:
        with self._lock:
            now = self.clock()
            old = [k for k, r in self._held.items() if now - r.at > self.ttl]
            for key in old:
                r = self._held.pop(key)
                self._total -= r.need
                self.released["expired"] += 1
            self._oldest = min((r.at for r in self._held.values()), default=float("inf"))
            if not self._held:
                self._alias.clear()
