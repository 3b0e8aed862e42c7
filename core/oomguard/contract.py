"""The contract between oomguard's parts, in one place: what alerts ask for, where the plugin's
API lives, which environment variables carry settings into vLLM, and where allocator statistics
are handed off. The remediator, the plugin, the alert rules, the twin and the manifests meet
here; change a value here and every side changes with it.
"""

from __future__ import annotations

# The label by which an alert asks the remediator for an action (oomguard.actions: which ones).
ACTION_LABEL = "oomguard_action"
# The pressure reason (the level series' and so the action alerts' `reason` label) that says the
# engine's own allocator fragmentation is what takes the room: free blocks stranded inside its
# segments (`inactive_split_bytes`), which only a restart of its process gives back. Without
# them the GPU would be out of pressure. The remediator restarts such an engine at a quiet
# moment (drained, nothing in flight) instead of capping it and waiting.
FRAGMENTATION_REASON = "allocator_fragmentation"

# The oomguard plugin's HTTP API inside vLLM's API server: state, ready, admission, drain, resume.
API_PREFIX = "/oomguard/v1"
# How every refusal of a draining replica begins (the door's 503, a queued request shed): a
# gateway, and the twin's, re-sends such a request to a peer.
DRAINING = "this replica is draining"
DRAINING_MESSAGE = f"{DRAINING}; retry on another replica"

# Environment variables read inside vLLM (plugin, executor) and set by its launchers.
PLUGIN_TOKEN_ENV = "OOMGUARD_PLUGIN_TOKEN"
PLUGIN_TOKEN_FILE_ENV = "OOMGUARD_PLUGIN_TOKEN_FILE"
PLUGIN_ALLOW_UNAUTHENTICATED_ENV = "OOMGUARD_PLUGIN_ALLOW_UNAUTHENTICATED"  # "1": local only
PLUGIN_RETRY_AFTER_ENV = "OOMGUARD_PLUGIN_RETRY_AFTER"  # seconds in a drain's 503 Retry-After
DEFER_STATUS_ENV = "OOMGUARD_DEFER_STATUS"  # a deferral's status: 429 (default) or 503
DEFER_RETRY_AFTER_ENV = "OOMGUARD_DEFER_RETRY_AFTER"  # seconds in a deferral's Retry-After
# seconds a drain keeps queueing (not refusing) while routers take the replica out of rotation
DRAIN_GRACE_ENV = "OOMGUARD_DRAIN_GRACE_SECONDS"
ALLOCATOR_DIR_ENV = "OOMGUARD_ALLOCATOR_DIR"
INCIDENT_DIR_ENV = "OOMGUARD_INCIDENT_DIR"
INITIAL_CAP_ENV = "OOMGUARD_INITIAL_ADMISSION_CAP"
TARGET_ENV = "OOMGUARD_TARGET"  # the target name in hand-off files and incident records

# Where ranks publish allocator statistics for the exporter (core/oomguard/handoff.py: the format).
HANDOFF_DIR = "/run/oomguard/allocator"

# `oomguard serve`'s state (flags in force, vLLM's log, exit records): the single-box unit's
# StateDirectory (deploy/single-box/oomguard-vllm.service), apart from the remediator's.
SERVE_STATE_DIR = "/var/lib/oomguard-serve"

# A twin GPU's state file (oomguard.twin.gpufile): set, `oomguard exporter` reads that simulated
# GPU instead of NVML and `oomguard serve` runs vLLM on the model-free executor over it. A
# rehearsal of the whole stack without a GPU (docs/single-box.md).
TWIN_GPU_FILE_ENV = "OOMGUARD_TWIN_GPU_FILE"

# The plugin's state document (GET {API_PREFIX}/state): oomguard.engine_state.EngineState.
