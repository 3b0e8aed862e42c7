"""A twin GPU in a file (oomguard.twin.gpufile): the state file's format and checks, the
exporter's NVML code reading it, `oomguard twin-gpu`, and `oomguard serve --twin-gpu`'s command.
tests/test_rehearsal.py runs all of it with the real vLLM server and the real units."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oomguard.exporter.collectors.nvml import NvmlCollector
from oomguard.twin.gpu import GPU_MODELS, MIB
from oomguard.twin.gpufile import (
    EXECUTOR,
    NEIGHBOUR_PID,
    FileTwinNvml,
    TwinStateError,
    publish_process,
    read_processes,
    read_state,
    rehearsal_command,
)

GIB = 2**30
H100 = GPU_MODELS["H100"]


def write(path, **state) -> None:
    path.write_text(json.dumps(state))


def test_the_state_file_takes_sizes_with_units(tmp_path):
    path = tmp_path / "gpu0.json"
    write(path, gpu="L4", neighbour_bytes="2GiB", fragmentation_bytes=1024)
    state = read_state(path)
    assert (state.gpu, state.neighbour_bytes, state.fragmentation_bytes) == ("L4", 2 * GIB, 1024)
    assert state.uuid.startswith("GPU-twin-")
    assert read_state(path).uuid == state.uuid  # the same file is the same GPU


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"gpu": "H1000"}, "not a twin GPU"),
        ({"neighbour_bytes": "lots"}, "neighbour_bytes: not a size"),
        ({"neighbour_bytes": "1TiB"}, "between 0 and the GPU's memory"),
        ({"neighbour": "1GiB"}, "unknown keys"),
        ({"model": "no-such-model"}, "no config.json there"),
    ],
)
def test_a_wrong_state_file_is_named(tmp_path, state, message):
    path = tmp_path / "gpu0.json"
    write(path, **state)
    with pytest.raises(TwinStateError, match=message):
        read_state(path)


def test_not_json_or_not_a_file_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(TwinStateError, match=r"bad\.json"):
        read_state(tmp_path / "bad.json")
    with pytest.raises(TwinStateError):
        read_state(tmp_path)  # a directory


def test_the_exporters_nvml_code_reads_the_file(tmp_path):
    """An engine's published memory and the neighbour are the GPU's processes; free memory is
    what they leave; a broken file is a GPU NVML cannot read, the others read on."""
    gpu0, gpu1 = tmp_path / "gpu0.json", tmp_path / "gpu1.json"
    write(gpu0, gpu="H100", neighbour_bytes="7GiB")
    write(gpu1, gpu="L4")
    publish_process(gpu0, os.getpid(), 60 * GIB)  # an engine that is alive: this process
    reading = NvmlCollector("h", backend=FileTwinNvml([str(gpu0), str(gpu1)])).collect()
    first, second = reading.gpus
    assert first.identity.model_name == "NVIDIA H100 80GB HBM3 (twin)"
    usable = (H100.total_mib - H100.reserved_mib) * MIB
    assert first.free == usable - 60 * GIB - 7 * GIB
    assert {pid: used for _, pid, used in reading.processes if _.gpu == "0"} == {
        os.getpid(): 60 * GIB,
        NEIGHBOUR_PID: 7 * GIB,
    }
    assert second.identity.model_name.startswith("NVIDIA L4")
    gpu1.write_text("{broken")
    reading = NvmlCollector("h", backend=FileTwinNvml([str(gpu0), str(gpu1)])).collect()
    assert [g.identity.gpu for g in reading.gpus] == ["0"] and reading.errors == {"unknown": 1}


def test_a_dead_engines_memory_is_freed(tmp_path):
    gpu = tmp_path / "gpu0.json"
    write(gpu)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    publish_process(gpu, child.pid, 10 * GIB)  # exited: the driver freed its memory
    publish_process(gpu, os.getpid(), 5 * GIB)
    (gpu.parent / "gpu0.json.processes" / "junk.json").write_text("[]")
    assert read_processes(gpu) == {os.getpid(): 5 * GIB}


def test_serve_runs_vllm_on_the_model_free_executor_over_the_twin(tmp_path):
    gpu = tmp_path / "gpu0.json"
    write(gpu, gpu="A100-80GB", model="llama-3-8b")
    argv = ["vllm", "serve", "/models/llama-3-8b", "--max-num-seqs", "64"]
    command, env = rehearsal_command(argv, str(gpu))
    assert command[:3] == ["vllm", "serve", str(read_state(gpu).model_dir())]
    assert command[3:5] == ["--served-model-name", "/models/llama-3-8b"]  # the name stays
    assert command[-2:] == ["--distributed-executor-backend", EXECUTOR]
    assert env["OOMGUARD_TWIN_GPU"] == "A100-80GB" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["OOMGUARD_TWIN_STATE_FILE"] == str(gpu)
    assert env["OOMGUARD_TWIN_MODEL"].endswith("llama-3-8b/config.json")
    # an executor backend already on the command line is replaced, not doubled
    command, _ = rehearsal_command([*argv, "--distributed-executor-backend=mp"], str(gpu))
    assert command.count("--distributed-executor-backend") == 1 and "mp" not in " ".join(command)
    with pytest.raises(TwinStateError, match="not `vllm serve MODEL"):
        rehearsal_command(["python", "-m", "http.server"], str(gpu))


def test_the_twin_gpu_command_creates_and_changes_the_file(tmp_path):
    gpu = tmp_path / "twin" / "gpu0.json"

    def twin(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "oomguard", "twin-gpu", str(gpu), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = twin("--gpu", "L40S")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpu"] == "L40S"
    uuid = read_state(gpu).uuid
    r = twin("--neighbour", "3.5GiB")
    assert r.returncode == 0 and read_state(gpu).neighbour_bytes == int(3.5 * GIB)
    assert read_state(gpu).gpu == "L40S" and read_state(gpu).uuid == uuid  # the rest is kept
    assert twin("--neighbour", "0").returncode == 0 and read_state(gpu).neighbour_bytes == 0
    r = twin("--neighbour", "3")  # 3 what?
    assert r.returncode == 2 and "has no unit" in r.stderr
    r = twin("--gpu", "Z9")
    assert r.returncode == 2 and "not a twin GPU" in r.stderr and "Traceback" not in r.stderr
    assert read_state(gpu).gpu == "L40S"  # a refused change leaves the file as it was


def test_serve_and_exporter_refuse_a_broken_twin(tmp_path):
    gpu = tmp_path / "gpu0.json"
    gpu.write_text("{")
    for args in (
        ["exporter", "--twin-gpu", str(gpu), "--listen", "127.0.0.1:0"],
        ["serve", "--allow-unauthenticated", "--twin-gpu", str(gpu), "--", "vllm", "serve", "m"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "oomguard", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "OOMGUARD_TWIN_GPU_FILE": ""},
        )
        assert r.returncode == 2 and str(gpu) in r.stderr and "Traceback" not in r.stderr, args
