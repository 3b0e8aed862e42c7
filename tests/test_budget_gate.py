"""The deploy-time gate (issue 26 item 4): `oomguard budget CONFIG --deployment manifest.yaml` or
`--serve-command "vllm serve ..."` sizes each vLLM workload with its own flags, GPU count and GPU
type, and exits 1 when vLLM would refuse to start (or, with --gate-prompt-logprobs, when the
longest request the deployment allows does not fit), 2 when it cannot size it.

Real parts: the repository's own generated manifest (deploy/kubernetes/vllm-example.yaml), the
twin's Llama-3-8B config, real configs from tests/fixtures/hf-configs, and manifests derived
from the example the way an operator edits it. Manifests are untrusted input: the hostile ones
must give one line and exit 2, never a traceback, and a command line is never run.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from oomguard.cli import main
from oomguard.sizing.deploy import from_command_line, parse_serve

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "kubernetes" / "vllm-example.yaml"
LLAMA3 = ROOT / "twin" / "oomguard" / "twin" / "models" / "llama-3-8b"
FIXTURES = Path(__file__).parent / "fixtures" / "hf-configs"
LLAMA31 = FIXTURES / "Llama-3.1-8B-Instruct.json"


def gate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    code = main(["budget", *args, "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else {}), out.err


def documents() -> list[Any]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d is not None]


def deployment() -> dict[str, Any]:
    (dep,) = [d for d in documents() if d.get("kind") == "Deployment"]
    return copy.deepcopy(dep)


def write(tmp_path: Path, *docs: Any, name: str = "manifest.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return path


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


# -- the shipped example -----------------------------------------------------------------------
def test_the_example_deployment_passes_the_gate_on_an_h100(capsys) -> None:
    code, doc, _ = gate(capsys, str(LLAMA3), "--deployment", str(EXAMPLE), "--gpu", "H100")
    assert code == 0 and doc["exit_code"] == 0
    (w,) = doc["workloads"]
    assert w["source"] == "Deployment/llm/vllm-llama-3-8b container vllm"
    assert w["model"] == "meta-llama/Meta-Llama-3-8B-Instruct" and w["gpus"] == 1
    assert w["serve_flags"] == {
        "max_model_len": 8192,
        "max_num_seqs": 64,
        "gpu_memory_utilization": 0.9,
    }
    assert w["verdict"] == "starts" and w["budget"]["inputs"]["gpu_memory_utilization"] == 0.9
    assert any("--port" in n for n in w["notes"])  # read, named, not sized


def test_the_example_without_a_gpu_stops_the_gate_with_one_line(capsys) -> None:
    """The example pins a node by name, not by GPU label: without --gpu nothing names the GPU.
    docs/budget.md: one line on stderr, exit 2, no JSON (a CI job's gate.json stays empty)."""
    code, doc, err = gate(capsys, str(LLAMA3), "--deployment", str(EXAMPLE))
    assert code == 2 and doc == {} and err.count("\n") == 1
    assert "no node label names the GPU" in err and "--gpu NAME" in err


def test_the_longest_request_gate_fails_a_prompt_logprobs_prompt_that_does_not_fit(capsys):
    """At 0.90 an 8,192-token prompt_logprobs chunk (9.8 GiB of logits) does not fit what an
    H100 leaves outside vLLM's budget: noted by default, a failure with the flag."""
    args = [str(LLAMA3), "--deployment", str(EXAMPLE), "--gpu", "H100"]
    code, doc, _ = gate(capsys, *args, "--gate-prompt-logprobs")
    (w,) = doc["workloads"]
    assert code == 1 and w["verdict"] == "longest request does not fit"
    assert "prompt_logprobs fits up to" in w["reason"]


def test_a_gpu_named_by_a_node_label_and_one_that_is_too_small(tmp_path, capsys) -> None:
    """nvidia.com/gpu.product picks the GPU; an 8B model at 131,072 tokens does not fit an L4:
    exit 1 with vLLM's reason."""
    dep = deployment()
    pod = dep["spec"]["template"]["spec"]
    pod["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-L4"}
    container(dep)["args"] = ["meta-llama/Llama-3.1-8B-Instruct", "--max-model-len=131072"]
    code, doc, _ = gate(capsys, str(LLAMA31), "--deployment", str(write(tmp_path, dep)))
    (w,) = doc["workloads"]
    assert code == 1 and w["gpu"] == "L4" and w["verdict"] == "will not start"
    assert "max_model_len" in w["reason"] or "weights" in w["reason"]


def test_every_gpu_the_affinity_allows_is_sized_and_the_worst_decides(tmp_path, capsys) -> None:
    dep = deployment()
    pod = dep["spec"]["template"]["spec"]
    pod.pop("nodeSelector")
    pod["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "cloud.google.com/gke-accelerator",
                                "operator": "In",
                                "values": ["nvidia-h100-80gb", "nvidia-l4"],
                            }
                        ]
                    }
                ]
            }
        }
    }
    container(dep)["args"] = ["meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "64k"]
    code, doc, _ = gate(capsys, str(LLAMA31), "--deployment", str(write(tmp_path, dep)))
    verdicts = {w["gpu"]: w["verdict"] for w in doc["workloads"]}
    assert verdicts == {"H100": "starts", "L4": "will not start"} and code == 1
    assert doc["workloads"][0]["serve_flags"]["max_model_len"] == 64000  # vLLM's 64k


def test_more_ranks_than_the_pods_gpus_will_not_start(tmp_path, capsys) -> None:
    dep = deployment()
    container(dep)["args"] += ["--tensor-parallel-size", "2"]
    code, doc, _ = gate(
        capsys, str(LLAMA3), "--deployment", str(write(tmp_path, dep)), "--gpu", "H100"
    )
    (w,) = doc["workloads"]
    assert code == 1 and "2 ranks on a pod with 1 GPU" in w["reason"]


def test_a_statefulset_with_the_images_entrypoint_and_env_expansion(tmp_path, capsys) -> None:
    """No command: the vLLM image's entrypoint takes the args; $(VAR) comes from the env."""
    dep = deployment()
    dep["kind"] = "StatefulSet"
    c = container(dep)
    c.pop("command")
    c["image"] = "vllm/vllm-openai:v0.33.0"
    c["args"] = ["--model", "$(MODEL)", "--max-model-len", "$(LEN)", "-tp=1"]
    c["env"] += [{"name": "MODEL", "value": "llama"}, {"name": "LEN", "value": "4096"}]
    code, doc, _ = gate(
        capsys, str(LLAMA3), "--deployment", str(write(tmp_path, dep)), "--gpu", "L4"
    )
    (w,) = doc["workloads"]
    assert code == 0 and w["source"].startswith("StatefulSet/") and w["model"] == "llama"
    assert w["serve_flags"]["max_model_len"] == 4096


def test_a_flag_whose_memory_is_not_modelled_cannot_pass(tmp_path, capsys) -> None:
    dep = deployment()
    container(dep)["args"] += ["--speculative-config", '{"method": "ngram"}']
    code, doc, _ = gate(
        capsys, str(LLAMA3), "--deployment", str(write(tmp_path, dep)), "--gpu", "H100"
    )
    (w,) = doc["workloads"]
    assert code == 2 and w["verdict"] == "cannot size" and "draft model" in w["reason"]


def test_max_model_len_auto_is_fitted_not_refused(capsys) -> None:
    cmd = "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len auto"
    code, doc, _ = gate(capsys, str(LLAMA31), "--serve-command", cmd, "--gpu", "L4")
    (w,) = doc["workloads"]
    assert code == 0 and any("fits it to the pool at start, about" in n for n in w["notes"])


# -- a `vllm serve` command line ---------------------------------------------------------------
def test_a_serve_command_line_is_read_like_vllm_reads_it(capsys) -> None:
    cmd = (
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --max_model_len=16k -tp 1 "
        "--gpu-memory-utilization 0.85 --no-enforce-eager --kv-cache-dtype fp8 --port 9000"
    )
    code, doc, _ = gate(capsys, str(LLAMA31), "--serve-command", cmd, "--gpu", "H100")
    (w,) = doc["workloads"]
    assert code == 0 and w["source"] == "command line"
    assert w["serve_flags"] == {
        "max_model_len": 16000,
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.85,
        "enforce_eager": False,
        "kv_cache_dtype": "fp8",
    }
    assert w["budget"]["kv_bytes_per_token"] == 65536  # FP8 KV


def test_the_api_server_module_form_and_human_readable_sizes() -> None:
    w = from_command_line(
        "python3 -m vllm.entrypoints.openai.api_server --model m --max-model-len 1K "
        "--kv-cache-memory-bytes 10G --enable-expert-parallel"
    )
    assert w.model == "m"
    assert w.flags == {
        "max_model_len": 1024,
        "kv_pool_bytes": 10 * 2**30,  # G is binary in vLLM, g decimal
        "enable_expert_parallel": True,
    }


def test_a_command_line_is_never_run(tmp_path) -> None:
    marker = tmp_path / "ran"
    w = from_command_line(f"vllm serve m --max-model-len 4096 $(touch {marker}); touch {marker}")
    assert not marker.exists() and w.model == "m" and w.flags == {"max_model_len": 4096}


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--max-model-len", "lots"], "not a whole number"),
        (["--max-model-len"], "needs a value"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--enforce-eager=maybe"], "not true or false"),
        (["--max-model-len", "1.5K"], "no decimals"),
        (["--max-model-len", "9" * 30], "not a whole number"),
    ],
)
def test_bad_serve_flags_are_named(words: list[str], message: str) -> None:
    from oomguard.errors import BudgetError

    with pytest.raises(BudgetError, match="--") as exc:
        parse_serve(["m", *words], "command line")
    assert message in str(exc.value)


