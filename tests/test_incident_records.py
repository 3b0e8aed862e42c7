"""The incident records are one model per kind (oomguard.incident_records) that the writers build
and the forensics read: what a writer writes reads back as the record it built, in the on-disk
format the reader has always read."""

from __future__ import annotations

import json
from types import SimpleNamespace

from oomguard import incident_records as records
from oomguard.forensics import reader

# The keys the plugin's observer wrote while its record was a plain dict.
OOM_KEYS = {
    "schema",
    "kind",
    "timestamp",
    "pid",
    "rank",
    "target",
    "engine",
    "device_index",
    "device_uuid",
    "requested_bytes",
    "device_limit_bytes",
    "device_free_bytes",
    "allocator",
    "batch",
    "in_flight",
    "in_flight_source",
    "model_name",
    "flags",
    "process_started_at",
    "uptime_seconds",
    "steps",
    "history",
}


def _step(req_id: str) -> SimpleNamespace:
    new = SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=[1] * 100,
        prefill_token_ids=None,
        num_computed_tokens=0,
        sampling_params=SimpleNamespace(n=1, prompt_logprobs=5, logprobs=True),
    )
    cached = SimpleNamespace(req_ids=["old"], num_computed_tokens=[7])
    return SimpleNamespace(
        num_scheduled_tokens={req_id: 100, "old": 1},
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        total_num_scheduled_tokens=101,
    )


def test_the_observer_writes_the_model_the_reader_reads(tmp_path, monkeypatch):
    from oomguard.vllm_plugin import oom

    # a request id longer than the record holds (vLLM takes X-Request-Id from the client)
    monkeypatch.setattr(oom, "_step", _step("x" * 1000))
    monkeypatch.setattr(oom, "_in_flight", None)
    rec = oom.OomRecorder(
        "",
        str(tmp_path),
        "t" * 300,
        lambda: {"allocated_bytes.all.current": 5},
        lambda: {"engine": "1"},
        lambda: {"segments": 3, "largest_free_block_bytes": 4096},
    )
    rec.sample()
    rec.observe(0, 1 << 30, 80 << 30, 1 << 20)
    [path] = tmp_path.glob("oom-*.json")
    assert path.name == records.oom_file_name(json.loads(path.read_text())["pid"], 1)
    text = path.read_text()
    on_disk = json.loads(text)
    assert set(on_disk) == OOM_KEYS
    assert on_disk["kind"] == "cuda_oom" and on_disk["schema"] == records.OOM_SCHEMA
    assert on_disk["batch"]["largest"][0]["id"] == "x" * records.MAX_TEXT
    assert "prompt_tokens" not in on_disk["batch"]["largest"][1]  # a running request's: unknown
    assert on_disk["batch"]["largest"][0]["params"] == {"n": 1, "prompt_logprobs": 5}
    assert on_disk["allocator"]["segments"] == 3 and "simulated" not in on_disk["allocator"]
    assert (on_disk["in_flight"], on_disk["in_flight_source"]) == (2, "step")

    parsed = reader._parse(path.name, path.read_bytes())
    assert isinstance(parsed, records.OomRecord)
    assert parsed.target == "t" * records.MAX_TEXT and parsed.allocator.segments == 3
    assert parsed.dump() == text  # what the reader holds is what was written


def test_without_a_step_the_batch_is_null_and_in_flight_absent(tmp_path, monkeypatch):
    from oomguard.vllm_plugin import oom

    monkeypatch.setattr(oom, "_step", None)
    monkeypatch.setattr(oom, "_in_flight", None)
    rec = oom.OomRecorder("", str(tmp_path), "", dict, dict)
    rec.observe(0, 1, 2, 3)
    [path] = tmp_path.glob("oom-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk["batch"] is None and "in_flight" not in on_disk
    assert set(on_disk) == OOM_KEYS - {"in_flight", "in_flight_source"}
    assert reader._parse(path.name, path.read_bytes()).batch is None


def test_an_exit_record_round_trips():
    record = records.ExitRecord(
        schema=records.EXIT_SCHEMA,
        timestamp=2.0,
        started_at=1.0,
        pid=7,
        generation=1,
        returncode=-9,
        signal=9,
        reason="killed",
        cgroup=records.CgroupKills(dir=None, oom_kills_at_start=0, oom_kills_at_exit=1),
    )
    text = record.dump()
    assert json.loads(text)["kind"] == "exit" and json.loads(text)["cgroup"]["dir"] is None
    name = records.exit_file_name(7, 1)
    assert reader._parse(name, text.encode()) == record.model_copy(update={"name": name})
