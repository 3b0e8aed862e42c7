"""Who may call oomguard's HTTP APIs: a bearer token or basic auth, as Alertmanager's
`http_config` sends them, from files re-read on rotation, compared in constant time."""

from __future__ import annotations

import base64
import binascii
import hmac

from oomguard.remediator.config import AuthConfig, SecretFile


class Authenticator:
    """Bearer token or basic auth, as Alertmanager's `http_config` sends them."""

    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self.token = SecretFile(config.bearer_token_file) if config.bearer_token_file else None
        self.password = (
            SecretFile(config.basic.password_file, token=False) if config.basic else None
        )

    def allows(self, header: str) -> bool:
        if self.config.allow_unauthenticated:
            return True
        scheme, _, value = header.partition(" ")
        scheme, value = scheme.lower(), value.strip()
        if scheme == "bearer" and self.token is not None:
            token = self.token.get()
            return token is not None and hmac.compare_digest(value.encode(), token.encode())
        if scheme == "basic" and self.password is not None and self.config.basic is not None:
            try:
                user, _, given = base64.b64decode(value, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            password = self.password.get()
            return (
                password is not None
                and hmac.compare_digest(user.encode(), self.config.basic.username.encode())
                and hmac.compare_digest(given.encode(), password.encode())
            )
        return False

    def challenge(self) -> str:
        return "Basic" if self.config.basic and not self.config.bearer_token_file else "Bearer"
