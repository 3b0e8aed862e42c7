"""Each type of the OOM taxonomy induced on purpose on the GPU twin and classified with its
evidence (issue 16, proof of item 3). Types 1 and 2 are in tests/test_incidents.py.

Every case runs the real parts: `vllm serve` (vLLM 0.33, CPU platform) with the twin executor
(twin/oomguard/twin/executor.py) on a twin H100 simulating Llama-3-8B, the oomguard plugin's
out-of-memory observer writing the OOM record from the dying EngineCore, and the `oomguard serve`
supervisor (in this process) writing the exit record with the reason. The records are then
classified by `oomguard.incidents` as the CLI and the exporter classify them. What each case
changes, and only that, is a twin knob or an action of the kernel (docs/twin.md, "Fault knobs"):

- 3 under load: the allocator's cache is fragmented (the twin's state file, as a trace sets it)
  so that a step of more than 384 tokens no longer fits; waves of eight concurrent 128-token
  requests fill one step, whose small activation allocation fails.
- 4 after hours: the twin's clock runs 1,500 times faster once the engine serves, so hours of
  allocator history pass in seconds; a leak knob (allocated grows) or a fragmentation knob
  (reserved − allocated grows) eats the headroom in about 2.5 simulated hours of steady load.
- 5 host OOM: the kernel's OOM killer, played by the test: it counts the kill in the cgroup's
  `memory.events` and SIGKILLs the engine. The cgroup is a directory the test controls, the one
  stand-in here: this machine's memory cgroup (v1) belongs to the harness that runs the session,
  which a test must not modify; the supervisor reads the file exactly as it reads a real one.
- 6 not an OOM: the twin GPU raises "CUDA error: an illegal memory access was encountered" (as
  PyTorch raises it) in the engine's third step, and dcgm-exporter's window counts XID 31 (GPU
  memory page fault, what an illegal address logs: https://docs.nvidia.com/deploy/xid-errors/)
  for that GPU, read by the exporter's own collectors.

Figures: the twin's physics (twin/oomguard/twin/physics.py), computed here with the same code
the worker runs, so each threshold is placed, not guessed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from oomguard import incident_records as records
from oomguard.forensics import incidents as inc
from oomguard.forensics import reader
from oomguard.remediator.supervisor import Supervisor
from oomguard.twin.physics import Physics, Step
from tests.conftest import DCGM_MIG
from tests.vllm_server import MODEL, prompt, require_vllm

GIB = 2**30
TOKENS = 2048  # --max-num-batched-tokens: a small activation profile keeps the numbers plain
SEQS = 8  # --max-num-seqs: half of it (4 requests) already makes a full batch


def physics() -> Physics:
    """The twin H100 the engines below run on (Llama-3-8B at vLLM's default 0.92)."""
    return Physics.for_model(gpu="H100", gpu_memory_utilization=0.92, max_num_batched_tokens=TOKENS)


class Engine:
    """A twin engine under the real supervisor; stopped whole, with its process group."""

    def __init__(self, tmp_path: Path, env: dict[str, str], cgroup: Path | None = None) -> None:
        from oomguard.lab.processes import TINY_MODEL, free_port, vllm_command, vllm_env

        require_vllm()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.incidents = tmp_path / "incidents"
        self.state = tmp_path / "gpu.json"
        self.state.write_text(json.dumps({"neighbour_bytes": 0}))
        args = (
            "--max-num-seqs",
            str(SEQS),
            "--max-num-batched-tokens",
            str(TOKENS),
            "--max-model-len",
            "2048",
            "--gpu-memory-utilization",
            "0.92",
        )
        self.sup = Supervisor(
            vllm_command(self.port, TINY_MODEL, args),
            tmp_path / "state",
            max_crashes=1,  # no restart: one incident to read
            stop_timeout=20,
            env={
                **vllm_env("t", None),
                "OOMGUARD_TWIN_GPU": "H100",
                "OOMGUARD_TWIN_STATE_FILE": str(self.state),
                "OOMGUARD_ALLOCATOR_DIR": str(tmp_path / "allocator"),
                "OOMGUARD_INCIDENT_DIR": str(self.incidents),
                "OOMGUARD_TARGET": "llama",
                **env,
            },
            cgroup_dir=str(cgroup) if cgroup else str(tmp_path / "no-cgroup"),
        )
        self.sup.start()
        self.pid = self.sup.child.pid if self.sup.child else 0
        deadline = time.monotonic() + 240
        while not self.sup.ready():
            if time.monotonic() > deadline or self.exit_records():
                self.stop()
                tail = (tmp_path / "state" / "vllm.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"the twin engine did not start:\n{tail}")
            time.sleep(0.5)

    def exit_records(self) -> list[Path]:
        return sorted(self.incidents.glob("exit-*.json"))

    def wait_for_exit(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.exit_records() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.exit_records(), "the engine did not exit"

    def stop(self) -> None:
        self.sup.stop()
        # vLLM's EngineCore shares the child's process group: nothing of it may outlive a test
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def incident(self, xids: list[inc.Xid] | None = None) -> inc.Incident:
        loaded = reader.load(self.incidents, missing_ok=False)
        assert not loaded.invalid, loaded.invalid
        [found] = inc.incidents(loaded, xids or [])
        return found

    def oom_record(self) -> dict[str, Any]:
        [path] = self.incidents.glob("oom-*.json")
        return json.loads(path.read_text())


@pytest.fixture
def engine(tmp_path):
    started: list[Engine] = []

    def start(env: dict[str, str], cgroup: Path | None = None) -> Engine:
        started.append(Engine(tmp_path, env, cgroup))
        return started[-1]

    yield start
    for e in started:
        e.stop()


async def _wave(url: str, first: int, count: int, length: int, max_tokens: int) -> list[int]:
    """`count` concurrent completions; their status codes (599: the connection failed)."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int) -> int:
            body = {"model": str(MODEL), "prompt": prompt(i, length), "max_tokens": max_tokens}
            try:
                r = await client.post(f"{url}/v1/completions", json=body)
            except httpx.TransportError:
                return 599
            return r.status_code

        return list(await asyncio.gather(*(one(first + i) for i in range(count))))


def wave(url: str, first: int, count: int, length: int, max_tokens: int) -> list[int]:
    return asyncio.run(_wave(url, first, count, length, max_tokens))


def until_dead(e: Engine, count: int, length: int, max_tokens: int, waves: int) -> list[int]:
    """Waves of requests until the engine dies (bounded); every status code seen."""
    codes: list[int] = []
    for k in range(waves):
        codes += wave(e.url, k * 1000, count, length, max_tokens)
        if e.exit_records() or e.sup.child is None or e.sup.child.poll() is not None:
            break
    e.wait_for_exit()
    return codes


# -- the knobs ----------------------------------------------------------------------------------
def test_the_fault_knobs_are_off_by_default_and_refuse_what_they_cannot_read():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from oomguard.twin.executor import GpuTwin

    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=TOKENS, max_num_seqs=SEQS),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.92, block_size=16),
        model_config=SimpleNamespace(max_model_len=2048),
    )
    plain = GpuTwin(config, {"gpu": "H100"})
    before = plain.memory_stats()
    for _ in range(5):
        plain.step(Step(tokens=8))
    assert (plain.clock_rate, plain.leaked, plain.fragmented) == (1.0, 0, 0)
    current = ("allocated_bytes.all.current", "reserved_bytes.all.current")
    assert abs(plain.clock() - time.time()) < 1
    assert [plain.memory_stats()[k] for k in current] == [before[k] for k in current]
    aged = GpuTwin(config, {"gpu": "H100", "clock_rate": 3600, "leak_bytes_per_hour": GIB})
    aged.step(Step(tokens=8))
    time.sleep(0.3)  # about 0.3 simulated hours
    assert 0.2 * 3600 < aged.clock() - time.time() < 1.0 * 3600
    assert 0.2 * GIB < aged.leaked < 1.0 * GIB
    low = aged.leaked
    grown = (
        aged.memory_stats()["allocated_bytes.all.current"] - before["allocated_bytes.all.current"]
    )
    assert low <= grown <= aged.leaked  # the clock runs on between the reads
    for bad in (
        {"clock_rate": 0.5},
        {"clock_rate": "fast"},
        {"leak_bytes_per_hour": -1},
        {"fragmentation_bytes_per_hour": float("nan")},
        {"cuda_error_at_step": 2.5},
        {"cuda_error_at_step": True},
    ):
        [key] = bad
        with pytest.raises(ValueError, match=key):
            GpuTwin(config, {"gpu": "H100", **bad})


# -- type 3: under load -------------------------------------------------------------------------
@pytest.mark.slow  # starts the real vLLM server
def test_a_full_batch_whose_small_allocation_fails_is_an_oom_under_load(engine):
    p = physics()
    # fragmentation leaves room for a step of 384 tokens, not one more: a step of 4 of the
    # 128-token prefills fails, and any step over 384 tokens holds at least 4 requests, half of
    # max_num_seqs, which is what the classifier calls a full batch. (With 16 seqs and room for
    # 1,024 tokens a step needed 9 requests to arrive within one step; on a loaded 2-core CI
    # machine the API server let them in too slowly and three waves went by without an OOM.)
    fit = 384
    prefill = 128
    fragmentation = p.total - p.peak(Step(tokens=fit))
    assert p.fits(Step(tokens=fit), fragmentation) and not p.fits(
        Step(tokens=fit + 1), fragmentation
    )
    # steps at 1/200 speed (about 1.2 s), so that requests arriving together are batched together
    e = engine({"OOMGUARD_TWIN_TIME_COMPRESSION": "0.005"})
    e.state.write_text(json.dumps({"neighbour_bytes": 0, "fragmentation_bytes": fragmentation}))
    time.sleep(0.5)  # the worker re-reads its state every 0.2 s
    codes = until_dead(e, SEQS, prefill, 8, waves=5)
    assert any(c >= 500 for c in codes), codes  # the in-flight requests died with the engine

    record = e.oom_record()
    # every request adds at most its 128 prefill tokens to a step: more than 384 needs 4
    assert record["batch"]["requests"] >= fit // prefill + 1
    assert record["batch"]["scheduled_tokens"] > fit
    assert record["allocator"]["fragmentation_bytes"] == fragmentation
    found = e.incident()
    assert (found.type, found.confidence, found.kind.number) == ("under_load", "confirmed", 3)
    f = found.figures
    assert f["batch_requests"] == record["batch"]["requests"] and f["max_num_seqs"] == SEQS
    assert f["requested_bytes"] == p.activation(record["batch"]["scheduled_tokens"])
    assert f["requested_bytes"] < 0.05 * f["reserved_bytes"]
    assert f["uptime_seconds"] < 2 * 3600
    assert any(f"max_num_seqs {SEQS}" in line for line in found.evidence), found.evidence
    # the supervisor's exit record is joined to the observer's record
    assert len(found.records) == 2 and found.records[0].startswith("exit-")
    # what the engine held as it died: every request EngineCore's scheduler had (noted after
    # each schedule), at least the failing step's batch, at most what the clients lost; the
    # exporter counts it for the error budget under the model vLLM's metrics name
    from oomguard.exporter.collectors.incidents import IncidentCollector
    from oomguard.exporter.render import FamilyBuilder

    assert record["in_flight_source"] == "scheduler"
    failed = sum(1 for c in codes if c >= 500)
    assert record["batch"]["requests"] <= record["in_flight"] <= failed, (record, codes)
    assert record["model_name"] == str(MODEL)
    out = FamilyBuilder()
    collector = IncidentCollector(str(e.incidents), "twin-node")
    collector.families(collector.collect(), out)
    [lost] = [f for f in out.families() if f.spec.name == "oomguard_requests_lost_total"]
    assert lost.samples == [(("twin-node", "llama", str(MODEL), "0"), float(record["in_flight"]))]


# -- type 4: after hours ------------------------------------------------------------------------
CLOCK_RATE = 1500  # 2.5 simulated hours in 6 s of serving


def headroom_of_a_small_step() -> int:
    """Room left on the twin H100 during a decode step of a few requests."""
    p = physics()
    return p.total - p.peak(Step(tokens=8))


def age_until_dead(e: Engine) -> None:
    """Steady light load (2 clients, short requests) until the engine dies, at most 60 s."""
    deadline = time.monotonic() + 60
    k = 0
    while time.monotonic() < deadline and e.sup.child is not None and e.sup.child.poll() is None:
        if wave(e.url, k, 2, 16, 16) != [200, 200]:
            break  # it died under them
        k += 2
    e.wait_for_exit()


@pytest.mark.slow  # starts the real vLLM server
@pytest.mark.parametrize("kind", ["leak", "fragmentation"])
def test_memory_that_creeps_up_for_hours_is_an_oom_after_hours(engine, kind):
    # the headroom is gone after about 2.5 simulated hours of serving
    per_hour = int(headroom_of_a_small_step() / 2.5)
    knob = {
        "leak": "OOMGUARD_TWIN_LEAK_BYTES_PER_HOUR",
        "fragmentation": "OOMGUARD_TWIN_FRAGMENTATION_BYTES_PER_HOUR",
    }[kind]
    e = engine({"OOMGUARD_TWIN_CLOCK_RATE": str(CLOCK_RATE), knob: str(per_hour)})
    started = time.monotonic()
    age_until_dead(e)
    wall = time.monotonic() - started

    record = e.oom_record()
    assert record["uptime_seconds"] >= 2 * 3600  # simulated hours...
    assert wall < 60  # ...in seconds
    history = record["history"]
    assert len(history) >= 8 and history[-1][0] - history[0][0] >= 1.5 * 3600, history
    allocated = [row[1] for row in history]
    gaps = [row[2] - row[1] for row in history]
    found = e.incident()
    assert (found.type, found.confidence, found.kind.number) == ("after_hours", "confirmed", 4)
    assert found.figures["after_hours"] == kind
    if kind == "leak":
        assert allocated == sorted(allocated) and allocated[-1] - allocated[0] >= GIB
        assert max(gaps) - min(gaps) < GIB  # the gap did not grow: not fragmentation
        assert found.figures["allocated_growth_bytes"] >= GIB
        assert any("grew steadily" in line and "a leak" in line for line in found.evidence)
        assert record["allocator"]["leaked_bytes"] > 0.9 * headroom_of_a_small_step()
    else:
        assert allocated[-1] == allocated[0]  # nothing retained...
        assert gaps == sorted(gaps) and gaps[-1] - gaps[0] >= GIB  # ...the unusable part grew
        assert found.figures["reserved_minus_allocated_bytes"] >= 2 * GIB
        assert any("reserved but unused" in line for line in found.evidence)
        assert record["allocator"]["fragmentation_bytes"] > 0.9 * headroom_of_a_small_step()
    assert found.figures["uptime_seconds"] >= 2 * 3600


# -- type 5: host OOM ---------------------------------------------------------------------------
def largest_child(e: Engine) -> int:
    """The OOM killer's choice among the API server's processes: the largest, vLLM's EngineCore
    (it holds the model runner's host memory; in the twin, torch and vLLM's engine)."""
    import psutil

    children = psutil.Process(e.pid).children(recursive=True)
    return max(children, key=lambda p: p.memory_info().rss).pid


def test_a_clean_exit_after_the_kernel_killed_the_engine_core_is_a_host_oom():
    """The record shape the engine_core case below produced (vLLM 0.33: the API server exits 0
    after its watchdog sees the dead EngineCore); without the kernel's count it stays unknown."""
    record = {
        "schema": records.EXIT_SCHEMA,
        "timestamp": 1_796_139_860.0,
        "started_at": 1_796_139_834.0,
        "pid": 1105,
        "returncode": 0,
        "reason": "exited",
        "log_tail": ["INFO:     Application startup complete."],
        "exception_lines": [
            "(APIServer pid=1105) ERROR 12-01 16:09:27 [async_llm.py:943] "
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."
        ],
        "cgroup": {"oom_kills_at_start": 1, "oom_kills_at_exit": 2},
    }
    found = inc.classify(None, records.ExitRecord.model_validate_json(json.dumps(record)))
    assert (found.type, found.confidence) == ("host_oom", "confirmed")
    assert any("EngineDeadError" in line for line in found.evidence)
    record["cgroup"] = {"oom_kills_at_start": 2, "oom_kills_at_exit": 2}
    unchanged = inc.classify(None, records.ExitRecord.model_validate_json(json.dumps(record)))
    assert unchanged.type == "unknown"


@pytest.mark.slow  # starts the real vLLM server
@pytest.mark.parametrize("victim", ["group", "engine_core"])
def test_an_engine_killed_by_the_kernels_oom_killer_is_a_host_oom(engine, tmp_path, victim):
    """`group`: the kernel kills the whole cgroup (memory.oom.group, Kubernetes' default with
    cgroup v2): the API server exits by SIGKILL. `engine_core`: it kills only the largest process,
    vLLM's EngineCore; the API server then exits on its own."""
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    events = cgroup / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    e = engine({}, cgroup)
    assert wave(e.url, 0, 4, 32, 4) == [200] * 4  # it served
    victim_pid = e.pid if victim == "group" else largest_child(e)
    assert victim_pid != e.pid or victim == "group"
    # the kernel: count the kill, then SIGKILL (no signal handler, no traceback)
    events.write_text("low 0\nhigh 0\nmax 41\noom 2\noom_kill 2\noom_group_kill 1\n")
    if victim == "group":
        os.killpg(e.pid, signal.SIGKILL)
    else:
        os.kill(victim_pid, signal.SIGKILL)
    e.wait_for_exit()

    [path] = e.exit_records()
    record = json.loads(path.read_text())
    assert (
        record["cgroup"]["oom_kills_at_start"] == 1 and record["cgroup"]["oom_kills_at_exit"] == 2
    )
    assert not list(e.incidents.glob("oom-*.json"))  # no CUDA OOM: the observer wrote nothing
    found = e.incident()
    assert (found.type, found.confidence, found.kind.number) == ("host_oom", "confirmed", 5)
    assert found.figures["cgroup_oom_kills_delta"] == 1
    assert found.target == "llama"
    if victim == "group":
        assert record["reason"] == "killed" and record["signal"] == 9
        assert found.figures["returncode"] == -9
    else:  # the API server's watchdog shut it down cleanly: no signal on the child itself
        assert record["reason"] == "exited" and record["signal"] is None
        assert any("killed one of its processes" in line for line in found.evidence)
        assert any("vLLM lost its engine" in line for line in found.evidence), found.evidence
    assert any("oom_kill count rose by 1" in line for line in found.evidence), found.evidence


# -- type 6: not an OOM -------------------------------------------------------------------------
@pytest.mark.slow  # starts the real vLLM server
def test_a_cuda_fault_that_is_not_out_of_memory_is_type_6_with_its_xid(engine, tmp_path):
    from oomguard.exporter.collectors.dcgm import DcgmCollector
    from oomguard.exporter.collectors.incidents import IncidentCollector

    e = engine({"OOMGUARD_TWIN_CUDA_ERROR_AT_STEP": "3"})
    codes = until_dead(e, 1, 32, 8, waves=4)
    assert any(c >= 500 for c in codes), codes  # the request in the failing step was lost

    [path] = e.exit_records()
    record = json.loads(path.read_text())
    assert record["reason"] == "cuda_error" and record["oom_records"] == []
    assert not list(e.incidents.glob("oom-*.json"))  # not an allocator OOM: no observer record
    # dcgm-exporter's next window counts XID 31 on the engine's GPU (the fixture's H100, its
    # XID count series changed from 79 to 31), read by the exporter's collectors
    dcgm_file = tmp_path / "dcgm.prom"
    dcgm_file.write_text(DCGM_MIG.read_text().replace('xid="79"} 1', 'xid="31"} 1'))
    dcgm = DcgmCollector("gpu-node-07", file=str(dcgm_file))
    dcgm.collect()
    collector = IncidentCollector(
        str(e.incidents), "gpu-node-07", xid_source=lambda: dcgm.recent_xids
    )
    assert dict(collector.collect().by_type) == {("llama", "", "not_oom"): 1}

    found = e.incident(list(dcgm.recent_xids))
    assert (found.type, found.confidence, found.kind.number) == ("not_oom", "confirmed", 6)
    assert found.figures["xids"] == [31] and found.figures["reason"] == "cuda_error"
    assert any("XID 31" in line for line in found.evidence)
    assert any("illegal memory access" in line for line in found.evidence), found.evidence
    # the log alone already says it: the XID is evidence beside it, not what decided
    assert e.incident().type == "not_oom"
