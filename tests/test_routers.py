"""Lose nothing behind real routers (issue 27 item 3): a deferral burst, a never-fit refusal and
a drain, through vllm-router 0.1.17 (PyPI), nginx (Debian) and the twin's own gateway, in front
of two real vLLM servers on the twin with the real plugin, configured as docs/vllm-plugin.md
("Behind a router") says. Requests are sent by OpenAI's own Python client (what most callers
run): it retries 408/409/429/5xx, honouring Retry-After, `RETRIES` times here. A request is
lost when the client gives up on it or a stream breaks; a never-fit request's 400 is a refusal
with its reason, not a loss.

The twin serves Llama-3-8B's config on an H100 at gpu_memory_utilization 0.96 (the guard
server test's numbers): a neighbour taking 2 GiB leaves room for a 1,500-token prompt_logprobs
request only later (deferred), never for an 8,192-token one (400).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from oomguard.lab.processes import MODELS, VllmProcess, start_all
from oomguard.lab.routers import Nginx, NginxSettings, VllmRouter, VllmRouterSettings
from tests.vllm_server import AUTH, TOKEN, require_vllm

pytestmark = pytest.mark.slow

MODEL = MODELS / "llama-3-8b"
GIB = 2**30
RETRIES = 10  # the client's retries per request (OpenAI's default is 2)
DEFER_RETRY_AFTER = 1  # seconds: the engines' deferral Retry-After in these tests
GRACE = 4.0  # the drain's grace behind a router that learns of it from readiness (1 s x 2 + 2)


@dataclass
class Engines:
    servers: list[VllmProcess]
    states: list[Path]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def neighbour(self, nbytes: int) -> None:
        for state in self.states:
            state.write_text(json.dumps({"neighbour_bytes": nbytes}))


def start_engine(tmp: Path, i: int, state: Path) -> VllmProcess:
    return VllmProcess(
        "--no-skip-tokenizer-init",  # prompt_logprobs need the twin's offline tokenizer
        "--gpu-memory-utilization",
        "0.96",
        "--max-model-len",
        "16384",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "2",  # a few concurrent clients queue: the drain has queued requests to send elsewhere
        log=tmp / f"vllm-{i}.log",
        token=TOKEN,
        model=MODEL,
        timeout=600,
        env={
            "OOMGUARD_TWIN_GPU": "H100",
            "OOMGUARD_TWIN_MODEL": "llama-3-8b",
            "OOMGUARD_TWIN_TIME_COMPRESSION": "50",
            "OOMGUARD_TWIN_STATE_FILE": str(state),
            "OOMGUARD_ALLOCATOR_DIR": str(tmp / f"allocator-{i}"),
            "OOMGUARD_GUARD_MODE": "enforce",
            "OOMGUARD_GUARD_REFRESH_SECONDS": "0.2",
            "OOMGUARD_DEFER_RETRY_AFTER": str(DEFER_RETRY_AFTER),
            "OOMGUARD_PLUGIN_RETRY_AFTER": "1",
            "HF_HUB_OFFLINE": "1",
        },
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    require_vllm()
    tmp = tmp_path_factory.mktemp("routers")
    states = [tmp / f"gpu{i}.json" for i in range(2)]
    for s in states:
        s.write_text(json.dumps({}))
    servers = start_all([lambda i=i: start_engine(tmp, i, states[i]) for i in range(2)])
    try:
        for s in servers:
            wait_for_headroom(s.url)
        yield Engines(servers, states)
    finally:
        for s in servers:
            s.stop()


def wait_for_headroom(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "oomguard_guard_headroom_bytes" in httpx.get(f"{url}/metrics", timeout=10).text:
            return
        time.sleep(0.3)
    raise AssertionError("the guard never received headroom from the engine")


@pytest.fixture(autouse=True)
def serving(engines: Engines) -> Iterator[None]:
    """Every test starts and ends with both engines serving and nothing on their GPUs."""
    yield
    engines.neighbour(0)
    for url in engines.urls:
        httpx.post(f"{url}/oomguard/v1/resume", headers=AUTH, timeout=30)


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 131 + k * 7) % 1000 + 3 for k in range(n)]  # within the twin tokenizer


@dataclass
class Tally:
    """What the clients saw, by request kind."""

    served: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)  # 400s with their error

    def ok(self, kind: str) -> None:
        self.served[kind] = self.served.get(kind, 0) + 1


async def send(
    client: Any, tally: Tally, kind: str, prompt: list[int], max_tokens: int, **extra: Any
) -> None:
    """One request through OpenAI's client; streamed unless `stream=False` is given."""
    import openai

    stream = extra.pop("stream", True)
    try:
        if stream:
            got = 0
            answer = await client.completions.create(
                model=str(MODEL),
                prompt=prompt,
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True, **extra},
            )
            async for chunk in answer:
                got += len(chunk.choices)
            if got == 0:
                tally.lost.append(f"{kind}: empty stream")
                return
        else:
            await client.completions.create(
                model=str(MODEL),
                prompt=prompt,
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True, **extra},
            )
        tally.ok(kind)
    except openai.BadRequestError as exc:
        tally.refused.append({"kind": kind, **(exc.body or {})})  # type: ignore[dict-item]
    except openai.APIError as exc:
        tally.lost.append(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}")


