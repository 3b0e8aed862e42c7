"""A twin GPU in a file: rehearse the real single-box stack on a machine without a GPU.

The state file is the GPU: what it is and what else holds memory on it. The operator writes it
(`oomguard twin-gpu FILE --gpu H100 --neighbour 7GiB`, or by hand), `oomguard exporter
--twin-gpu FILE` reads it through the exporter's NVML code as it would read a GPU, and `oomguard
serve --twin-gpu FILE` runs vLLM on the model-free executor over it (with $OOMGUARD_TWIN_GPU_FILE
set, both do it without a flag: a systemd drop-in turns the real units into a rehearsal).

The state file, JSON (docs/twin.md, "A twin GPU in a file"):

    {
      "gpu": "H100",               a twin GPU model (GPU_MODELS; default H100), read at start
      "uuid": "GPU-twin-…",        optional; default derived from the file's path
      "neighbour_bytes": "7GiB",   memory another process holds on the GPU (0: none)
      "fragmentation_bytes": 0,    reserved-but-unusable memory inside the engine (0: none)
      "model": "llama-3-8b"        optional: `oomguard serve` serves this twin model folder
    }                              (twin/models/<name>, or a folder with config.json and a
                                   tokenizer) in place of the command's, under the command's
                                   name (--served-model-name): no weights needed; read at start

Sizes take a unit or a plain number of bytes. Writers replace the file atomically; readers take
it as untrusted (bounded read, a wrong value is an error that names it).

The engines on the GPU: each vLLM engine on the model-free executor publishes its device memory
(weights, KV pool, activations, graphs, non-torch, fragmentation, as its physics has it) in
`<FILE>.processes/<pid>.json` as {"pid": …, "used_bytes": …, "timestamp": …}; the exporter's
twin NVML lists each one whose process is alive, as NVML lists a GPU's processes, and the
neighbour as process NEIGHBOUR_PID.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pynvml

from oomguard import bounded
from oomguard.twin.gpu import GPU_MODELS, TwinGpu, TwinNvml
from oomguard.units import parse_size

NEIGHBOUR_PID = 424242  # the neighbour's pid in the twin's NVML process list
STATE_LIMITS = bounded.Limits(max_bytes=64 * 1024, max_depth=4)
KEYS = ("gpu", "uuid", "neighbour_bytes", "fragmentation_bytes", "model")
MODELS = Path(__file__).resolve().parent / "models"


class TwinStateError(ValueError):
    """A state file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class TwinState:
    gpu: str = "H100"
    uuid: str = ""
    neighbour_bytes: int = 0
    fragmentation_bytes: int = 0
    model: str = ""

    def model_dir(self) -> Path | None:
        """The folder `model` names (a twin model, else a path), or None when unset."""
        if not self.model:
            return None
        twin = MODELS / self.model
        return twin if (twin / "config.json").is_file() else Path(self.model)


def default_uuid(path: str | os.PathLike[str]) -> str:
    """A stable UUID for the file's GPU: the same file is the same GPU across restarts."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()
    return f"GPU-twin-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:28]}"


def parse_state(data: Any, source: str) -> TwinState:
    if not isinstance(data, dict):
        raise TwinStateError(f"{source}: expected a JSON object")
    unknown = sorted(str(k)[:40] for k in data if k not in KEYS)
    if unknown:
        raise TwinStateError(f"{source}: unknown keys {unknown[:5]} (known: {', '.join(KEYS)})")
    gpu = data.get("gpu", "H100")
    if not isinstance(gpu, str) or gpu not in GPU_MODELS:
        shown = repr(gpu)[:40]
        raise TwinStateError(
            f"{source}: gpu {shown} is not a twin GPU (one of {', '.join(sorted(GPU_MODELS))})"
        )
    uuid = data.get("uuid") or default_uuid(source)
    if not isinstance(uuid, str) or not 0 < len(uuid) <= 96 or not uuid.isprintable():
        raise TwinStateError(f"{source}: uuid must be 1-96 printable characters")
    sizes = {}
    for key in ("neighbour_bytes", "fragmentation_bytes"):
        value = data.get(key, 0)
        try:
            sizes[key] = parse_size(value, plain=True)
        except ValueError as exc:
            raise TwinStateError(f"{source}: {key}: {exc}") from None
        if sizes[key] < 0 or sizes[key] > GPU_MODELS[gpu].total_mib * 2**20:
            raise TwinStateError(f"{source}: {key} must be between 0 and the GPU's memory")
    model = data.get("model", "")
    if not isinstance(model, str) or len(model) > 4096:
        raise TwinStateError(f"{source}: model must be a twin model's name or a folder")
    state = TwinState(gpu, uuid, sizes["neighbour_bytes"], sizes["fragmentation_bytes"], model)
    folder = state.model_dir()
    if folder is not None and not (folder / "config.json").is_file():
        raise TwinStateError(
            f"{source}: model {model[:80]!r}: no config.json there (twin models: "
            f"{', '.join(sorted(p.parent.name for p in MODELS.glob('*/config.json')))})"
        )
    return state


def read_state(path: str | os.PathLike[str]) -> TwinState:
    """The state file, validated. Raises TwinStateError (bounded.InputError's message inside)."""
    source = os.fspath(path)
    try:
        data = bounded.read_json(path, STATE_LIMITS)
    except bounded.InputError as exc:
        raise TwinStateError(str(exc)) from None
    return parse_state(data, source)


def write_state(path: str | os.PathLike[str], state: TwinState) -> None:
    """Replace the state file atomically (readers never see half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n")
    os.replace(tmp, target)


# -- the engines' memory on the GPU --------------------------------------------------------------
def processes_dir(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}.processes")


def publish_process(path: str | os.PathLike[str], pid: int, used_bytes: int) -> None:
    """An engine's device memory on the twin GPU (atomic; the caller handles OSError)."""
    folder = processes_dir(path)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"pid": pid, "used_bytes": int(used_bytes), "timestamp": time.time()}
    tmp = folder / f".{pid}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / f"{pid}.json")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def read_processes(path: str | os.PathLike[str], limit: int = 64) -> dict[int, int]:
    """pid -> device bytes of every engine on the GPU whose process is alive (a dead engine's
    memory is freed, as the driver frees it). Files that are not well-formed are skipped."""
    found: dict[int, int] = {}
    try:
        entries = sorted(processes_dir(path).glob("*.json"))[:limit]
    except OSError:
        return found
    for entry in entries:
        try:
            record = bounded.read_json(entry, STATE_LIMITS, follow_symlinks=False)
            pid, used = record["pid"], record["used_bytes"]
        except (bounded.InputError, KeyError, TypeError):
            continue
        if not (isinstance(pid, int) and isinstance(used, int)) or pid <= 0 or used < 0:
            continue
        if entry.stem == str(pid) and _alive(pid):
            found[pid] = used
    return found


