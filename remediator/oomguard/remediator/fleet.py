"""The allowlisted engines as the controller's parts share them: each target's configuration
and plugin token. One object, replaced in place when discovery changes the allowlist, so intake,
restarts and convergence always see the same fleet."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from oomguard.remediator.actuator import Target
from oomguard.remediator.config import SecretFile
from oomguard.remediator.targets import TargetConfig


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
        # selector shape (its label names) -> their values -> targets: an alert is routed with
        # one lookup per shape (usually one), not a scan of every target's selector
        self._order = {t.name: i for i, t in enumerate(targets)}
        self._index: dict[tuple[str, ...], dict[tuple[str | None, ...], list[str]]] = {}
        for t in targets:
            sel = t.selector()
            keys = tuple(sorted(sel))
            table = self._index.setdefault(keys, {})
            table.setdefault(tuple(sel[k] for k in keys), []).append(t.name)
        return old

    def select(self, labels: Mapping[str, str]) -> list[str]:
        """The targets whose selector labels `labels` carries exactly, in allowlist order (the
        same answer as intake.select, from the index)."""
        found: list[str] = []
        for keys, table in self._index.items():
            # a label the alert lacks is None: it matches no selector value, "" included
            found.extend(table.get(tuple(labels.get(k) for k in keys), ()))
        if len(found) > 1:
            found.sort(key=self._order.__getitem__)
        return found

    def target(self, name: str) -> Target:
        return make_target(self.targets[name], self.tokens.get(name))