def client_for(url: str) -> Any:
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=RETRIES, timeout=120
    )


# -- routers -------------------------------------------------------------------------------------
def vllm_router(tmp: Path, engines: Engines, readiness: bool = True) -> VllmRouter:
    settings = VllmRouterSettings(readiness=readiness, interval_s=1, failures=2, timeout_s=2)
    return VllmRouter(tmp / "vllm-router", engines.urls, settings)


def nginx(tmp: Path, engines: Engines, settings: NginxSettings | None = None) -> Nginx:
    return Nginx(tmp / "nginx", engines.urls, settings or NginxSettings())


def wait_deferring(engines: Engines) -> None:
    """Until every engine's guard defers a 1,500-token prompt_logprobs request (its headroom
    refresh saw the neighbour)."""
    deadline = time.monotonic() + 30
    for url in engines.urls:
        while True:
            r = httpx.post(
                f"{url}/v1/completions",
                json={
                    "model": str(MODEL),
                    "prompt": ids(1500, 99),
                    "max_tokens": 1,
                    "prompt_logprobs": 0,
                },
                timeout=120,
            )
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) == DEFER_RETRY_AFTER
                assert r.headers["x-should-retry"] == "true"
                break
            assert time.monotonic() < deadline, f"{url} never deferred: {r.status_code}"
            time.sleep(0.3)


async def deferral_burst(
    url: str, engines: Engines, neighbour_s: float = 4.0, wait: bool = True
) -> Tally:
    """Both engines defer long prompt_logprobs requests for `neighbour_s` while 6 of them, 1
    never-fit (8,192 tokens) and 24 short requests arrive at once through `url` (`wait`: first
    check that each engine answers a deferral 429)."""
    engines.neighbour(2 * GIB)
    if wait:
        await asyncio.to_thread(wait_deferring, engines)
    tally = Tally()
    client = client_for(url)
    tasks = [
        asyncio.create_task(
            send(client, tally, "long", ids(1500, i), 2, prompt_logprobs=0, stream=i % 2 == 0)
        )
        for i in range(6)
    ]
    tasks.append(
        asyncio.create_task(send(client, tally, "never", ids(8192, 50), 2, prompt_logprobs=0))
    )
    tasks += [
        asyncio.create_task(send(client, tally, "short", ids(16, 100 + i), 8, stream=i % 2 == 0))
        for i in range(24)
    ]
    await asyncio.sleep(neighbour_s)
    engines.neighbour(0)  # the neighbour leaves: the deferred requests fit now
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    await client.close()
    return tally


def check_burst(tally: Tally) -> None:
    assert tally.lost == [], tally.lost
    assert tally.served == {"long": 6, "short": 24}, tally.served
    [never] = tally.refused
    assert never["kind"] == "never" and never["param"] == "prompt_logprobs", never


@pytest.mark.parametrize("router", ["vllm-router", "nginx"])
def test_deferral_burst_and_never_fit_lose_nothing(engines, tmp_path, router):
    front = vllm_router(tmp_path, engines) if router == "vllm-router" else nginx(tmp_path, engines)
    try:
        tally = asyncio.run(deferral_burst(front.url, engines))
        check_burst(tally)
        # nothing was ejected or tripped: both engines take requests at once, none refused
        if isinstance(front, VllmRouter):
            assert sorted(front.workers()) == sorted(engines.urls)
        quick = Tally()

        async def after() -> None:
            client = client_for(front.url)
            await asyncio.gather(
                *(send(client, quick, "short", ids(16, 300 + i), 4) for i in range(8))
            )
            await client.close()

        asyncio.run(after())
        assert quick.lost == [] and quick.served == {"short": 8}
    finally:
        front.stop()


