"""The supervisor's API is untrusted input: authentication first, strict types, bounded bodies,
a restart rate limit (issue 12, item 7).

The supervisor is the real one; its child is a stand-in process (a sleeping Python) that takes
`--max-num-seqs` and `--gpu-memory-utilization` like vLLM does, because these tests are about the
API's input handling, not about vLLM. The app is served in-process by Starlette's test client.
"""

from __future__ import annotations

import sys

import pytest
from starlette.testclient import TestClient

from oomguard.remediator.config import AuthConfig
from oomguard.remediator.supervisor import Supervisor, create_app

TOKEN = "supervisor-token-1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHILD = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def supervisor(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    sup = Supervisor(
        [*CHILD, "--max-num-seqs", "16", "--gpu-memory-utilization", "0.9"],
        tmp_path / "state",
        stop_timeout=5,
        max_restarts=2,
        restart_window_seconds=600,
    )
    sup.start()
    client = TestClient(create_app(sup, AuthConfig(bearer_token_file=str(token))))
    yield sup, client
    sup.stop()


def restart(client: TestClient, body: object = None, headers: dict | None = None, **kw):
    return client.post("/v1/restart", json=body, headers=AUTH if headers is None else headers, **kw)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"initial_cap": True}, "initial_cap"),
        ({"initial_cap": 2.0}, "initial_cap"),
        ({"initial_cap": "3"}, "initial_cap"),
        ({"flags": {"gpu_memory_utilization": 0.85, "max_num_seqs": 2.9}}, "max_num_seqs"),
        ({"flags": {"gpu_memory_utilization": 0.85, "max_num_seqs": True}}, "max_num_seqs"),
        ({"flags": {"gpu_memory_utilization": 0.85, "max_num_seqs": "12"}}, "max_num_seqs"),
        ({"flags": {"gpu_memory_utilization": "0.85", "max_num_seqs": 12}}, "gpu_memory"),
        ({"flags": {"gpu_memory_utilization": True, "max_num_seqs": 12}}, "gpu_memory"),
        ({"flags": {"max_num_seqs": 12}}, "gpu_memory_utilization"),
        ({"reason": 5}, "reason"),
        ({"force": True}, "force"),
        ([1, 2], "dictionary"),
    ],
)
def test_no_coercion_every_wrong_type_is_400_naming_the_field(supervisor, body, field):
    sup, client = supervisor
    generation = sup.generation
    r = restart(client, body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]
    assert sup.generation == generation  # nothing restarted


def test_non_finite_gmu_is_refused(supervisor):
    _, client = supervisor
    r = client.post(
        "/v1/restart",
        content=b'{"flags": {"gpu_memory_utilization": NaN, "max_num_seqs": 12}}',
        headers=AUTH,
    )
    assert r.status_code == 400 and "finite" in r.json()["error"]


@pytest.mark.parametrize(
    "content",
    [
        # answered 500 (RecursionError) before
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-nesting"),
        pytest.param(b'{"initial_cap": ' + b"9" * 5000 + b"}", id="5000-digit-int"),
        pytest.param(b"nope", id="not-json"),
        pytest.param(b"", id="empty"),
        pytest.param(b"\xff\xfe{}", id="bad-utf8"),
    ],
)
def test_malformed_bodies_are_400_not_500(supervisor, content):
    sup, client = supervisor
    r = client.post("/v1/restart", content=content, headers=AUTH)
    assert r.status_code in (400, 413), r.text
    assert sup.generation == 1


def test_a_huge_body_is_413(supervisor):
    _, client = supervisor
    r = client.post("/v1/restart", content=b'{"reason": "' + b"x" * 100_000 + b'"}', headers=AUTH)
    assert r.status_code == 413


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Bearer wrong",
        "Basic eDp5",
        "Bearer " + "é" * 8,  # non-ASCII: a wrong token, not a 400 or a 500
        "Bearer",
    ],
)
def test_authentication_comes_before_the_body(supervisor, header):
    sup, client = supervisor
    headers = {} if header is None else {"Authorization": header.encode("utf-8")}
    for content in (b'{"initial_cap": true}', b"[" * 50_000, b"nope"):
        r = client.post("/v1/restart", content=content, headers=headers)
        assert r.status_code == 401, (header, content[:10], r.text)
        assert "initial_cap" not in r.text and "JSON" not in r.text
    assert sup.generation == 1


def test_initial_caps_of_any_size_are_clamped(supervisor):
    sup, client = supervisor
    r = restart(client, {"initial_cap": 2**64})
    assert r.status_code == 202, r.text
    assert r.json()["initial_cap"] == 16 and sup.initial_cap == 16  # max_num_seqs
    r = restart(client, {"initial_cap": -(2**70)})
    assert r.status_code == 202 and r.json()["initial_cap"] == 1