class FileTwinNvml(TwinNvml):
    """NVML over twin GPUs in state files, re-read at every poll (the collector's
    nvmlDeviceGetCount starts each one). A file that cannot be read makes its GPU fail as a
    real one does (NVML_ERROR_UNKNOWN on every call), and the others read on."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__([])
        self.paths = paths
        self.errors: dict[int, str] = {}

    def nvmlDeviceGetCount(self) -> int:
        gpus, self.errors = [], {}
        for i, path in enumerate(self.paths):
            try:
                state = read_state(path)
            except TwinStateError as exc:
                self.errors[i] = str(exc)
                state = TwinState()
            processes = read_processes(path) if i not in self.errors else {}
            if state.neighbour_bytes:
                processes[NEIGHBOUR_PID] = state.neighbour_bytes
            gpus.append(TwinGpu(state.uuid or default_uuid(path), state.gpu, i, processes))
        with self.lock:
            self.gpus = gpus
        return len(gpus)

    def _check(self, handle: Any) -> int:
        index = handle[1] if isinstance(handle, tuple) else handle
        if index in self.errors:
            raise pynvml.NVMLError_Unknown()
        return int(index)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        self._check(handle)
        return super().nvmlDeviceGetUUID(handle)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._check(handle)
        return f"{super().nvmlDeviceGetName(handle)} (twin)"

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        self._check(handle)
        return super().nvmlDeviceGetMemoryInfo(handle, version)


# -- `oomguard serve --twin-gpu FILE` -----------------------------------------------------------
EXECUTOR = "oomguard.twin.executor.ModelFreeExecutor"
_BACKEND = "--distributed-executor-backend"


def _without(argv: list[str], flag: str) -> list[str]:
    """argv less `flag VALUE` and `flag=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def rehearsal_command(argv: list[str], path: str) -> tuple[list[str], dict[str, str]]:
    """`vllm serve MODEL ...` as a rehearsal over the twin GPU in `path`: on the model-free
    executor (vLLM's own server, scheduler and KV manager; no weights, no GPU), with the GPU's
    physics (twin/physics.py) and the state file's neighbour and fragmentation. With `model`
    in the state file, that folder is served under the command's model name. Returns the
    command and the environment to add. Raises TwinStateError."""
    state = read_state(path)
    try:
        at = argv.index("serve") + 1
    except ValueError:
        raise TwinStateError(f"{path}: the command is not `vllm serve MODEL ...`") from None
    if at >= len(argv) or argv[at].startswith("-"):
        raise TwinStateError(f"{path}: `vllm serve` without a model")
    argv = list(argv)
    folder = state.model_dir()
    if folder is not None:
        if not any(
            a == "--served-model-name" or a.startswith("--served-model-name=") for a in argv
        ):
            argv[at + 1 : at + 1] = ["--served-model-name", argv[at]]
        argv[at] = str(folder)
    argv = [*_without(argv, _BACKEND), _BACKEND, EXECUTOR]
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",  # the folder holds the tokenizer: no network wait
        "OOMGUARD_TWIN_GPU": state.gpu,
        "OOMGUARD_TWIN_STATE_FILE": os.path.abspath(path),
    }
    config = Path(argv[at]) / "config.json"
    if config.is_file():
        env["OOMGUARD_TWIN_MODEL"] = str(config)  # the physics of the model served
    return argv, env
