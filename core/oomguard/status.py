"""`oomguard status`: every engine's state at a glance, read from the parts that hold it.

The state of one engine is spread over four places, three of them behind tokens:
- the exporter's `/metrics` (no token): the pressure level and its reason, per engine and GPU;
- the plugin's `GET /oomguard/v1/state` inside vLLM (the plugin's token): cap, mode, load;
- the supervisor's `GET /v1/status` (`oomguard serve`, its token): flags, generation, exits;
- the remediator's `GET /v1/targets` (its token): what it decided, holds, limits, firing alerts.

`status` reads each part once (in parallel, each bounded in time and size), joins them per
target and prints one block per target (or JSON). A part it cannot read is shown as such with
the reason (unreachable, 401, not JSON), never a traceback. Where the parts are comes from the
remediator's config (`--config`, default /etc/oomguard/remediator.yaml): its listen address and
token, each target's URL, plugin token and supervisor; the exporters from `--exporter` (default
the config's standalone exporters, else http://127.0.0.1:9848/metrics).

Exit status: 0 when every part was read and no engine needs attention; 1 when something does
(level 2 or worse, blind, held, a limit withholding an action, paused, a supervisor that gave
up, a part that cannot be read); 2 for a mistake in the command or the config.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from oomguard import bounded
from oomguard.contract import API_PREFIX
from oomguard.errors import ConfigError
from oomguard.exporter.textparse import parse

DEFAULT_CONFIG = "/etc/oomguard/remediator.yaml"
DEFAULT_EXPORTER = "http://127.0.0.1:9848/metrics"
LEVEL = "oomguard_engine_pressure_level"
GPU_LEVEL = "oomguard_gpu_pressure_level"
COLLECTOR_UP = "oomguard_exporter_collector_up"
BUILD_INFO = "oomguard_exporter_build_info"
LEVEL_NAMES = {-1: "blind", 0: "ok", 1: "caution", 2: "pressure", 3: "critical"}
METRICS_LIMITS = bounded.Limits(max_bytes=16 * bounded.MIB)
JSON_LIMITS = bounded.Limits(max_bytes=4 * bounded.MIB)


# -- where the parts are ------------------------------------------------------------------------
@dataclass
class Endpoint:
    url: str
    token_file: str | None = None
    basic: tuple[str, str] | None = None  # (username, password file)


@dataclass
class TargetSpec:
    name: str
    url: str = ""
    match: dict[str, str] = field(default_factory=dict)
    plugin: Endpoint | None = None
    supervisor: Endpoint | None = None


@dataclass
class Plan:
    exporters: list[str]
    remediator: Endpoint | None
    targets: list[TargetSpec]
    default_plugin_token: str | None = None  # for targets the remediator found (discovery)


def _local(listen: str) -> str:
    """The URL of a local listen address (0.0.0.0 and an empty host are reached on loopback)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def exporter_beside(config_path: str) -> str | None:
    """The /metrics URL of the exporter whose config sits beside the remediator's (a single
    box: /etc/oomguard/exporter.yaml), from its `listen`; None without one."""
    from oomguard.config import load_yaml

    path = Path(config_path).parent / "exporter.yaml"
    if not path.is_file():
        return None
    try:
        listen = load_yaml(path).get("listen", "0.0.0.0:9848")
    except ConfigError:
        return None
    return f"{_local(str(listen))}/metrics"


def plan_from_config(
    config: Any,
    exporters: list[str],
    remediator_url: str | None = None,
    remediator_token: str | None = None,
    config_path: str | None = None,
) -> Plan:
    """The parts a remediator config names (`oomguard.remediator.config.RemediatorConfig`);
    the exporters: `exporters`, else the config's standalone ones, else the exporter whose
    config sits beside it (`config_path`'s folder), else the default."""
    auth = config.auth
    basic = (auth.basic.username, auth.basic.password_file) if auth.basic else None
    remediator = Endpoint(
        remediator_url or _local(config.listen),
        remediator_token or auth.bearer_token_file,
        None if remediator_token else basic,
    )
    targets = []
    for t in config.targets:
        sup = t.restart.supervisor if t.restart and t.restart.supervisor else None
        targets.append(
            TargetSpec(
                t.name,
                t.url,
                t.selector(),
                Endpoint(t.url, t.token_file),
                Endpoint(sup.url, sup.token_file) if sup else None,
            )
        )
    standalone = config.standalone.exporters if config.standalone else []
    discovery = getattr(config, "discovery", None)
    beside = exporter_beside(config_path) if config_path else None
    return Plan(
        exporters or list(standalone) or ([beside] if beside else [DEFAULT_EXPORTER]),
        remediator,
        targets,
        getattr(discovery, "token_file", None),
    )