# -- hostile input -----------------------------------------------------------------------------
HOSTILE: dict[str, str] = {
    "not_yaml": "kind: Deployment\nspec: [unclosed\n",
    "no_vllm": "apiVersion: v1\nkind: Service\nmetadata: {name: x}\n",
    "args_not_a_list": (
        "kind: Deployment\nspec:\n  template:\n    spec:\n      containers:\n"
        "      - name: v\n        image: vllm/vllm-openai\n        args: --model m\n"
    ),
    "gpu_count": (
        "kind: Deployment\nspec:\n  template:\n    spec:\n      containers:\n"
        "      - name: v\n        image: vllm/vllm-openai\n        args: [m]\n"
        "        resources: {limits: {nvidia.com/gpu: lots}}\n"
    ),
    "deep": "a: " + "[" * 5000 + "]" * 5000 + "\n",
    "billion_laughs": "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + "kind: Deployment\n",
    "unknown_gpu_label": (
        "kind: Deployment\nspec:\n  template:\n    spec:\n"
        "      nodeSelector: {nvidia.com/gpu.product: NVIDIA-Imaginary-9000}\n"
        "      containers:\n      - name: v\n        command: [vllm, serve]\n        args: [m]\n"
    ),
    "shell_command": (
        "kind: Deployment\nspec:\n  template:\n    spec:\n      containers:\n"
        "      - name: v\n        image: vllm/vllm-openai\n        command: [/bin/sh, -c]\n"
        "        args: ['vllm serve m']\n"
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_manifest_is_one_line_and_exit_2(name: str, tmp_path, capsys) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(HOSTILE[name])
    code = main(["budget", str(LLAMA3), "--deployment", str(path), "--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("oomguard budget:")
    assert "Traceback" not in err


def test_a_fifo_or_an_oversized_manifest_is_refused(tmp_path, capsys) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (5 * 2**20) + "\n")
    for path in (fifo, big):
        assert main(["budget", str(LLAMA3), "--deployment", str(path), "--gpu", "H100"]) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_serve_flags_beside_a_deployment_are_refused(capsys) -> None:
    code = main(["budget", str(LLAMA3), "--deployment", str(EXAMPLE), "--gpu", "H100", "-tp", "2"])
    assert code == 2 and "drop --tensor-parallel-size" in capsys.readouterr().err
