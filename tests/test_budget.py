from __future__ import annotations

import json

import pytest

from oomguard.budget import BudgetInputs, compute, parse_size, shape_from_hf_config
from oomguard.cli import main
from oomguard.errors import BudgetError

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
LLAMA3_70B = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}
DEEPSEEK_V2_LITE = {
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
    "vocab_size": 102400,
    "n_routed_experts": 64,
    "moe_intermediate_size": 1408,
    "n_shared_experts": 2,
    "max_position_embeddings": 163840,
}


def test_llama3_8b_kv_bytes_per_token_is_128_kib():
    shape = shape_from_hf_config(LLAMA3_8B)
    assert shape.kv_bytes_per_token() == 131_072
    assert shape.kv_bytes_per_token(1) == 65_536  # fp8 KV cache halves it
    # 32K tokens = 4 GiB, 128K tokens = 16 GiB
    assert shape.kv_bytes_per_token() * 32768 == 4 * 1024**3
    assert 7.9e9 < shape.parameter_count() < 8.1e9


def test_mla_models_cache_one_latent_per_layer():
    shape = shape_from_hf_config(DEEPSEEK_V2_LITE)
    assert shape.kv_bytes_per_token() == 27 * (512 + 64) * 2


def test_gqa_heads_split_over_tensor_parallel():
    b = compute(
        shape_from_hf_config(LLAMA3_70B),
        BudgetInputs(gpu_memory_bytes=80 * 10**9, tensor_parallel_size=4, max_model_len=8192),
    )
    assert b.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert b.kv_bytes_per_token_per_gpu == b.kv_bytes_per_token // 4


def test_budget_numbers_and_recommendation():
    b = compute(
        shape_from_hf_config(LLAMA3_8B),
        BudgetInputs(gpu_memory_bytes=80 * 10**9, max_model_len=8192, kv_pool_bytes=40 * 1024**3),
    )
    assert b.kv_pool_tokens == 40 * 1024**3 // 131072  # 327,680 tokens
    assert b.concurrency_at_context == pytest.approx(40.0)
    assert b.recommended_max_num_seqs == 30 and b.recommended_range == (28, 32)
    assert any("max_num_seqs=256" in w for w in b.warnings)


def test_warnings_for_high_utilization_and_a_context_that_cannot_fit():
    b = compute(
        shape_from_hf_config(LLAMA3_8B),
        BudgetInputs(gpu_memory_bytes=24 * 10**9, gpu_memory_utilization=0.97),
    )
    text = " ".join(b.warnings)
    assert "0.97" in text and "refuse to start" in text


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hidden_size": 4096}, "num_hidden_layers"),
        ({**LLAMA3_8B, "layer_types": ["full_attention", "mamba"]}, "hybrid"),
        ({**LLAMA3_8B, "torch_dtype": "float3"}, "unknown dtype"),
    ],
)
def test_unsupported_configs_are_refused_clearly(config, message):
    with pytest.raises(BudgetError, match=message):
        shape_from_hf_config(config)


def test_multimodal_wrapper_uses_text_config():
    shape = shape_from_hf_config({"architectures": ["Llava"], "text_config": LLAMA3_8B})
    assert shape.kv_bytes_per_token() == 131_072


def test_parse_size():
    assert parse_size("80GiB") == 80 * 1024**3
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError):
        parse_size("lots")


def test_cli_json_and_table(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    assert (
        main(["budget", str(tmp_path), "--gpu", "H100", "--max-model-len", "8192", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 131072 and out["recommended_max_num_seqs"] >= 1
    assert main(["budget", str(path), "--gpu-memory", "80GiB", "--max-model-len", "8192"]) == 0
    assert "KV bytes per token (model)      131,072 B" in capsys.readouterr().out


def test_cli_bad_input_exits_2_with_a_message(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{broken")
    assert main(["budget", str(path), "--gpu", "H100"]) == 2
    assert "is not JSON" in capsys.readouterr().err
    path.write_text(json.dumps(LLAMA3_8B))
    assert main(["budget", str(path), "--gpu-memory", "lots"]) == 2
