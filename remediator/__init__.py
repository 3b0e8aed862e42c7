"""The remediator: Alertmanager webhooks to safe, automatic action on vLLM (being built)."""
