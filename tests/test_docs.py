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
  <!-- docs-test: rehearsal -->  docs/single-box.md's rehearsal without a GPU: run after the
                               sandbox blocks of steps 1-4 with a stand-in systemd that starts the
                               units' real commands (tests/test_rehearsal.py)
  <!-- docs-test: skip (why) -->

Commands quoted in docs/budget.md and the runbooks are checked one by one (below), and the
remediator's config table in docs/remediator.md against the config loader's fields.
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

from oomguard import vllm_seam

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
            assert mark in ("run", "sandbox", "rehearsal") or mark.startswith("skip ("), (
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
        p.name
        for p in (ROOT / "dashboards" / "oomguard" / "dashboards" / "generated").glob("*.json")
    )
    assert (root / "etc/grafana/provisioning/datasources/oomguard.yaml").is_file()

    # the services were verified, then enabled
    assert any(c.startswith("systemd-analyze verify") for c in calls)
    assert "systemctl enable --now oomguard-vllm oomguard-exporter oomguard-remediator" in calls
    pip = [c for c in calls if c.startswith("pip install")]
    # the GPU host's lock, and the generate extra that step 2 needs (after the install)
    assert pip and "'" not in pip[0] and ".[remediator,generate]" in pip[0]
    assert "-c requirements/gpu-lock.txt" in pip[0]
    assert f"vllm=={vllm_seam.newest().VERSION}" in pip[0]
    assert (root / "etc/oomguard/vllm.env").is_file()
    site_rules = root / "etc/oomguard/site/alerts/oomguard/alerts/generated/oomguard.rules.yaml"
    assert "https://wiki.example.com/oomguard/runbooks/" in site_rules.read_text()
    assert (root / "etc/prometheus/oomguard.rules.yaml").read_text() == site_rules.read_text()


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