# -- reading ------------------------------------------------------------------------------------
@dataclass
class Read:
    """One part's answer: `data` when read, else `error` (one line: why)."""

    url: str
    data: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _secret(path: str, token: bool = True) -> str:
    """A token (checked: one line of visible ASCII, as a header carries it) or a password;
    an error never quotes the file's content."""
    try:
        value = (
            bounded.read_token(path) if token else bounded.read_text(path, bounded.TOKEN).strip()
        )
    except bounded.InputError as exc:
        if exc.reason == "permission_denied":
            raise PermissionError(
                f"cannot read the token file {path}: run as root or in its group (oomguard)"
            ) from None
        raise PermissionError(f"token file {exc}") from None
    if not value:
        raise PermissionError(f"the token file {path} is empty")
    return value


def _headers(endpoint: Endpoint) -> dict[str, str]:
    import base64

    if endpoint.token_file:
        return {"Authorization": f"Bearer {_secret(endpoint.token_file)}"}
    if endpoint.basic:
        user, password_file = endpoint.basic
        raw = f"{user}:{_secret(password_file, token=False)}".encode()
        return {"Authorization": f"Basic {base64.b64encode(raw).decode()}"}
    return {}


def fetch(client: httpx.Client, url: str, endpoint: Endpoint | None, as_json: bool) -> Read:
    """GET `url`, bounded in size and in time: the whole answer, head and body, within the
    client's timeout (httpx's timeouts are per read: a part that sent a byte a second held the
    command for as long as it liked). The request runs in a daemon thread; one still running
    at the deadline is left to end with the command. Never raises."""
    within = client.timeout.read or 10.0
    box: list[Read] = []

    def run() -> None:
        try:
            box.append(_fetch(client, url, endpoint, as_json))
        except Exception as exc:  # never a traceback from a part
            box.append(Read(url, error=f"{type(exc).__name__}: {exc}"[:300]))

    worker = threading.Thread(target=run, name="status-read", daemon=True)
    worker.start()
    worker.join(within)
    if box:
        return box[0]
    return Read(url, error=f"no whole answer within {within:g}s")


def _fetch(client: httpx.Client, url: str, endpoint: Endpoint | None, as_json: bool) -> Read:
    limits = JSON_LIMITS if as_json else METRICS_LIMITS
    try:
        headers = _headers(endpoint) if endpoint else {}
    except PermissionError as exc:
        return Read(url, error=str(exc))
    try:
        with client.stream("GET", url, headers=headers) as r:
            if r.status_code == 401:
                why = "token missing" if not headers else "the token was refused"
                return Read(url, error=f"HTTP 401 ({why})")
            if r.status_code != 200:
                return Read(url, error=f"HTTP {r.status_code}")
            body = bounded.collect(r.iter_bytes(), url, limits)
    except httpx.TimeoutException:
        return Read(url, error=f"no answer within {client.timeout.read}s")
    except httpx.HTTPError as exc:
        return Read(url, error=f"unreachable: {type(exc).__name__}: {exc}"[:300])
    except bounded.InputError as exc:
        return Read(url, error=exc.detail)
    try:
        if as_json:
            return Read(url, bounded.parse_json(body, url, limits))
        return Read(url, bounded.decode(body, url))
    except bounded.InputError as exc:
        return Read(url, error=exc.detail)


# -- joining ------------------------------------------------------------------------------------
@dataclass
class EngineLevel:
    exporter: str
    labels: dict[str, str]
    level: int
    reason: str


@dataclass
class TargetReport:
    name: str
    url: str
    levels: list[EngineLevel] = field(default_factory=list)
    plugin: dict[str, Any] | None = None
    plugin_error: str | None = None
    supervisor: dict[str, Any] | None = None
    supervisor_error: str | None = None
    remediator: dict[str, Any] | None = None
    attention: list[str] = field(default_factory=list)


