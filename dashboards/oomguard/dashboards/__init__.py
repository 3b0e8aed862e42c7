"""Grafana dashboards (grafanalib), generated into JSON with their provisioning files."""
