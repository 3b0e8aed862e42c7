"""Generated files: write them, or check that the committed copies match their generator."""

from __future__ import annotations

from pathlib import Path


def sync(root: Path, files: dict[Path, str], check: bool) -> list[Path]:
    """Return the paths whose committed content differs; write them unless `check`."""
    drift: list[Path] = []
    for rel, content in files.items():
        path = root / rel
        current = path.read_text() if path.exists() else None
        if current != content:
            drift.append(rel)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
    return drift
