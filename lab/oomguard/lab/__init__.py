"""The lab above the twin: real vLLM servers, Prometheus, Alertmanager and the remediator run
against twin GPUs (runner, processes, routers), the demo and its report, and the simulated-time
GPU matrix and recovery. Nothing in the product imports it; only the CLI and the tests do."""
