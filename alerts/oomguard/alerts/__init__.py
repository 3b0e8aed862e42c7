"""Prometheus alert and recording rules, generated from the catalog and thresholds."""
