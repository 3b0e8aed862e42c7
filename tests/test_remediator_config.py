"""The remediator's configuration: the shipped example loads, mistakes are named."""

from __future__ import annotations

import pytest

from oomguard.errors import ConfigError
from oomguard.remediator.config import RemediatorConfig, SecretFile, load


def test_the_shipped_example_is_valid(repo_root, tmp_path, monkeypatch):
    config = RemediatorConfig.model_validate(
        __import__("yaml").safe_load((repo_root / "deploy" / "remediator.example.yaml").read_text())
    )
    assert [t.selector()["instance"] for t in config.targets] == [
        "gpu-node-1:9848",
        "gpu-node-2:9848",
    ]
    assert config.host_port == ("0.0.0.0", 9849)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("targets: [{name: a, url: 'http://x'}]", "auth"),
        ("auth: {allow_unauthenticated: true}\ntargets: []", "targets"),
        (
            "auth: {allow_unauthenticated: true}\n"
            "targets: [{name: a, url: 'http://x'}, {name: a, url: 'http://y'}]",
            "target names must be unique: a",
        ),
        (
            "auth: {allow_unauthenticated: true}\ntargets: [{name: a, url: 'http://x'}]\n"
            "mode: standalone",
            "standalone",
        ),
        (
            "auth: {allow_unauthenticated: true}\ntargets: [{name: a, url: 'http://x'}]\n"
            "policy: {step_factor: 1.5}",
            "policy.step_factor",
        ),
        (
            "auth: {allow_unauthenticated: true}\ntargets: [{name: 'a b', url: 'http://x'}]",
            "targets.0.name",
        ),
        (
            "auth: {allow_unauthenticated: true}\ntargets: [{name: a, url: 'http://x', "
            "token_file: /nonexistent/token}]",
            "token_file: /nonexistent/token not found",
        ),
    ],
)
def test_mistakes_are_named(tmp_path, text, expected):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load(path)


def test_secret_files_are_reread_on_change_and_kept_when_unreadable(tmp_path):
    import os

    path = tmp_path / "token"
    path.write_text("one\n")
    secret = SecretFile(str(path))
    assert secret.get() == "one"
    path.write_text("two\n")
    os.utime(path, (1, 1))  # a different mtime, as a rotated Secret gets
    assert secret.get() == "two"
    path.unlink()
    assert secret.get() == "two"


@pytest.mark.parametrize("listen", ["0.0.0.0:9849", "10.0.0.5:9849", "gpu-1:9849"])
def test_no_authentication_is_refused_beyond_loopback(tmp_path, listen):
    """Anyone who reaches the port could drain, pause or restart engines: allow_unauthenticated
    passes only on a loopback address (it passed `--check` on 0.0.0.0 before)."""
    path = tmp_path / "r.yaml"
    path.write_text(
        f"listen: '{listen}'\nauth: {{allow_unauthenticated: true}}\n"
        "targets: [{name: a, url: 'http://x'}]\n"
    )
    with pytest.raises(ConfigError, match="only for a remediator bound to loopback"):
        load(path)


@pytest.mark.parametrize("listen", ["127.0.0.1:9849", "127.0.0.2:9849", "localhost:9849", ":9849"])
def test_no_authentication_on_loopback_is_allowed(tmp_path, listen):
    path = tmp_path / "r.yaml"
    path.write_text(
        f"listen: '{listen}'\nauth: {{allow_unauthenticated: true}}\n"
        "targets: [{name: a, url: 'http://x'}]\n"
    )
    assert load(path).auth.allow_unauthenticated
