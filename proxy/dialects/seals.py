"""Seals on sampled reasoning: clients echo reasoning back (Anthropic thinking signatures, Responses
encrypted_content) and only a seal this deployment issued proves it is the reasoning we sampled.

A seal is an HMAC-SHA256 of the text under the deployment's secret: TITO_REASONING_SECRET, or
without one a random secret the first process made and kept in the database, so that every worker
and replica, and a restart, verify it (app._stored_secret). Sealer(None), for code that builds no
app, uses a random secret of this process.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

from pydantic import SecretStr

_PROCESS_SECRET = secrets.token_bytes(32)
_DOMAIN = b"tito-proxy reasoning seal v1\0"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sealer:
    def __init__(self, secret: SecretStr | None) -> None:
        self._key = secret.get_secret_value().encode() if secret is not None else _PROCESS_SECRET

    def signature(self, text: str) -> str:
        """The seal of `text` (an Anthropic thinking signature)."""
        return _b64(hmac.new(self._key, _DOMAIN + text.encode(), hashlib.sha256).digest())

    def verifies(self, text: str, signature: str) -> bool:
        return hmac.compare_digest(self.signature(text).encode(), signature.encode())

    def envelope(self, text: str) -> str:
        """The text and its seal in one opaque string (a Responses reasoning encrypted_content)."""
        return f"{_b64(text.encode())}.{self.signature(text)}"

    def opened(self, envelope: str) -> str | None:
        """The text an envelope we issued carries; None for one we did not issue."""
        body, _, signature = envelope.partition(".")
        try:
            text = _unb64(body).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        return text if self.verifies(text, signature) else None
