"""Restart with adjusted flags on the real vLLM server: `oomguard serve` (the local backend), the
restart sequence, the remediator driving it, a twin CUDA OOM crash and a failing restart."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

from oomguard.lab.processes import SupervisedVllm
from oomguard.remediator.actuator import PluginActuator, Target
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import RemediatorConfig
from oomguard.remediator.controller import Controller
from oomguard.remediator.flags import Flags
from oomguard.remediator.main import restart_backends
from oomguard.remediator.restart import RestartSequence, SupervisorBackend
from oomguard.twin.physics import Physics, Step
from tests.remediator_helpers import alert, payload
from tests.vllm_server import MODEL, TOKEN, prompt, require_vllm

pytestmark = pytest.mark.slow
GIB = 2**30
# the supervisor's crashloop guard: two crashes within its window and it gives up (each failed
# vLLM start costs half a minute of CPU here, so the guard is met with as few as it takes)
MAX_CRASHES = 2


class Gateway:
    """Steady load that behaves like a gateway: a 503 (draining) or a refused connection
    (restarting) is retried; anything else that is not a 200 is a lost request."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url, self.clients = url, clients
        self.ok, self.retried, self.lost = 0, 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as client:

            async def worker(k: int) -> None:
                i = k
                while not self.stop.is_set():
                    i += 100
                    body = {"model": str(MODEL), "prompt": prompt(i, 64), "max_tokens": 8}
                    while not self.stop.is_set():
                        try:
                            r = await client.post(f"{self.url}/v1/completions", json=body)
                        except httpx.TransportError:
                            r = None
                        if r is not None and r.status_code == 200:
                            self.ok += 1
                            break
                        if r is None or r.status_code == 503:
                            self.retried += 1
                            await asyncio.sleep(0.2)
                            continue
                        self.lost.append(r.status_code)
                        break

            await asyncio.gather(*(worker(k) for k in range(self.clients)))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(120)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    require_vllm()
    work = tmp_path_factory.mktemp("supervised")
    (work / "stoken").write_text("supervisor-token-1")
    (work / "ptoken").write_text(TOKEN)
    gpu = work / "gpu.json"
    gpu.write_text(json.dumps({"neighbour_bytes": 0}))
    proc = SupervisedVllm(
        work,
        "--max-num-seqs",
        "16",
        "--gpu-memory-utilization",
        "0.9",
        "--max-model-len",
        "32768",
        "--max-num-batched-tokens",
        "8192",
        plugin_token=TOKEN,
        supervisor_token_file=work / "stoken",
        env={
            "OOMGUARD_TWIN_GPU": "H100",
            "OOMGUARD_TWIN_STATE_FILE": str(gpu),
            "OOMGUARD_TWIN_TIME_COMPRESSION": "20",
            "OOMGUARD_ALLOCATOR_DIR": str(work / "allocator"),
        },
        max_crashes=MAX_CRASHES,
    )
    proc.work, proc.gpu = work, gpu
    yield proc
    proc.stop()


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (httpx.HTTPError, KeyError, ValueError):
            value = None
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"{what} did not happen within {timeout}s")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serving(engine) -> None:
    """The module's engine is up (an earlier test's restart may still be loading it)."""
    wait(lambda: state(engine), 300, "the engine serving")


def state(engine) -> dict:
    return httpx.get(f"{engine.url}/oomguard/v1/state", timeout=5).json()


