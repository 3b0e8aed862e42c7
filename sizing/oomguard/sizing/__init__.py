"""Sizing a vLLM deployment before it runs: `oomguard budget` and `oomguard preflight`.

- `model`: a config.json read in pure Python (per-layer KV shapes, weights by part);
- `capacity`: vLLM 0.33's KV cache planning in pure Python;
- `budget`: available KV memory, the pool, concurrency, the verdict;
- `vllm_path`: the same specs and planning by vLLM's own code, where vLLM is importable;
- `deploy`: a Kubernetes Deployment/StatefulSet or a `vllm serve` command line as inputs;
- `gate`: the deploy-time gate (`budget --deployment/--serve-command`);
- `preflight`: the longest prompt at max batch against a running server, before production;
- sizes with units come from `oomguard.units`.
The logits formula shared with the request guard is `oomguard.logits`; the GPU table is
`oomguard.gpus`.
"""
