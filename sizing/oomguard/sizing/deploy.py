"""The deploy-time gate's inputs: a Kubernetes Deployment/StatefulSet or a `vllm serve` command
line, read as vLLM would read its flags, never run.

- `parse_serve(argv)`: the model and the serve flags that size memory, from a `vllm serve`
  argument vector (`vllm serve MODEL --flag v`, `python -m vllm.entrypoints.openai.api_server
  --model MODEL ...`), `--flag=v` and `--flag v` alike, underscores or dashes (vLLM's
  FlexibleArgumentParser takes both), vLLM's human-readable integers (`32k`, `1M`);
- `from_command_line(text)`: the same from one command-line string, split with `shlex` (no
  shell: nothing is expanded or executed);
- `from_manifest(path)`: every vLLM container of every Deployment or StatefulSet in a YAML file
  (several documents), read through `oomguard.bounded`: its command and args as Kubernetes
  joins them (`$(VAR)` from the container's literal `env` values), the GPU count from
  `resources.limits["nvidia.com/gpu"]`, and the GPU type from the pod's `nodeSelector` or
  required node affinity (`nvidia.com/gpu.product`, GKE's `cloud.google.com/gke-accelerator`).

Flags that change memory in ways `budget` does not model (speculative decoding, CPU offload, a
KV connector, a block-count override, online quantization, FP32) make the workload unsizable
with the reason: a gate must not pass what it cannot size.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from oomguard import bounded, vllm_seam
from oomguard.errors import BudgetError

# A manifest is text an operator writes: generous, but bounded.
MANIFEST_LIMITS = bounded.Limits(max_bytes=4 * bounded.MIB, max_depth=64)
MAX_ARGS = 4096  # arguments in one command line
MAX_GPUS = 4096

# serve flag -> (BudgetInputs field, kind). Kinds: int (vLLM's human-readable integers), float,
# str, bool (`--x`, `--no-x`, `--x=true`), size (bytes).
SIZING_FLAGS: dict[str, tuple[str, str]] = {
    "tensor-parallel-size": ("tensor_parallel_size", "int"),
    "pipeline-parallel-size": ("pipeline_parallel_size", "int"),
    "data-parallel-size": ("data_parallel_size", "int"),
    "enable-expert-parallel": ("enable_expert_parallel", "bool"),
    "max-model-len": ("max_model_len", "int"),
    "gpu-memory-utilization": ("gpu_memory_utilization", "float"),
    "max-num-seqs": ("max_num_seqs", "int"),
    "max-num-batched-tokens": ("max_num_batched_tokens", "int"),
    "kv-cache-dtype": ("kv_cache_dtype", "str"),
    "block-size": ("block_size", "int"),
    "enforce-eager": ("enforce_eager", "bool"),
    "async-scheduling": ("async_scheduling", "bool"),
    "kv-cache-memory-bytes": ("kv_pool_bytes", "int"),
}
SHORT = {
    "-tp": "tensor-parallel-size",
    "-pp": "pipeline-parallel-size",
    "-dp": "data-parallel-size",
}
# Flags whose memory this budget does not model: the workload is not sized, and says why.
UNMODELLED = {
    "speculative-config": "speculative decoding adds a draft model and its KV cache",
    "cpu-offload-gb": "CPU offload moves weights off the GPU",
    "kv-transfer-config": "a KV connector changes the pool (vLLM issue 21348)",
    "num-gpu-blocks-override": "a block-count override replaces the pool vLLM would size",
    "quantization": "online quantization changes the weights from the checkpoint's",
}
# Boolean flags that take no value (so the next word is not theirs).
BOOLEAN = {
    "enable-expert-parallel",
    "enforce-eager",
    "async-scheduling",
    "trust-remote-code",
    "enable-prefix-caching",
    "enable-chunked-prefill",
    "disable-log-requests",
    "disable-log-stats",
    "enable-auto-tool-choice",
    "skip-tokenizer-init",
    "enable-lora",
    "disable-custom-all-reduce",
    "disable-hybrid-kv-cache-manager",
}
DTYPES_MODELLED = {"auto", "bfloat16", "bf16", "float16", "half", "fp16"}
# node labels naming the GPU; the GPU table (oomguard.gpus.lookup) knows both kinds of value
GPU_LABELS = ("nvidia.com/gpu.product", "cloud.google.com/gke-accelerator")


@dataclass
class Workload:
    """One vLLM engine to size: where it came from, its model and serve flags, its GPUs."""

    source: str
    model: str
    flags: dict[str, Any] = field(default_factory=dict)  # BudgetInputs fields
    max_model_len_auto: bool = False
    gpus: int | None = None  # GPUs the pod asks for (nvidia.com/gpu)
    gpu_labels: list[str] = field(default_factory=list)  # node label values naming the GPU
    unsizable: str = ""  # why this workload cannot be sized ("" when it can)
    notes: list[str] = field(default_factory=list)


def _human_int(text: str, flag: str) -> int:
    """vLLM's human-readable integer: 1k = 1,000, 1K = 1,024 (vllm/utils/argparse_utils.py)."""
    m = re.fullmatch(r"(\d{1,15})(?:\.(\d{1,6}))?([kKmMgGtT]?)", text.strip())
    if not m:
        raise BudgetError(f"--{flag} {text[:40]!r}: not a whole number")
    whole, frac, suffix = m.groups()
    if not suffix:
        if frac:
            raise BudgetError(f"--{flag} {text[:40]!r}: not a whole number")
        return int(whole)
    if suffix.isupper():
        if frac:
            raise BudgetError(f"--{flag} {text[:40]!r}: no decimals with a binary suffix")
        return int(whole) * 1024 ** ("KMGT".index(suffix) + 1)
    scale = 1000 ** ("kmgt".index(suffix) + 1)
    return int(whole) * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)


