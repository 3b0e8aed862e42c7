"""Where the files that ship beside the code live, in a checkout or in an installed wheel.

In a checkout the package spans one import root per component (`core/oomguard/`,
`exporter/oomguard/exporter/`, ...); installed, it is one `site-packages/oomguard/`. Data that
belongs to a component (generated rules and dashboards, twin models and traces) sits inside its
folder in both, found by import (`importlib.resources`), never beside another component's
file. The deployment files and runbooks sit at the repository's
top in a checkout, where the docs point; the wheel carries them as `oomguard/deploy` and
`oomguard/runbooks`.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def _beside_package(name: str) -> Path:
    """`oomguard/<name>` when installed, else `<repository>/<name>` (the checkout, where this
    file is core/oomguard/paths.py)."""
    shipped = PACKAGE / name
    if shipped.is_dir():
        return shipped
    return PACKAGE.parent.parent / name


def deploy_dir() -> Path:
    return _beside_package("deploy")


def runbooks_dir() -> Path:
    """The demo's report quotes the runbooks of the alerts that fired; a missing one is a link."""
    return _beside_package("runbooks")
