"""The demo report's chart: one timeline of memory, KV usage, caps, preemptions, alerts, actions."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLOURS = {"llama-a": "tab:blue", "llama-b": "tab:orange"}


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float):
            xs.append(row["t"])
            ys.append(value)
    return xs, ys


def render(
    rows: Sequence[dict[str, Any]],
    events: Sequence[tuple[float, str]],
    targets: Sequence[str],
    floor_gib: float,
    out: Path,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(5, 1, figsize=(11, 12), sharex=True)
    mem, kv, cap, pre, marks = axes

    for gpu, style in (("gpu0", "-"), ("gpu1", "--")):
        mem.plot(*_series(rows, f"{gpu}_free_gib"), style, label=f"GPU {gpu[-1]} free")
    mem.axhline(floor_gib, color="red", linewidth=0.8, label="critical floor")
    mem.set_ylabel("free GiB")
    mem.set_title("oomguard demo: GPU memory incident on the twin")

    for name in targets:
        colour = COLOURS.get(name)
        kv.plot(*_series(rows, f"{name}_kv"), color=colour, label=name)
        cap.step(*_series(rows, f"{name}_cap"), where="post", color=colour, label=name)
        pre.plot(*_series(rows, f"{name}_preemptions"), color=colour, label=name)
        draining = [r["t"] for r in rows if r.get(f"{name}_mode") == "draining"]
        if draining:
            cap.scatter(draining, [0] * len(draining), marker="|", color=colour, s=80)
    kv.set_ylabel("KV cache used")
    kv.set_ylim(0, 1.05)
    cap.set_ylabel("admission cap\n(| = draining)")
    pre.set_ylabel("preemptions\n(total)")

    alerts = sorted({a for r in rows for a in r.get("alerts", [])})
    for i, alert in enumerate(alerts):
        ts = [r["t"] for r in rows if alert in r.get("alerts", [])]
        marks.scatter(ts, [i] * len(ts), marker="s", s=12)
    actions = [(t, e) for t, e in events if e.startswith("remediator:")]
    ooms = [(t, e) for t, e in events if "out of memory" in e.lower()]
    y_actions, y_ooms = len(alerts), len(alerts) + 1
    marks.scatter([t for t, _ in actions], [y_actions] * len(actions), marker="v", color="k")
    marks.scatter([t for t, _ in ooms], [y_ooms] * len(ooms), marker="x", color="red", s=60)
    marks.set_yticks(
        range(len(alerts) + 2),
        [*(a.removeprefix("Oomguard") for a in alerts), "remediator actions", "CUDA OOM"],
    )
    marks.set_xlabel("seconds")
    for ax in (mem, kv, cap, pre):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    marks.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
