"""Dependencies of the routes: the app state and the session a request belongs to."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Header, Request

from proxy.app_state import AppState
from proxy.errors import InvalidRequest, UnsupportedParameter

_SESSION_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


# Dependencies are coroutines: FastAPI runs a plain function in its thread pool, a hop per request.
async def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.proxy
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def known_query(*names: str) -> Callable[[Request], Awaitable[None]]:
    """A dependency refusing query parameters other than `names`: a misspelled filter
    (`?branch=all`, `?statsu=finished`) would otherwise answer something else than was asked."""
    known = frozenset(names)

    async def refuse_unknown(request: Request) -> None:
        unknown = sorted(set(request.query_params) - known)
        if unknown:
            listed = ", ".join(sorted(known)) or "none"
            raise UnsupportedParameter(
                f"unknown query parameter {unknown[0]!r}; known: {listed}", param=unknown[0]
            )

    return refuse_unknown


def new_session_id() -> str:
    """A session id nobody can guess (128 bits from the OS's CSPRNG): the harness key alone lets a
    client write to any session it can name."""
    return secrets.token_hex(16)


def check_session_id(session_id: str) -> str:
    # "." and ".." are path segments a URL resolves away: no route could name such a session.
    if not _SESSION_ID.match(session_id) or session_id in (".", ".."):
        raise InvalidRequest(
            "session ids are 1-128 characters of letters, digits and . _ : @ - (not . or ..)",
            param="session_id",
        )
    return session_id


async def resolve_session_id(
    request: Request,
    x_session_id: Annotated[str | None, Header()] = None,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> tuple[str, bool]:
    return session_of(request.path_params.get("session_id"), x_session_id, idempotency_key)


def session_of(
    from_path: str | None, x_session_id: str | None, idempotency_key: str | None = None
) -> tuple[str, bool]:
    """The session from the path, else the X-Session-Id header, else a new one (created=True): one
    named by the request's Idempotency-Key when it has one, so that its retry, which names no session
    either, finds the record in that session instead of sampling again in another."""
    if from_path is not None and x_session_id is not None and from_path != x_session_id:
        raise InvalidRequest(
            "the X-Session-Id header names another session than the path", param="session_id"
        )
    chosen = from_path or x_session_id
    if chosen is None:
        if idempotency_key is not None:
            return f"idem-{hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]}", True
        return new_session_id(), True
    return check_session_id(chosen), False


SessionIdDep = Annotated[tuple[str, bool], Depends(resolve_session_id)]