# -- drains --------------------------------------------------------------------------------------
def state(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/oomguard/v1/state", timeout=10).json()


async def drain_under_load(
    url: str,
    engines: Engines,
    drain: Any,
    resume: Any,
    clients: int = 8,
    seconds: float = 16.0,
    drain_at: float = 4.0,
    resume_at: float = 11.0,
) -> tuple[Tally, dict[str, Any]]:
    """`clients` closed-loop clients (streamed and not) through `url`; at `drain_at` the engine
    holding the most requests is drained with `drain(engine_url)`, at `resume_at` resumed."""
    tally = Tally()
    client = client_for(url)
    stop = time.monotonic() + seconds  # the load's end (moved if the drain starts late)

    async def user(u: int) -> None:
        i = 0
        while time.monotonic() < stop:
            await send(client, tally, "load", ids(16, 1000 + u * 1000 + i), 400, stream=u % 4 != 3)
            i += 1

    users = [asyncio.create_task(user(u)) for u in range(clients)]
    await asyncio.sleep(drain_at)
    deadline = time.monotonic() + 30  # a loaded machine may take a while to get going
    while True:
        held = [await asyncio.to_thread(state, e) for e in engines.urls]
        load = [h["running"] + h["waiting"] for h in held]
        if max(load) >= 2 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    busiest = max(range(len(held)), key=lambda i: load[i])
    target = engines.urls[busiest]
    before = held[busiest]
    await asyncio.to_thread(drain, target)
    stop = max(stop, time.monotonic() + seconds - drain_at)
    await asyncio.sleep(resume_at - drain_at)
    during = await asyncio.to_thread(state, target)
    await asyncio.to_thread(resume, target)
    await asyncio.wait_for(asyncio.gather(*users), 180)
    await client.close()
    return tally, {
        "held_at_drain": before["running"] + before["waiting"],
        "waiting_at_drain": before["waiting"],
        "shed": during["shed_total"] - before["shed_total"],
        "drained": during["drained"],
    }


def plugin_drain(grace: float) -> Any:
    def drain(url: str) -> None:
        r = httpx.post(
            f"{url}/oomguard/v1/drain", json={"grace_seconds": grace}, headers=AUTH, timeout=30
        )
        assert r.status_code == 200, r.text

    return drain


def plugin_resume(url: str) -> None:
    assert httpx.post(f"{url}/oomguard/v1/resume", headers=AUTH, timeout=30).status_code == 200


def check_drain(tally: Tally, seen: dict[str, Any]) -> None:
    print("drain:", seen, "served:", tally.served)
    assert tally.lost == [], tally.lost
    assert seen["held_at_drain"] > 0, seen  # the drained engine was serving the load
    assert seen["drained"], seen  # it emptied: a restart would have lost nothing
    assert tally.served["load"] >= 8


def test_drain_behind_vllm_router_readiness(engines, tmp_path):
    """vllm-router health-checks /oomguard/v1/ready every second (2 failures: out); the drain
    keeps queueing for its grace, then sheds: nothing reaches a client as an error."""
    front = vllm_router(tmp_path, engines, readiness=True)
    try:
        tally, seen = asyncio.run(
            drain_under_load(front.url, engines, plugin_drain(GRACE), plugin_resume)
        )
        check_drain(tally, seen)
    finally:
        front.stop()


def test_drain_behind_vllm_router_admin_api(engines, tmp_path):
    """The remediator's own actuator removes the worker from vllm-router, then drains with no
    grace (queued requests shed at once: their streams answer 503, which the router retries on
    the peer), and adds it back after the resume."""
    from oomguard.remediator.actuator import PluginActuator, Target
    from oomguard.remediator.router import Route, RoutedActuator, RouterConfig

    front = vllm_router(tmp_path, engines, readiness=False)
    router = RouterConfig(name="front", url=front.url, timeout_seconds=60)
    actuator = RoutedActuator(PluginActuator(), {u: Route(router, u) for u in engines.urls})

    def drain(url: str) -> None:
        out = actuator.drain(Target(url, url, TOKEN))
        assert out["router"] == {"removed": True} and out["mode"] == "draining", out
        assert url not in front.workers()

    def resume(url: str) -> None:
        assert actuator.resume(Target(url, url, TOKEN))["router"] == {"added": True}
        assert url in front.workers()

    try:
        tally, seen = asyncio.run(drain_under_load(front.url, engines, drain, resume))
        check_drain(tally, seen)
    finally:
        actuator.close()
        front.stop()


def test_drain_behind_nginx(engines, tmp_path):
    """nginx retries the drain's 503 on the peer (`http_503 non_idempotent`), streams included:
    their 503 comes before any byte of the stream."""
    front = nginx(tmp_path, engines)
    try:
        tally, seen = asyncio.run(
            drain_under_load(front.url, engines, plugin_drain(0.0), plugin_resume)
        )
        check_drain(tally, seen)
    finally:
        front.stop()


# -- the plugin's side, on one engine ------------------------------------------------------------
async def stream_status(
    c: httpx.AsyncClient, url: str, seed: int
) -> tuple[int, dict[str, str], bytes]:
    """A streamed completion: its status, headers and whole body."""
    body = {"model": str(MODEL), "prompt": ids(16, seed), "max_tokens": 400, "stream": True}
    async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
        return r.status_code, dict(r.headers), await r.aread()


def test_a_stream_shed_by_a_drain_is_a_503_before_any_byte(engines):
    """vLLM answers 200 to a streamed request before the engine has it; shed from the queue by
    a drain it would be an error event inside that 200, which no router retries. The plugin
    holds the 200 until the first chunk and answers the error's own status instead."""
    url = engines.urls[0]

    async def scenario() -> tuple[int, list[tuple[int, dict[str, str], bytes]]]:
        async with httpx.AsyncClient(timeout=120) as c:
            await c.put(f"{url}/oomguard/v1/admission", json={"cap": 1}, headers=AUTH)
            try:
                tasks = [asyncio.create_task(stream_status(c, url, 7000 + i)) for i in range(3)]
                for _ in range(1000):
                    s = (await c.get(f"{url}/oomguard/v1/state")).json()
                    if (s["running"], s["waiting"]) == (1, 2):
                        break
                    await asyncio.sleep(0.01)
                assert (s["running"], s["waiting"]) == (1, 2), s
                r = await c.post(f"{url}/oomguard/v1/drain", headers=AUTH)
                assert r.json()["shedding"], r.json()
                results = await asyncio.gather(*tasks)
                after = (await c.get(f"{url}/oomguard/v1/state")).json()
                return after["shed_total"] - s["shed_total"], results
            finally:
                await c.post(f"{url}/oomguard/v1/resume", headers=AUTH)
                await c.put(f"{url}/oomguard/v1/admission", json={"cap": 2}, headers=AUTH)

    # A queued request that already holds KV blocks is not shed: vLLM runs it under the drain's
    # PAUSED_NEW and it finishes here (engine.shed_waiting). Which of the two queued ones that is
    # depends on vLLM's timing (seen in CI about once in five runs on 2 CPUs), so the statuses
    # must match what the engine shed, and a try in which it shed nothing is made again.
    for _ in range(3):
        shed, results = asyncio.run(scenario())
        statuses = sorted(status for status, _, _ in results)
        assert statuses == sorted([200] * (3 - shed) + [503] * shed), (
            shed,
            [(s, b[:200]) for s, _, b in results],
        )
        if shed:
            break
    else:
        pytest.fail("the drain found no queued request to shed in 3 tries")
    for status, headers, body in results:
        if status == 503:
            assert headers["content-type"] == "application/json"
            assert int(headers["retry-after"]) > 0 and headers["x-should-retry"] == "true"
            error = json.loads(body)["error"]
            assert error["code"] == 503 and "retry" in error["message"]
        else:
            assert b"data: [DONE]" in body and b'"error"' not in body


def test_a_drain_with_grace_leaves_rotation_first_and_sheds_after(engines):
    """With a grace, readiness fails at once and nothing new starts, but requests arriving are
    queued, not refused; when the grace ends they are shed (503) and new ones refused at the
    door. /health (liveness) stays 200 throughout."""
    url = engines.urls[1]

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(f"{url}/oomguard/v1/drain", json={"grace_seconds": 3}, headers=AUTH)
            assert r.status_code == 200 and r.json()["mode"] == "draining"
            assert not r.json()["shedding"]
            assert (await c.get(f"{url}/oomguard/v1/ready")).status_code == 503
            assert (await c.get(f"{url}/health")).status_code == 200
            t0 = time.monotonic()
            queued = asyncio.create_task(stream_status(c, url, 8000))
            await asyncio.sleep(1.0)
            s = (await c.get(f"{url}/oomguard/v1/state")).json()
            assert (s["waiting"], s["shedding"]) == (1, False), s  # queued, not refused
            status, _, _ = await queued
            assert status == 503 and time.monotonic() - t0 >= 2.0  # shed when the grace ended
            door = await c.post(
                f"{url}/v1/completions",
                json={"model": str(MODEL), "prompt": ids(8, 1), "max_tokens": 2},
            )
            assert door.status_code == 503 and "draining" in door.text
            s = (await c.get(f"{url}/oomguard/v1/state")).json()
            assert s["shedding"] and s["drained"], s
            assert (await c.get(f"{url}/health")).status_code == 200
            await c.post(f"{url}/oomguard/v1/resume", headers=AUTH)
            assert (await c.get(f"{url}/oomguard/v1/ready")).status_code == 200

    asyncio.run(scenario())


def test_drain_body_is_checked(engines):
    url = engines.urls[1]
    for body in ('{"grace_seconds": -1}', '{"grace_seconds": "5"}', '{"grace": 1}', "[", "1e999"):
        r = httpx.post(f"{url}/oomguard/v1/drain", content=body, headers=AUTH, timeout=30)
        assert r.status_code == 400, (body, r.text)
    assert state(url)["mode"] == "serving"  # a refused body drains nothing
    assert httpx.post(
        f"{url}/oomguard/v1/drain", content=b'{"grace_seconds": 1}', timeout=30
    ).status_code in (401, 403)
