"""`oomguard demo`: the same incident with and without oomguard, a healthy GPU left alone, and a
one-page report checked in a real headless browser.

The demo runs once for the module, from the installed wheel's virtualenv (tests/wheel_env.py, shared
with tests/test_packaging.py): real vLLM servers, exporter, Prometheus, Alertmanager, remediator;
each test reads what it left in the report folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from oomguard.lab.processes import have_prometheus_stack
from oomguard.lab.report_dashboards import fill, legend, load_dashboards, value_mappings
from tests.report_check import Browser, find_browser
from tests.vllm_server import require_vllm
from tests.wheel_env import borrow_vllm, run_oomguard, site_packages

PNG = b"\x89PNG\r\n\x1a\n"


def require_browser() -> None:
    """Like require_vllm: skip on a developer machine without Chromium, fail in CI."""
    if find_browser():
        return
    if os.environ.get("CI"):
        pytest.fail("no Chromium; `make test` installs it (scripts/install-system-deps.sh)")
    pytest.skip("Chromium not installed (scripts/install-system-deps.sh installs it)")


@dataclass
class DemoRun:
    stdout: str
    report: Path
    summary: dict[str, Any]
    engine_logs: list[Path]  # each engine's output, under `oomguard serve`
    site_packages: Path  # the wheel venv's


@pytest.fixture(scope="module")
def demo(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The full demo, run once, from the installed wheel's venv (outside the checkout, vLLM
    borrowed from this environment): what a user who installed the package gets."""
    require_vllm()
    if not have_prometheus_stack():
        pytest.skip("Prometheus/Alertmanager not installed (scripts/install-system-deps.sh)")
    borrow_vllm(installed)
    home = tmp_path_factory.mktemp("demo")
    report, work = home / "report", home / "work"
    work.mkdir()
    r = run_oomguard(
        installed,
        "demo",
        "--report",
        str(report),
        cwd=home,
        timeout=1400,  # five vLLMs on a busy 2-core machine: minutes to load
        env={"TMPDIR": str(work)},  # the demo's work files (the engines' logs) land here
    )
    logs = sorted(work.rglob("vllm.log"))
    assert r.returncode == 0, (
        r.stdout[-4000:] + r.stderr[-4000:] + "".join(p.read_text()[-2000:] for p in logs[-1:])
    )
    summary = json.loads((report / "summary.json").read_text())
    return DemoRun(r.stdout, report, summary, logs, site_packages(installed))


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_the_demo_ran_from_the_installed_wheel(demo):
    """The twin models, traces, rules, dashboards and Prometheus/Alertmanager configs came from
    the installed package, not the checkout: every engine served the trace's model folder
    (llama-3-8b) from the wheel's site-packages."""
    assert len(demo.engine_logs) == 5  # two alone, two guarded, one on the healthy GPU
    for log in demo.engine_logs:
        assert f"{demo.site_packages}/oomguard/twin/models/llama-3-8b" in log.read_text(), log
    assert set(demo.summary["dashboards"]) == {"fleet", "node", "remediation"}
    assert (demo.report / "summary.md").is_file() and (demo.report / "report.html").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_side_by_side_vllm_alone_crashes_and_oomguard_loses_nothing(demo):
    summary = demo.summary
    alone = summary["side_by_side"]["alone"]
    guarded = summary["side_by_side"]["oomguard"]
    # the same seeded incident: the same requests on both sides
    assert alone["requests"] == guarded["requests"] > 100
    # vLLM alone: a CUDA OOM kills engine 0 with its in-flight requests; it reloads the model
    assert alone["crashes"] >= 1 and alone["engine_deaths"] >= 1
    assert alone["lost"] > 0, alone["lost_requests"]
    assert alone["down_s"] > 300  # dead or reloading for minutes of trace time
    assert alone["actions"] == []
    # oomguard: no OOM, nothing lost, engine 0 drained and brought back in stages
    assert guarded["crashes"] == 0 and guarded["engine_deaths"] == 0
    assert guarded["lost"] == 0, guarded["lost_requests"]
    assert guarded["completed"] == guarded["requests"]
    assert guarded["down_s"] < alone["down_s"]  # never dead (a slow health check may read down)
    assert any(a.endswith(":drain") for a in guarded["actions"]), guarded["actions"]
    assert any(a.endswith(":resume") for a in guarded["actions"]), guarded["actions"]
    assert guarded["recovery_s"] is not None
    assert alone["recovery_s"] is None or guarded["recovery_s"] < alone["recovery_s"]
    # the same horizon: every request served with oomguard, fewer without. (Goodput, within the
    # TTFT objective, is in the report but not asserted: in compressed time a busy machine's
    # wall-clock latency alone can break the objective on both sides.)
    assert guarded["completed"] > alone["completed"]


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_do_no_harm_segment_has_no_alert_and_no_action(demo):
    summary = demo.summary
    d = summary["do_no_harm"]
    assert d["gpu_memory_utilization"] == 0.92 and d["prometheus"] is True
    # it was heavy: the KV cache ran full and requests queued (a test that cannot fail otherwise)
    assert d["kv_usage_max"] >= 0.8 and d["waiting_max"] > 0
    assert d["completed"] > 50 and d["lost"] == 0 and d["crashes"] == 0
    assert d["alerts"] == [], d["alerts"]
    assert d["actions"] == [], d["actions"]
    assert d["max_pressure_level"] == 0


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_report_shows_what_on_call_saw(demo):
    stdout, report, summary = demo.stdout, demo.report, demo.summary
    # the live view showed both runs while it ran
    assert "vLLM alone" in stdout and "vLLM + oomguard" in stdout
    # dashboards drawn from the real Prometheus, with the generated JSON's own queries
    boards = load_dashboards()
    assert set(summary["dashboards"]) == set(boards) == {"fleet", "node", "remediation"}
    for name, panels in summary["dashboards"].items():
        assert (report / f"dashboard-{name}.png").read_bytes()[:8] == PNG
        expected = [p["title"] for p in boards[name]["panels"] if p.get("type") != "row"]
        assert [p["title"] for p in panels] == expected
        for p in panels:
            assert all("$" not in q for q in p["queries"]), p
        assert sum(p["series"] for p in panels) > 0, name  # real data, not empty frames
    # alerts with their runbooks; the remediator acted on the guarded engine 0 only
    fired = {a["alert"] for a in summary["alerts"]}
    assert fired, "no alert fired for the incident"
    # a runbook link may point into its page (OomguardIncidentClassified.md#long_prompt)
    assert all(
        a["runbook_url"].split("#")[0].endswith(f"{a['alert']}.md") for a in summary["alerts"]
    )
    assert all(a["target"] != "llama-1" for a in summary["alerts"] if a["action"])
    audit = [json.loads(x) for x in (report / "remediator-audit.jsonl").read_text().splitlines()]
    times = [e["time"] for e in audit]
    assert times == sorted(times) and any(e["event"] == "received" for e in audit)
    page = (report / "report.html").read_text()
    for alert in fired:
        assert alert in page
    md = (report / "summary.md").read_text()
    assert "| requests lost |" in md and "![side by side](side-by-side.png)" in md


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_report_renders_in_a_real_browser(demo, tmp_path):
    require_browser()
    report, summary = demo.report, demo.summary
    with Browser() as browser:
        result = browser.check(report / "report.html")
    (tmp_path / "screenshot.png").write_bytes(result.screenshot)
    assert result.title == "oomguard demo report"
    # side by side, do no harm, three dashboards: every image decoded, none fetched from outside
    assert len(result.images) == 2 + len(summary["dashboards"]) == 5
    assert result.broken_images == [], result.broken_images
    assert all(i["data"] and i["width"] > 400 for i in result.images)
    assert result.links and result.broken_links == [], result.broken_links
    assert result.external == []
    assert result.screenshot[:8] == PNG and len(result.screenshot) > 20_000


