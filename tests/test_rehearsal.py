"""docs/single-box.md, "Rehearse without a GPU", end to end: the walkthrough's steps 1 to 4 (as
tests/test_docs.py sandboxes them), then the rehearsal's blocks as written, with a stand-in
systemd that starts the units' real commands (tests/fake_systemctl.py): `oomguard serve` running
the real vLLM 0.33 on the model-free executor over a twin H100, the exporter reading that twin
through its NVML code, the remediator, Prometheus with the generated rules, Alertmanager with the
generated routes. The docs' neighbour takes the GPU's slack: the level goes to 3, the remediator
caps the engine (the drain is withheld: one engine), OomguardRemediationLimited reaches the pager
receiver; the neighbour leaves and traffic flows: level 0, full admission, `oomguard status`
exits 0. Every well-known port is mapped to a free one, every path lives in a temporary root.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from oomguard.lab.processes import Inbox, free_port
from tests.test_docs import FENCE, RECORDER, ROOT, SHIMS, need

pytestmark = pytest.mark.slow
DOC = "docs/single-box.md"
PORTS = ("8000", "9848", "9849", "9850", "9851", "9090", "9093")
MOVED = ("/etc/", "/opt/oomguard", "/var/lib/", "/run/")
BIN = Path(sys.executable).parent
MARK = "OOMGUARD_REHEARSAL_ID"  # in every process the rehearsal starts, to stop them all


def doc_blocks() -> tuple[list[str], list[str]]:
    """The sandbox blocks before step 5 (the rehearsal takes its place) and the rehearsal's."""
    text = (ROOT / DOC).read_text()
    step5 = text.index("### 5. Start")
    before = [
        m["code"] for m in FENCE.finditer(text) if m["mark"] == "sandbox" and m.start() < step5
    ]
    rehearsal = [m["code"] for m in FENCE.finditer(text) if m["mark"] == "rehearsal"]
    return before, rehearsal


SHIMS_HERE = {
    **SHIMS,
    "chown": 'grep -qx "$1" "$SANDBOX/users" && test -e "$2"',
    "systemctl": 'exec "$REAL_PYTHON_VENV" "$REPO/tests/fake_systemctl.py" "$@"',
    # the stand-in venv: pip records, oomguard and vllm are this environment's real ones
    "python3": (
        'if [[ $1 == -m && $2 == venv ]]; then mkdir -p "$3/bin"; '
        'printf "#!/bin/sh\\necho \\"pip \\$*\\" >> \\"$SANDBOX_LOG\\"\\n" > "$3/bin/pip"; '
        "for t in oomguard vllm; do "
        'printf "#!/bin/sh\\nexec %s \\"\\$@\\"\\n" "$OOMGUARD_BIN/$t" > "$3/bin/$t"; done; '
        'chmod +x "$3/bin/pip" "$3/bin/vllm" "$3/bin/oomguard"; '
        'else exec "$REAL_PYTHON" "$@"; fi'
    ),
}


