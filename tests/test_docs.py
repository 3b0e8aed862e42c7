"""The walkthroughs work when followed literally.

Every ```sh block in README.md, docs/single-box.md, docs/kubernetes.md and deploy/docker/README.md
carries a marker comment on the line before it:

  <!-- docs-test: run -->      runs as written, offline, from the repository root
  <!-- docs-test: sandbox -->  runs as written with /etc, /opt/oomguard and /var/lib moved into a
                               temporary root, and the commands that change the machine or reach a
                               cluster (apt-get, useradd, systemctl, kubectl, ...) replaced by
                               stand-ins that record their arguments and check their preconditions;
                               promtool, amtool, systemd-analyze and kubectl kustomize are the real
                               ones. The test then checks what the block left behind.
  <!-- docs-test: skip (why) -->
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/single-box.md", "docs/kubernetes.md", "deploy/docker/README.md"]
FENCE = re.compile(r"(?ms)^(?:<!-- docs-test: (?P<mark>[^>]*?) -->\n)?```sh\n(?P<code>.*?)^```")
# Paths a sandboxed block writes to, moved under the temporary root.
MOVED = ("/etc/", "/opt/oomguard", "/var/lib/")


def blocks(doc: str) -> list[tuple[str, str]]:
    return [(m["mark"] or "", m["code"]) for m in FENCE.finditer((ROOT / doc).read_text())]


def test_every_shell_block_says_how_it_is_tested():
    for doc in DOCS:
        for mark, code in blocks(doc):
            assert mark in ("run", "sandbox") or mark.startswith("skip ("), (
                f"{doc}: a ```sh block without <!-- docs-test: run|sandbox|skip (why) -->:\n{code}"
            )


RUN_BLOCKS = [(doc, code) for doc in DOCS for mark, code in blocks(doc) if mark == "run"]


@pytest.mark.parametrize("doc,code", RUN_BLOCKS, ids=[d for d, _ in RUN_BLOCKS])
def test_run_blocks(doc, code):
    bin_dir = Path(sys.executable).parent
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"{doc}:\n{code}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"


# -- the sandbox --------------------------------------------------------------------------------
RECORDER = """#!/usr/bin/env bash
# stand-in for {name}: records the call, then checks what the real one would need
echo "{name} $*" >> "$SANDBOX_LOG"
{body}
"""

SHIMS = {
    # the machine
    "apt-get": 'for p in "$@"; do [[ $p == prometheus* ]] && mkdir -p "$SANDBOX/etc/prometheus"; done; true',
    "groupadd": 'getent_file="$SANDBOX/groups"; echo "${@: -1}" >> "$getent_file"',
    "useradd": 'prev=""; for a in "$@"; do [[ $prev == --groups ]] && grep -qx "$a" "$SANDBOX/groups"; prev=$a; done; echo "${@: -1}" >> "$SANDBOX/users"',
    "usermod": 'grep -qx "${@: -2:1}" "$SANDBOX/groups"',
    "chgrp": 'grep -qx "$1" "$SANDBOX/groups" && test -e "$2"',
    "systemctl": "true",
    # a stand-in venv: pip records, oomguard is this environment's
    "python3": (
        'if [[ $1 == -m && $2 == venv ]]; then mkdir -p "$3/bin"; '
        'printf "#!/bin/sh\\necho \\"pip \\$*\\" >> \\"$SANDBOX_LOG\\"\\n" > "$3/bin/pip"; '
        'printf "#!/bin/sh\\nexec %s \\"\\$@\\"\\n" "$OOMGUARD_BIN/oomguard" > "$3/bin/oomguard"; '
        'printf "#!/bin/sh\\n" > "$3/bin/vllm"; chmod +x "$3/bin/pip" "$3/bin/vllm" "$3/bin/oomguard"; '
        'else exec "$REAL_PYTHON" "$@"; fi'
    ),
    # systemd-analyze verify against the temporary root (the units name /opt/oomguard/...)
    "systemd-analyze": 'exec /usr/bin/env -u PATH "$REAL_SYSTEMD_ANALYZE" "$1" --root="$SANDBOX" "${@:2}"',
    # a cluster: namespaces and secrets are checked, `apply -k` renders for real
    "kubectl": r"""
ns=default; args=()
while [[ $# -gt 0 ]]; do
  case $1 in -n) ns=$2; shift 2;; *) args+=("$1"); shift;; esac
done
set -- "${args[@]}"
case "$1 $2" in
  "create namespace") echo "$3" >> "$SANDBOX/namespaces";;
  "create secret")
    grep -qx "$ns" "$SANDBOX/namespaces" || { echo "namespace $ns does not exist" >&2; exit 1; }
    for a in "$@"; do
      if [[ $a == --from-file=* ]]; then test -s "${a#--from-file=}" || { echo "no file ${a#--from-file=}" >&2; exit 1; }; fi
    done;;
  "apply -k") "$REAL_KUBECTL" kustomize "$3" > "$SANDBOX/applied.yaml";;
