"""The oomguard plugin on the real vLLM server (vLLM 0.33, CPU platform, model-free executor).

Nothing of vLLM is mocked: its API server, EngineCore, V1 scheduler and KV cache manager run;
only the model is absent (twin/oomguard/twin/executor.py returns one token per scheduled request).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from oomguard import vllm_seam
from tests.vllm_server import AUTH, MODEL, VllmServer, complete, require_vllm

pytestmark = pytest.mark.slow

KV_BLOCKS = 256  # 4,096 tokens: 64 requests of 700 tokens must queue and preempt

# vLLM 0.32 (tests/test_vllm032.py runs this file on it) cannot end a request from the engine with
# a retryable error: its EngineCoreOutput has no `error` (vllm_seam.ENGINE_OUTPUT_ERROR). A drain
# still stops admissions and lets running requests finish, but the queued ones it sheds are
# answered 500, not 503 + Retry-After; and a drain under preemption does not preempt there.
SHED_IS_RETRYABLE = pytest.mark.xfail(
    not vllm_seam.ENGINE_OUTPUT_ERROR,
    reason="vLLM 0.32: shed requests are answered 500 (no error field in EngineCoreOutput)",
    strict=True,
)


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
    # the counters the remediator's staged re-admission reads
    since = capped["after"]["since_cap_change"]
    # preemptions after the change: fewer than with no cap, and none at all when what ran at
    # the change fits the pool (on a loaded machine many requests may be in before the change,
    # so the run's total is not compared: it depends on how fast the client got the cap in)
    assert since["preemptions"] < uncapped["preemptions"]
    if capped["at_change"] * -(-(600 + 100) // 16) <= KV_BLOCKS:
        assert since["preemptions"] == 0
    assert since["admitted"] > 0
    assert since["admitted"] + capped["at_change"] <= since["finished"] <= 64
    assert capped["after"]["admission_cap"] == 2


def test_an_admission_counts_as_prefilled_while_it_still_decodes(server):
    # what the staged re-admission counts as a clean admission: its prompt fully computed
    # (its KV allocated), long before its last token
    async def scenario() -> tuple[dict, dict]:
        url = server.url
        async with httpx.AsyncClient(timeout=120) as c:
            await c.put(f"{url}/oomguard/v1/admission", json={"cap": 1}, headers=AUTH)
            task = asyncio.create_task(complete(c, url, 500, 600, 1400))
            during: dict = {}
            for _ in range(2000):
                s = (await c.get(f"{url}/oomguard/v1/state")).json()
                if s["since_cap_change"]["prefilled"] >= 1 or task.done():
                    during = s
                    break
                await asyncio.sleep(0.005)
            response = await task
            assert response.status_code == 200
            after = (await c.get(f"{url}/oomguard/v1/state")).json()
        return during, after

    during, after = asyncio.run(scenario())
    since = during["since_cap_change"]
    assert since["prefilled"] == since["admitted"] == 1
    assert since["finished"] == 0 and during["running"] == 1  # still decoding
    assert after["since_cap_change"]["finished"] == after["since_cap_change"]["prefilled"] == 1


@SHED_IS_RETRYABLE
def test_drain_finishes_running_and_sends_queued_requests_elsewhere(server):
    async def scenario() -> None:
        url = server.url
        async with httpx.AsyncClient(timeout=120) as c:
            before = (await c.get(f"{url}/oomguard/v1/state")).json()
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
            # the queued three end at once, retryable, while the running three still run
            done, _ = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            first = next(iter(done)).result()
            assert first.status_code == 503 and int(first.headers["retry-after"]) > 0
            assert (await c.get(f"{url}/oomguard/v1/state")).json()["running"] == 3

            refused = await complete(c, url, 999, 10, 5)
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
            assert (await c.get(f"{url}/oomguard/v1/ready")).status_code == 503
            results = await asyncio.gather(*tasks)
            statuses = sorted(r.status_code for r in results)
            assert statuses == [200, 200, 200, 503, 503, 503], statuses
            ok = [r for r in results if r.status_code == 200]
            assert all(r.json()["usage"]["completion_tokens"] == 300 for r in ok)
            shed = [r for r in results if r.status_code == 503]
            assert all(int(r.headers["retry-after"]) > 0 for r in shed)
            assert all("retry" in r.json()["error"]["message"] for r in shed)
            s = (await c.get(f"{url}/oomguard/v1/state")).json()
            # drained: nothing running and nothing queued, so a restart now loses nothing
            assert s["drained"] and (s["running"], s["waiting"]) == (0, 0)
            assert s["shed_total"] - before["shed_total"] == 3

            resumed = await c.post(f"{url}/oomguard/v1/resume", headers=AUTH)
            assert resumed.json()["mode"] == "serving"
            assert (await c.get(f"{url}/oomguard/v1/ready")).status_code == 200
            assert (await complete(c, url, 1000, 10, 5)).status_code == 200

    asyncio.run(scenario())


@SHED_IS_RETRYABLE
def test_requests_preempted_while_draining_go_elsewhere_too(server):
    """Under vLLM's PAUSED_NEW a request preempted back to the queue would wait for good, so the
    engine would never drain. 12 requests of 200 + 400 tokens need 7,200 KV tokens of 4,096:
    those running when the drain starts preempt one another as they grow."""

    async def scenario() -> None:
        url = server.url
        async with httpx.AsyncClient(timeout=120) as c:
            before = (await c.get(f"{url}/oomguard/v1/state")).json()
            tasks = [asyncio.create_task(complete(c, url, 300 + i, 200, 400)) for i in range(12)]
            for _ in range(500):
                s = (await c.get(f"{url}/oomguard/v1/state")).json()
                if s["running"] == 12:
                    break
                await asyncio.sleep(0.005)
            assert s["running"] == 12, s
            assert (await c.post(f"{url}/oomguard/v1/drain", headers=AUTH)).status_code == 200
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            after = (await c.get(f"{url}/oomguard/v1/state")).json()
        assert after["preemptions_total"] > before["preemptions_total"], "no preemption happened"
        assert after["drained"] and (after["running"], after["waiting"]) == (0, 0)
        statuses = [r.status_code for r in results]
        assert set(statuses) <= {200, 503} and statuses.count(503) > 0
        assert statuses.count(503) == after["shed_total"] - before["shed_total"]
        assert all(int(r.headers["retry-after"]) > 0 for r in results if r.status_code == 503)
        assert all(
            r.json()["usage"]["completion_tokens"] == 400 for r in results if r.status_code == 200
        )

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/v1/completions/",
        "/v1/chat/completions",
        "/v1/responses",
        "/invocations",
        "/v1/embeddings",
        "/pooling",
    ],
)
def test_every_inference_route_is_gated_while_draining(server, path):
    assert httpx.post(f"{server.url}/oomguard/v1/drain", headers=AUTH, timeout=10).is_success
    r = httpx.post(
        f"{server.url}{path}",
        json={"model": str(MODEL), "prompt": [11, 12], "max_tokens": 2},
        timeout=10,
    )
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
    assert "draining" in r.text


def test_every_post_route_of_the_server_is_classified(server):
    """A vLLM upgrade that adds an inference route must not slip past the drain gate."""
    from oomguard.vllm_plugin.api import CONTROL_PATHS, GATED_PATHS

    spec = httpx.get(f"{server.url}/openapi.json", timeout=120).json()  # built on first call
    posts = {path for path, methods in spec["paths"].items() if "post" in methods}
    assert "/v1/completions" in posts and "/invocations" in posts
    assert not GATED_PATHS & CONTROL_PATHS
    assert posts - GATED_PATHS - CONTROL_PATHS == set()


def test_mutating_routes_need_the_token_and_reads_do_not(server):
    for method, path, body in (
        ("PUT", "/admission", {"cap": 1}),
        ("POST", "/drain", None),
        ("POST", "/resume", None),
    ):
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic x"},
            {"Authorization": "Bearer tökén".encode()},  # non-ASCII: 401, not 400
            {"Authorization": b"Bearer \xff\xfe"},
        ):
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


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b'{"cap": "x"}', id="wrong-type"),
        pytest.param(b"{cap:", id="not-json"),
        pytest.param(b"[" * 50_000, id="deep-nesting"),
        pytest.param(b'{"force": true}', id="unknown-field"),
    ],
)
def test_authentication_comes_before_the_body(server, content):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.put(
            f"{server.url}/oomguard/v1/admission",
            content=content,
            headers={**headers, "Content-Type": "application/json"},
            timeout=10,
        )
        assert r.status_code == 401, r.text
        assert "cap" not in r.text and "JSON" not in r.text  # nothing about the schema


@pytest.mark.parametrize(
    ("content", "status"),
    [
        pytest.param(b"[" * 4000, 400, id="deep-nesting"),  # 500 before
        pytest.param(b'{"cap": ' + b"9" * 5000 + b"}", 400, id="5000-digit-int"),
        pytest.param(b"\xff\xfe", 400, id="bad-utf8"),
        pytest.param(b'{"cap": 1, "pad": "' + b"x" * 10_000 + b'"}', 413, id="huge"),
    ],
)
def test_malformed_bodies_are_refused_not_500(server, content, status):
    r = httpx.put(
        f"{server.url}/oomguard/v1/admission",
        content=content,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == status, r.text
    assert server.state()["admission_cap"] == 64


@pytest.mark.parametrize(
    ("cap", "applied"),
    [(0, 1), (-5, 1), (10_000, 64), (64, 64), (2**64, 64), (2**200, 64), (-(2**64), 1)],
)
def test_caps_out_of_range_are_clamped_and_say_so(server, cap, applied):
    body = put_cap(server, cap).json()
    assert body["admission_cap"] == applied and body["clamped"] == (cap != applied)
    if cap != applied:
        assert "outside 1..64" in body["message"]
    assert server.state()["admission_cap"] == applied