def test_restart_with_new_flags_under_load_then_staged_readmission(engine, tmp_path):
    target = Target("llama", engine.url, TOKEN, "tiny")
    backend = SupervisorBackend(engine.api, lambda: engine.token)
    assert backend.flags().current == Flags(0.9, 16)
    gateway = Gateway(engine.url)
    try:
        wait(lambda: gateway.ok > 20, 30, "load to flow")
        audit = AuditLog(tmp_path / "audit.jsonl")
        seq = RestartSequence(PluginActuator(), backend, audit, drain_timeout=30, ready_timeout=120)
        result = seq.run(target, Flags(0.86, 12), "test", ["fp1"])
        assert result.ok, result
        s = state(engine)
        assert (s["startup_max_num_seqs"], s["gpu_memory_utilization"]) == (12, 0.86)
        assert s["admission_cap"] == 1  # back through staged re-admission, not at full admission
        steps = [(e["action"], e["result"]) for e in audit.entries()]
        assert steps == [
            ("drain", "ok"),
            ("wait_idle", "ok"),
            ("restart", "ok"),
            ("wait_ready", "ok"),
        ]
        # persisted: the supervisor's state survives it, and the flags are on the command line
        saved = json.loads((engine.work / "state" / "flags.json").read_text())
        assert saved["current"] == {"gpu_memory_utilization": 0.86, "max_num_seqs": 12}
        assert "--max-num-seqs" in engine.status()["command"]

        # the remediator's reconcile loop re-admits in stages up to the new startup cap
        cfg = RemediatorConfig.model_validate(
            {
                "auth": {"allow_unauthenticated": True},
                "targets": [
                    {
                        "name": "llama",
                        "url": engine.url,
                        "token_file": str(engine.work / "ptoken"),
                        "restart": {"supervisor": {"url": engine.api}},
                    },
                    {"name": "other", "url": "http://127.0.0.1:1"},
                ],
                "audit_log": str(tmp_path / "audit2.jsonl"),
            }
        )
        c = Controller(cfg, PluginActuator(), AuditLog(cfg.audit_log))
        caps = []

        def readmitted() -> bool:
            c.reconcile()
            caps.append(state(engine)["admission_cap"])
            return caps[-1] == 12

        wait(readmitted, 60, "re-admission to 12")
        assert sorted(set(caps)) == sorted(set(caps), key=caps.index)  # only ever up
        c.close()
    finally:
        gateway.close()
    assert gateway.lost == [] and gateway.ok > 40, (gateway.lost, gateway.ok)


def test_a_cuda_oom_crash_comes_back_with_lower_flags_and_capped(engine):
    before = engine.status()
    current = Flags(**before["flags"]["current"])
    # a neighbour takes 1 GiB more than a 4,000-token step leaves free: that step cannot fit
    physics = Physics.for_model(
        gpu="H100",
        gpu_memory_utilization=current.gpu_memory_utilization,
        max_num_batched_tokens=8192,
    )
    neighbour = physics.total - physics.peak(Step(tokens=4000)) + GIB
    lowered_gmu = current.gpu_memory_utilization - 0.04
    assert neighbour <= physics.total - physics.driver_reserved - lowered_gmu * physics.total
    engine.gpu.write_text(json.dumps({"neighbour_bytes": neighbour}))
    time.sleep(0.5)
    r = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": str(MODEL), "prompt": prompt(1, 4000), "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code >= 500  # the engine died under it
    status = wait(
        # the supervisor restarts once the dead server has exited: tens of seconds on a
        # loaded 2-core machine
        lambda: (s := engine.status())["generation"] > before["generation"] and s,
        180,
        "restart",
    )
    assert status["exits"][-1]["reason"] == "cuda_oom"
    lowered = Flags(**status["flags"]["current"])
    assert lowered == Flags(
        round(current.gpu_memory_utilization - 0.04, 4), int(current.max_num_seqs * 0.8)
    )
    wait(lambda: state(engine)["startup_max_num_seqs"] == lowered.max_num_seqs, 300, "ready")
    s = state(engine)
    assert s["admission_cap"] == 1 and s["gpu_memory_utilization"] == lowered.gpu_memory_utilization
    # the twin's allocator stats say what happened, in the hand-off format the exporter reads:
    # written by the OOM observer in the engine that died, before it died
    reports = [json.loads(p.read_text()) for p in (engine.work / "allocator").glob("pid-*.json")]
    [died] = [r for r in reports if r["ooms"] >= 1 and not pid_alive(r["pid"])]
    assert died["ooms"] == 1, reports
    incidents = [
        json.loads(p.read_text()) for p in (engine.work / "allocator" / "incidents").glob("*.json")
    ]
    [record] = [i for i in incidents if i["pid"] == died["pid"]]
    assert record["kind"] == "cuda_oom" and record["allocator"]["neighbour_bytes"] == neighbour
    assert record["batch"]["largest"][0]["prompt_tokens"] == 4000  # the request that killed it
    assert record["flags"]["gpu_memory_utilization"] == current.gpu_memory_utilization
    # and with the lower flags the same neighbour no longer kills it
    ok = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": str(MODEL), "prompt": prompt(2, 4000), "max_tokens": 4},
        timeout=60,
    )
    assert ok.status_code == 200
    engine.gpu.write_text(json.dumps({"neighbour_bytes": 0}))


