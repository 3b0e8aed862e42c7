"""The demo report's own charts: the incident side by side, and the do-no-harm segment.

Inputs are plain series (see `lab/report.py`), so the charts never reach into running parts.
Time is trace time in minutes: both incident runs share one axis because they replay the same
requests and GPU events on the same clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUNS = {"alone": ("vLLM alone", "tab:red"), "oomguard": ("vLLM + oomguard", "tab:blue")}
MODE_COLOURS = {
    "serving": "#73bf69",
    "capped": "#fade2a",
    "draining": "#ff9830",
    "down": "#f2495c",
    "starting": "#cccccc",
}
LEVEL_NAMES = ["blind", "ok", "caution", "pressure", "critical"]  # levels -1 .. 3


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _bands(ax: Any, t: Sequence[float], modes: Sequence[str], y: float) -> None:
    """Coloured spans, one per stretch of the same engine mode."""
    if not t:
        return
    start = 0
    for i in range(1, len(t) + 1):
        if i == len(t) or modes[i] != modes[start]:
            end = t[i] if i < len(t) else t[-1]
            colour = MODE_COLOURS.get(modes[start], "#cccccc")
            ax.barh(y, (end - t[start]) / 60, left=t[start] / 60, height=0.6, color=colour)
            start = i


def side_by_side(runs: dict[str, dict[str, Any]], out: Path) -> Path:
    """Four rows on one trace-time axis: GPU 0 free memory (and the neighbour), engine 0's mode,
    requests lost so far, and goodput per minute, for vLLM alone and vLLM + oomguard."""
    plt = _pyplot()
    fig, (mem, mode, lost, good) = plt.subplots(
        4, 1, figsize=(11, 10), sharex=True, gridspec_kw={"height_ratios": [3, 1.3, 2, 2.5]}
    )
    for key, (label, colour) in RUNS.items():
        r = runs.get(key)
        if not r:
            continue
        minutes = [t / 60 for t in r["t"]]
        mem.plot(minutes, r["free_gib"], color=colour, label=f"{label}: GPU 0 free")
        for t in r["crashes"]:
            mem.axvline(t / 60, color=colour, linestyle=":", linewidth=1)
            mem.annotate(
                "CUDA OOM", (t / 60, 0), xytext=(3, 6), textcoords="offset points", color=colour
            )
        lost.step(
            [0, *(t / 60 for t in r["lost_at"]), minutes[-1] if minutes else 0],
            [0, *range(1, len(r["lost_at"]) + 1), len(r["lost_at"])],
            where="post",
            color=colour,
            label=label,
        )
        edges, per_min = r["goodput_per_min"]
        good.step(edges, per_min, where="post", color=colour, label=label)
    any_run = next(iter(runs.values()), None)
    if any_run:
        mem.plot(
            [t / 60 for t in any_run["t"]],
            any_run["neighbour_gib"],
            color="grey",
            linestyle="--",
            label="neighbour process (both runs)",
        )
        if any_run.get("pressure_ends_s") is not None:
            for ax in (mem, mode, lost, good):
                ax.axvline(any_run["pressure_ends_s"] / 60, color="grey", linewidth=0.6)
    mem.set_ylabel("GiB")
    mem.set_ylim(bottom=0)
    mem.set_title("The same incident, the same seed: vLLM alone vs vLLM + oomguard")
    for y, key in enumerate(("oomguard", "alone")):
        r = runs.get(key)
        if r:
            _bands(mode, r["t"], r["mode0"], y)
    mode.set_yticks([0, 1], [RUNS["oomguard"][0], RUNS["alone"][0]])
    mode.set_ylabel("engine 0")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c) for m, c in MODE_COLOURS.items() if m != "starting"
    ]
    mode.legend(
        handles,
        [m for m in MODE_COLOURS if m != "starting"],
        loc="upper right",
        fontsize=7,
        ncol=4,
    )
    lost.set_ylabel("requests lost\n(cumulative)")
    good.set_ylabel("goodput\n(output tokens/s\nwithin the TTFT goal)")
    good.set_xlabel("trace time (minutes); grey line: the neighbour has left")
    for ax in (mem, lost, good):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return _save(fig, out, plt)


def do_no_harm(rows: Sequence[dict[str, Any]], actions: int, title: str, out: Path) -> Path:
    """The healthy engine: free memory, pressure level, KV usage and queue; alerts and actions."""
    plt = _pyplot()
    fig, (mem, level, kv) = plt.subplots(
        3, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1.2, 2]}
    )
    t = [r["t"] / 60 for r in rows]
    mem.plot(t, [r["free_gib"] for r in rows], color="tab:green", label="GPU free (NVML)")
    mem.set_ylabel("GiB")
    mem.set_ylim(bottom=0)
    mem.legend(loc="upper right", fontsize=8)
    mem.set_title(title)
    level.step(t, [r["level"] for r in rows], where="post", color="tab:green")
    level.set_yticks(range(-1, 4), LEVEL_NAMES)
    level.set_ylim(-1.3, 3.3)
    level.set_ylabel("pressure level")
    alerts = sum(1 for r in rows if r.get("alerts"))
    level.text(
        0.01,
        0.85,
        f"alert samples: {alerts}   remediator actions: {actions}",
        transform=level.transAxes,
        fontsize=9,
    )
    kv.plot(t, [100 * r["kv"] for r in rows], color="tab:purple", label="KV cache used (%)")
    kv.set_ylabel("KV used (%)")
    kv.set_ylim(0, 105)
    queue = kv.twinx()
    queue.plot(t, [r["running"] for r in rows], color="tab:blue", label="running", linewidth=0.8)
    queue.plot(t, [r["waiting"] for r in rows], color="tab:orange", label="waiting", linewidth=0.8)
    queue.set_ylabel("requests")
    lines = kv.get_legend_handles_labels()
    more = queue.get_legend_handles_labels()
    kv.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    kv.set_xlabel("trace time (minutes)")
    for ax in (mem, level, kv):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, out, plt)


def _save(fig: Any, out: Path, plt: Any) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
