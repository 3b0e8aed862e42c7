"""The `oomguard` command: one entry point, a subcommand per component.

Imports of each component happen inside its subcommand, so `oomguard budget` does not load the
exporter and nothing does work at import time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from oomguard import bounded, vllm_seam
from oomguard.contract import SERVE_STATE_DIR, TWIN_GPU_FILE_ENV
from oomguard.digits import decimal
from oomguard.errors import BudgetError, ConfigError
from oomguard.units import duration_arg, size_arg
from oomguard.version import __version__

# A model's config.json: a few KB; multimodal ones with label maps stay well under 4 MiB.
MODEL_CONFIG_LIMITS = bounded.Limits(max_bytes=4 * bounded.MIB)
MAX_PARALLEL = 4096  # ranks in one parallel dimension: far beyond any deployment


def _whole(low: int, high: int) -> Callable[[str], int]:
    """argparse type: a whole number of ASCII digits from `low` to `high` (int() would also take
    '١٣', '1_000' and 5,000 digits)."""

    def whole(text: str) -> int:
        value = decimal(text.strip())
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a whole number from {low:,} to {high:,}, got {_shown(text)}"
            )
        return value

    return whole


def _shown(text: str, keep: int = 40) -> str:
    """A value quoted in an error, shortened: an error line never carries a 5,000-character
    input whole."""
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text):,} characters)"


_LONG_WORD = re.compile(r"\S{121,}")


def _one_line(text: str) -> str:
    """An error as one line: lines joined, and any word over 120 characters (a value quoted
    whole) shortened."""
    parts = [line.strip() for line in str(text).splitlines() if line.strip()] or [""]
    line = parts[0] + (" " + "; ".join(parts[1:]) if len(parts) > 1 else "")
    return _LONG_WORD.sub(lambda m: f"{m[0][:60]}... ({len(m[0]):,} characters)", line)


def _check_dir(what: str, path: str, create: bool = False) -> None:
    """A directory argument: wrong when the path exists as something else or cannot be one;
    with `create`, made now (an output or state directory), so a permission problem stops the
    command before it starts anything."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:  # ENOTDIR: a parent is a file; ELOOP, EACCES...
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path}: not a directory")
    if st is None and create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{what} {path}: cannot create it: {exc.strerror or exc}") from None


def _key_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _check_listen(what: str, listen: str) -> None:
    """Bind and release the address now, so a taken port fails before anything starts."""
    host, sep, port = listen.rpartition(":")
    number = decimal(port)
    if not sep or number is None or number > 65535:
        raise ConfigError(f"{what} {listen!r}: expected HOST:PORT with a port up to 65535")
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            probe.bind(address)
    except OSError as exc:
        raise ConfigError(f"{what} {listen}: cannot listen there: {exc.strerror or exc}") from exc


def _check_secret_file(what: str, path: str) -> None:
    """A token file that is missing, unreadable, not text or empty would turn every request
    into a 401 (or a 500); a FIFO would hang the start; a token on two lines or with a
    non-ASCII character cannot go in a header (a password file may hold any text)."""
    try:
        if what.endswith("password_file"):
            empty = not bounded.read_text(path, bounded.TOKEN).strip()
        else:
            empty = not bounded.read_token(path)
    except bounded.InputError as exc:
        raise ConfigError(f"{what} {exc}") from None
    if empty:
        raise ConfigError(f"{what} {path}: the file is empty")


def _secret_files(model: Any, where: str = "") -> list[tuple[str, str]]:
    """Every `*_file` setting in a loaded config, with its place in the file."""
    from pydantic import BaseModel

    found = []
    for name, value in model:
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            place = f"{where}{name}" + (f"[{i}]" if isinstance(value, list) else "")
            if isinstance(item, BaseModel):
                found += _secret_files(item, f"{place}.")
            elif name.endswith("_file") and isinstance(item, str):
                found.append((place, item))
    return found


# -- exporter -----------------------------------------------------------------------------------
def _add_exporter(sub: Any) -> None:
    p = sub.add_parser(
        "exporter",
        help="run the per-node metrics exporter",
        description="Poll GPU memory (NVML or dcgm-exporter), vLLM engines, allocator statistics "
        "and cgroup memory in the background, compute pressure levels, and serve them on "
        "/metrics. Flags override the YAML config file.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML config (docs/configuration.md)")
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="address to serve /metrics and /healthz on (default 0.0.0.0:9848)",
    )
    p.add_argument(
        "--interval",
        type=duration_arg,
        metavar="DURATION",
        help="poll interval, 100ms to 60s; a plain number is seconds (default 1s)",
    )
    p.add_argument("--hostname", help="Hostname label value (default $NODE_NAME or host name)")
    p.add_argument(
        "--vllm",
        action="append",
        type=_key_value,
        metavar="NAME=URL",
        default=[],
        help="a vLLM /metrics endpoint to scrape, e.g. llama=http://127.0.0.1:8000"
        "/metrics; repeat for several engines",
    )
    p.add_argument("--dcgm-url", metavar="URL", help="read GPU memory from dcgm-exporter")
    p.add_argument("--dcgm-file", metavar="FILE", help="read dcgm-exporter output from a file")
    p.add_argument("--no-nvml", action="store_true", help="do not read GPUs through NVML")
    p.add_argument(
        "--allocator-dir",
        metavar="DIR",
        help="hand-off directory where the vLLM plugin publishes allocator stats "
        "(default /run/oomguard/allocator)",
    )
    p.add_argument(
        "--cgroup",
        action="append",
        type=_key_value,
        metavar="NAME=PATH",
        default=[],
        help="a cgroup to report host memory for (default self=/sys/fs/cgroup); repeat for several",
    )
    p.add_argument(
        "--twin-gpu",
        action="append",
        metavar="FILE",
        default=[],
        help="rehearse without a GPU: read the twin GPU in this state file through the NVML "
        f"code instead of the hardware (docs/twin.md); repeat for several; default "
        f"${TWIN_GPU_FILE_ENV}",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=_run_exporter)


def exporter_config_from_args(args: argparse.Namespace) -> Any:
    from oomguard.config import load_yaml, validate
    from oomguard.exporter.config import ExporterConfig

    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    if args.listen:
        data["listen"] = args.listen
    if args.interval is not None:
        data["interval_seconds"] = args.interval
    if args.hostname:
        data["hostname"] = args.hostname
    if args.vllm:
        data["vllm"] = [*data.get("vllm", []), *({"name": n, "url": u} for n, u in args.vllm)]
    if args.dcgm_url or args.dcgm_file:
        data["dcgm"] = {**data.get("dcgm", {}), "url": args.dcgm_url, "file": args.dcgm_file}
    if args.no_nvml:
        data["nvml"] = {**data.get("nvml", {}), "enabled": False}
    if args.allocator_dir:
        data["allocator"] = {**data.get("allocator", {}), "directory": args.allocator_dir}
    if args.cgroup:
        data["cgroups"] = [{"name": n, "path": p} for n, p in args.cgroup]
    config = validate(ExporterConfig, data, args.config or "command-line flags")
    for target in config.vllm:
        _check_url(f"vllm target {target.name}:", target.url)
    if config.dcgm.url:
        _check_url("dcgm.url", config.dcgm.url)
    # Read later, on every poll: what is not there yet may come (a sidecar's first write, the
    # first rank's report), but a path that can never be right stops the start.
    if config.dcgm.file:
        _check_regular_or_missing("dcgm.file", config.dcgm.file)
    if config.allocator.enabled:
        _check_dir("allocator.directory", config.allocator.directory)
        if config.allocator.incident_directory:
            _check_dir("allocator.incident_directory", config.allocator.incident_directory)
    for cg in config.cgroups:
        _check_dir(f"cgroup {cg.name}:", cg.path)
    return config


