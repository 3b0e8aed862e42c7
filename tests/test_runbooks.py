"""The runbooks are true to what is deployed: every panel they name exists, every command works on
the deployment it is written for, and what they say pages or tickets is what the routes do.

- Panels: `**<Dashboard> → <Panel>**` names a panel of that dashboard; bold names that follow it
  on the same line (`**Headroom per GPU**`) name panels of the same dashboard.
- kubectl: the real kubectl parses every command (run against a closed port, it must get as
  far as connecting), and every namespace, object, label selector and port it names exists in
  the shipped manifests (`deploy/kubernetes`; `monitoring` is the stock installs' namespace).
- curl: every URL is on 127.0.0.1 at a component's port; on Kubernetes that port is reached
  through a `kubectl port-forward` the same runbook gives (the exporter has no hostPort, the
  remediator's Service is cluster-internal), on a single box it is the port the shipped
  single-box config listens on. systemctl and journalctl name the shipped units.
- Routing: each runbook's Meaning says who is told (`Routing: a page.`), and every other
  sentence that says an alert pages or tickets writes it as `OomguardX (a page)`: both are
  checked against Alertmanager's routes (amtool), as is the README's table.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from oomguard.alerts.rules import all_alerts
from oomguard.dashboards.definitions import DASHBOARDS
from oomguard.thresholds import AlertThresholds
from tests.test_alertmanager_config import PAGER, expected_receivers

ROOT = Path(__file__).resolve().parent.parent
RUNBOOKS = sorted((ROOT / "runbooks").glob("*.md"))
T = AlertThresholds()
ALERTS = {a.name: a for a in all_alerts(T)}
NAMES = set(ALERTS)

# who is told, as a runbook writes it
CLAIMS = {
    "a page": {PAGER},
    "a ticket": {"oncall-ticket"},
    "a work order": {"remediator"},
    "a work order and a page": {"remediator", PAGER},
    "a page when fast, a ticket when slow": {PAGER, "oncall-ticket"},
    "dashboards only": {"nowhere"},
    "the watchdog": {"watchdog"},
}
_CLAIMS = "|".join(map(re.escape, sorted(CLAIMS, key=len, reverse=True)))  # longest first
CLAIM = re.compile(r"(Oomguard[A-Za-z]+|Watchdog) \((" + _CLAIMS + r")\)")
PAGING_WORD = re.compile(r"\b(pages?|paged|paging|tickets?)\b", re.I)


def text(path: Path) -> str:
    return path.read_text()


def flat(path: Path) -> str:
    """The runbook with wrapped lines joined (inline code spans wrap across lines)."""
    return re.sub(r"\n(?!\n|#|- |\d+\. |\|)\s*", " ", text(path))


def spans(path: Path) -> list[str]:
    return [s.strip() for s in re.findall(r"`([^`\n]+)`", flat(path))]


def routed(name: str) -> set[str]:
    severities = {a.severity for a in all_alerts(T) if a.name == name}
    receivers: set[str] = set()
    for a in all_alerts(T):
        if a.name == name and a.severity in severities:
            receivers |= set(expected_receivers(a))
    return receivers


# -- panels --------------------------------------------------------------------------------------
def panels() -> dict[str, set[str]]:
    out = {}
    for build in DASHBOARDS.values():
        d = build(T)
        out[d["title"].removeprefix("oomguard / ")] = {p["title"] for p in d["panels"]}
    return out


def panel_references(path: Path) -> list[tuple[str, str]]:
    found = []
    for line in flat(path).splitlines():
        dashboard = None
        for bold in re.findall(r"\*\*([^*]+)\*\*", line):
            if "→" in bold:
                dashboard, _, panel = (x.strip() for x in bold.partition("→"))
                found.append((dashboard, panel))
            elif dashboard and bold not in NAMES:
                found.append((dashboard, bold.strip()))
    return found


def test_every_panel_a_runbook_names_exists():
    known = panels()
    checked = 0
    for path in RUNBOOKS:
        for dashboard, panel in panel_references(path):
            assert dashboard in known, f"{path.name}: no dashboard {dashboard!r}"
            assert panel in known[dashboard], f"{path.name}: {dashboard} has no panel {panel!r}"
            checked += 1
    assert checked >= 20


# -- the shipped manifests -----------------------------------------------------------------------
@cache
def manifests() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    kustomization = yaml.safe_load((ROOT / "deploy/kubernetes/kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        docs += [
            d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes" / name).read_text()) if d
        ]
    return docs


KINDS = {
    "deploy": "Deployment",
    "deployment": "Deployment",
    "ds": "DaemonSet",
    "daemonset": "DaemonSet",
    "svc": "Service",
    "service": "Service",
    "configmap": "ConfigMap",
    "cm": "ConfigMap",
    "secret": "Secret",
    "podmonitor": "PodMonitor",
}
STOCK_NAMESPACE = "monitoring"  # kube-prometheus's (and Helm's usual) Prometheus and Alertmanager


def pod_templates(namespace: str | None) -> list[dict[str, Any]]:
    return [
        d["spec"]["template"]
        for d in manifests()
        if d["kind"] in ("Deployment", "DaemonSet")
        and (namespace is None or d["metadata"].get("namespace") == namespace)
    ]


def object_exists(kind: str, name: str, namespace: str) -> bool:
    if kind == "Secret" and name == "oomguard-tokens":
        return True  # created by hand (docs/kubernetes.md): tokens are not committed
    return any(
        d["kind"] == kind
        and d["metadata"]["name"] == name
        and d["metadata"].get("namespace") == namespace
        for d in manifests()
    )


def container_ports(kind: str, name: str, namespace: str) -> set[int]:
    for d in manifests():
        if d["kind"] == kind and d["metadata"]["name"] == name:
            if d["metadata"].get("namespace") != namespace:
                continue
            if kind == "Service":
                return {p["port"] for p in d["spec"]["ports"]}
            spec = d["spec"]["template"]["spec"]
            return {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
    return set()


def kubectl_commands() -> list[tuple[str, str]]:
    out = []
    for path in RUNBOOKS:
        for span in spans(path):
            for part in re.split(r"\s*(?:\||&&|;|\$\()\s*", span):
                if part.startswith("kubectl "):
                    out.append((path.name, part.rstrip(")")))
    return out


def _argv(command: str) -> list[str]:
    command = re.sub(r"<[^<>]*>", "x", command)
    return shlex.split(command)


_VALUED = {"-n", "--namespace", "-l", "--selector", "-o", "--output", "-c", "--container"}
_VALUED |= {"--field-selector", "-L", "--label-columns", "--tail", "--since", "-f", "-k"}


def _parse(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(namespace, label selector, positional arguments) of a kubectl command line."""
    namespace = selector = None
    positional: list[str] = []
    args = iter(argv[1:])
    for a in args:
        if a == "--":
            break  # what follows is the command `kubectl exec` runs
        name, eq, value = a.partition("=")
        if a.startswith("-") and name in _VALUED:
            value = value if eq else next(args, "")
            if name in ("-n", "--namespace"):
                namespace = value
            elif name in ("-l", "--selector"):
                selector = value
        elif not a.startswith("-"):
            positional.append(a)
    return namespace, selector, positional


