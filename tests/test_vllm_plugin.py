"""The oomguard plugin on the real vLLM server (vLLM 0.33, CPU platform, model-free executor).

Nothing of vLLM is mocked: its API server, EngineCore, V1 scheduler and KV cache manager run;
only the model is absent (twin/executor.py returns one token per scheduled request).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.vllm_server import AUTH, VllmServer, complete, require_vllm

pytestmark = pytest.mark.slow

KV_BLOCKS = 256  # 4,096 tokens: 64 requests of 700 tokens must queue and preempt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    s = VllmServer(
        "--max-num-seqs",
        "64",
        "--max-model-len",
        "2048",
        env={"OOMGUARD_TWIN_KV_BLOCKS": str(KV_BLOCKS), "OOMGUARD_TWIN_STEP_SECONDS": "0.002"},
        log=tmp_path_factory.mktemp("vllm") / "vllm.log",
    )
    yield s
    s.stop()


def put_cap(server, cap, headers=AUTH, **kw):
    return httpx.put(
        f"{server.url}/oomguard/v1/admission", json={"cap": cap}, headers=headers, timeout=10, **kw
    )


@pytest.fixture(autouse=True)
def full_admission(request, server):
    yield
    if server.proc.poll() is None:
        httpx.post(f"{server.url}/oomguard/v1/resume", headers=AUTH, timeout=10)
        put_cap(server, 64)


async def flood(
    server, cap: int | None, n: int = 64, prompt_len: int = 600, max_tokens: int = 100
) -> dict:
    """n long requests arriving 5 ms apart; optionally lower the cap once 2 are running."""
    url = server.url
    async with httpx.AsyncClient(timeout=300) as c:
        before = (await c.get(f"{url}/oomguard/v1/state")).json()
        tasks: list[asyncio.Task] = []

        async def launch() -> None:
            for i in range(n):
                tasks.append(asyncio.create_task(complete(c, url, i, prompt_len, max_tokens)))
                await asyncio.sleep(0.005)

        launcher = asyncio.create_task(launch())
        at_change, max_after, result = None, 0, None
        while not launcher.done() or not all(t.done() for t in tasks):
            s = (await c.get(f"{url}/oomguard/v1/state")).json()
            if cap is not None and at_change is None and s["running"] >= 2:
                result = (
                    await c.put(f"{url}/oomguard/v1/admission", json={"cap": cap}, headers=AUTH)
                ).json()
                at_change = result["state"]["running"]
            elif at_change is not None:
                max_after = max(max_after, s["running"])
            await asyncio.sleep(0.01)
        responses = [t.result() for t in tasks]
        after = (await c.get(f"{url}/oomguard/v1/state")).json()
    return {
        "statuses": [r.status_code for r in responses],
        "tokens": [
            r.json()["usage"]["completion_tokens"] for r in responses if r.status_code == 200
        ],
        "preemptions": after["preemptions_total"] - before["preemptions_total"],
        "at_change": at_change,
        "max_after": max_after,
        "result": result,
        "after": after,
    }


def test_lowering_the_cap_under_load_keeps_the_engine_alive_and_cuts_preemptions(server):
    uncapped = asyncio.run(flood(server, None))
    assert uncapped["statuses"] == [200] * 64 and uncapped["tokens"] == [100] * 64
    assert uncapped["preemptions"] > 0, "the load must be heavy enough to preempt"

    capped = asyncio.run(flood(server, 2))
    assert server.alive()
    assert capped["statuses"] == [200] * 64 and capped["tokens"] == [100] * 64
    assert capped["result"]["admission_cap"] == 2 and not capped["result"]["clamped"]
    # lowering the cap never preempts or aborts: what runs keeps running, nothing new joins
    assert capped["max_after"] <= max(2, capped["at_change"])
    assert capped["preemptions"] < uncapped["preemptions"]
    # the counters the remediator's staged re-admission reads
    since = capped["after"]["since_cap_change"]
    assert since["admitted"] > 0
    assert since["admitted"] + capped["at_change"] <= since["finished"] <= 64
    assert capped["after"]["admission_cap"] == 2


def test_drain_finishes_running_holds_queued_and_refuses_new(server):
    async def scenario() -> None:
        url = server.url
        async with httpx.AsyncClient(timeout=120) as c:
            await c.put(f"{url}/oomguard/v1/admission", json={"cap": 3}, headers=AUTH)
            tasks = [asyncio.create_task(complete(c, url, 100 + i, 200, 300)) for i in range(6)]
            for _ in range(500):
                s = (await c.get(f"{url}/oomguard/v1/state")).json()
                if s["running"] == 3 and s["waiting"] == 3:
                    break
                await asyncio.sleep(0.01)
            assert (s["running"], s["waiting"]) == (3, 3)
            drained = await c.post(f"{url}/oomguard/v1/drain", headers=AUTH)
            assert drained.status_code == 200 and drained.json()["mode"] == "draining"

            refused = await complete(c, url, 999, 10, 5)
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
            assert (await c.get(f"{url}/oomguard/v1/ready")).status_code == 503
            # the three running requests finish; the three queued ones wait, not aborted
            for _ in range(1000):
                s = (await c.get(f"{url}/oomguard/v1/state")).json()
                if s["drained"]:
                    break
                await asyncio.sleep(0.01)
            assert s["drained"] and s["running"] == 0 and s["waiting"] == 3
            assert sum(t.done() for t in tasks) == 3
            assert all(t.result().status_code == 200 for t in tasks if t.done())

            resumed = await c.post(f"{url}/oomguard/v1/resume", headers=AUTH)
            assert resumed.json()["mode"] == "serving"
            assert (await c.get(f"{url}/oomguard/v1/ready")).status_code == 200
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))
            assert (await complete(c, url, 1000, 10, 5)).status_code == 200

    asyncio.run(scenario())


def test_mutating_routes_need_the_token_and_reads_do_not(server):
    for method, path, body in (
        ("PUT", "/admission", {"cap": 1}),
        ("POST", "/drain", None),
        ("POST", "/resume", None),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
            r = httpx.request(
                method, f"{server.url}/oomguard/v1{path}", json=body, headers=headers, timeout=10
            )
            assert r.status_code == 401, (path, headers, r.text)
    assert server.state()["mode"] == "serving"  # nothing happened
    assert server.state()["admission_cap"] == 64
    assert httpx.get(f"{server.url}/oomguard/v1/ready", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"cap": "x"}, "valid integer"),
        ({"cap": 2.5}, "valid integer"),
        ({}, "cap"),
        ({"cap": 2, "force": True}, "force"),
        ({"cap": True}, "valid integer"),
    ],
)
def test_bad_admission_bodies_are_400_and_change_nothing(server, body, fragment):
    r = httpx.put(f"{server.url}/oomguard/v1/admission", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 400 and fragment in r.text
    assert server.state()["admission_cap"] == 64


def test_not_json_is_400(server):
    r = httpx.put(
        f"{server.url}/oomguard/v1/admission",
        content=b"{cap:",
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400


@pytest.mark.parametrize(("cap", "applied"), [(0, 1), (-5, 1), (10_000, 64), (64, 64)])
def test_caps_out_of_range_are_clamped_and_say_so(server, cap, applied):
    body = put_cap(server, cap).json()
    assert body["admission_cap"] == applied and body["clamped"] == (cap != applied)
    if cap != applied:
        assert "outside 1..64" in body["message"]
    assert server.state()["admission_cap"] == applied