def _check_url(what: str, url: str) -> None:
    """An http(s) URL with a host and a valid port (the scraper refuses anything else later,
    with a traceback)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (it raises on a port out of range)
    except ValueError as exc:
        raise ConfigError(f"{what} {_shown(url, 80)}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} {_shown(url, 80)}: expected an http:// or https:// URL")


def _check_regular_or_missing(what: str, path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO or device?)"
        raise ConfigError(f"{what} {path}: {kind}")


def twin_gpu_files(flags: list[str]) -> list[str]:
    """The twin GPU state files: the flags, else $OOMGUARD_TWIN_GPU_FILE; each must be valid
    now (a rehearsal that silently reads no GPU would teach the wrong lesson)."""
    from oomguard.twin.gpufile import TwinStateError, read_state

    files = flags or ([os.environ[TWIN_GPU_FILE_ENV]] if os.environ.get(TWIN_GPU_FILE_ENV) else [])
    for path in files:
        try:
            read_state(path)
        except TwinStateError as exc:
            raise ConfigError(f"twin GPU {exc}") from None
    return files


def _run_exporter(args: argparse.Namespace) -> int:
    from oomguard.exporter.main import run

    twins = twin_gpu_files(args.twin_gpu)
    if twins:
        args.no_nvml = False  # the twin is read through the NVML collector
    config = exporter_config_from_args(args)
    backend = None
    if twins:
        from oomguard.twin.gpufile import FileTwinNvml

        if not config.nvml.enabled:
            config = config.model_copy(
                update={"nvml": config.nvml.model_copy(update={"enabled": True})}
            )
        backend = FileTwinNvml(twins)
        logging.getLogger("oomguard.exporter").warning(
            "REHEARSAL: the GPUs are twins read from %s, not hardware", ", ".join(twins)
        )
    _check_listen("listen", config.listen)
    try:
        return run(config, nvml_backend=backend)
    except OSError as exc:  # the port is taken, or the address is not ours
        raise ConfigError(f"cannot listen on {config.listen}: {exc.strerror or exc}") from exc


# -- budget -------------------------------------------------------------------------------------
def _add_budget(sub: Any) -> None:

    p = sub.add_parser(
        "budget",
        help="size weights, KV cache and max_num_seqs for a model on a GPU",
        description="From a Hugging Face config.json, the GPU's memory and vLLM's flags: "
        "weights, KV bytes per token, KV pool, concurrency at a context length, and a "
        "recommended max_num_seqs at 70-80 % of what memory allows, with warnings. Exits 1 "
        "when vLLM would refuse to start with these flags.",
    )
    p.add_argument(
        "model_config", metavar="CONFIG_JSON", help="path to the model's config.json, or its folder"
    )
    _add_gpu_memory(
        p,
        "the CUDA total of one GPU (NVML total less reserved), e.g. 79.1GiB",
        required=False,
    )
    gate = p.add_mutually_exclusive_group()
    gate.add_argument(
        "--deployment",
        metavar="YAML",
        help="deploy-time gate: size every vLLM container of the Deployments and StatefulSets "
        "in this Kubernetes manifest with its own serve flags, GPU count (nvidia.com/gpu) and "
        "GPU type (node label nvidia.com/gpu.product or cloud.google.com/gke-accelerator, or "
        "--gpu); exit 1 when one would not start (docs/budget.md, 'Deploy-time gate')",
    )
    gate.add_argument(
        "--serve-command",
        metavar="COMMAND",
        help="deploy-time gate for a `vllm serve ...` command line (split like a shell does, "
        "never run); the GPU from --gpu or --gpu-memory",
    )
    p.add_argument(
        "--gate-prompt-logprobs",
        action="store_true",
        help="with --deployment/--serve-command: also exit 1 when a max_model_len prompt with "
        "prompt_logprobs would not fit (the longest request the deployment allows)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help=(
            f"vLLM's --gpu-memory-utilization (default {vllm_seam.GPU_MEMORY_UTILIZATION}, "
            f"vLLM {vllm_seam.MINOR}'s)"
        ),
    )
    p.add_argument(
        "--max-model-len",
        type=_whole(1, 2147483647),
        help="vLLM's --max-model-len (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_whole(1, 2147483647),
        help="vLLM's --max-num-seqs (default: what vllm serve picks for this GPU size)",
    )
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=_whole(1, MAX_PARALLEL),
        help="vLLM's --tensor-parallel-size (default 1)",
    )
    p.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=_whole(1, MAX_PARALLEL),
        help="vLLM's -pp (default 1)",
    )
    p.add_argument(
        "-dp",
        "--data-parallel-size",
        type=_whole(1, MAX_PARALLEL),
        help="vLLM's -dp (default 1)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="spread MoE experts over TP x DP ranks, as vLLM's flag does",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM's flag)")
    p.add_argument(
        "--kv-cache-dtype",
        help="vLLM's --kv-cache-dtype: auto, fp8, fp8_e4m3, fp8_e5m2 (default auto)",
    )
    p.add_argument(
        "--block-size",
        type=_whole(1, 2**16),
        help="KV block size in tokens (default 16, 64 for MLA)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_whole(1, 2**31 - 1),
        help="largest prefill chunk, drives the activation estimate (default: vllm serve's "
        "for this GPU size)",
    )
    p.add_argument(
        "--context-len",
        type=_whole(1, 2**31 - 1),
        help="context length for the concurrency figure (default max-model-len)",
    )
    p.add_argument(
        "--weights-bytes",
        metavar="SIZE",
        help="weights per GPU, from vLLM's 'Model loading took X GiB' log line",
    )
    p.add_argument(
        "--overhead-bytes",
        metavar="SIZE",
        help="activation + non-torch memory per GPU, overriding the estimate",
    )
    p.add_argument(
        "--kv-pool-bytes",
        metavar="SIZE",
        help="KV pool per GPU from vLLM's 'Available KV cache memory' log line",
    )
    p.add_argument(
        "--sizing",
        choices=("auto", "vllm", "python"),
        default=os.environ.get("OOMGUARD_SIZING", "auto"),
        help="who sizes the KV cache: vLLM's own code (built on the meta device, no GPU; "
        "auto: where vLLM is importable) or the pure-Python reader (default $OOMGUARD_SIZING "
        "or auto)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run_budget)


def _add_gpu_memory(p: argparse.ArgumentParser, size_help: str, required: bool = True) -> None:
    """--gpu NAME or --gpu-memory SIZE, one of them (required unless a deployment names it)."""
    from oomguard.gpus import GPUS

    gpu = p.add_mutually_exclusive_group(required=required)
    gpu.add_argument(
        "--gpu",
        type=_known_gpu,
        metavar="{" + ",".join(sorted(GPUS)) + "}",
        help="a known GPU's memory (any letter case)",
    )
    gpu.add_argument("--gpu-memory", metavar="SIZE", help=size_help)


def _known_gpu(text: str) -> str:
    """A known GPU's name in any letter case ('h100' is 'H100')."""
    from oomguard.gpus import GPUS, lookup

    spec = lookup(text)
    if spec is None:
        raise argparse.ArgumentTypeError(
            f"unknown GPU {text[:40]!r}: one of {', '.join(sorted(GPUS))}, or give --gpu-memory"
        )
    return spec.key


