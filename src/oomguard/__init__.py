"""oomguard: keep vLLM GPU serving out of out-of-memory crashes.

The core package holds what every component shares: the metric catalog, memory and KV budget
math, thresholds and configuration loading, the allocator hand-off format, and the CLI.
"""

__version__ = "0.1.0"