def test_restarts_are_rate_limited(supervisor):
    sup, client = supervisor
    assert restart(client, {"reason": "first"}).status_code == 202
    assert restart(client, {"reason": "second"}).status_code == 202
    third = restart(client, {"reason": "third"})
    assert third.status_code == 429
    assert 0 < int(third.headers["retry-after"]) <= 600
    assert sup.generation == 3  # the initial start plus two restarts
    # refused flags do not use up the budget, and a refused restart changes nothing
    assert sup.flags.current.max_num_seqs == 16


def test_out_of_range_flags_do_not_count_against_the_rate_limit(supervisor):
    _, client = supervisor
    bad = {"flags": {"gpu_memory_utilization": 0.99, "max_num_seqs": 16}}
    for _ in range(3):
        assert restart(client, bad).status_code == 400
    r = restart(client, {"flags": {"gpu_memory_utilization": 0.86, "max_num_seqs": 2**80}})
    assert r.status_code == 400 and "outside" in r.json()["error"]
    assert restart(client, {"flags": {"gpu_memory_utilization": 0.86, "max_num_seqs": 12}}).json()[
        "flags"
    ] == {"gpu_memory_utilization": 0.86, "max_num_seqs": 12}


# -- exit incidents: why the child died, next to the OOM observer's records ---------------------
DYING = {
    "cuda_error": "print('RuntimeError: CUDA error: an illegal memory access was encountered', "
    "flush=True); sys.exit(1)",
    "killed": "os.kill(os.getpid(), signal.SIGKILL)",
    # the OOM line, then more than the 200-line tail of failed requests' tracebacks (~64 streams)
    "cuda_oom_buried": "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
    "3.91 GiB', flush=True); [print(f'request {i} failed: EngineDeadError', flush=True) "
    "for i in range(400)]; sys.exit(1)",
    # no OOM line at all (stderr lost), only the observer's record
    "cuda_oom_record": "import pathlib; d = pathlib.Path(os.environ['OOMGUARD_INCIDENT_DIR']); "
    "d.mkdir(parents=True, exist_ok=True); (d / f'oom-{os.getpid()}-1.json').write_text('{}'); "
    "sys.exit(1)",
    "cuda_oom": "import pathlib; d = pathlib.Path(os.environ['OOMGUARD_INCIDENT_DIR']); "
    "d.mkdir(parents=True, exist_ok=True); (d / f'oom-{os.getpid()}-1.json').write_text('{}'); "
    "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB', "
    "flush=True); sys.exit(1)",
}


@pytest.mark.parametrize("reason", sorted(DYING))
def test_a_crash_leaves_an_exit_incident_beside_the_oom_records(tmp_path, reason):
    import json
    import time

    incidents = tmp_path / "incidents"
    script = f"import os, signal, sys\n{DYING[reason]}"
    sup = Supervisor(
        [sys.executable, "-c", script, "--max-num-seqs", "8"],
        tmp_path / "state",
        max_crashes=1,  # no restart: one record to read
        env={"OOMGUARD_INCIDENT_DIR": str(incidents)},
    )
    sup.start()
    deadline = time.monotonic() + 60
    while not list(incidents.glob("exit-*.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    sup.stop()
    [path] = list(incidents.glob("exit-*.json"))
    record = json.loads(path.read_text())
    expected = "cuda_oom" if reason.startswith("cuda_oom") else reason
    assert record["schema"] == "oomguard.exit_incident.v1" and record["reason"] == expected
    assert sup.exits[-1].reason == expected
    if reason == "killed":
        assert record["returncode"] == -9 and record["signal"] == 9
    if reason == "cuda_oom":
        assert record["oom_records"] == [f"oom-{record['pid']}-1.json"]
        assert "CUDA out of memory" in record["log_tail"][-1]
    if reason == "cuda_error":
        assert "illegal memory access" in record["log_tail"][-1]
    assert record["flags"]["max_num_seqs"] == 8


def test_an_oom_buried_under_failed_requests_still_lowers_the_flags(tmp_path):
    """Under ~64 streams the OOM line is followed by hundreds of failed requests' lines, past
    the 200-line tail: the exit is still a CUDA OOM and the next start has lower flags."""
    import time

    script = f"import os, signal, sys\n{DYING['cuda_oom_buried']}"
    sup = Supervisor(
        [sys.executable, "-c", script, "--max-num-seqs", "64", "--gpu-memory-utilization", "0.9"],
        tmp_path / "state",
        max_crashes=3,
        restart_delay=0.1,
        env={"OOMGUARD_INCIDENT_DIR": str(tmp_path / "incidents")},
    )
    before = sup.flags.current
    sup.start()
    deadline = time.monotonic() + 60
    while not sup.exits and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the watcher lowers the flags right after it records the exit
    sup.stop()
    assert sup.exits[0].reason == "cuda_oom"
    after = sup.flags.current
    assert (
        after.max_num_seqs < before.max_num_seqs
        or after.gpu_memory_utilization < before.gpu_memory_utilization
    )