@dataclass
class Report:
    time: float
    exporters: list[dict[str, Any]]
    remediator: dict[str, Any]
    targets: list[TargetReport]
    unlisted: list[EngineLevel]  # engines an exporter reports that no target selects
    attention: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _exporter_levels(url: str, text: str) -> tuple[list[EngineLevel], dict[str, Any]]:
    parsed = parse(text, wanted={LEVEL, GPU_LEVEL, COLLECTOR_UP, BUILD_INFO})
    if not parsed.get(BUILD_INFO):
        raise ValueError("not an oomguard exporter's /metrics (no oomguard_exporter_build_info)")
    instance = urlsplit(url).netloc
    levels = [
        EngineLevel(
            url, {**s.labels, "instance": instance}, int(s.value), s.labels.get("reason", "")
        )
        for s in parsed.get(LEVEL)
    ]
    down = sorted(
        f"{s.labels.get('collector', '')} {s.labels.get('target', '')}".strip()
        for s in parsed.get(COLLECTOR_UP)
        if s.value != 1
    )
    gpus = [
        {
            "gpu": s.labels.get("gpu", ""),
            "uuid": s.labels.get("UUID", ""),
            "model": s.labels.get("modelName", ""),
            "level": int(s.value),
            "reason": s.labels.get("reason", ""),
        }
        for s in parsed.get(GPU_LEVEL)
    ]
    return levels, {"collectors_down": down, "gpus": gpus}


def _selects(match: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def build(plan: Plan, client: httpx.Client) -> Report:
    """Read every part (in parallel) and join them per target."""
    jobs: dict[str, Callable[[], Read]] = {}
    for url in plan.exporters:
        jobs[f"exporter {url}"] = partial(fetch, client, url, None, False)
    rem = plan.remediator
    if rem is not None:
        jobs["remediator"] = partial(fetch, client, f"{rem.url}/v1/targets", rem, True)
    for t in plan.targets:
        if t.plugin is not None:
            state = f"{t.plugin.url.rstrip('/')}{API_PREFIX}/state"
            jobs[f"plugin {t.name}"] = partial(fetch, client, state, t.plugin, True)
        if t.supervisor is not None:
            status = f"{t.supervisor.url.rstrip('/')}/v1/status"
            jobs[f"supervisor {t.name}"] = partial(fetch, client, status, t.supervisor, True)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(jobs)))) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        reads = {name: f.result() for name, f in futures.items()}

    attention: list[str] = []
    exporters, levels = [], []
    for url in plan.exporters:
        r = reads[f"exporter {url}"]
        entry: dict[str, Any] = {"url": url, "ok": r.ok, "error": r.error}
        if r.ok:
            try:
                found, extra = _exporter_levels(url, r.data)
                levels += found
                entry.update(extra)
                if extra["collectors_down"]:
                    attention.append(f"exporter {url}: down: {', '.join(extra['collectors_down'])}")
            except ValueError as exc:
                entry.update(ok=False, error=str(exc))
        if not entry["ok"]:
            attention.append(f"exporter {url}: {entry['error']}")
        exporters.append(entry)

    remediator: dict[str, Any] = {"url": rem.url if rem else None, "ok": False}
    targets_view: dict[str, Any] = {}
    if rem is None:
        remediator["error"] = "not given"
    else:
        r = reads["remediator"]
        remediator["error"] = r.error
        if r.ok and isinstance(r.data, dict) and isinstance(r.data.get("targets"), dict):
            remediator.update(
                ok=True,
                paused=bool(r.data.get("paused")),
                dry_run=bool(r.data.get("dry_run")),
                firing_alerts=r.data.get("firing_alerts"),
            )
            targets_view = r.data["targets"]
            if remediator["paused"]:
                attention.append("remediator: paused (it decides and changes nothing)")
        elif r.ok:
            remediator["error"] = "not the remediator's /v1/targets answer"
        if not remediator["ok"]:
            attention.append(f"remediator {rem.url}: {remediator['error']}")

    specs = {t.name: t for t in plan.targets}
    discovered: dict[str, Callable[[], Read]] = {}
    for name, view in targets_view.items():  # found by the remediator (discovery)
        if name not in specs and isinstance(view, dict):
            url = str(view.get("url") or "")
            token = plan.default_plugin_token
            specs[name] = TargetSpec(name, url, {"target": name}, None)
            if url:
                spec = specs[name]
                spec.plugin = Endpoint(url, token)
                state = f"{url.rstrip('/')}{API_PREFIX}/state"
                discovered[f"plugin {name}"] = partial(fetch, client, state, spec.plugin, True)
    if discovered:  # in parallel too: a fleet's engines, not one timeout after another
        with ThreadPoolExecutor(max_workers=min(16, len(discovered))) as pool:
            futures = {name: pool.submit(job) for name, job in discovered.items()}
            reads.update({name: f.result() for name, f in futures.items()})

    reports = []
    claimed: set[int] = set()
    for name, spec in specs.items():
        rep = TargetReport(name, spec.url)
        for i, lv in enumerate(levels):
            if _selects(spec.match, lv.labels):
                rep.levels.append(lv)
                claimed.add(i)
        plugin = reads.get(f"plugin {name}")
        if plugin is not None:
            rep.plugin, rep.plugin_error = (
                (plugin.data, None) if plugin.ok else (None, plugin.error)
            )
            if plugin.ok and not isinstance(plugin.data, dict):
                rep.plugin, rep.plugin_error = None, "not the plugin's state document"
        sup = reads.get(f"supervisor {name}")
        if sup is not None:
            rep.supervisor, rep.supervisor_error = (sup.data, None) if sup.ok else (None, sup.error)
            if sup.ok and not isinstance(sup.data, dict):
                rep.supervisor, rep.supervisor_error = None, "not the supervisor's status"
        view = targets_view.get(name)
        rep.remediator = view if isinstance(view, dict) else None
        rep.attention = _attention(rep, remediator["ok"])
        attention += [f"{name}: {a}" for a in rep.attention]
        reports.append(rep)
    unlisted = [lv for i, lv in enumerate(levels) if i not in claimed]
    for lv in unlisted:
        if lv.level >= 2 or lv.level < 0:
            who = lv.labels.get("target", "?")
            attention.append(f"{who}: level {lv.level} ({lv.reason}), and no target selects it")
    return Report(time.time(), exporters, remediator, reports, unlisted, attention)


