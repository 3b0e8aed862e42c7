"""The per-node exporter: collectors, pressure levels and the /metrics server."""
