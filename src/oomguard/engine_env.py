"""Environment variables that oomguard sets for vLLM and the plugin reads (a contract between the
supervisor, which starts vLLM, and the plugin inside it)."""

from __future__ import annotations

# Start the engine with this admission cap instead of its full max_num_seqs: after a crash or a
# restart for memory the engine comes back through staged re-admission.
INITIAL_CAP_ENV = "OOMGUARD_INITIAL_ADMISSION_CAP"
