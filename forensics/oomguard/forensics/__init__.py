"""OOM forensics: the incident records the vLLM plugin and the `oomguard serve` supervisor
write, read back, joined and classified (`oomguard incidents`, the exporter's incident
collector)."""