class Rehearsal:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = tmp / "root"
        self.shims = tmp / "shims"
        self.log = tmp / "calls.log"
        self.id = uuid.uuid4().hex
        self.inbox = Inbox()
        self.ports = {p: str(free_port()) for p in PORTS}
        self.ports["9850"] = self.inbox.url.rsplit(":", 1)[1]
        for d in ("etc/systemd/system", "etc/grafana/provisioning/datasources"):
            (self.root / d).mkdir(parents=True)
        (self.root / "etc/grafana/provisioning/dashboards").mkdir(parents=True)
        (self.root / "groups").write_text("prometheus\n")
        self.shims.mkdir()
        for name, body in SHIMS_HERE.items():
            (self.shims / name).write_text(RECORDER.format(name=name, body=body))
            (self.shims / name).chmod(stat.S_IRWXU)
        self.log.touch()
        self.env = {
            **os.environ,
            "PATH": f"{self.shims}:{os.environ['PATH']}",
            "SANDBOX": str(self.root),
            "SANDBOX_LOG": str(self.log),
            "SANDBOX_PORTS": json.dumps(self.ports),
            "SANDBOX_OWNER": str(os.getpid()),  # units stopped if this test process dies
            "OOMGUARD_BIN": str(BIN),
            "REAL_PYTHON": shutil.which("python3") or sys.executable,
            "REAL_PYTHON_VENV": sys.executable,
            "REAL_SYSTEMD_ANALYZE": shutil.which("systemd-analyze") or "false",
            "REPO": str(ROOT),
            MARK: self.id,
        }
        self.env.pop("OOMGUARD_TWIN_GPU_FILE", None)

    def script(self, code: str) -> str:
        for path in MOVED:
            code = code.replace(path, f"{self.root}{path}")
        for port, mapped in self.ports.items():
            code = re.sub(rf"(?<=127\.0\.0\.1:){port}\b", mapped, code)
        return code

    def run(self, code: str, timeout: float) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", self.script(code)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert r.returncode == 0, (
            f"{DOC}: a block failed\n{code}\n{r.stdout[-3000:]}{r.stderr[-3000:]}\n{self.logs()}"
        )
        return r

    def status(self) -> dict[str, Any]:
        r = subprocess.run(
            [
                str(BIN / "oomguard"),
                "status",
                "--json",
                "--config",
                f"{self.root}/etc/oomguard/remediator.yaml",
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode in (0, 1), r.stderr
        return json.loads(r.stdout)

    def wait(self, what: str, check: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            last = self.status()
            if check(last):
                return last
            time.sleep(3)
        raise AssertionError(
            f"{what}: not within {timeout}s\n{json.dumps(last, indent=1)[-4000:]}\n{self.logs()}"
        )

    def logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            out.append(
                f"--- {path.name}\n"
                + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
            )
        vllm = self.root / "var/lib/oomguard-serve/vllm.log"
        if vllm.exists():
            out.append(
                "--- vllm.log\n" + "\n".join(vllm.read_text(errors="replace").splitlines()[-15:])
            )
        return "\n".join(out)

    def stop_everything(self) -> None:
        """Every process that carries this rehearsal's mark, whatever started it."""
        for unit in ("oomguard-vllm", "oomguard-exporter", "oomguard-remediator"):
            with contextlib.suppress(Exception):
                subprocess.run(
                    [sys.executable, str(ROOT / "tests/fake_systemctl.py"), "stop", unit],
                    env=self.env,
                    timeout=90,
                )
        for _ in range(2):
            for pid in marked(self.id):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM if _ == 0 else signal.SIGKILL)
            time.sleep(3)
        self.inbox.close()


def marked(mark: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if f"{MARK}={mark}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
    return pids


def target(report: dict[str, Any]) -> dict[str, Any]:
    (t,) = [t for t in report["targets"] if t["name"] == "llama-3-8b"]
    return t


def incident(report: dict[str, Any]) -> bool:
    t = target(report)
    plugin = t.get("plugin") or {}
    limited = (t.get("remediator") or {}).get("limited") or {}
    return (
        any(lv["level"] == 3 for lv in t["levels"])
        and limited.get("limit") == "single_replica"
        and plugin.get("admission_cap", 64) < plugin.get("startup_max_num_seqs", 0)
    )


def recovered(report: dict[str, Any]) -> bool:
    t = target(report)
    plugin = t.get("plugin") or {}
    return (
        [lv["level"] for lv in t["levels"]] == [0]
        and plugin.get("admission_cap") == plugin.get("startup_max_num_seqs")
        and not report["attention"]
    )


@pytest.mark.timeout(3600)  # minutes here; bounded waits, generous under load
def test_rehearse_the_single_box_stack_on_a_twin(tmp_path):
    need("promtool", "amtool", "prometheus", "prometheus-alertmanager", "curl")
    if not (BIN / "vllm").exists():
        pytest.skip("vLLM is not installed (make setup-vllm)")
    before, rehearsal = doc_blocks()
    assert len(before) == 4 and len(rehearsal) == 5, "the walkthrough changed: update this test"
    r = Rehearsal(tmp_path)
    try:
        for code in before:  # steps 1-4: install, site files, Prometheus and Alertmanager, Grafana
            r.run(code, timeout=300)
        install_cpu, start, inject, recover, end = rehearsal
        r.run(install_cpu, timeout=60)
        pip = [c for c in r.log.read_text().splitlines() if c.startswith("pip install")]
        assert any("torch==2.13.0" in c and "download.pytorch.org/whl/cpu" in c for c in pip)

        # the twin, the drop-ins, the real units; the block ends with `oomguard status`, exit 0
        out = r.run(start, timeout=1000).stdout
        assert "(twin)" in out and "nothing needs attention" in out, out
        healthy = r.status()
        assert [lv["level"] for lv in target(healthy)["levels"]] == [0]

        # a neighbour takes the slack: level 3, the drain withheld (one engine), capped, a page
        started = time.monotonic()
        r.run(inject, timeout=60)
        report = r.wait("the incident is seen and handled", incident, timeout=600)
        reasons = {lv["reason"] for lv in target(report)["levels"]}
        assert reasons == {"headroom_exhausted"}, reasons
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not pages(r.inbox, "OomguardRemediationLimited"):
            time.sleep(2)
        page = pages(r.inbox, "OomguardRemediationLimited")
        assert page, f"no page reached the pager receiver: {r.inbox.received}\n{r.logs()}"
        assert (
            page[0]["labels"]["limit"] == "single_replica"
            and page[0]["labels"]["target"] == "llama-3-8b"
        )
        assert "runbook_url" in page[0]["annotations"]
        handled_s = time.monotonic() - started

        # the neighbour leaves and traffic flows: level 0, full admission, nothing to attend to
        r.run(recover, timeout=1200)  # 60 requests: minutes on a loaded machine
        report = r.wait("recovery to full admission", recovered, timeout=600)
        audit = (r.root / "var/lib/oomguard/remediator-audit.jsonl").read_text()
        assert '"withheld"' in audit and '"single_replica"' in audit and '"lower_cap"' in audit
        print(f"incident seen, capped and paged within {handled_s:.0f} s")

        r.run(end, timeout=200)
        assert not (r.root / "run/units/oomguard-vllm.pid").exists()
    finally:
        r.stop_everything()
    assert marked(r.id) == [], "a process of the rehearsal outlived it"


def pages(inbox: Inbox, alertname: str) -> list[dict[str, Any]]:
    return [
        alert
        for item in inbox.received
        if item["receiver"] == "pager"
        for alert in item["payload"].get("alerts", [])
        if alert.get("labels", {}).get("alertname") == alertname and alert.get("status") == "firing"
    ]
