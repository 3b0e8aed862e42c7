"""Routers benchmark: what each choice of status code and router setting loses, measured.

tests/test_routers.py proves the recommended settings lose nothing; this measures the choices
behind them, on the same two real vLLM servers on the twin with the plugin and OpenAI's client
as the caller (retrying 10 times after Retry-After), so that each choice in docs/vllm-plugin.md
("Behind a router") stands on a number recorded here:

- a deferral burst (both engines defer 6 long prompt_logprobs requests for 4 s while 24 short
  ones and one that never fits arrive) with the deferral answered 429 (the default) or 503,
  behind vllm-router (its default cache_aware policy, and round_robin) and nginx (recommended,
  and told to retry 429 too);
- a drain behind vllm-router that learns of it from readiness, with the drain's grace 0 (shed at
  once) or covering the router's checks.

Each cell records the requests lost (short ones apart: those no deferral concerns), whether the
router still had both engines afterwards, and what 8 short requests sent right after the burst
lost with OpenAI's default 2 retries (a router whose breakers the burst opened fails them).

Usage: python -m bench.routers [--quick] [--out bench/results/routers.json]
(--quick: the 429/503 deferral cells behind vllm-router and nginx only).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import record
from oomguard.lab.processes import start_all
from oomguard.lab.routers import (
    Nginx,
    NginxSettings,
    VllmRouter,
    VllmRouterSettings,
)
from tests import test_routers as scenario

ROOT = Path(__file__).resolve().parents[1]


def engines(tmp: Path, defer_status: int) -> scenario.Engines:
    import os

    os.environ["OOMGUARD_DEFER_STATUS"] = str(defer_status)  # the engines inherit it
    tmp.mkdir(parents=True, exist_ok=True)
    states = [tmp / f"gpu{i}.json" for i in range(2)]
    for s in states:
        s.write_text("{}")
    servers = start_all(
        [functools.partial(scenario.start_engine, tmp, i, states[i]) for i in range(2)]
    )
    for server in servers:
        scenario.wait_for_headroom(server.url)
    return scenario.Engines(servers, states)


def burst_cell(front: Any, e: scenario.Engines) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        tally = asyncio.run(deferral_burst(front.url, e))
    finally:
        e.neighbour(0)
    after = asyncio.run(right_after(front.url))
    short_lost = [x for x in tally.lost if x.startswith("short")]
    out: dict[str, Any] = {
        "lost": len(tally.lost),
        "short_lost": len(short_lost),
        "served": tally.served,
        "refused_400": len(tally.refused),
        "lost_examples": sorted(set(x[:120] for x in tally.lost))[:4],
        "seconds": round(time.monotonic() - t0, 1),
        # 8 short requests sent just after, by a client with OpenAI's default 2 retries: a
        # router whose breakers the burst opened fails them too
        "after_lost": len(after.lost),
        "after_examples": sorted(set(x[:120] for x in after.lost))[:2],
    }
    if isinstance(front, VllmRouter):
        out["workers_after"] = len(front.workers())
    return out


async def deferral_burst(url: str, e: scenario.Engines) -> scenario.Tally:
    """The test's burst, waiting for either deferral status."""
    e.neighbour(2 * scenario.GIB)
    await asyncio.sleep(2.0)  # two guard refreshes (0.2 s) on a loaded machine
    return await scenario.deferral_burst(url, e, neighbour_s=4.0, wait=False)


async def right_after(url: str) -> scenario.Tally:
    import openai

    tally = scenario.Tally()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=60)
    await asyncio.gather(
        *(scenario.send(client, tally, "short", scenario.ids(16, 500 + i), 4) for i in range(8))
    )
    await client.close()
    return tally


def drain_cell(front: VllmRouter, e: scenario.Engines, grace: float) -> dict[str, Any]:
    tally, seen = asyncio.run(
        scenario.drain_under_load(
            front.url, e, scenario.plugin_drain(grace), scenario.plugin_resume
        )
    )
    return {"grace_s": grace, "lost": len(tally.lost), "served": tally.served, **seen}


FRONTS = (
    "vllm-router cache_aware",
    "nginx recommended",
    "vllm-router round_robin",
    "nginx also retrying 429",
)
FRONTS_QUICK = FRONTS[:2]


def make_front(name: str, work: Path, urls: list[str]) -> VllmRouter | Nginx:
    checks: dict[str, Any] = {"interval_s": 1, "failures": 2}
    if name == "vllm-router cache_aware":
        return VllmRouter(work, urls, VllmRouterSettings(**checks))
    if name == "vllm-router round_robin":
        return VllmRouter(work, urls, VllmRouterSettings(policy="round_robin", **checks))
    if name == "nginx also retrying 429":
        return Nginx(work, urls, NginxSettings(retry_429=True))
    return Nginx(work, urls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "routers.json"))
    args = parser.parse_args()
    cells: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="oomguard-routers-"))
    for status in (429, 503):
        e = engines(tmp / f"engines-{status}", status)
        try:
            fronts = FRONTS_QUICK if args.quick else FRONTS
            for name in fronts:
                front = make_front(name, tmp / f"{status}-{name.replace(' ', '-')}", e.urls)
                try:
                    key = f"deferral {status} behind {name}"
                    cells[key] = burst_cell(front, e)
                    print(f"{key}: {json.dumps(cells[key])}", flush=True)
                finally:
                    front.stop()
                time.sleep(2)
            if status == 429 and not args.quick:
                for grace in (0.0, scenario.GRACE):
                    front = VllmRouter(
                        tmp / f"vr-drain-{grace}",
                        e.urls,
                        VllmRouterSettings(interval_s=1, failures=2),
                    )
                    try:
                        key = f"drain behind vllm-router readiness, grace {grace:g} s"
                        cells[key] = drain_cell(front, e, grace)
                        print(f"{key}: {json.dumps(cells[key])}", flush=True)
                    finally:
                        front.stop()
        finally:
            for s in e.servers:
                s.stop()
    record.write(
        args.out,
        "routers",
        args.quick,
        client=f"OpenAI Python client, {scenario.RETRIES} retries after Retry-After",
        cells=cells,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
