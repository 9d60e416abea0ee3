"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from proxy.api.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/health", response_model=None)
async def health(state: StateDep) -> dict[str, Any] | JSONResponse:
    engine_ready = await state.engine.ready()
    body = {"status": "ok" if engine_ready else "engine_unavailable", "engine": state.engine.name}
    return body if engine_ready else JSONResponse(body, status_code=503)
