"""Sizing a vLLM deployment: `oomguard budget` and the parts `preflight` shares.

- `model`: a config.json read in pure Python (per-layer KV shapes, weights by part);
- `capacity`: vLLM 0.33's KV cache planning in pure Python;
- `budget`: available KV memory, the pool, concurrency, the verdict;
- `vllm_path`: the same specs and planning by vLLM's own code, where vLLM is importable;
- `deploy`: a Kubernetes Deployment/StatefulSet or a `vllm serve` command line as inputs;
- sizes with units come from `oomguard.units`.
The logits formula shared with the request guard is `oomguard.logits`; the GPU table is
`oomguard.gpus`.
"""