def _attention(rep: TargetReport, remediator_read: bool) -> list[str]:
    out = []
    if not rep.levels:
        out.append("no pressure level: no exporter reports this target")
    for lv in rep.levels:
        if lv.level >= 2:
            out.append(f"level {lv.level} {LEVEL_NAMES.get(lv.level, '')} ({lv.reason})")
        elif lv.level < 0:
            out.append(f"blind ({lv.reason})")
    if rep.plugin_error:
        out.append(f"engine state: {rep.plugin_error}")
    if rep.supervisor_error:
        out.append(f"supervisor: {rep.supervisor_error}")
    if rep.supervisor and rep.supervisor.get("gave_up"):
        out.append("supervisor gave up (crashloop): it restarts vLLM only when asked")
    view = rep.remediator
    if view is not None:
        if view.get("mode") == "held":
            out.append(f"held: {view.get('reason')}")
        limited = view.get("limited")
        if isinstance(limited, dict):
            out.append(f"{limited.get('action')} withheld by the {limited.get('limit')} limit")
    elif remediator_read:
        out.append("not on the remediator's allowlist")
    return out


# -- text ---------------------------------------------------------------------------------------
def _ago(stamp: Any, now: float) -> str:
    if not isinstance(stamp, int | float):
        return ""
    seconds = max(0, int(now - stamp))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    return f"{seconds // 3600}h ago"


def _engine_line(state: dict[str, Any]) -> str:
    cap, startup = state.get("admission_cap"), state.get("startup_max_num_seqs")
    parts = [str(state.get("mode", "?"))]
    if cap is not None and startup is not None:
        parts.append(f"cap {cap} of {startup}" + (" (full)" if cap == startup else ""))
    if state.get("running") is not None:
        parts.append(f"{state.get('running')} running, {state.get('waiting')} waiting")
    kv = state.get("kv_cache_usage")
    if isinstance(kv, int | float):
        parts.append(f"KV {kv:.0%}")
    return ", ".join(parts)


def _supervisor_line(status: dict[str, Any], now: float) -> str:
    flags = status.get("flags") or {}
    current, original = flags.get("current") or {}, flags.get("original") or {}
    state = "running" if status.get("running") else "not running"
    if status.get("ready"):
        state += ", ready"
    if status.get("gave_up"):
        state += ", GAVE UP"
    gmu, seqs = current.get("gpu_memory_utilization"), current.get("max_num_seqs")
    lowered = (
        ""
        if current == original
        else (
            f" (started at {original.get('gpu_memory_utilization')} / "
            f"{original.get('max_num_seqs')})"
        )
    )
    line = (
        f"generation {status.get('generation')}, {state}; gmu {gmu}, max_num_seqs {seqs}{lowered}"
    )
    exits = status.get("exits") or []
    if exits and isinstance(exits[-1], dict):
        last = exits[-1]
        line += f"; last exit {last.get('reason')} {_ago(last.get('time'), now)}"
    return line


