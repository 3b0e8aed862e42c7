"""The distribution's version: `oomguard --version`, the exporter's build_info, the image tag.

`oomguard` is a PEP 420 namespace package spread over one import root per component (`core/`,
`exporter/`, `remediator/`, ...: docs/architecture.md), so no folder holds an `__init__.py` for it.
Keep this in step with `version` in pyproject.toml.
"""

__version__ = "0.1.0"