esac
""",
}


def sandbox(tmp_path: Path, doc: str) -> tuple[Path, list[str]]:
    """Run the doc's sandbox blocks in order; return the temporary root and the recorded calls."""
    root = tmp_path / "root"
    shims = tmp_path / "shims"
    for d in (
        "etc/systemd/system",
        "etc/grafana/provisioning/datasources",
        "etc/grafana/provisioning/dashboards",
        "var/lib/grafana",
    ):
        (root / d).mkdir(parents=True)
    (root / "namespaces").write_text("monitoring\n")  # the prometheus-operator's, a prerequisite
    (root / "groups").write_text("prometheus\n")
    for lib in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(lib).is_dir():  # the host's targets, for systemd-analyze's dependency checks
            shutil.copytree(lib, root / "usr/lib/systemd/system", symlinks=True)
            break
    shims.mkdir()
    for name, body in SHIMS.items():
        (shims / name).write_text(RECORDER.format(name=name, body=body))
        (shims / name).chmod(stat.S_IRWXU)
    log = tmp_path / "calls.log"
    log.touch()
    script = "\n".join(code for mark, code in blocks(doc) if mark == "sandbox")
    for path in MOVED:
        script = script.replace(path, f"{root}{path}")
    env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "SANDBOX": str(root),
        "SANDBOX_LOG": str(log),
        "OOMGUARD_BIN": str(Path(sys.executable).parent),
        "REAL_PYTHON": shutil.which("python3") or sys.executable,
        "REAL_SYSTEMD_ANALYZE": shutil.which("systemd-analyze") or "false",
        "REAL_KUBECTL": shutil.which("kubectl") or "false",
    }
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"{doc}: the walkthrough failed\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    assert "Unknown key" not in r.stderr and "Failed" not in r.stderr, r.stderr
    return root, log.read_text().splitlines()


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")


def test_single_box_walkthrough(tmp_path):
    need("promtool", "amtool", "systemd-analyze")
    root, calls = sandbox(tmp_path, "docs/single-box.md")

    # the secrets: root:oomguard, 0750 and 0640, readable by every unit that needs them
    etc = root / "etc" / "oomguard"
    assert stat.S_IMODE(etc.stat().st_mode) == 0o750
    for token in ("remediator-token", "plugin-token", "supervisor-token"):
        assert stat.S_IMODE((etc / token).stat().st_mode) == 0o640
        assert (etc / token).read_text().strip()
        assert f"chgrp oomguard {etc / token}" in calls
    assert f"chgrp oomguard {etc}" in calls
    assert "groupadd --system oomguard" in calls
    assert any(c.startswith("useradd") and c.endswith(" vllm") for c in calls)
    units = root / "etc" / "systemd" / "system"
    for unit in units.glob("oomguard-*.service"):
        text = unit.read_text()
        if "User=vllm" in text or "DynamicUser=yes" in text:
            reads_tokens = "/etc/oomguard/" in text
            assert not reads_tokens or "SupplementaryGroups=oomguard" in text or "User=vllm" in text
    assert "usermod -aG oomguard prometheus" in calls  # Alertmanager reads the remediator token
    assert (
        "credentials_file: /etc/oomguard/remediator-token"
        in (root / "etc" / "prometheus" / "alertmanager.yml").read_text()
    )

    # Prometheus finds its rules where the walkthrough put them (promtool ran in the block too)
    prom = yaml.safe_load((root / "etc" / "prometheus" / "prometheus.yml").read_text())
    for rule_file in prom["rule_files"]:
        assert Path(rule_file).is_file(), rule_file

    # the remediator and exporter configs the units name are in place and valid
    for name in ("exporter.yaml", "remediator.yaml"):
        assert (etc / name).is_file()
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "exporter", "--help"], capture_output=True, timeout=60
    )
    assert r.returncode == 0

    # Grafana: the dashboards where the provider looks for them
    provider = yaml.safe_load(
        (root / "etc/grafana/provisioning/dashboards/oomguard.yaml").read_text()
    )
    folder = Path(str(root) + provider["providers"][0]["options"]["path"])
    assert sorted(p.name for p in folder.glob("*.json")) == sorted(
        p.name for p in (ROOT / "src" / "oomguard" / "dashboards" / "generated").glob("*.json")
    )
    assert (root / "etc/grafana/provisioning/datasources/oomguard.yaml").is_file()

    # the services were verified, then enabled
    assert any(c.startswith("systemd-analyze verify") for c in calls)
    assert "systemctl enable --now oomguard-vllm oomguard-exporter oomguard-remediator" in calls
    pip = [c for c in calls if c.startswith("pip install")]
    assert pip and "'.[remediator]'" not in pip[0] and ".[remediator]" in pip[0]


def test_kubernetes_walkthrough(tmp_path):
    need("kubectl")
    root, calls = sandbox(tmp_path, "docs/kubernetes.md")
    created = set((root / "namespaces").read_text().split())
    objects = [o for o in yaml.safe_load_all((root / "applied.yaml").read_text()) if o]
    namespaces = {o["metadata"].get("namespace") for o in objects} - {None}
    assert namespaces <= created, (
        f"manifests use namespaces the walkthrough never creates: {namespaces - created}"
    )
    # every Secret the manifests mount exists in that namespace
    secrets = {(ns, "oomguard-tokens") for ns in created}
    for o in objects:
        pod = o.get("spec", {}).get("template", {}).get("spec", {})
        for volume in pod.get("volumes", []):
            name = volume.get("secret", {}).get("secretName")
            if name:
                assert (o["metadata"]["namespace"], name) in secrets, (o["metadata"], name)
    assert any(c.startswith("kubectl get crd") for c in calls)


def test_kubernetes_manifests_leave_the_cluster_alertmanager_alone(tmp_path):
    need("kubectl")
    root, _ = sandbox(tmp_path, "docs/kubernetes.md")
    objects = [o for o in yaml.safe_load_all((root / "applied.yaml").read_text()) if o]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("Secret", "alertmanager-main") not in kinds
    (amc,) = [o for o in objects if o["kind"] == "AlertmanagerConfig"]
    assert amc["metadata"]["namespace"] == "oomguard"
    assert amc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "oomguard"
