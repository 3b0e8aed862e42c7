"""The remediator: Alertmanager webhooks to safe, automatic action on vLLM (cap, drain, restart)."""
