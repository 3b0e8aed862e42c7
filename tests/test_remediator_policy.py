"""The remediator's decision: bounded, deterministic, and never moved by KV usage alone."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.remediator.policy import (
    Observed,
    PolicyConfig,
    actions_for,
    decide,
)
from oomguard.remediator.webhook import Alert

T0 = datetime(2026, 11, 29, tzinfo=UTC)
POLICY = PolicyConfig()


def alert(name: str, action: str | None = None, status: str = "firing") -> Alert:
    labels = {"alertname": name, "target": "llama"}
    if action:
        labels["oomguard_action"] = action
    return Alert(f"fp-{name}", status, labels, T0, None)


def obs(
    cap=64,
    startup=64,
    draining=False,
    seconds=60.0,
    admitted=0,
    finished=0,
    preempted=0,
    running=0,
    waiting=0,
    prefilled=0,
):
    return Observed(
        startup, cap, draining, seconds, admitted, finished, preempted, running, waiting, prefilled
    )


def test_actions_come_from_labels_and_the_policy_and_kv_never_acts():
    firing = [
        alert("OomguardMemoryPressure", "lower_cap"),
        alert("OomguardKVCacheUsageHigh", "drain"),  # even if mislabelled
        alert("OomguardMemoryCritical", "drain", status="resolved"),
    ]
    assert actions_for(firing, POLICY) == {"lower_cap"}
    override = PolicyConfig(actions={"OomguardMemoryPressure": "drain"})
    assert actions_for(firing, override) == {"drain"}
    assert actions_for([alert("OomguardEngineDown")], POLICY) == set()


def test_pressure_lowers_by_twenty_percent_per_step_and_waits_between_steps():
    assert decide({"lower_cap"}, obs(cap=64), POLICY).cap == 51
    assert decide({"lower_cap"}, obs(cap=51, seconds=5), POLICY).cap == 51  # too soon
    assert decide({"lower_cap"}, obs(cap=1), POLICY).cap == 1  # never below 1
    assert decide({"lower_cap"}, obs(cap=10), PolicyConfig(floor=9)).cap == 9


def test_critical_drains_and_resolution_resumes_at_the_first_stage():
    d = decide({"drain", "lower_cap"}, obs(cap=40), POLICY)
    assert d.draining and d.phase == "draining" and d.cap == 40
    resumed = decide(set(), obs(cap=40, draining=True), POLICY)
    assert not resumed.draining and resumed.cap == 1 and resumed.phase == "readmitting"


def test_readmission_goes_to_full_after_five_clean_single_admissions():
    # the field rule: admit one at a time, full admission after 5 clean single admissions
    waiting = decide(set(), obs(cap=1, admitted=1, finished=0), POLICY)
    assert waiting.cap == 1  # the one admitted is still running (no prefill count: old plugin)
    preempted = decide(set(), obs(cap=1, admitted=9, finished=9, preempted=1), POLICY)
    assert preempted.cap == 1  # not clean
    assert decide(set(), obs(cap=1, admitted=5, finished=5), POLICY).cap == 64
    assert decide(set(), obs(cap=64), POLICY).phase == "serving"


def test_doubling_stages_when_configured():
    doubling = POLICY.model_copy(update={"readmit_stages": "doubling"})
    caps = [1]
    while caps[-1] < 64:
        caps.append(decide(set(), obs(cap=caps[-1], admitted=5, finished=5), doubling).cap)
    assert caps == [1, 2, 4, 8, 16, 32, 64]


def test_a_restarted_remediator_continues_a_readmission_where_the_engine_is():
    # nothing but the engine's own state is needed to pick up at the stage it is in
    assert decide(set(), obs(cap=8, admitted=6, finished=5), POLICY).cap == 64
    doubling = POLICY.model_copy(update={"readmit_stages": "doubling"})
    assert decide(set(), obs(cap=8, admitted=6, finished=5), doubling).cap == 16


observed = st.builds(
    lambda startup, cap, draining, seconds, a, f, p: Observed(
        startup, min(cap, startup), draining, seconds, a, f, p
    ),
    st.integers(1, 1024),
    st.integers(1, 1024),
    st.booleans(),
    st.floats(0, 3600, allow_nan=False),
    st.integers(0, 100),
    st.integers(0, 100),
    st.integers(0, 10),
)
action_sets = st.sets(st.sampled_from(["lower_cap", "drain", "restart"]))
policies = st.builds(
    PolicyConfig,
    step_factor=st.floats(0.05, 0.95),
    floor=st.integers(1, 64),
    readmit_start=st.integers(1, 64),
    readmit_successes=st.integers(1, 10),
    readmit_growth=st.floats(1.1, 4),
)


@settings(max_examples=500, deadline=None)
@given(action_sets, observed, policies)
def test_the_cap_always_stays_within_one_and_startup(actions, o, policy):
    d = decide(actions, o, policy)
    assert 1 <= d.cap <= o.startup_max_num_seqs
    if actions & {"lower_cap", "restart"} and "drain" not in actions:
        assert d.cap <= o.admission_cap  # pressure never raises the cap
        assert not d.draining
    assert d.draining == ("drain" in actions)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                ("OomguardMemoryPressure", "lower_cap"),
                ("OomguardMemoryCritical", "drain"),
                ("OomguardKVCacheUsageHigh", None),
                ("OomguardPreemptionRateHigh", "lower_cap"),
                ("OomguardEngineDown", None),
            ]
        ),
        max_size=8,
    ),
    observed,
    st.randoms(use_true_random=False),
)
def test_the_same_alert_set_always_gives_the_same_desired_state(pairs, o, rnd):
    alerts = [alert(n, a) for n, a in pairs]
    shuffled = alerts + alerts
    rnd.shuffle(shuffled)
    assert decide(actions_for(alerts, POLICY), o, POLICY) == decide(
        actions_for(shuffled, POLICY), o, POLICY
    )


def test_observed_from_the_plugins_state_document():
    state = {
        "startup_max_num_seqs": 64,
        "admission_cap": 8,
        "mode": "draining",
        "since_cap_change": {"seconds": 3.5, "admitted": 2, "finished": 1, "preemptions": 0},
    }
    assert Observed.from_state(state) == Observed(64, 8, True, 3.5, 2, 1, 0)


def test_the_first_step_from_full_admission_is_immediate_and_later_ones_are_paced():
    # the cap just reached startup (a re-admission finished 2 s ago) and pressure returns
    assert decide({"lower_cap"}, obs(cap=64, seconds=2), POLICY).cap == 51
    # already capped and changed 2 s ago: wait for step_seconds
    paced = decide({"lower_cap"}, obs(cap=51, seconds=2), POLICY)
    assert (paced.cap, paced.reason) == (51, "pressure: waiting for the next step")
    assert decide({"lower_cap"}, obs(cap=51, seconds=31), POLICY).cap == 40


def test_a_clean_admission_counts_once_its_prefill_ran_and_lets_one_more_in():
    # the field rule, one at a time: cap 1, 2, ... 5, each raise once the last prefill ran
    caps = [1]
    while caps[-1] < 64:
        running = caps[-1]  # nothing has finished: long outputs still decoding
        o = obs(cap=caps[-1], admitted=1, prefilled=1, running=running, waiting=20)
        caps.append(decide(set(), o, POLICY).cap)
    assert caps == [1, 2, 3, 4, 5, 64]  # five clean admissions, none finished


def test_an_admission_still_in_prefill_is_not_clean_yet():
    o = obs(cap=2, admitted=1, prefilled=0, running=2, waiting=20)
    assert decide(set(), o, POLICY).cap == 2  # its prompt's KV is not all allocated yet


def test_memory_that_rises_during_the_stage_is_not_a_clean_admission():
    # the KV pool ran short: a preemption since the cap change holds the stage
    o = obs(cap=3, admitted=1, prefilled=1, preempted=1, running=3, waiting=20)
    d = decide(set(), o, POLICY)
    assert d.cap == 3 and d.phase == "readmitting"
    # the GPU's memory rose: the pressure alert fires during the stage, the cap goes down
    soon = obs(cap=3, admitted=1, prefilled=1, running=3, waiting=20, seconds=5.0)
    held = decide({"lower_cap"}, soon, POLICY)
    assert held.cap == 3 and held.phase == "capped"  # not raised: paced before lowering
    later = obs(cap=3, admitted=1, prefilled=1, running=3, waiting=20, seconds=60.0)
    assert decide({"lower_cap"}, later, POLICY).cap == 2
    assert decide({"drain"}, soon, POLICY).draining


@pytest.mark.parametrize("cap", [3, 41])  # the single-admission stage; a capped engine
def test_a_stage_held_by_preemptions_alone_goes_to_full_admission_in_time(cap):
    """Only a cap change resets the preemption count: without a bound, one preemption would
    keep a healthy engine capped for good once no alert fires."""
    held = obs(cap=cap, admitted=5, prefilled=5, preempted=1, running=cap, waiting=20)
    assert decide(set(), held, POLICY).cap == cap  # within the bound: the stage holds
    stalled = obs(
        cap=cap,
        admitted=5,
        prefilled=5,
        preempted=1,
        running=cap,
        waiting=20,
        seconds=POLICY.readmit_stall_seconds,
    )
    d = decide(set(), stalled, POLICY)
    assert (d.cap, d.phase, d.draining) == (64, "readmitting", False)
    assert "preemptions alone" in d.reason
    # an alert still asking for action wins over the bound
    assert decide({"lower_cap"}, stalled, POLICY).cap < cap
    assert decide({"drain"}, stalled, POLICY).draining


def test_requests_a_drain_let_run_count_but_one_new_admission_must_run_clean():
    # resumed at cap 1 with 40 still decoding from before the drain: let one in above them
    carried = obs(cap=1, running=40, waiting=30)
    first = decide(set(), carried, POLICY)
    assert first.cap == 41 and first.phase == "readmitting"
    # nothing waiting: nothing to let in, and no full admission without a new clean one;
    # held readmit_idle_seconds with nothing waiting, the stage advances by one, not to full
    idle = POLICY.readmit_idle_seconds
    assert decide(set(), obs(cap=1, running=40, seconds=idle - 0.5), POLICY).cap == 1
    assert decide(set(), obs(cap=1, running=40, seconds=idle), POLICY).cap == 2
    assert decide(set(), obs(cap=41, admitted=1, prefilled=0, running=41), POLICY).cap == 41
    # above the single-admission stage the cap carries no count: five clean ones at that cap
    assert decide(set(), obs(cap=41, admitted=1, prefilled=1, running=41), POLICY).cap == 41
    assert decide(set(), obs(cap=41, admitted=5, prefilled=5, running=41), POLICY).cap == 64
    # a few still running: they count, and one new clean admission brings full admission
    assert decide(set(), obs(cap=1, running=4, waiting=3), POLICY).cap == 5
    assert decide(set(), obs(cap=5, admitted=1, prefilled=1, running=5), POLICY).cap == 64


def test_an_engine_capped_but_never_drained_needs_five_clean_admissions_at_its_cap():
    lowered = obs(cap=51, admitted=4, prefilled=4, running=51, waiting=10)
    assert decide(set(), lowered, POLICY).cap == 51  # 4 of 5; no one-at-a-time raise
    assert decide(set(), obs(cap=51, admitted=5, prefilled=5, running=51), POLICY).cap == 64


def test_under_light_traffic_a_stage_that_held_nobody_back_advances_with_time():
    """5 clean admissions cannot happen soon at one request every few seconds: a stage held
    readmit_idle_seconds with nothing waiting and nothing in prefill counts as one."""
    idle = POLICY.readmit_idle_seconds
    assert idle > 0
    caps, seconds = [1], 0.0
    while caps[-1] < 64:
        d = decide(set(), obs(cap=caps[-1], seconds=idle), POLICY)
        assert d.phase == "readmitting" and not d.draining
        caps.append(d.cap)
        seconds += idle
    assert caps == [1, 2, 3, 4, 5, 64] and seconds == 5 * idle
    # not before its time, nor with an admission in prefill or a preemption at the stage
    assert decide(set(), obs(cap=2, seconds=idle - 0.1), POLICY).cap == 2
    for held in (
        obs(cap=2, seconds=60.0, admitted=1, running=1),  # its prefill has not run
        obs(cap=2, seconds=60.0, admitted=1, prefilled=1, preempted=1, running=1),
    ):
        assert decide(set(), held, POLICY).cap == 2
    # an alert still asking for action wins; 0 turns it off
    assert decide({"lower_cap"}, obs(cap=2, seconds=60.0), POLICY).cap == 1
    off = POLICY.model_copy(update={"readmit_idle_seconds": 0.0})
    assert decide(set(), obs(cap=2, seconds=600.0), off).cap == 2


def test_a_plugin_without_prefill_counts_waits_for_finished_requests():
    # an older plugin reports no `prefilled`: finished admissions count, as before
    assert decide(set(), obs(cap=1, admitted=1, running=1, waiting=9), POLICY).cap == 1
    assert decide(set(), obs(cap=1, admitted=1, finished=1, waiting=9), POLICY).cap == 2
