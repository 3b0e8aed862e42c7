"""Token files that cannot be a bearer token (a second line, a CR, a space, a non-ASCII
character) are refused by name, and the token is never printed. Found: `oomguard status` printed
"Illegal header value b'Bearer abc\\ndef-s3cret'" for a token file on two lines and raised
UnicodeEncodeError (a traceback) for a non-ASCII one; the remediator put the same header, token
included, into its log, its audit log ("failed" reason) and /v1/targets."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from oomguard import bounded
from oomguard.errors import ConfigError
from oomguard.remediator.config import SecretFile, load
from oomguard.status import Endpoint, fetch

SECRET = "s3cret-value"
BAD_TOKENS = {
    "two lines": f"abc\n{SECRET}\n",
    "a CR inside": f"abc\r{SECRET}",
    "a space inside": f"Bearer {SECRET}",
    "non-ASCII": f"abcé{SECRET}",
    "a NUL": f"abc\x00{SECRET}",
}


@pytest.fixture
def listener() -> Iterator[str]:
    """Something that accepts connections (and answers nothing)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("kind", sorted(BAD_TOKENS))
def test_status_refuses_a_token_file_that_is_no_token_and_never_prints_it(
    tmp_path: Path, listener: str, kind: str
) -> None:
    token = tmp_path / "token"
    token.write_text(BAD_TOKENS[kind])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "oomguard",
            "status",
            "--remediator",
            listener,
            "--remediator-token-file",
            str(token),
            "--exporter",
            f"{listener}/metrics",
            "--timeout",
            "1s",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert SECRET not in out and "Traceback" not in out
    assert "--remediator-token-file" in out and "a bearer token is one line" in out


@pytest.mark.parametrize("kind", sorted(BAD_TOKENS))
def test_a_token_file_turned_bad_after_the_start_is_a_reason_not_a_leak(
    tmp_path: Path, listener: str, kind: str
) -> None:
    token = tmp_path / "token"
    token.write_text(BAD_TOKENS[kind])
    with httpx.Client(timeout=1) as client:
        read = fetch(client, f"{listener}/v1/targets", Endpoint(listener, str(token)), True)
    assert read.error is not None and SECRET not in read.error, read.error
    assert "bearer token" in read.error


def test_a_password_file_may_hold_any_text(tmp_path: Path) -> None:
    """Basic auth's password is base64-encoded: a space or a non-ASCII letter is fine."""
    password = tmp_path / "password"
    password.write_text("correct horse é battery\n")
    secret = SecretFile(str(password), token=False)
    assert secret.get() == "correct horse é battery"


def test_the_remediator_refuses_a_target_token_that_is_no_token(tmp_path: Path) -> None:
    token = tmp_path / "plugin-token"
    token.write_text(f"abc\n{SECRET}\n")
    config = tmp_path / "remediator.yaml"
    config.write_text(
        "auth: {allow_unauthenticated: true}\n"
        f"targets: [{{name: a, url: 'http://127.0.0.1:1', token_file: {token}}}]\n"
        f"audit_log: {tmp_path / 'audit.jsonl'}\n"
    )
    with pytest.raises(ConfigError) as refused:
        load(config)
    assert SECRET not in str(refused.value) and "a line break" in str(refused.value)


def test_a_rotated_token_that_is_no_token_keeps_the_last_good_one(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("good-token\n")
    secret = SecretFile(str(token))
    assert secret.get() == "good-token"
    token.write_text(f"good-token\n{SECRET}\n")  # an editor's second line, a paste gone wrong
    assert secret.get() == "good-token"
    assert secret.error is not None and SECRET not in secret.error


def test_check_token_names_what_is_wrong_not_the_value() -> None:
    assert bounded.check_token("abc.DEF-123_~+/=", "f") == "abc.DEF-123_~+/="
    with pytest.raises(bounded.InputError) as bad:
        bounded.check_token(f"ab\n{SECRET}", "f")
    assert bad.value.reason == "not_token" and SECRET not in str(bad.value)