def test_kubernetes_priority_class_quota_admits_the_exporter():
    """docs/kubernetes.md's ResourceQuota, for clusters that limit priority classes, names the
    class the generated DaemonSet's pods use, in the DaemonSet's namespace: a renamed class or
    namespace in the generator leaves that quota admitting nothing."""
    (code,) = [c for _, c in blocks("docs/kubernetes.md") if "kind: ResourceQuota" in c]
    quota = yaml.safe_load(code.split("<<'YAML'\n", 1)[1].split("\nYAML", 1)[0])
    exporter = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/exporter.yaml").read_text()))
    (daemonset,) = [o for o in exporter if o and o["kind"] == "DaemonSet"]
    (priority,) = [o for o in exporter if o and o["kind"] == "PriorityClass"]
    used = daemonset["spec"]["template"]["spec"]["priorityClassName"]
    assert used == priority["metadata"]["name"]
    assert quota["apiVersion"] == "v1" and quota["kind"] == "ResourceQuota"
    assert quota["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    (match,) = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert match["scopeName"] == "PriorityClass" and match["operator"] == "In"
    assert match["values"] == [used]
    pods = quota["spec"]["hard"]["pods"]
    assert isinstance(pods, str) and int(pods) > 0  # a quantity, quoted as the API takes it


def test_kubernetes_manifests_leave_the_cluster_alertmanager_alone(tmp_path):
    need("kubectl")
    root, _ = sandbox(tmp_path, "docs/kubernetes.md")
    objects = [o for o in yaml.safe_load_all((root / "applied.yaml").read_text()) if o]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("Secret", "alertmanager-main") not in kinds
    (amc,) = [o for o in objects if o["kind"] == "AlertmanagerConfig"]
    # in the Alertmanager's namespace, which both stock installs select (docs/kubernetes.md)
    assert amc["metadata"]["namespace"] == "monitoring"
    assert amc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "oomguard"
    # the webhook's token Secret, which the walkthrough creates there
    (hook,) = next(r for r in amc["spec"]["receivers"] if r["name"] == "remediator")[
        "webhookConfigs"
    ]
    secret = hook["httpConfig"]["authorization"]["credentials"]["name"]
    assert f"kubectl -n monitoring create secret generic {secret}" in " ".join(
        (ROOT / "docs" / "kubernetes.md").read_text().split()
    )


# -- commands quoted in the reference docs and runbooks -----------------------------------------
# docs/budget.md and the runbooks give commands to copy (an on-call engineer pastes them at 3 AM),
# in ```sh blocks and inline. Each `oomguard ...` and `amtool ...` command there must be one the
# tool accepts: `oomguard budget` and `oomguard incidents` run for real (offline), `preflight`
# runs against a closed port (every flag is checked before it connects), the rest are parsed by
# the CLI's own parser; amtool runs for real against a closed port, so only its usage checks can
# fail it. Placeholders (`<GPU>`, `FILE`) become values a reader would type; a command with `...`
# is a sketch, not checked.
COMMAND_DOCS = [
    "docs/budget.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "runbooks").glob("*.md")),
]
ANY_FENCE = re.compile(r"(?ms)^```(?P<lang>\w*)\n(?P<code>.*?)^```")
INLINE = re.compile(r"`([^`]+)`")
TOOLS = ("oomguard ", "amtool ")
PLACEHOLDERS = {
    "<GPU>": "H100",
    "<len>": "8192",
    "<n>": "256",
    "config.json": "twin/oomguard/twin/models/llama-3-8b/config.json",
}


def quoted_commands(doc: str) -> list[str]:
    """Every oomguard/amtool command in the doc: fenced sh lines (continuations joined, comments
    dropped) and inline code spans (which may wrap across lines)."""
    text = (ROOT / doc).read_text()
    found = []
    for m in ANY_FENCE.finditer(text):
        if m["lang"] == "sh":
            for line in m["code"].replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip().removeprefix(".venv/bin/")
                if line.startswith(TOOLS):
                    found.append(line)
    for m in INLINE.finditer(ANY_FENCE.sub("", text)):
        span = " ".join(m[1].split())
        # `oomguard budget` names the command, `oomguard incidents [DIR]` is a synopsis
        if span.startswith(TOOLS) and len(span.split()) > 2 and "[" not in span:
            found.append(span)
    return [c for c in found if "..." not in c]  # `oomguard budget ... | head -1`: a sketch


def _argv(command: str) -> list[str]:
    import shlex

    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    command = re.sub(r"<[^<>]*>", "x", command)
    words = shlex.split(command)
    for stop in ("|", ">", "&&", ";"):  # what follows a pipe or redirection is not the command's
        if stop in words:
            words = words[: words.index(stop)]
    return words


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


QUOTED = [(doc, cmd) for doc in COMMAND_DOCS for cmd in quoted_commands(doc)]


def test_the_reference_docs_quote_commands():
    """The extraction finds what is there: if it found nothing, the checks below would pass."""
    docs = {doc for doc, _ in QUOTED}
    assert "docs/budget.md" in docs and "runbooks/OomguardIncidentClassified.md" in docs
    tools = {cmd.split()[0] for _, cmd in QUOTED}
    assert tools == {"oomguard", "amtool"}
    assert len([c for _, c in QUOTED if c.startswith("oomguard preflight")]) >= 2


@pytest.mark.parametrize("doc,command", QUOTED, ids=[f"{d}:{c[:60]}" for d, c in QUOTED])
def test_quoted_commands_are_accepted(doc, command, tmp_path):
    argv = _argv(command)
    closed = f"http://127.0.0.1:{_free_port()}"
    where = f"{doc}: `{command}`"
    if argv[0] == "amtool":
        need("amtool")
        if argv[1] != "silence":
            pytest.skip("only amtool silence commands are checked (against a closed port)")
        r = subprocess.run(
            [*argv, f"--alertmanager.url={closed}"], capture_output=True, text=True, timeout=30
        )
        # past amtool's own checks (a silence needs a comment, matchers must parse), it connects
        assert "connection refused" in r.stderr, f"{where}\n{r.stderr}"
        return
    sub = argv[1]
    if sub in ("budget", "incidents", "preflight"):
        if sub == "preflight":
            argv = [closed if a.startswith("http") else a for a in argv]
        env = {**os.environ, "OOMGUARD_INCIDENT_DIR": str(tmp_path)}
        r = subprocess.run(
            [sys.executable, "-m", "oomguard", *argv[1:]],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if sub == "preflight":  # it got as far as asking the server
            assert r.returncode == 2 and "cannot reach" in r.stderr, f"{where}\n{r.stderr}"
        elif r.returncode == 1:  # budget's verdict: vLLM would refuse to start
            assert sub == "budget" and "will not start" in r.stdout, f"{where}\n{r.stdout}"
        else:
            assert r.returncode == 0, f"{where}\n{r.stderr}"
        return
    from oomguard.cli import build_parser

    try:
        build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{where}: the CLI rejects it (exit {exc.code})")


# -- the config tables against their loaders ---------------------------------------------------
KEY = re.compile(r"^[a-z_][a-z_.\[\]]*$")


def _loader_fields(config: type) -> dict[str, object]:
    """Every key a config loader accepts (dotted, `[]` for a list item), with its default (None
    where it has none or it is built by a factory)."""
    import typing

    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    def models(annotation: object) -> list[type[BaseModel]]:
        found = [m for a in typing.get_args(annotation) for m in models(a)]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found.append(annotation)
        return found

    def walk(model: type[BaseModel], prefix: str) -> dict[str, object]:
        keys: dict[str, object] = {}
        for name, field in model.model_fields.items():
            inner = models(field.annotation)
            sep = "[]." if typing.get_origin(field.annotation) is list else "."
            for sub in inner:
                keys |= walk(sub, prefix + name + sep)
            if not inner:
                default = field.default
                keys[prefix + name] = None if default is PydanticUndefined else default
        return keys

    return walk(config, "")


def _documented_fields(doc: str, sections: dict[str, str]) -> dict[str, str]:
    """The keys the tables under these headings name (each heading's rows take its prefix), with
    the default each row gives. In a cell `a.b.c` / `d` / `e`, a bare name takes the last dotted
    name's prefix. A list (`vllm[]`) or a pointer (`safety.*`) names no key of its own."""
    text = (ROOT / doc).read_text()
    documented: dict[str, str] = {}
    for heading, section_prefix in sections.items():
        body = text.split(f"\n{heading}\n", 1)[1]
        body = re.split(r"\n#+ ", body, maxsplit=1)[0]
        for row in re.findall(r"(?m)^\| (.+?) \| (.+?) \|", body):
            names = [n for n in re.findall(r"`([^`]+)`", row[0]) if KEY.match(n)]
            defaults = [d.strip().strip("`") for d in row[1].split(" / ")]
            if len(defaults) != len(names):
                defaults = ["–"] * len(names)
            prefix = section_prefix
            for name, default in zip(names, defaults, strict=True):
                if "." in name:
                    prefix = section_prefix + name.rsplit(".", 1)[0] + "."
                    name = section_prefix + name
                else:
                    name = prefix + name
                if not name.endswith(("[]", "*")):
                    documented[name] = default
    return documented


def _same_default(doc: str, actual: object) -> bool:
    if doc == "–" or actual is None or isinstance(actual, dict | list):
        return True  # none given, or not a scalar to compare
    if isinstance(actual, bool):
        return doc in (("true", "on") if actual else ("false", "off"))
    if isinstance(actual, int | float):
        try:
            return float(doc.replace(",", "")) == float(actual)
        except ValueError:
            return True  # written with a unit (`1 MiB`, `2 GiB`)
    return doc == ('""' if actual == "" else str(actual))


def _remediator_documented() -> dict[str, str]:
    return _documented_fields("docs/remediator.md", {"## Safety": "", "## Configuration": ""})


def _table_is_the_loader(documented: dict[str, str], loader: dict[str, object], doc: str) -> None:
    assert sorted(set(documented) - set(loader)) == [], "documented, but the loader refuses it"
    assert sorted(set(loader) - set(documented)) == [], f"accepted, but not in {doc}"
    wrong = {k: (d, loader[k]) for k, d in documented.items() if not _same_default(d, loader[k])}
    assert wrong == {}, "documented default differs from the loader's (doc, loader)"


def test_the_remediator_config_table_is_the_loader():
    from oomguard.remediator.config import RemediatorConfig

    documented = _remediator_documented()
    assert "policy.readmit_stall_seconds" in documented  # the parse found the tables
    _table_is_the_loader(documented, _loader_fields(RemediatorConfig), "docs/remediator.md")


def test_the_exporter_config_table_is_the_loader():
    from oomguard.exporter.config import ExporterConfig

    documented = _documented_fields(
        "docs/configuration.md",
        {
            "## `oomguard exporter`": "",
            "### `pressure` (also `core/oomguard/thresholds.py`)": "pressure.",
        },
    )
    assert "pressure.kv_budget_margin" in documented and "vllm[].url" in documented
    _table_is_the_loader(documented, _loader_fields(ExporterConfig), "docs/configuration.md")


def test_the_example_config_uses_only_documented_keys():
    """deploy/remediator.example.yaml (the 'complete example') loads with the real loader and
    every key in it is in the table."""
    from oomguard.remediator.config import RemediatorConfig

    example = yaml.safe_load((ROOT / "deploy" / "remediator.example.yaml").read_text())
    RemediatorConfig.model_validate(example)  # the token files are only checked by load()

    def keys(value: object, prefix: str = "") -> set[str]:
        if isinstance(value, list):
            return {k for item in value for k in keys(item, prefix.removesuffix(".") + "[].")}
        if isinstance(value, dict) and not prefix.endswith(("match.", "actions.")):
            return {k for name, v in value.items() for k in keys(v, f"{prefix}{name}.")}
        return {prefix.removesuffix(".")}

    assert keys(example) - set(_remediator_documented()) == set()


def test_the_runbooks_config_check_validates_and_starts_nothing(tmp_path):
    """OomguardRemediatorDown's `oomguard remediator --config FILE --check`: 0 and one line for a
    good file, even while a remediator holds its port; 2 naming the field or file otherwise."""
    import socket

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with socket.socket() as holder:  # the running remediator's port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        good = {
            "listen": f"127.0.0.1:{port}",
            "auth": {"bearer_token_file": str(token)},
            "targets": [{"name": "a", "url": "http://127.0.0.1:1", "token_file": str(token)}],
            "audit_log": str(tmp_path / "audit.jsonl"),
        }
        bad_field = {**good, "policy": {"readmit_stall_secs": 300}}
        empty_token = {**good, "auth": {"bearer_token_file": str(tmp_path / "empty")}}
        (tmp_path / "empty").write_text("")
        results = {}
        for name, config in (("good", good), ("bad", bad_field), ("empty", empty_token)):
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            results[name] = subprocess.run(
                [sys.executable, "-m", "oomguard", "remediator", "--config", str(path), "--check"],
                capture_output=True,
                text=True,
                timeout=60,
            )
    ok = results["good"]
    assert ok.returncode == 0 and ok.stdout.strip().endswith("ok (1 targets, mode alertmanager)")
    assert not (tmp_path / "audit.jsonl").exists()  # nothing started, nothing recorded
    assert results["bad"].returncode == 2 and "policy.readmit_stall_secs" in results["bad"].stderr
    assert results["empty"].returncode == 2 and "the file is empty" in results["empty"].stderr