def _gib(value: float) -> str:
    return f"{value / 1024**3:,.2f} GiB"


def _emit(text: str) -> None:
    """Write a command's report to stdout. A reader that stops early (`| head -1`) closes the
    pipe: not an error, so the rest is dropped quietly and the command keeps its exit status."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _size_with_vllm(
    config: dict[str, Any], quant: dict[str, Any] | None, shape: Any, inputs: Any, budget: Any
) -> Any:
    """The budget with vLLM's own figures: its weights (parameter shapes on the meta device)
    where they are CUDA's, the pool they leave, and its planner's blocks, tokens and refusal."""
    from oomguard.sizing import vllm_path
    from oomguard.sizing.budget import compute, vision_weights_per_gpu

    extra = vision_weights_per_gpu(shape, inputs)
    if budget.pool_source == "vLLM log":
        pool: dict[str, Any] = {"available": [budget.kv_pool_bytes_per_gpu]}
    else:
        before = int(inputs.gpu_memory_bytes * inputs.gpu_memory_utilization)
        pool = {
            "pool_before_weights": before - budget.overhead_bytes_per_gpu,
            "fallback_weights": budget.weights_bytes_per_gpu,
            "extra_weights": extra,
        }
    (sizing,) = vllm_path.run(
        [
            vllm_path.job(
                config,
                max_model_len=budget.max_model_len,
                max_num_batched_tokens=budget.max_num_batched_tokens,
                tensor_parallel_size=inputs.tensor_parallel_size,
                kv_cache_dtype=inputs.kv_cache_dtype,
                block_size=inputs.block_size,
                async_scheduling=inputs.async_scheduling,
                hf_quant_config=quant,
                **pool,
            )
        ]
    )
    if sizing.ok and sizing.weights_bytes_per_gpu is not None and inputs.weights_bytes is None:
        theirs = sizing.weights_bytes_per_gpu + extra
        ours = budget.weights_bytes_per_gpu
        budget = compute(shape, inputs, vllm_weights=theirs)
        if abs(theirs - ours) > 0.01 * theirs:
            budget.notes.append(
                f"weights: the pure-Python reader's {ours / 1024**3:,.2f} GiB differs from "
                f"vLLM's parameter shapes ({theirs / 1024**3:,.2f} GiB): vLLM's are used"
            )
    vllm_path.apply(budget, sizing)
    return budget


# the serve flags `budget` takes, and vLLM's default for each (a deployment brings its own)
SERVE_FLAG_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": vllm_seam.GPU_MEMORY_UTILIZATION,
    "max_model_len": None,
    "max_num_seqs": None,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "enable_expert_parallel": False,
    "enforce_eager": False,
    "kv_cache_dtype": "auto",
    "block_size": None,
    "max_num_batched_tokens": None,
}


def _model_config(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """config.json (and a modelopt checkpoint's hf_quant_config.json beside it)."""
    path = Path(args.model_config)
    quant: dict[str, Any] | None = None
    if path.is_dir():
        # a modelopt checkpoint keeps its quantization (and KV cache dtype) beside config.json
        quant_file = path / "hf_quant_config.json"
        if quant_file.is_file():
            try:
                loaded = bounded.read_json(quant_file, MODEL_CONFIG_LIMITS)
            except bounded.InputError as exc:
                raise BudgetError(str(exc)) from None
            if not isinstance(loaded, dict):
                raise BudgetError(f"{quant_file} is not a JSON object")
            quant = loaded
        path = path / "config.json"
    try:
        config = bounded.read_json(path, MODEL_CONFIG_LIMITS)
    except bounded.InputError as exc:  # a FIFO, bad UTF-8, deep nesting, 5,000 digits...
        raise BudgetError(str(exc)) from None
    if not isinstance(config, dict):
        raise BudgetError(f"{path} is not a JSON object")
    return config, quant


def _budget_inputs(args: argparse.Namespace, memory: int, gpu: str, serve: dict[str, Any]) -> Any:
    from oomguard.sizing.budget import BudgetInputs
    from oomguard.units import parse_size

    try:
        size = lambda v: parse_size(v) if v else None  # noqa: E731
        return BudgetInputs(
            gpu_memory_bytes=memory,
            gpu_name=gpu,
            context_len=args.context_len,
            weights_bytes=size(args.weights_bytes),
            overhead_bytes=size(args.overhead_bytes),
            kv_pool_bytes=size(args.kv_pool_bytes),
            **{**SERVE_FLAG_DEFAULTS, **serve},
        )
    except ValueError as exc:
        raise BudgetError(str(exc)) from exc


def _sized(
    args: argparse.Namespace, config: dict[str, Any], quant: dict[str, Any] | None, inputs: Any
) -> Any:
    """The budget, by vLLM's own code where it is wanted and importable."""
    from oomguard.sizing import vllm_path
    from oomguard.sizing.budget import compute
    from oomguard.sizing.model import shape_from_hf_config, with_hf_quant_config

    shape = shape_from_hf_config(with_hf_quant_config(config, quant))
    budget = compute(shape, inputs)
    use_vllm = args.sizing == "vllm" or (args.sizing == "auto" and vllm_path.vllm_importable())
    if use_vllm and inputs.pipeline_parallel_size == 1:
        budget = _size_with_vllm(config, quant, shape, inputs, budget)
    elif use_vllm:
        budget.notes.append("pipeline parallelism: the pure-Python reader sized this")
    return budget


def _run_budget(args: argparse.Namespace) -> int:
    from oomguard.gpus import GPUS
    from oomguard.units import parse_size

    serve = {
        k: getattr(args, k) for k in SERVE_FLAG_DEFAULTS if getattr(args, k) not in (None, False)
    }
    if args.deployment or args.serve_command:
        return _run_gate(args, serve)
    if args.gate_prompt_logprobs:
        raise BudgetError("--gate-prompt-logprobs goes with --deployment or --serve-command")
    if not (args.gpu or args.gpu_memory):
        raise BudgetError("give the GPU: --gpu NAME or --gpu-memory SIZE")
    config, quant = _model_config(args)
    try:
        memory = GPUS[args.gpu].cuda_total_bytes if args.gpu else parse_size(args.gpu_memory)
    except ValueError as exc:
        raise BudgetError(str(exc)) from exc
    inputs = _budget_inputs(args, memory, args.gpu or "", serve)
    budget = _sized(args, config, quant, inputs)
    # A pipeline can gate on it: 1 when vLLM would refuse to start with these flags.
    status = 1 if budget.will_not_start else 0
    if args.json:
        _emit(json.dumps(budget.to_dict(), indent=2))
        return status
    _emit("\n".join(_budget_lines(budget, memory, inputs)))
    return status


def _budget_lines(budget: Any, memory: int, inputs: Any) -> list[str]:
    if budget.will_not_start:
        recommended = f"none: vLLM will not start ({budget.will_not_start})"
    else:
        recommended = (
            f"{budget.recommended_max_num_seqs} "
            f"(70-80 %: {budget.recommended_range[0]}-{budget.recommended_range[1]})"
        )
    rows = [
        ("device memory (CUDA total)", _gib(memory)),
        ("gpu_memory_utilization", f"{inputs.gpu_memory_utilization:.2f}"),
        (f"weights per GPU ({budget.weights_source})", _gib(budget.weights_bytes_per_gpu)),
        ("non-KV (profile) per GPU", _gib(budget.overhead_bytes_per_gpu)),
        *((f"  {k}", _gib(v)) for k, v in budget.overhead_parts.items()),
        (f"KV pool per GPU ({budget.pool_source})", _gib(budget.kv_pool_bytes_per_gpu)),
        ("KV bytes per token (model)", f"{budget.kv_bytes_per_token:,} B"),
        ("KV bytes per token (per GPU)", f"{budget.kv_bytes_per_token_per_gpu:,} B"),
        ("KV tokens (vLLM's 'GPU KV cache size')", f"{budget.kv_pool_tokens:,}"),
        ("KV blocks / cache groups", f"{budget.num_blocks:,} / {budget.kv_cache_groups}"),
        ("max_model_len", f"{budget.max_model_len:,}"),
        (f"concurrency at {budget.context_len:,} tokens", f"{budget.concurrency_at_context:,.1f}"),
        ("max_num_seqs", f"{budget.max_num_seqs}"),
        ("recommended max_num_seqs", recommended),
        (
            "longest prompt_logprobs prompt",
            f"{budget.longest_prompt_logprobs_prompt:,} tokens (a {budget.max_num_batched_tokens:,}"
            f"-token chunk holds {_gib(budget.prompt_logprobs_chunk_bytes)} of logits)",
        ),
        ("sized by", "vLLM's own code" if budget.sizing_path == "vllm" else "pure Python"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"assumed: {a}" for a in budget.assumptions]
    lines += [f"note: {n}" for n in budget.notes]
    lines += [f"warning: {w}" for w in budget.warnings]
    return lines


def _run_gate(args: argparse.Namespace, cli_serve: dict[str, Any]) -> int:
    """The deploy-time gate: each workload of a manifest (or one command line) on each GPU it
    may be scheduled on. Exit 0: every one starts (and, with --gate-prompt-logprobs, takes a
    max_model_len prompt with prompt_logprobs); 1: one would not; 2: one cannot be sized."""
    from oomguard.sizing import gate

    if cli_serve:
        raise BudgetError(
            "with --deployment or --serve-command the serve flags come from the deployment: "
            f"drop {', '.join('--' + k.replace('_', '-') for k in sorted(cli_serve))}"
        )
    config, quant = _model_config(args)
    results = gate.evaluate(
        args,
        config,
        quant,
        inputs_for=lambda memory, gpu, serve: _budget_inputs(args, memory, gpu, serve),
        size=lambda inputs: _sized(args, config, quant, inputs),
    )
    status = max(r.status for r in results)
    if args.json:
        doc = {
            "schema_version": 2,
            "exit_code": status,
            "workloads": [r.to_dict() for r in results],
        }
        _emit(json.dumps(doc, indent=2))
        return status
    out: list[str] = []
    for r in results:
        out.append(f"== {r.headline()}")
        if r.budget is not None:
            out += _budget_lines(r.budget, r.memory, r.inputs)
        out += [f"gate: {n}" for n in [*r.workload.notes, *r.notes]]
    _emit("\n".join(out))
    return status


# -- preflight ----------------------------------------------------------------------------------
def _add_preflight(sub: Any) -> None:
    from oomguard.contract import HANDOFF_DIR

    p = sub.add_parser(
        "preflight",
        help="the longest prompt at max batch against a live vLLM, stopping before danger",
        description="Ramp prompt length (with prompt_logprobs) and concurrency against a vLLM "
        "server with the oomguard plugin, watching the allocator's peak, retries and OOMs in "
        "the hand-off directory; stop a margin before the device is full. Report the largest "
        "safe load, the headroom at the peak and recommended flags. Exit 0: safe at the target "
        "load; 1: a limit below it, or a failure; 2: the preflight could not run.",
    )
    p.add_argument("url", metavar="URL", help="the vLLM API server, e.g. http://127.0.0.1:8000")
    _add_gpu_memory(
        p,
        "the CUDA total of one GPU (NVML total less reserved), e.g. 79.1GiB: the same meaning "
        "as budget's",
    )
    p.add_argument(
        "--driver-reserved",
        metavar="SIZE",
        help="NVML's reserved memory of the --gpu given, where this driver reserves another "
        "figure (nvidia-smi -q; default: the table's)",
    )
    p.add_argument(
        "--allocator-dir",
        default=HANDOFF_DIR,
        help=f"hand-off directory the ranks publish allocator stats into (default {HANDOFF_DIR})",
    )
    p.add_argument(
        "--margin", metavar="SIZE", default="256MiB", help="stop this far below the device"
    )
    p.add_argument(
        "--max-concurrency",
        type=_whole(1, 2**16),
        default=256,
        help="phase B's ceiling (default 256)",
    )
    p.add_argument(
        "--target-prompt-len", type=_whole(1, 2**31 - 1), help="default: max_model_len - 1"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_preflight)


def _run_preflight(args: argparse.Namespace) -> int:
    from oomguard.gpus import GPUS
    from oomguard.sizing.preflight import PreflightError, Settings, render, run
    from oomguard.units import parse_size

    try:
        # One meaning of --gpu-memory across commands: the CUDA total (NVML total less the
        # driver's reserved part), the figure vLLM multiplies by gpu_memory_utilization.
        if args.gpu:
            device, reserved = GPUS[args.gpu].total_bytes, GPUS[args.gpu].reserved_bytes
        else:
            device, reserved = parse_size(args.gpu_memory), 0
        if args.driver_reserved:
            if not args.gpu:
                raise ValueError(
                    "--driver-reserved goes with --gpu: --gpu-memory is the CUDA total, "
                    "the driver's reserved part already taken off"
                )
            reserved = parse_size(args.driver_reserved)
        settings = Settings(
            url=args.url.rstrip("/"),
            device_bytes=device,
            driver_reserved_bytes=reserved,
            allocator_dir=args.allocator_dir,
            margin_bytes=parse_size(args.margin),
            max_concurrency=args.max_concurrency,
            target_prompt_len=args.target_prompt_len,
        )
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc
    if not args.url.startswith(("http://", "https://")):
        raise PreflightError(f"URL must start with http:// or https://, got {_shown(args.url)}")
    try:
        parts = urlsplit(args.url)
        parts.port  # noqa: B018 (it raises on a port out of range)
    except ValueError as exc:
        raise PreflightError(f"URL {_shown(args.url)}: {exc}") from None
    if not parts.hostname:
        raise PreflightError(f"URL {_shown(args.url)} names no host")
    if args.max_concurrency < 1 or (args.target_prompt_len or 1) < 1:
        raise PreflightError("--max-concurrency and --target-prompt-len must be at least 1")
    _check_dir("--allocator-dir", args.allocator_dir)
    if args.gpu and GPUS[args.gpu].reserved_estimated and not args.driver_reserved:
        print(f"note: {GPUS[args.gpu].provenance}", file=sys.stderr, flush=True)
    report = run(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    _emit(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return report.exit_code


# -- incidents ----------------------------------------------------------------------------------
def _one_line_errors(p: argparse.ArgumentParser) -> None:
    """This (sub)command's usage mistakes (unknown flags included) as one line and exit 2."""

    def error(message: str) -> Any:
        print(_one_line(f"{p.prog}: {message}"), file=sys.stderr)
        sys.exit(2)

    parse_known = p.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = parse_known(args, namespace)
        if extra:
            error(f"unrecognized arguments: {' '.join(extra)[:200]}")
        return parsed, extra

    p.error = error  # type: ignore[method-assign]
    p.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _add_incidents(sub: Any) -> None:
    p = sub.add_parser(
        "incidents",
        help="list and explain OOM incidents, each with its type, evidence and fix",
        description="Read the incident records the vLLM plugin's OOM observer and `oomguard "
        "serve` write, join them and classify each incident into the field's taxonomy (1 "
        "startup, 2 long prompt, 3 under load, 4 after hours, 5 host OOM, 6 not an OOM). "
        "Refused (malformed, hostile) files are counted, never read twice.",
    )
    p.add_argument(
        "directory",
        nargs="?",
        metavar="DIR",
        help="incident directory (default $OOMGUARD_INCIDENT_DIR, else "
        "$OOMGUARD_ALLOCATOR_DIR/incidents, else /run/oomguard/allocator/incidents)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--since", metavar="WHEN", help="only incidents since: 90s, 30m, 2h, 7d or an ISO time"
    )
    p.add_argument(
        "--dcgm-file",
        metavar="FILE",
        help="a saved dcgm-exporter scrape: its XID counts (DCGM_EXP_XID_ERRORS_COUNT), taken "
        "as seen at the file's modification time, can make a crash 'not an OOM' (type 6)",
    )
    p.set_defaults(func=_run_incidents)


def _run_incidents(args: argparse.Namespace) -> int:
    import os

    from oomguard.forensics.incidents import incidents, parse_since, render_text
    from oomguard.forensics.incidents import to_json as incidents_json
    from oomguard.forensics.reader import IncidentDirError, load

    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    xids = []
    if args.dcgm_file:
        from oomguard.errors import CollectorError
        from oomguard.exporter.collectors.dcgm import XID_COUNT, _read_file, xids_from_text
        from oomguard.exporter.scrape import DEFAULT_MAX_BYTES
        from oomguard.exporter.textparse import parse

        try:
            text = _read_file(args.dcgm_file, DEFAULT_MAX_BYTES)
        except CollectorError as exc:  # the reader's message names the file
            raise ConfigError(f"--dcgm-file {exc}") from None
        try:
            if not parse(text).samples:  # every line checked; a page of none is no scrape
                raise CollectorError("no_data", "no samples")
            xids = xids_from_text(text, os.stat(args.dcgm_file).st_mtime)
            counted = bool(parse(text, (XID_COUNT,)).get(XID_COUNT))
        except CollectorError as exc:
            raise ConfigError(
                f"--dcgm-file {args.dcgm_file}: not a dcgm-exporter scrape ({exc})"
            ) from None
        except OSError as exc:
            raise ConfigError(f"--dcgm-file {args.dcgm_file}: {exc.strerror or exc}") from None
        if not counted:  # dcgm-exporter's shipped counters CSV leaves the XID count out
            print(
                f"oomguard incidents: note: {args.dcgm_file} has no {XID_COUNT} series (add it "
                "to dcgm-exporter's counters CSV): XIDs not checked",
                file=sys.stderr,
            )
    from oomguard.vllm_plugin.oom import directories

    directory = args.directory or directories()[1]
    try:
        loaded = load(directory, missing_ok=False)
    except IncidentDirError as exc:
        if args.directory or exc.reason != "not_found":
            raise ConfigError(str(exc)) from None
        # The default directory appears with the first OOM record: a healthy box has none yet.
        # Not an error (a script or a cron job must not page for it); DIR that is missing is.
        print(
            f"oomguard incidents: nothing recorded yet: {directory} does not exist (it appears "
            "with the first OOM record; pass DIR or set OOMGUARD_INCIDENT_DIR where the engines "
            "write theirs)",
            file=sys.stderr,
        )
        loaded = load(directory, missing_ok=True)
    found = incidents(loaded, xids)
    if since is not None:
        found = [i for i in found if i.timestamp >= since]
    out = incidents_json(found, loaded.invalid) if args.json else render_text(found, loaded.invalid)
    _emit(out.rstrip("\n"))
    return 0


# -- generate -----------------------------------------------------------------------------------
def _add_generate(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="write the alert rules, dashboards and Alertmanager/Prometheus configs",
        description="Regenerate every generated file from the metric catalog and thresholds. "
        "With --check, write nothing and exit 1 if a committed file differs.",
    )
    p.add_argument("--root", default=".", help="repository root to write into (default .)")
    p.add_argument("--check", action="store_true", help="only report drift, exit 1 if any")
    p.add_argument(
        "--thresholds",
        metavar="FILE",
        help="YAML overriding alert thresholds (see core/oomguard/thresholds.py "
        "AlertThresholds); the committed files use the defaults",
    )
    p.set_defaults(func=_run_generate)


def generated_files(thresholds: Any = None) -> dict[Path, str]:
    """Every generated file and its content, from the alert and dashboard generators."""
    from oomguard.alerts.generate import ALERTMANAGER, RULES
    from oomguard.alerts.generate import outputs as alert_outputs
    from oomguard.dashboards.generate import GENERATED
    from oomguard.dashboards.generate import outputs as dashboard_outputs
    from oomguard.manifests.kubernetes import outputs as manifest_outputs

    alerts, dashboards = alert_outputs(thresholds), dashboard_outputs(thresholds)
    manifests = manifest_outputs(
        alerts[RULES],
        alerts[ALERTMANAGER],
        {str(p): text for p, text in dashboards.items() if p.parent == GENERATED},
        thresholds,
    )
    from oomguard.singlebox import outputs as single_box_outputs

    return {**alerts, **dashboards, **manifests, **single_box_outputs()}


def benchmark_docs(root: Path) -> dict[Path, str]:
    """docs/benchmarks.md from the recorded results, where `root` is a checkout with bench/.

    bench/report.py lives beside the results it reads, outside the package (a wheel has neither),
    so it is loaded from the checkout by path. Every figure on the page comes from those files.
    """
    script = root / "bench" / "report.py"
    if not script.is_file():
        return {}
    spec = importlib.util.spec_from_file_location("oomguard_bench_report", script)
    if spec is None or spec.loader is None:
        return {}
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    outputs: dict[Path, str] = module.outputs(root)
    return outputs


def _run_generate(args: argparse.Namespace) -> int:
    from oomguard.alerts.generate import docs_outputs as alert_docs
    from oomguard.config import load_yaml, validate
    from oomguard.generated import sync
    from oomguard.thresholds import AlertThresholds

    thresholds = None
    if args.thresholds:
        thresholds = validate(AlertThresholds, load_yaml(args.thresholds), args.thresholds)
    _check_dir("--root", args.root)
    root = Path(args.root)
    try:
        files = {
            **generated_files(thresholds),
            **alert_docs(root, thresholds),
            **benchmark_docs(root),
        }
        drift = sync(root, files, check=args.check)
    except OSError as exc:  # a file in the tree that cannot be written (or read)
        raise ConfigError(f"--root {args.root}: {exc}") from None
    except (KeyError, ValueError) as exc:  # bench/results or the page's template: one line
        raise ConfigError(f"--root {args.root}: docs/benchmarks.md: {exc}") from None
    for path in drift:
        print(f"{'differs' if args.check else 'wrote'}: {path}")
    return 1 if args.check and drift else 0


# -- demo ---------------------------------------------------------------------------------------
def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="replay a GPU memory incident with and without oomguard, no GPU needed",
        description="Replay the same seeded GPU memory incident on real vLLM servers (model-free "
        "executor, twin GPUs) twice at once: vLLM alone (it hits a CUDA OOM and reloads) and "
        "vLLM with oomguard (exporter, Prometheus and Alertmanager with the generated rules, "
        "remediator); beside them a healthy 24 GB GPU at gpu_memory_utilization 0.92 under heavy "
        "load that oomguard must leave alone. Shows both runs live and writes a one-page HTML "
        "report. Needs vLLM (make demo installs it).",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: a shorter healthy segment, no waiting for the crashed engine's reload",
    )
    p.add_argument(
        "--report",
        default="demo-report",
        metavar="DIR",
        help="folder for report.html, summary.md, summary.json, the PNGs and the audit log",
    )
    p.add_argument(
        "--no-prometheus",
        action="store_true",
        help="skip Prometheus and Alertmanager even when installed (no dashboards in the report)",
    )
    p.add_argument(
        "--router",
        choices=("gateway", "vllm-router", "nginx"),
        default="gateway",
        help="what is in front of each fleet's engines: the twin's gateway, or vllm-router or "
        "nginx as docs/vllm-plugin.md configures them (needs them installed)",
    )
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    import shutil

    from oomguard.lab.demo import Options, run

    _check_dir("--report", args.report, create=True)  # before minutes of demo, not after
    if shutil.which("vllm", path=str(Path(sys.executable).parent)) is None:
        raise ConfigError(
            "vLLM is not installed in this environment: run `make demo`, which "
            f"installs vllm=={vllm_seam.newest().VERSION} for the CPU"
        )
    return run(
        Options(
            report_dir=Path(args.report),
            prometheus=not args.no_prometheus,
            quick=args.quick,
            router=args.router,
        )
    )


# -- remediator ---------------------------------------------------------------------------------
def _add_remediator(sub: Any) -> None:
    p = sub.add_parser(
        "remediator",
        help="receive Alertmanager webhooks and act on vLLM engines (or explain a payload)",
        description="Run the remediator: it receives Alertmanager webhooks (or, in standalone "
        "mode, watches exporters' pressure levels) and converges each allowlisted engine toward "
        "the state its firing alerts call for: lower the cap, drain, staged re-admission. "
        "`oomguard remediator explain` prints what it would do for one payload and acts on "
        "nothing.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="remediator YAML config")
    p.add_argument("--dry-run", action="store_true", help="decide and record, act on nothing")
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the config and its token files (in standalone mode, fetch each "
        "exporter once: it must answer with an oomguard /metrics), print one line and exit (0 "
        "valid, 2 not); starts nothing, so it runs beside a remediator that holds the port",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=_run_remediator)
    rsub = p.add_subparsers(dest="remediator_command", metavar="SUBCOMMAND")
    e = rsub.add_parser(
        "explain",
        help="print what the remediator would do for a webhook payload; changes nothing",
    )
    e.add_argument("payload", help="Alertmanager webhook JSON file, or - for stdin")
    e.add_argument(
        "--state",
        action="append",
        default=[],
        metavar="TARGET=FILE",
        help="use this saved /oomguard/v1/state JSON instead of asking the engine (repeatable)",
    )
    e.set_defaults(func=_run_remediator_explain)


def _load_remediator(args: argparse.Namespace) -> Any:
    from oomguard.remediator.config import load

    config = load(args.config)
    if args.dry_run:
        config = config.model_copy(update={"dry_run": True})
    return config


def _check_exporters(config: Any, strict: bool) -> list[str]:
    """Standalone mode: fetch each exporter once. Anything that answers but is not an oomguard
    exporter's /metrics (its HTML index, another server) is a ConfigError; an exporter that
    cannot be read is one too with `strict` (--check), else a warning (at start it may be
    coming up beside us). Returns a note per exporter."""
    from oomguard.errors import CollectorError
    from oomguard.remediator.standalone import NotAnExporter, check_exporter

    notes = []
    for i, url in enumerate(config.standalone.exporters if config.standalone else []):
        where = f"standalone.exporters.{i}"
        try:
            engines = check_exporter(url)
        except NotAnExporter as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (CollectorError, ValueError) as exc:
            if strict:
                raise ConfigError(f"{where}: cannot read {url}: {exc}") from None
            logging.getLogger("oomguard.remediator").warning(
                "%s: cannot read %s yet (%s): holding until it answers", where, url, exc
            )
            continue
        notes.append(f"{url}: {engines} engine levels")
    return notes


def _run_remediator(args: argparse.Namespace) -> int:
    config = _load_remediator(args)
    for where, path in _secret_files(config):
        _check_secret_file(where, path)
    notes = _check_exporters(config, strict=args.check) if config.mode == "standalone" else []
    if args.check:
        dry = ", dry run" if config.dry_run else ""
        read = f"; {'; '.join(notes)}" if notes else ""
        print(f"{args.config}: ok ({len(config.targets)} targets, mode {config.mode}{dry}{read})")
        return 0
    _check_listen("listen", config.listen)
    from oomguard.remediator.main import Remediator

    return Remediator(config).serve()


def _run_remediator_explain(args: argparse.Namespace) -> int:
    import json

    from oomguard.remediator.main import explain
    from oomguard.remediator.webhook import MAX_BODY_BYTES, PayloadError, parse

    config = _load_remediator(args)
    limits = bounded.Limits(max_bytes=MAX_BODY_BYTES)
    try:
        if args.payload == "-":
            body = bounded.collect([sys.stdin.buffer.read(MAX_BODY_BYTES + 1)], "stdin", limits)
        else:
            body = bounded.read_bytes(args.payload, limits)
    except bounded.InputError as exc:
        raise ConfigError(str(exc)) from None
    try:
        webhook = parse(body)
    except PayloadError as exc:
        raise ConfigError(f"{args.payload}: {exc}") from exc
    states = {}
    for item in args.state:
        try:
            name, path = _key_value(item)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"--state {item[:200]!r}: {exc}") from None
        try:
            states[name] = bounded.read_json(path)
        except bounded.InputError as exc:
            raise ConfigError(f"--state {exc}") from None
    for entry in explain(config, webhook, states or None):
        print(json.dumps(entry, sort_keys=True))
    return 0


# -- serve (the local supervisor) ---------------------------------------------------------------
def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run vLLM as a supervised child that the remediator can restart with new flags",
        description="Run `vllm serve ...` (everything after --) as a child: restart it on "
        "request with adjusted --gpu-memory-utilization/--max-num-seqs (persisted in the state "
        "directory), record why it exits, bring it back capped after a CUDA OOM, and stop "
        "restarting after a crashloop. Example: oomguard serve --token-file /etc/oomguard/"
        "supervisor-token -- vllm serve /models/llama --max-num-seqs 64",
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:9851",
        metavar="HOST:PORT",
        help="address of the supervisor's API (default %(default)s)",
    )
    p.add_argument("--token-file", metavar="FILE", help="bearer token for the supervisor's API")
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve the API without a token: only with --listen on a loopback address",
    )
    p.add_argument(
        "--state-dir",
        default=SERVE_STATE_DIR,
        metavar="DIR",
        help="flags in force (flags.json), vLLM's log, exit records (default %(default)s, the "
        "unit's StateDirectory)",
    )
    p.add_argument(
        "--max-crashes",
        type=_whole(0, 10**6),
        default=5,
        metavar="N",
        help="crashes within --crash-window before it stops restarting (default %(default)s)",
    )
    p.add_argument(
        "--crash-window",
        type=duration_arg,
        default=600.0,
        metavar="DURATION",
        help="window of --max-crashes (default 10m)",
    )
    p.add_argument(
        "--restart-delay",
        type=duration_arg,
        default=5.0,
        metavar="DURATION",
        help="wait after a crash before starting vLLM again (default 5s)",
    )
    p.add_argument(
        "--stop-timeout",
        type=duration_arg,
        default=60.0,
        metavar="DURATION",
        help="SIGTERM, then SIGKILL after this long (default 1m)",
    )
    p.add_argument(
        "--max-restarts",
        type=_whole(0, 10**6),
        default=6,
        metavar="N",
        help="requested restarts allowed within --restart-window; beyond it the API answers 429 "
        "(default %(default)s)",
    )
    p.add_argument(
        "--restart-window",
        type=duration_arg,
        default=600.0,
        metavar="DURATION",
        help="window of --max-restarts (default 10m)",
    )
    p.add_argument(
        "--keep-flags-on-crash",
        action="store_true",
        help="restart a crashed vLLM with the same flags and full admission (a plain restart "
        "policy; the default lowers the flags after a CUDA OOM and starts capped)",
    )
    p.add_argument(
        "--log-max-size",
        type=size_arg,
        default=100 * 2**20,
        metavar="SIZE",
        help="rotate vLLM's log (<state-dir>/vllm.log) when it would pass this size "
        "(default 100MiB)",
    )
    p.add_argument(
        "--log-backups",
        type=_whole(0, 1000),
        default=5,
        metavar="N",
        help="rotated logs kept: vllm.log.1 (newest) to vllm.log.N (default %(default)s)",
    )
    p.add_argument(
        "--twin-gpu",
        metavar="FILE",
        default=os.environ.get(TWIN_GPU_FILE_ENV) or None,
        help="rehearse without a GPU: run vLLM on the model-free executor over the twin GPU in "
        f"FILE (docs/twin.md; default ${TWIN_GPU_FILE_ENV})",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="(default %(default)s)",
    )
    p.add_argument("vllm", nargs=argparse.REMAINDER, help="-- vllm serve MODEL [flags...]")
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from oomguard.remediator.config import AuthConfig, is_loopback
    from oomguard.remediator.supervisor import Supervisor, serve

    argv = args.vllm[1:] if args.vllm[:1] == ["--"] else args.vllm
    if args.token_file is None and not args.allow_unauthenticated:
        raise ConfigError("give --token-file (or --allow-unauthenticated on a loopback-only box)")
    if args.allow_unauthenticated and not is_loopback(args.listen):
        # anyone who reaches the port could restart vLLM with other flags
        raise ConfigError(
            f"--allow-unauthenticated is only for a loopback --listen (127.0.0.1), not "
            f"{args.listen}: give --token-file"
        )
    if args.token_file:
        _check_secret_file("--token-file", args.token_file)
    _check_listen("--listen", args.listen)  # before vLLM starts, not after its minutes of loading
    _check_dir("--state-dir", args.state_dir, create=True)
    env: dict[str, str] = {}
    if args.twin_gpu:
        from oomguard.twin.gpufile import TwinStateError, rehearsal_command

        try:
            argv, env = rehearsal_command(argv, args.twin_gpu)
        except TwinStateError as exc:
            raise ConfigError(f"--twin-gpu {exc}") from None
        logging.getLogger("oomguard.supervisor").warning(
            "REHEARSAL: vLLM runs on the model-free executor over the twin GPU %s, not hardware",
            args.twin_gpu,
        )
    sup = Supervisor(
        argv,
        Path(args.state_dir),
        max_crashes=args.max_crashes,
        crash_window_seconds=args.crash_window,
        restart_delay=args.restart_delay,
        stop_timeout=args.stop_timeout,
        adjust_on_crash=not args.keep_flags_on_crash,
        max_restarts=args.max_restarts,
        restart_window_seconds=args.restart_window,
        log_max_bytes=args.log_max_size,
        log_backups=args.log_backups,
        env=env,
    )
    auth = AuthConfig(
        bearer_token_file=args.token_file, allow_unauthenticated=args.allow_unauthenticated
    )
    return serve(sup, args.listen, auth)


# -- status -------------------------------------------------------------------------------------
def _add_status(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="every engine's level, cap, mode and the remediator's decision, at a glance",
        description="Read the exporter's /metrics, each engine's /oomguard/v1/state, each "
        "supervisor's /v1/status and the remediator's /v1/targets (with the tokens the "
        "remediator's config names) and show, per target: the pressure level and its reason, "
        "the cap and mode, the remediator's last decision and any hold or limit. Parts that "
        "cannot be read are shown as such. The first thing to run (docs/single-box.md). Exit "
        "status: 0 all read and nothing needs attention, 1 something does, 2 a usage error.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="the remediator's config: its address and token, every target's URL, plugin "
        "token and supervisor (default /etc/oomguard/remediator.yaml when it exists)",
    )
    p.add_argument(
        "--exporter",
        action="append",
        default=[],
        metavar="URL",
        help="an exporter's /metrics; repeat for a fleet (default: the config's standalone "
        "exporters, else the one whose exporter.yaml sits beside the config, else "
        "http://127.0.0.1:9848/metrics)",
    )
    p.add_argument(
        "--remediator",
        metavar="URL",
        help="the remediator's base URL (default: from the config's listen)",
    )
    p.add_argument("--remediator-token-file", metavar="FILE", help="(default: the config's)")
    p.add_argument(
        "--engine",
        action="append",
        type=_key_value,
        default=[],
        metavar="NAME=URL",
        help="a vLLM server's base URL under its target name (without --config); repeatable",
    )
    p.add_argument("--plugin-token-file", metavar="FILE", help="the plugin's token, for --engine")
    p.add_argument(
        "--supervisor",
        action="append",
        type=_key_value,
        default=[],
        metavar="NAME=URL",
        help="an `oomguard serve` API under its target name (without --config); repeatable",
    )
    p.add_argument("--supervisor-token-file", metavar="FILE", help="for --supervisor")
    p.add_argument(
        "--timeout",
        type=duration_arg,
        default=2.0,
        metavar="DURATION",
        help="per part: its whole answer, however slowly it trickles (default 2s)",
    )
    p.add_argument(
        "--wait",
        type=duration_arg,
        metavar="DURATION",
        help="read again every 5 s until nothing needs attention, for at most this long (after "
        "a start or a deploy: `--wait 2m`); prints the last reading",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    import time

    import httpx

    from oomguard import status

    # what the command line gives is checked now (a usage error, exit 2); what the parts answer,
    # and the token files the config names, are shown in the report
    for url in args.exporter:
        _check_url("--exporter", url)
    if args.remediator:
        _check_url("--remediator", args.remediator)
    for flag, pairs in (("--engine", args.engine), ("--supervisor", args.supervisor)):
        if pairs and args.config:
            raise ConfigError(f"{flag} is for a box without --config: the config names them")
        for name, url in pairs:
            if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
                raise ConfigError(
                    f"{flag} {_shown(name)}: a target name is 1-64 of A-Za-z0-9_.:- (the "
                    "exporter's target label)"
                )
            _check_url(f"{flag} {name}:", url)
    for flag, path in (
        ("--remediator-token-file", args.remediator_token_file),
        ("--plugin-token-file", args.plugin_token_file),
        ("--supervisor-token-file", args.supervisor_token_file),
    ):
        if path is not None:
            _check_secret_file(flag, path)
    config_path = args.config
    if config_path is None and not args.engine and Path(status.DEFAULT_CONFIG).exists():
        config_path = status.DEFAULT_CONFIG
    if config_path:
        from oomguard.config import load_yaml, validate
        from oomguard.remediator.config import RemediatorConfig

        config = validate(RemediatorConfig, load_yaml(config_path), config_path)
        plan = status.plan_from_config(
            config, args.exporter, args.remediator, args.remediator_token_file, config_path
        )
    else:
        sups = dict(args.supervisor)
        names = [n for n, _ in args.engine] + [n for n in sups if n not in dict(args.engine)]
        engines = dict(args.engine)
        plan = status.Plan(
            args.exporter or [status.DEFAULT_EXPORTER],
            status.Endpoint(args.remediator, args.remediator_token_file)
            if args.remediator
            else None,
            [
                status.TargetSpec(
                    name,
                    engines.get(name, ""),
                    {"target": name},
                    status.Endpoint(engines[name], args.plugin_token_file)
                    if name in engines
                    else None,
                    status.Endpoint(sups[name], args.supervisor_token_file)
                    if name in sups
                    else None,
                )
                for name in names
            ],
        )
    deadline = time.monotonic() + (args.wait or 0.0)
    with httpx.Client(timeout=args.timeout) as client:
        report = status.build(plan, client)
        while status.exit_status(report) and time.monotonic() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
            report = status.build(plan, client)
    _emit(status.to_json(report) if args.json else status.render_text(report))
    return status.exit_status(report)


# -- twin-gpu (a twin GPU's state file, for rehearsals) ------------------------------------------
def _add_twin_gpu(sub: Any) -> None:
    p = sub.add_parser(
        "twin-gpu",
        help="create or change a twin GPU's state file (rehearse the stack without a GPU)",
        description="Write the state file of a twin GPU that `oomguard exporter --twin-gpu "
        "FILE` and `oomguard serve --twin-gpu FILE` run on (docs/twin.md): create it, or change "
        "what is given and keep the rest. --neighbour starts, grows or ends (0) another "
        "process's memory on the GPU, as a real incident does. Prints the state.",
    )
    p.add_argument("file", metavar="FILE", help="the state file (created if missing)")
    p.add_argument("--gpu", help="twin GPU model, e.g. H100, L4, A100-80GB (default H100)")
    p.add_argument("--neighbour", type=size_arg, metavar="SIZE", help="e.g. 7GiB; 0 ends it")
    p.add_argument("--fragmentation", type=size_arg, metavar="SIZE", help="e.g. 2GiB; 0: none")
    p.add_argument(
        "--model",
        help="serve this twin model (llama-3-8b, tiny-llama) or folder in place of the "
        "command's; '' to serve the command's own folder",
    )
    p.set_defaults(func=_run_twin_gpu)


def _run_twin_gpu(args: argparse.Namespace) -> int:
    import dataclasses

    from oomguard.twin.gpufile import TwinState, TwinStateError, parse_state, read_state
    from oomguard.twin.gpufile import write_state as write

    path = Path(args.file)
    try:
        state = read_state(path) if path.exists() else TwinState()
        changes = {
            "gpu": args.gpu,
            "neighbour_bytes": args.neighbour,
            "fragmentation_bytes": args.fragmentation,
            "model": args.model,
        }
        state = dataclasses.replace(state, **{k: v for k, v in changes.items() if v is not None})
        state = parse_state(dataclasses.asdict(state), str(path))  # the same checks as readers
        write(path, state)
    except TwinStateError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    _emit(json.dumps(dataclasses.asdict(state), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oomguard",
        description="Keep vLLM GPU serving out of out-of-memory crashes.",
    )
    parser.add_argument("--version", action="version", version=f"oomguard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_status(sub)  # the first thing to run: first in --help
    _add_exporter(sub)
    _add_budget(sub)
    _add_preflight(sub)
    _add_generate(sub)
    _add_demo(sub)
    _add_remediator(sub)
    _add_serve(sub)
    _add_incidents(sub)
    _add_twin_gpu(sub)
    for each in _parsers(parser):
        _one_line_errors(each)
    return parser


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and every (nested) subcommand parser under it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to one parser
                found += _parsers(child)
    return found


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape is noise
    try:
        return int(args.func(args))
    except (ConfigError, BudgetError, bounded.InputError) as exc:
        # one line: a message quoting a file's content must not spill over several
        print(_one_line(f"oomguard {args.command}: {exc}"), file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = _EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(
            f"oomguard {args.command}: needs the Python package {exc.name!r}: "
            f"pip install 'oomguard[{extra}]'",
            file=sys.stderr,
        )
        return 2


# Optional packages and the extra (pyproject.toml) that installs each.
_EXTRAS = {
    "apscheduler": "remediator",
    "kubernetes": "kubernetes",
    "grafanalib": "generate",
    "matplotlib": "demo",
}


if __name__ == "__main__":
    sys.exit(main())