def test_browser_check_catches_a_broken_image_and_a_dangling_link(tmp_path):
    require_browser()
    page = tmp_path / "broken.html"
    page.write_text(
        "<!doctype html><title>broken</title><h1 id='top'>x</h1>"
        "<img src='data:image/png;base64,AAAA' alt='broken'>"
        "<a href='#top'>fine</a><a href='#nowhere'>dangling</a><a href='missing.md'>file</a>"
    )
    with Browser() as browser:
        result = browser.check(page)
    assert [i["alt"] for i in result.broken_images] == ["broken"]
    assert sorted(link["href"] for link in result.broken_links) == ["#nowhere", "missing.md"]


def test_dashboard_queries_are_filled_as_grafana_fills_them():
    expr = (
        'sum(rate(oomguard_vllm_preemptions_total{job=~"$job", instance=~"$node"}'
        "[$__rate_interval]))"
    )
    # Grafana: $__rate_interval = max(4 x scrape interval, step + scrape interval)
    assert fill(expr, step=1, scrape=1) == (
        'sum(rate(oomguard_vllm_preemptions_total{job=~".*", instance=~".*"}[4s]))'
    )
    assert "[11s]" in fill(expr, step=10, scrape=1)
    assert legend("{{target}}/{{engine}} used", {"target": "llama-0", "engine": "0"}) == (
        "llama-0/0 used"
    )
    # every panel query of the generated dashboards is left without a variable
    for board in load_dashboards().values():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                assert "$" not in fill(target["expr"], 1, 1), target["expr"]
            if panel.get("type") == "state-timeline":  # coloured by the dashboard's own mappings
                assert value_mappings(panel), panel["title"]
    level = {
        "fieldConfig": {
            "defaults": {
                "mappings": [
                    {"type": "value", "options": {"3": {"color": "red", "text": "critical"}}}
                ]
            }
        }
    }
    assert value_mappings(level) == {3: ("#f2495c", "critical")}


def test_demo_help_offers_a_quick_mode():
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert r.returncode == 0 and "--quick" in r.stdout
