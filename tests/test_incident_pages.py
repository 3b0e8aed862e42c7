"""One page per incident, measured: incident timelines (tests/incident_timelines.py) through the
generated rules (promtool) into a real Alertmanager with the shipped configuration, counted at
the receivers (tests/alert_replay.py).

Each incident that warrants a page pages once; designed behaviour pages nobody: the cap
instead of a drain while another replica of the model is out of service, an engine the
remediator cannot read because it crashed, a model unavailable while the engine that crashed
reloads (the OOM's page covers it), the slow burn that follows a fast one. A model's only engine
that can only be capped (a single box, limit `single_replica`) pages once: nothing else relieves
it (issue 29). The remediator gets every work order, a few webhooks each.
"""

from __future__ import annotations

import threading
import time

import pytest

from oomguard.lab.processes import have_prometheus_stack
from tests.alert_replay import (
    AlertmanagerProcess,
    Outcome,
    Sink,
    alertmanager_config,
    firing,
    outcome,
    replay,
)
from tests.incident_timelines import timelines

pytestmark = pytest.mark.skipif(not have_prometheus_stack(), reason="needs Alertmanager")

COMPRESSION = 120.0  # timeline seconds per real second (Alertmanager's timings divided alike)
TAIL = 420.0  # timeline seconds replayed after the last alert: the pager's 5m group_interval

# What each incident sends, as designed: each page (the alerts of its first notification: the
# one that opens it, and those that may fire in the same minute) and the tickets.
OOM = {"OomguardCudaOomObserved"}
# the drain of the model's only engine refused as it died (limit single_replica): its page
# joins the OOM's, the same model
ONLY_ENGINE = {"OomguardRemediationLimited"}
EXPECTED: dict[str, tuple[list[tuple[set[str], set[str]]], list[set[str]]]] = {
    # the OOM pages; the model unavailable while the engine reloads (no ready peer, 8 minutes)
    # and the refused drain of the model's only engine join the same pager incident (grouped by
    # model), they do not page again. The
    # classification follows as a ticket; the reload's own alerts (EngineRestarted, the vLLM
    # collector down, the remediator's reads failing) are that incident, no ticket or page.
    "cuda-oom-3m-alone": ([(OOM, ONLY_ENGINE)], [{"OomguardIncidentClassified"}]),
    "cuda-oom-8m-alone": ([(OOM, ONLY_ENGINE)], [{"OomguardIncidentClassified"}]),
    "cuda-oom-3m-peer": ([(OOM, set())], [{"OomguardIncidentClassified"}]),
    "cuda-oom-8m-peer": ([(OOM, set())], [{"OomguardIncidentClassified"}]),
    # the remediator handles it (cap, then a lower cap as the other replica drains already):
    # tickets for the fragmentation, the GPU and the queue behind the cap, no page
    "fragmentation-creep": (
        [],
        [
            {"OomguardAllocatorFragmentationGrowing"},
            {"OomguardGpuMemoryPressure"},
            {"OomguardGpuMemoryCritical"},
            {"OomguardRequestsQueueing"},
        ],
    ),
    # the same on a model's only engine (a single box): the remediator can only cap it, so
    # RemediationLimited (limit single_replica) pages once, what on-call does is in its runbook
    "fragmentation-creep-one-engine": (
        [({"OomguardRemediationLimited"}, set())],
        [
            {"OomguardAllocatorFragmentationGrowing"},
            {"OomguardGpuMemoryPressure"},
            {"OomguardGpuMemoryCritical"},
            {"OomguardRequestsQueueing"},
        ],
    ),
    # the fast burn pages; its slow burn is no ticket, then or after
    "slo-burn-2pct": ([({"OomguardRequestErrorBudgetBurn"}, set())], []),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    tls = timelines()
    steps = firing(tls)
    sink = Sink()
    am = AlertmanagerProcess(
        tmp_path_factory.mktemp("am"), alertmanager_config(sink.url, COMPRESSION)
    )
    try:
        errors: list[BaseException] = []
        lags: dict[str, float] = {}

        def run(i: int) -> None:
            try:
                lags[tls[i].name] = replay(am.url, tls[i], steps[tls[i].name], COMPRESSION, TAIL)
            except BaseException as exc:  # reported below, not lost in a thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(tls))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=600)
        assert not errors, errors
        time.sleep(TAIL / COMPRESSION)  # the last flushes (a resolve, a repeat) arrive
    finally:
        am.stop()
        sink.close()
    out = {tl.name: outcome(sink.received, tl.name) for tl in tls}
    for name, got in out.items():
        got.lag = lags.get(name, 0.0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("incident", sorted(EXPECTED))
def test_one_page_per_incident(outcomes, incident):
    pages, tickets = EXPECTED[incident]
    got = outcomes[incident]
    # a failure names how far the replay fell behind its schedule (in timeline seconds): events a
    # minute apart are 0.5 s apart here, and a heavily loaded machine can reorder them
    assert len(got.pages) == len(pages), got
    for page, (first, also) in zip(got.pages, pages, strict=True):
        # the page opens with the incident's first alert; alerts that fire in the same minute
        # may be in its first notification or join it as an update
        assert first <= page <= first | also, got
    assert sorted(map(sorted, got.tickets)) == sorted(map(sorted, tickets)), got
    assert not got.paged_and_ticketed, got


@pytest.mark.slow
def test_the_remediator_gets_every_work_order_without_a_storm(outcomes):
    """Every action alert reaches the remediator; each alert is its own group there, so it is
    told when one fires and when it resolves (and every repeat_interval while it lasts)."""
    oom = outcomes["cuda-oom-8m-alone"]
    assert {"OomguardCudaOomObserved", "OomguardMemoryCritical", "OomguardPressureBlind"} <= (
        oom.remediator_alerts
    )
    creep = outcomes["fragmentation-creep-one-engine"]
    assert {"OomguardMemoryPressure", "OomguardMemoryCritical"} <= creep.remediator_alerts
    repeat = 300 / COMPRESSION  # the remediator route's repeat_interval, compressed
    for name, got in outcomes.items():
        for key, times in got.remediator_groups.items():
            # fired, resolved, and one repeat per repeat_interval while it fires
            allowed = 2 + (max(times) - min(times)) / repeat + 1
            assert len(times) <= allowed, (name, key, len(times), allowed)
