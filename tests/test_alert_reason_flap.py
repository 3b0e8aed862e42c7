"""A reason that changes while the level stays up must not keep the action alerts from firing.
`reason` is a label of the level series, so a rule on the raw series would track its `for` per
(engine, reason): an engine held at level 2 whose reason alternates (a step-guard shrink's 15 s
hold, then headroom_low again) would restart the `for` at every change and never fire, and no
cap would be lowered while memory stays short (found at stop 39, promtool-reproduced). The
action alerts judge the engine (`max without (reason)`, oomguard.actions.ActionAlert); the
fragmentation alert alone looks at one reason. The generated promtool cases hold the same
(alerts/cases.py); this file keeps the shipped rules' own file under test with a control, as it
did while the gap was open.

promtool plays the series as Prometheus scrapes them: a series that leaves a scrape gets a
staleness marker (`stale`), so it is gone at once, not for the 5-minute lookback."""

from __future__ import annotations

from pathlib import Path

import yaml

from oomguard.alerts.generate import RULES
from tests.test_alert_rules import promtool_on

ENGINE = 'target="a",engine="0"'
ALERT = "OomguardMemoryPressure"


def fires(
    repo_root: Path, tmp_path: Path, series: dict[str, str], at: str, alert: str = ALERT
) -> bool:
    """Whether `alert` fires at `at` for these level series, on the shipped rules (promtool: a
    case that expects no alert fails, naming the alerts it got)."""
    tests = {
        "rule_files": [RULES.name],
        "evaluation_interval": "5s",
        "tests": [
            {
                "name": f"{alert} reason flap",
                "interval": "5s",
                "input_series": [
                    {
                        "series": f'oomguard_engine_pressure_level{{{ENGINE},reason="{reason}"}}',
                        "values": values,
                    }
                    for reason, values in series.items()
                ],
                "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": []}],
            }
        ],
    }
    rules = yaml.safe_load((repo_root / RULES).read_text())
    r = promtool_on(tmp_path, rules, tests, alert)
    out = r.stdout + r.stderr
    assert r.returncode == 0 or "got:" in out, out  # a broken file is not an answer
    return r.returncode != 0 and f'alertname="{alert}"' in out


def test_a_steady_reason_at_level_2_fires_after_its_for(repo_root, tmp_path):
    """The control: the harness sees the alert when the rules fire it."""
    assert fires(repo_root, tmp_path, {"headroom_low": "2x30"}, "40s")
    assert not fires(repo_root, tmp_path, {"headroom_low": "2x30"}, "20s")  # still pending


def test_level_2_held_for_two_minutes_fires_whatever_its_reason_says(repo_root, tmp_path):
    # every 5 s one of the two series says 2; each reason lasts 20 s, then the other
    series = {
        "headroom_low": "2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2",
        "step_guard_shrink": "_ _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _",
    }
    assert fires(repo_root, tmp_path, series, "135s")


FLAP = "2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2"
FRAGMENTS = {
    "allocator_fragmentation": FLAP,
    "headroom_low": "_ _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _ 2 2 2 2 stale _ _ _",
}


def test_fragmentation_that_comes_and_goes_is_pressure_but_not_a_restart(repo_root, tmp_path):
    """The restart path wants its reason held for its `for`: fragments that come and go (20 s
    each) leave the engine capped by the engine-wide alert, not drained for a restart."""
    assert fires(repo_root, tmp_path, FRAGMENTS, "135s")
    frag = "OomguardFragmentationPressure"
    assert not fires(repo_root, tmp_path, FRAGMENTS, "135s", frag)
    held = {"allocator_fragmentation": "2x30"}
    assert fires(repo_root, tmp_path, held, "40s", frag)
    assert not fires(repo_root, tmp_path, held, "20s", frag)
