"""Requests lost in engine crashes: the OOM observer's records (what the engine held, running and
queued, as it died) counted once per death by the exporter's incident collector and served as
`oomguard_requests_lost_total`, which the error-budget SLI adds (promtool cases in
alerts/cases.py; the real vLLM twin in tests/test_incidents_induced.py)."""

from __future__ import annotations

import json
from pathlib import Path

from oomguard.exporter.collectors.incidents import IncidentCollector, crash_losses
from oomguard.exporter.render import FamilyBuilder
from oomguard.incident_records import OomRecord

NOW = 1_790_000_000.0


def record(pid: int, at: float, held: int | None, rank: int = 0, engine: str = "0") -> dict:
    out = {
        "schema": "oomguard.oom_incident.v1",
        "kind": "cuda_oom",
        "timestamp": at,
        "pid": pid,
        "rank": rank,
        "target": "llama",
        "engine": engine,
        "model_name": "meta-llama/Meta-Llama-3-8B-Instruct",
        "requested_bytes": 2**30,
    }
    if held is not None:
        out |= {"in_flight": held, "in_flight_source": "scheduler"}
    return out


def parsed(*records: dict) -> list[OomRecord]:
    return [OomRecord.model_validate({**r, "name": f"oom-{r['pid']}-1.json"}) for r in records]


MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def test_each_death_counts_once_whatever_ranks_recorded_it():
    # a tensor-parallel engine: both ranks record the step (rank 1 saw only its batch);
    # the engine reloads and dies again ten minutes later; engine 1 of the same server too
    lost = crash_losses(
        parsed(
            record(101, NOW, 24),
            record(102, NOW + 0.2, 9, rank=1),
            record(201, NOW + 600, 31),
            record(301, NOW + 5, 4, engine="1"),
        )
    )
    assert lost == {("llama", MODEL, "0"): 55, ("llama", MODEL, "1"): 4}


def test_the_better_told_rank_wins_and_an_old_record_counts_nothing():
    lost = crash_losses(parsed(record(101, NOW, 9), record(102, NOW + 1, 24, rank=1)))
    assert lost == {("llama", MODEL, "0"): 24}
    assert crash_losses(parsed(record(101, NOW, None))) == {("llama", MODEL, "0"): 0}


def test_the_collector_serves_the_count(tmp_path: Path):
    for i, r in enumerate([record(101, NOW, 24), record(102, NOW + 0.2, 9, rank=1)]):
        (tmp_path / f"oom-{r['pid']}-{i + 1}.json").write_text(json.dumps(r))
    (tmp_path / "oom-999-1.json").write_text(
        '{"schema": "oomguard.oom_incident.v1", "in_flight": -3}'
    )
    collector = IncidentCollector(str(tmp_path), "gpu-node-1")
    reading = collector.collect()
    assert reading.invalid  # the hostile record is refused, the others counted
    out = FamilyBuilder()
    collector.families(reading, out)
    by_name = {f.spec.name: f for f in out.families()}
    lost = by_name["oomguard_requests_lost_total"]
    assert lost.spec.type == "counter"
    assert lost.samples == [(("gpu-node-1", "llama", MODEL, "0"), 24.0)]
