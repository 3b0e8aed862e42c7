"""The allowlisted engines as the controller's parts share them: each target's configuration
and plugin token. One object, replaced in place when discovery changes the allowlist, so intake,
restarts and convergence always see the same fleet."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from oomguard.remediator.actuator import Target
from oomguard.remediator.config import SecretFile, TargetConfig


def make_target(cfg: TargetConfig, secret: SecretFile | None) -> Target:
    """The actuator's view of an allowlisted engine, with its token as the file says now."""
    return Target(cfg.name, cfg.url, secret.get() if secret else None, cfg.model)


class Fleet:
    def __init__(self, targets: Iterable[TargetConfig]) -> None:
        self.targets: dict[str, TargetConfig] = {}
        self.tokens: dict[str, SecretFile] = {}
        self.replace(targets)

    def replace(self, targets: Iterable[TargetConfig]) -> dict[str, TargetConfig]:
        """Take a new allowlist; returns the old one. A token file shared by several targets
        keeps one reader."""
        old = self.targets
        files = {s.path: s for s in self.tokens.values()}
        targets = list(targets)
        self.targets = {t.name: t for t in targets}
        self.tokens = {
            t.name: files.get(Path(t.token_file)) or SecretFile(t.token_file)
            for t in targets
            if t.token_file
        }
        return old

    def target(self, name: str) -> Target:
        return make_target(self.targets[name], self.tokens.get(name))
