"""Trainer-facing administration: the weight version recorded when the engine reports none."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.deps import StateDep
from proxy.store.models import WEIGHT_VERSION_KEY
from proxy.store.repository import Repository

router = APIRouter(prefix="/admin", tags=["admin"])


class WeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    weight_version: str = Field(min_length=1, max_length=128)


@router.post("/weight_version")
async def set_weight_version(body: WeightVersion, state: StateDep) -> dict[str, Any]:
    async with state.db_sessions() as db, db.begin():
        await Repository(db).set_setting(WEIGHT_VERSION_KEY, body.weight_version)
    return {"weight_version": body.weight_version}


@router.get("/weight_version")
async def get_weight_version(state: StateDep) -> dict[str, Any]:
    """The version set on any process or replica (the database's), else the engine's at start."""
    async with state.db_sessions() as db:
        stored = await Repository(db).get_setting(WEIGHT_VERSION_KEY)
    return {"weight_version": stored or state.turns.trainer_version.fallback}
