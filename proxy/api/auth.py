"""API keys. The harness key opens the OpenAI surface; the admin key opens everything that reads or
changes recorded data, and a harness key there is refused, so an agent cannot read its trajectories."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from fastapi import Request
from pydantic import SecretStr

from proxy.app_state import AppState
from proxy.config import Settings
from proxy.errors import Forbidden, Unauthorized


def _presented(headers: Mapping[str, str]) -> str | None:
    """The key a client sent: `Authorization: Bearer KEY` (OpenAI SDKs), `x-api-key: KEY` (Anthropic
    SDKs, Claude Code) or `api-key: KEY` (Azure-style)."""
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, key = authorization.partition(" ")
        return key.strip() if scheme.lower() == "bearer" else None
    return headers.get("x-api-key") or headers.get("api-key")


def _matches(presented: str | None, key: SecretStr | None) -> bool:
    # Constant-time: the comparison must not leak how much of a guess was right.
    return (
        presented is not None
        and key is not None
        and hmac.compare_digest(presented.encode(), key.get_secret_value().encode())
    )


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.proxy
    return state


def check_harness_key(settings: Settings, headers: Mapping[str, str]) -> None:
    """The harness key (or the admin key) when one is set, else nothing to check."""
    if settings.api_key is None:
        return
    presented = _presented(headers)
    if not (_matches(presented, settings.api_key) or _matches(presented, settings.admin_key)):
        raise Unauthorized("Incorrect API key provided; send it as Authorization: Bearer <key>")


async def require_harness_key(request: Request) -> None:
    check_harness_key(_state(request).settings, request.headers)


async def require_admin_key(request: Request) -> None:
    settings = _state(request).settings
    key = settings.admin_key or settings.api_key
    if key is None:
        return
    presented = _presented(request.headers)
    if _matches(presented, key):
        return
    if settings.admin_key is not None and _matches(presented, settings.api_key):
        raise Forbidden("the harness key cannot read or change recorded sessions; use the admin key")
    raise Unauthorized("Incorrect admin key provided; send it as Authorization: Bearer <key>")