def _remediator_lines(view: dict[str, Any], now: float) -> list[str]:
    lines = [f"{view.get('mode', '?')}: {view.get('reason', '')}"]
    alerts = view.get("alerts") or {}
    if alerts:
        lines.append("alerts: " + ", ".join(sorted(alerts)))
    limited = view.get("limited")
    if isinstance(limited, dict):
        lines.append(f"limit: {limited.get('action')} withheld by {limited.get('limit')}")
    waiting = view.get("waiting")
    if isinstance(waiting, str) and waiting:
        lines.append(f"waiting: {waiting[:200]}")  # elective: not an attention item
    last = view.get("last_action")
    if isinstance(last, dict):
        after: dict[str, Any] = last["after"] if isinstance(last.get("after"), dict) else {}
        done = f" -> cap {after['cap']}" if after.get("cap") is not None else ""
        result = f" ({last['result']})" if last.get("result") not in (None, "", "ok") else ""
        lines.append(
            f"last action: {last.get('action') or last.get('event')}{done}{result}, "
            f"{_ago(last.get('time'), now)}: {last.get('reason', '')}"
        )
    if view.get("error"):
        lines.append(f"error: {view['error']}")
    return lines


def render_text(report: Report) -> str:
    now = report.time
    out = [f"oomguard status, {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}"]
    for e in report.exporters:
        if e["ok"]:
            down = f", down: {', '.join(e['collectors_down'])}" if e.get("collectors_down") else ""
            gpus = ", ".join(
                f"GPU {g['gpu']} ({g['model']}) {LEVEL_NAMES.get(g['level'], g['level'])}"
                + ("" if g["reason"] == "ok" else f" ({g['reason']})")
                for g in e.get("gpus", [])
            )
            out.append(f"exporter   {e['url']}: read{down}; {gpus or 'no GPU'}")
        else:
            out.append(f"exporter   {e['url']}: CANNOT READ: {e['error']}")
    r = report.remediator
    if r.get("ok"):
        flags = [
            "PAUSED" if r.get("paused") else "acting",
            *(["dry run"] if r.get("dry_run") else []),
            f"{r.get('firing_alerts')} alerts firing",
        ]
        out.append(f"remediator {r['url']}: {', '.join(flags)}")
    elif r.get("url") is None:
        out.append("remediator not given (--config FILE, or --remediator URL)")
    else:
        out.append(f"remediator {r['url']}: CANNOT READ: {r.get('error')}")
    for t in report.targets:
        out.append("")
        out.append(f"{t.name}  {t.url}")
        if t.levels:
            for lv in t.levels:
                name = LEVEL_NAMES.get(lv.level, str(lv.level))
                engine = lv.labels.get("engine") or "-"
                out.append(f"  level       {lv.level} {name} ({lv.reason}), engine {engine}")
        else:
            out.append("  level       none: no exporter reports this target")
        if t.plugin is not None:
            out.append(f"  engine      {_engine_line(t.plugin)}")
        elif t.plugin_error:
            out.append(f"  engine      CANNOT READ: {t.plugin_error}")
        if t.remediator is not None:
            first, *rest = _remediator_lines(t.remediator, now)
            out.append(f"  remediator  {first}")
            out += [f"              {line}" for line in rest]
        if t.supervisor is not None:
            out.append(f"  supervisor  {_supervisor_line(t.supervisor, now)}")
        elif t.supervisor_error:
            out.append(f"  supervisor  CANNOT READ: {t.supervisor_error}")
    if report.unlisted:
        out.append("")
        out.append("engines no target selects (the remediator does not protect them):")
        for lv in report.unlisted:
            out.append(
                f"  {lv.labels.get('target', '?')} engine {lv.labels.get('engine') or '-'}: "
                f"level {lv.level} ({lv.reason})"
            )
    out.append("")
    if report.attention:
        out.append("needs attention:")
        out += [f"  - {a}" for a in report.attention]
    else:
        out.append("all parts read; nothing needs attention")
    return "\n".join(out)


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, default=str)


def exit_status(report: Report) -> int:
    return 1 if report.attention else 0