@pytest.mark.parametrize("doc,command", kubectl_commands(), ids=lambda x: x[:70])
def test_kubectl_commands_parse_and_name_shipped_objects(doc, command, tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl")
    argv = _argv(command)
    namespace, selector, words = _parse(argv)
    where = f"{doc}: `{command}`"
    ours = namespace not in (None, "x", STOCK_NAMESPACE)
    if ours:
        assert any(d["metadata"].get("namespace") == namespace for d in manifests()), where
    verb = words[0]
    # kind/name references (deploy/oomguard-remediator, ds/oomguard-exporter, svc/...)
    for word in words[1:]:
        kind, slash, name = word.partition("/")
        if slash and kind in KINDS and name != "x" and ours:
            assert object_exists(KINDS[kind], name, namespace or ""), f"{where}: no {word}"
    if verb in ("get", "describe", "edit") and len(words) >= 3 and "/" not in words[2]:
        kind = KINDS.get(words[1])
        if kind and words[2] != "x" and ours:
            assert object_exists(kind, words[2], namespace or ""), f"{where}: no {kind} {words[2]}"
    # a label selector on pods selects shipped pods
    if selector and len(words) > 1 and "pod" in words[1]:
        wanted = dict(kv.split("=", 1) for kv in selector.split(","))
        templates = pod_templates(None if "-A" in argv else namespace)
        assert any(wanted.items() <= t["metadata"]["labels"].items() for t in templates), (
            f"{where}: selects no shipped pod"
        )
    # a port-forward forwards a port the object has
    if verb == "port-forward":
        kind, _, name = words[1].partition("/")
        ports = {int(p.split(":")[-1]) for p in words[2:]}
        if kind in KINDS and name != "x" and namespace != STOCK_NAMESPACE:
            have = container_ports(KINDS[kind], name, namespace or "")
            assert ports <= have, f"{where}: {words[1]} has ports {sorted(have)}"
    # the real kubectl accepts it: against a closed port it gets as far as connecting
    closed = "https://127.0.0.1:9"
    r = subprocess.run(
        ["kubectl", f"--server={closed}", "--token=x", "--insecure-skip-tls-verify", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env={"KUBECONFIG": str(tmp_path / "none"), "PATH": "/usr/bin:/bin", "EDITOR": "true"},
    )
    assert "connection refused" in r.stderr or "connect:" in r.stderr, f"{where}\n{r.stderr}"


_VERBS = {
    "get",
    "describe",
    "logs",
    "exec",
    "port-forward",
    "rollout",
    "edit",
    "label",
    "apply",
    "delete",
    "top",
    "events",
}


def test_the_kubectl_check_catches_a_wrong_command(tmp_path):
    """The parse check fails on what kubectl refuses, and the names check on a wrong object."""
    r = subprocess.run(
        ["kubectl", "--server=https://127.0.0.1:9", "get", "pods", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"KUBECONFIG": str(tmp_path / "none"), "PATH": "/usr/bin:/bin"},
    )
    assert "connection refused" not in r.stderr
    assert not object_exists("DaemonSet", "oomguard-exporter", "llm")
    assert object_exists("DaemonSet", "oomguard-exporter", "oomguard")
    assert 9848 in container_ports("DaemonSet", "oomguard-exporter", "oomguard")


# -- curl, systemctl, journalctl -----------------------------------------------------------------
def single_box_ports() -> dict[str, int]:
    def port(path: str) -> int:
        listen = yaml.safe_load((ROOT / path).read_text())["listen"]
        return int(listen.rsplit(":", 1)[1])

    flags = (ROOT / "deploy/single-box/vllm.env").read_text()  # vLLM's flags, units and Procfile
    vllm = int(re.search(r"--port[ =](\d+)", flags).group(1))  # type: ignore[union-attr]
    unit = (ROOT / "deploy/single-box/oomguard-vllm.service").read_text()
    supervisor = int(re.search(r"serve --listen \S+:(\d+)", unit).group(1))  # type: ignore[union-attr]
    return {
        "exporter": port("deploy/single-box/exporter.yaml"),
        "remediator": port("deploy/single-box/remediator.yaml"),
        "vllm": vllm,
        "supervisor": supervisor,
    }


def test_every_curl_reaches_a_port_the_runbook_opens():
    ports = set(single_box_ports().values())
    checked = 0
    for path in RUNBOOKS:
        body = flat(path)
        forwarded = {
            int(p.split(":")[-1])
            for cmd in re.findall(r"`(kubectl [^`]*port-forward[^`]*)`", body)
            for p in shlex.split(re.sub(r"<[^<>]*>", "x", cmd))
            if re.fullmatch(r"(\d+:)?\d+", p)
        }
        for span in spans(path):
            for url in re.findall(r"curl [^`]*?(https?://[^\s'\"`]+)", span):
                host, _, rest = url.split("//", 1)[1].partition(":")
                port = int(re.match(r"\d+", rest).group(0)) if rest else 80  # type: ignore[union-attr]
                where = f"{path.name}: {url}"
                assert host in ("127.0.0.1", "localhost"), (
                    f"{where}: on Kubernetes the components are reached through kubectl "
                    "port-forward (the exporter has no hostPort), on one box on 127.0.0.1"
                )
                assert port in ports | {9090, 9093}, where
                if port in (9848, 9849) or port == 9090:
                    assert port in forwarded, f"{where}: no `kubectl port-forward` to {port}"
                checked += 1
    assert checked >= 8


def test_units_a_runbook_names_are_shipped():
    units = {p.stem for p in (ROOT / "deploy/single-box").glob("*.service")}
    units |= {"prometheus", "prometheus-alertmanager"}  # Debian's packages' own units
    for path in RUNBOOKS:
        for span in spans(path):
            for unit in re.findall(r"(?:systemctl \w+|journalctl -u) ([\w-]+)", span):
                assert unit in units, f"{path.name}: no unit {unit}"


# -- who is told ---------------------------------------------------------------------------------
def _sentences(path: Path) -> list[str]:
    body = re.sub(r"`[^`]*`", "`…`", flat(path))
    return [s for s in re.split(r"(?<=[.:;])\s+|\n", body) if s.strip()]


@pytest.mark.parametrize("path", [p for p in RUNBOOKS if p.stem in NAMES], ids=lambda p: p.stem)
def test_each_runbook_says_who_is_told_as_the_routes_do(path):
    meaning = text(path).split("## Meaning", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"Routing: (" + _CLAIMS + r")\.", meaning)
    assert len(found) == 1, f"{path.name}: its Meaning says `Routing: <{'|'.join(CLAIMS)}>.`"
    assert CLAIMS[found[0]] == routed(path.stem), (path.name, found[0], routed(path.stem))


def test_every_paging_claim_in_the_runbooks_matches_the_routes():
    checked = 0
    for path in RUNBOOKS:
        for sentence in _sentences(path):
            claimed = {name: what for name, what in CLAIM.findall(sentence)}
            for name, what in claimed.items():
                assert name in NAMES, f"{path.name}: no alert {name}"
                assert CLAIMS[what] == routed(name), f"{path.name}: {name} ({what}): {sentence}"
                checked += 1
            if PAGING_WORD.search(sentence.replace("Routing:", "")):
                named = set(re.findall(r"\b(Oomguard[A-Za-z]+)\b", sentence)) - {path.stem}
                unclaimed = named - set(claimed)
                assert not unclaimed, (
                    f"{path.name}: say who is told as `{sorted(unclaimed)[0]} (a page)` (or a "
                    f"ticket, a work order, dashboards only): {sentence}"
                )
    assert checked >= 10


def test_the_readme_table_is_the_routes():
    """runbooks/README.md's "Who gets what": each row's alerts go to its receiver."""
    readme = text(ROOT / "runbooks/README.md")
    table = readme.split("## Who gets what", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"(?m)^\| (.+?) \| (.+?) \|$", table)
    seen = set()
    for alerts, receiver in rows[2:] if rows and set(rows[0][0]) <= {"-"} else rows[1:]:
        names = {f"Oomguard{n}" for n in re.findall(r"\b([A-Z][A-Za-z]+)\b", alerts)}
        names &= NAMES
        wanted = {r for claim, rs in CLAIMS.items() if claim in receiver for r in rs}
        assert wanted, receiver
        for name in names:
            severities = {a.severity for a in all_alerts(T) if a.name == name}
            if len(severities) > 1:  # a fast burn pages, a slow one tickets: one row each
                assert wanted <= routed(name), (name, receiver)
            else:
                assert routed(name) == wanted, (name, receiver)
            seen.add(name)
    assert {n for n in NAMES if PAGER in routed(n)} <= seen  # every paging alert is listed


def test_the_claim_checks_catch_the_old_prose(tmp_path):
    """IncidentClassified once said the crash "already paged (OomguardCudaOomObserved,
    OomguardHostOomKill, OomguardEngineRestarted)": HostOomKill and EngineRestarted are tickets."""
    old = "It is a ticket: the crash itself already paged (OomguardHostOomKill)."
    assert PAGING_WORD.search(old) and not CLAIM.findall(old)
    assert routed("OomguardHostOomKill") == {"oncall-ticket"}
    assert json.dumps(sorted(routed("OomguardCudaOomObserved"))) == '["oncall-pager", "remediator"]'