def _bool(text: str, flag: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise BudgetError(f"--{flag} {text[:40]!r}: not true or false")


def _value(kind: str, text: str, flag: str) -> Any:
    if kind == "int":
        return _human_int(text, flag)
    if kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise BudgetError(f"--{flag} {text[:40]!r}: not a number") from None
        if not 0 < value <= 1:
            raise BudgetError(f"--{flag} {value}: must be in (0, 1]")
        return value
    if kind == "bool":
        return _bool(text, flag)
    return text


def parse_serve(argv: list[str], source: str) -> Workload:
    """A `vllm serve` argument vector (after `serve`, or after the api_server module)."""
    if len(argv) > MAX_ARGS:
        raise BudgetError(f"{source}: over {MAX_ARGS} arguments")
    work = Workload(source=source, model="")
    ignored: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if not word.startswith("-"):
            if not work.model:
                work.model = word  # `vllm serve MODEL`
            else:
                ignored.append(word)
            continue
        name, eq, inline = word.partition("=")
        name = SHORT.get(name, name.lstrip("-").replace("_", "-"))
        negated = name.startswith("no-") and name[3:] in {*SIZING_FLAGS, *BOOLEAN}
        key = name[3:] if negated else name
        takes_value = not (negated or key in BOOLEAN)
        if eq:
            value: str | None = inline
        elif takes_value and i < len(argv) and not argv[i].startswith("--"):
            value = argv[i]
            i += 1
        else:
            value = None
        if key == "model":
            work.model = value or ""
        elif key in UNMODELLED:
            work.unsizable = work.unsizable or f"--{key}: {UNMODELLED[key]}"
        elif key == "dtype" and value is not None and value.lower() not in DTYPES_MODELLED:
            work.unsizable = work.unsizable or f"--dtype {value}: only 16-bit models are sized"
        elif key in SIZING_FLAGS:
            target, kind = SIZING_FLAGS[key]
            if kind == "bool":
                on = not negated if value is None else _bool(value, key)
                work.flags[target] = (not on) if negated and value is not None else on
            elif value is None:
                raise BudgetError(f"{source}: --{key} needs a value")
            elif key == "max-model-len" and value.strip().lower() in ("auto", "-1"):
                work.max_model_len_auto = True
            else:
                work.flags[target] = _value(kind, value, key)
        else:
            ignored.append(f"--{key}")
    if not work.model:
        raise BudgetError(f"{source}: no model (vllm serve MODEL or --model)")
    if ignored:
        shown = ", ".join(sorted(set(ignored))[:12])
        work.notes.append(f"flags that do not size memory, not read: {shown}")
    return work


def serve_args(words: list[str]) -> list[str] | None:
    """The serve arguments of a command, or None when it does not start vLLM's server:
    `vllm serve ...`, `python -m vllm.entrypoints.openai.api_server ...`."""
    for k, w in enumerate(words):
        base = os.path.basename(w)
        if base == "vllm" and k + 1 < len(words) and words[k + 1] == "serve":
            return words[k + 2 :]
        if w == "-m" and k + 1 < len(words) and words[k + 1].startswith(vllm_seam.ENTRYPOINTS):
            return words[k + 2 :]
    return None


def from_command_line(text: str) -> Workload:
    """`vllm serve ...` as a shell would split it (shlex: quotes honoured, nothing run)."""
    if len(text) > 64 * 1024:
        raise BudgetError("the command line is over 64 KiB")
    try:
        words = shlex.split(text, comments=True)
    except ValueError as exc:
        raise BudgetError(f"the command line does not split: {exc}") from None
    args = serve_args(words)
    if args is None:
        raise BudgetError("the command line does not run `vllm serve`")
    return parse_serve(args, "command line")


# -- Kubernetes ----------------------------------------------------------------------------------
def _documents(path: str) -> list[Any]:
    """Every YAML document of a manifest file, each checked by oomguard.bounded."""
    try:
        raw = bounded.read_bytes(path, MANIFEST_LIMITS)
        text = bounded.decode(raw, path)
    except bounded.InputError as exc:
        raise BudgetError(str(exc)) from None
    # document markers at column 0 (block scalars are indented, so this split is exact)
    chunks = re.split(r"(?m)^(?:---|\.\.\.)[ \t]*(?:#.*)?$", text)
    docs = []
    for n, chunk in enumerate(chunks):
        if not chunk.strip():
            continue
        try:
            docs.append(bounded.parse_yaml(chunk, f"{path} (document {n + 1})", MANIFEST_LIMITS))
        except bounded.InputError as exc:
            raise BudgetError(str(exc)) from None
    return docs


def _expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` in command and args: a defined variable is replaced, `$$` is a
    literal `$`, anything else stays as written (as the kubelet does)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, word)


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BudgetError(f"{what} is not a list of strings")
    return list(value)


def _gpu_count(container: dict[str, Any], where: str) -> int | None:
    resources = container.get("resources") or {}
    if not isinstance(resources, dict):
        raise BudgetError(f"{where}: resources is not a mapping")
    for part in ("limits", "requests"):
        block = resources.get(part) or {}
        if not isinstance(block, dict):
            raise BudgetError(f"{where}: resources.{part} is not a mapping")
        count = block.get("nvidia.com/gpu")
        if count is None:
            continue
        text = str(count) if isinstance(count, (int, str)) and not isinstance(count, bool) else ""
        if not re.fullmatch(r"\d{1,4}", text.strip()) or not 0 < int(text) <= MAX_GPUS:
            raise BudgetError(f"{where}: nvidia.com/gpu {str(count)[:20]!r} is not a GPU count")
        return int(text)
    return None


def _gpu_labels(pod: dict[str, Any], where: str) -> list[str]:
    """Node label values that name the GPU: nodeSelector, or the required node affinity's
    `In` expressions (every value: the pod may land on any of them)."""
    found: list[str] = []
    selector = pod.get("nodeSelector") or {}
    if not isinstance(selector, dict):
        raise BudgetError(f"{where}: nodeSelector is not a mapping")
    for key in GPU_LABELS:
        if isinstance(selector.get(key), str):
            found.append(selector[key])
    affinity = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = affinity.get("nodeSelectorTerms") if isinstance(affinity, dict) else None
    for term in terms if isinstance(terms, list) else []:
        exprs = term.get("matchExpressions") if isinstance(term, dict) else None
        for e in exprs if isinstance(exprs, list) else []:
            if isinstance(e, dict) and e.get("key") in GPU_LABELS and e.get("operator") == "In":
                found += [v for v in _strings(e.get("values"), f"{where}: affinity values")]
    return found


def _is_vllm(container: dict[str, Any], words: list[str]) -> bool:
    image = str(container.get("image", ""))
    return serve_args(words) is not None or "vllm" in image.rsplit("/", 1)[-1].lower()


def from_manifest(path: str) -> list[Workload]:
    """Every vLLM container of every Deployment or StatefulSet in the file."""
    found: list[Workload] = []
    for doc in _documents(path):
        if not isinstance(doc, dict) or doc.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        meta = doc.get("metadata") or {}
        name = f"{doc['kind']}/{meta.get('namespace', 'default')}/{meta.get('name', '?')}"
        pod = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
        if not isinstance(pod, dict):
            raise BudgetError(f"{name}: spec.template.spec is not a mapping")
        containers = pod.get("containers") or []
        if not isinstance(containers, list):
            raise BudgetError(f"{name}: containers is not a list")
        for c in containers:
            if not isinstance(c, dict):
                raise BudgetError(f"{name}: a container is not a mapping")
            where = f"{name} container {str(c.get('name', '?'))[:60]}"
            env = {
                str(e["name"]): str(e["value"])
                for e in c.get("env") or []
                if isinstance(e, dict) and "name" in e and isinstance(e.get("value"), str)
            }
            command = [_expand(w, env) for w in _strings(c.get("command"), f"{where}: command")]
            args = [_expand(w, env) for w in _strings(c.get("args"), f"{where}: args")]
            words = command + args
            if not _is_vllm(c, words):
                continue
            serve = serve_args(words)
            if serve is None:
                # no command: the vLLM image's entrypoint (`vllm serve`) takes the args
                if command:
                    raise BudgetError(f"{where}: its command does not run `vllm serve`")
                serve = args
            work = parse_serve(serve, where)
            work.gpus = _gpu_count(c, where)
            work.gpu_labels = _gpu_labels(pod, where)
            found.append(work)
    if not found:
        raise BudgetError(f"{path}: no Deployment or StatefulSet runs a vLLM container")
    return found
