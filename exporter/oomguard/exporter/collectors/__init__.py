"""One module per source: NVML, dcgm-exporter, vLLM, allocator hand-off, cgroup."""