def test_a_failing_restart_is_reported_and_given_up_within_limits(engine, tmp_path):
    serving(engine)
    target = Target("llama", engine.url, TOKEN, "tiny")
    backend = SupervisorBackend(engine.api, lambda: engine.token)
    current = backend.flags().current
    # 30 GiB held by another process: vLLM refuses to start (free memory below what it wants)
    engine.gpu.write_text(json.dumps({"neighbour_bytes": 30 * GIB}))
    audit = AuditLog(tmp_path / "audit.jsonl")
    # it never comes back while the neighbour holds the memory: 10 s show the sequence reporting
    # that (a longer wait only adds time); the supervisor's own guard is checked below
    seq = RestartSequence(PluginActuator(), backend, audit, drain_timeout=30, ready_timeout=10)
    result = seq.run(target, current, "test", [])
    assert not result.ok and result.step == "wait_ready"
    status = wait(lambda: (s := engine.status())["gave_up"] and s, 120, "the crashloop guard")
    crashes = [e["reason"] for e in status["exits"] if e["reason"] != "requested"]
    # the OOM above counts in the window: with it, one failed start is enough to give up
    assert len(crashes) >= MAX_CRASHES and crashes[-1] == "exited"
    assert audit.entries()[-1]["result"] == "failed"
    # an operator clears the neighbour and asks again: it comes back
    engine.gpu.write_text(json.dumps({"neighbour_bytes": 0}))
    backend.restart(current, 1, "operator")
    wait(lambda: state(engine)["mode"] == "serving", 120, "ready again")
    assert not engine.status()["gave_up"]


def test_the_supervisor_api_needs_its_token_and_checks_flags(engine):
    r = httpx.post(f"{engine.api}/v1/restart", json={}, timeout=10)
    assert r.status_code == 401
    auth = {"Authorization": f"Bearer {engine.token}"}
    r = httpx.post(
        f"{engine.api}/v1/restart",
        json={"flags": {"gpu_memory_utilization": 0.99, "max_num_seqs": 16}},
        headers=auth,
        timeout=10,
    )
    assert r.status_code == 400 and "outside" in r.json()["error"]
    r = httpx.post(f"{engine.api}/v1/restart", content=b"nope", headers=auth, timeout=10)
    assert r.status_code == 400


def test_the_remediator_restarts_once_per_alert_episode(engine, tmp_path):
    serving(engine)
    cfg = RemediatorConfig.model_validate(
        {
            "auth": {"allow_unauthenticated": True},
            "targets": [
                {
                    "name": "llama",
                    "url": engine.url,
                    "token_file": str(engine.work / "ptoken"),
                    "restart": {
                        "supervisor": {"url": engine.api, "token_file": str(engine.work / "stoken")}
                    },
                },
                {"name": "other", "url": engine.url},  # a ready peer of the same model
            ],
            "safety": {"cooldown_seconds": 0},
            "audit_log": str(tmp_path / "audit.jsonl"),
        }
    )
    c = Controller(cfg, PluginActuator(), AuditLog(cfg.audit_log), backends=restart_backends(cfg))
    before = engine.status()
    from oomguard.remediator.webhook import parse

    oom = alert("OomguardCudaOomObserved", "llama", oomguard_action="restart")
    c.receive(parse(payload(oom)))
    c.reconcile()
    assert c.status["llama"].mode == "restarting"
    wait(lambda: "llama" not in c._restarting, 180, "the restart sequence")
    status = engine.status()
    assert status["generation"] == before["generation"] + 1
    assert Flags(**status["flags"]["current"]) == Flags(**before["flags"]["current"]).lower(
        cfg.flags
    )
    # the same episode, still firing (or replayed): no second restart, even for a new controller
    c.receive(parse(payload(oom)))
    c.reconcile()
    c2 = Controller(cfg, PluginActuator(), AuditLog(cfg.audit_log), backends=restart_backends(cfg))
    c2.receive(parse(payload(oom)))
    c2.reconcile()
    assert "llama" not in c2._restarting and engine.status()["generation"] == status["generation"]
    c.close()
    c2.close()
