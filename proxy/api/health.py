"""Liveness and readiness."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from proxy.api.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/health", response_model=None)
async def health(state: StateDep) -> dict[str, Any] | JSONResponse:
    engine_ready = await state.engine.ready()
    body = {"status": "ok" if engine_ready else "engine_unavailable", "engine": state.engine.name}
    if engine_ready:
        return body
    retry_after = str(max(1, math.ceil(state.settings.retry_after_s)))
    return JSONResponse(body, status_code=503, headers={"Retry-After": retry_after})
