"""Trainer routes for the proxy's engines: list them, register one at run time, drain one out."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.deps import StateDep
from proxy.app_state import AppState
from proxy.engines.pool import EnginePool
from proxy.errors import ProxyError

router = APIRouter(prefix="/admin", tags=["admin"])


class NewEngine(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(min_length=1, max_length=2048, pattern=r"^https?://\S+$")
    # Default: the next free engine-N.
    id: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")


def _pool(state: AppState) -> EnginePool:
    if state.pool is None:
        raise ProxyError("this proxy's engine is not a pool")
    return state.pool


@router.get("/engines")
async def list_engines(state: StateDep) -> dict[str, Any]:
    return {"engines": _pool(state).engines_report()}


@router.post("/engines", status_code=201)
async def add_engine(body: NewEngine, state: StateDep) -> dict[str, Any]:
    member = await _pool(state).add(body.url, body.id)
    return member.report()


@router.delete("/engines/{engine_id}")
async def remove_engine(engine_id: str, state: StateDep) -> dict[str, Any]:
    """Returns once the engine's turns in flight have finished; its sessions move on their next turn."""
    member = await _pool(state).remove(engine_id)
    return {**member.report(), "removed": True}
