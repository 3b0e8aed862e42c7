"""vLLM's memory flags for a restart: bounded steps down, walk-back, persistence, argv editing.

Only a restart gives memory back from vLLM's KV pool. The operator's move on memory that stays
critical, or on an OOM crashloop: lower `--gpu-memory-utilization` by 0.03-0.05 and
`--max-num-seqs` by 20 %, and later walk both back toward the original values one step at a time.
`--max-num-active-seqs` may not exceed `--max-num-seqs` (vLLM refuses to start), so a step down
clamps it too.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from oomguard import vllm_seam
from oomguard.errors import ConfigError
from oomguard.remediator import statefile

log = logging.getLogger("oomguard.supervisor")

GMU = "--gpu-memory-utilization"
SEQS = "--max-num-seqs"
ACTIVE = "--max-num-active-seqs"  # bounded by --max-num-seqs
VLLM_DEFAULT_GMU = vllm_seam.GPU_MEMORY_UTILIZATION  # vLLM's default (read back from an engine)


class FlagLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gmu_step: float = Field(0.04, ge=0.01, le=0.1, description="gpu_memory_utilization per step.")
    gmu_floor: float = Field(0.5, gt=0, lt=1, description="Never restart below this.")
    seqs_factor: float = Field(0.8, gt=0, lt=1, description="max_num_seqs multiplier per step.")
    seqs_floor: int = Field(1, ge=1)
    walk_back_after_seconds: float = Field(
        3600.0, ge=0, description="Quiet time after a change before stepping back up."
    )


@dataclass(frozen=True)
class Flags:
    gpu_memory_utilization: float
    max_num_seqs: int

    def lower(self, limits: FlagLimits) -> Flags:
        return Flags(
            round(max(limits.gmu_floor, self.gpu_memory_utilization - limits.gmu_step), 4),
            max(limits.seqs_floor, math.floor(self.max_num_seqs * limits.seqs_factor)),
        )

    def toward(self, original: Flags, limits: FlagLimits) -> Flags:
        """One step back toward `original` (never past it)."""
        return Flags(
            round(
                min(original.gpu_memory_utilization, self.gpu_memory_utilization + limits.gmu_step),
                4,
            ),
            min(
                original.max_num_seqs,
                max(self.max_num_seqs + 1, math.ceil(self.max_num_seqs / limits.seqs_factor)),
            ),
        )


def _find(argv: list[str], flag: str) -> tuple[int, str] | None:
    """Where `flag` is set (the last time: argparse keeps the last) in either spelling vLLM
    accepts (`--max-num-seqs` or `--max_num_seqs`), and its value."""
    found = None
    for spelling in {flag, "--" + flag[2:].replace("-", "_")}:
        for i, arg in enumerate(argv):
            if arg == spelling and i + 1 < len(argv):
                hit = i, argv[i + 1]
            elif arg.startswith(spelling + "="):
                hit = i, arg.split("=", 1)[1]
            else:
                continue
            if found is None or hit[0] > found[0]:
                found = hit
    return found


def read(argv: list[str], default_seqs: int) -> Flags:
    """The flags a `vllm serve` command line sets (vLLM's defaults where it sets none)."""
    gmu, seqs = _find(argv, GMU), _find(argv, SEQS)
    try:
        return Flags(
            float(gmu[1]) if gmu else VLLM_DEFAULT_GMU,
            int(seqs[1]) if seqs else default_seqs,
        )
    except ValueError as exc:
        raise ConfigError(f"cannot read {GMU}/{SEQS} from the vLLM command line: {exc}") from exc


def _set(argv: list[str], flag: str, value: str) -> None:
    found = _find(argv, flag)
    if found is None:
        argv += [flag, value]
    elif argv[found[0]].startswith("--") and "=" not in argv[found[0]]:
        argv[found[0] + 1] = value
    else:
        argv[found[0]] = f"{argv[found[0]].split('=', 1)[0]}={value}"


def apply(argv: list[str], flags: Flags) -> list[str]:
    """`argv` with both flags set to `flags` (replaced where present, appended otherwise), and
    `--max-num-active-seqs` clamped to the new `--max-num-seqs` where it is set above it."""
    out = list(argv)
    _set(out, GMU, f"{flags.gpu_memory_utilization:g}")
    _set(out, SEQS, str(flags.max_num_seqs))
    active = _find(out, ACTIVE)
    try:
        too_high = active is not None and int(active[1]) > flags.max_num_seqs
    except ValueError:
        too_high = False  # not a number: vLLM reports it, the operator's line is not ours to fix
    if too_high:
        _set(out, ACTIVE, str(flags.max_num_seqs))
    return out


@dataclass
class FlagState:
    """What survives restarts of the engine and of oomguard: original and current flags."""

    original: Flags
    current: Flags
    changed_at: float = field(default_factory=time.time)
    history: list[dict[str, Any]] = field(default_factory=list)

    def set(self, flags: Flags, reason: str) -> None:
        if flags == self.current:
            return
        self.history.append(
            {
                "time": time.time(),
                "from": asdict(self.current),
                "to": asdict(flags),
                "reason": reason,
            }
        )
        self.history = self.history[-50:]
        self.current, self.changed_at = flags, time.time()


class FlagStore:
    """One JSON file, replaced atomically, so a crash or a full disk mid-write never loses the
    flags (statefile.py). A file whose content cannot be used is moved aside and reported in
    `problem`: the engine starts with the command line's flags rather than not at all."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.problem: str | None = None

    def load(self, original: Flags) -> FlagState:
        data, why = statefile.read(self.path)
        if data is None:
            self.problem = why
            return FlagState(original, original)
        try:
            state = FlagState(
                _flags(data["original"]),
                _flags(data["current"]),
                _finite(data["changed_at"]),
                [h for h in data.get("history", []) if isinstance(h, dict)][-50:],
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.problem = statefile.set_aside(self.path, f"{self.path}: {exc!r}")
            return FlagState(original, original)
        if state.original != original:
            log.warning(
                "the command line's flags %s differ from the original ones in %s (%s): "
                "the recorded ones are kept",
                original,
                self.path,
                state.original,
            )
        return state

    def save(self, state: FlagState) -> None:
        """Raises OSError when the file cannot be written; the old one is kept then."""
        statefile.write(
            self.path,
            {
                "original": asdict(state.original),
                "current": asdict(state.current),
                "changed_at": state.changed_at,
                "history": state.history,
            },
        )


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)


def _flags(value: Any) -> Flags:
    if not isinstance(value, dict):
        raise TypeError(f"flags are not an object: {value!r}")
    gmu, seqs = _finite(value["gpu_memory_utilization"]), value["max_num_seqs"]
    if not 0 < gmu <= 1:
        raise ValueError(f"gpu_memory_utilization {gmu} outside (0, 1]")
    if isinstance(seqs, bool) or not isinstance(seqs, int) or not 1 <= seqs <= 1_000_000:
        raise ValueError(f"max_num_seqs {seqs!r} is not a count of sequences")
    return Flags(gmu, seqs)
