"""Trainer-facing administration: the weight version recorded when the engine reports none."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.deps import StateDep
from proxy.store.repository import Repository

router = APIRouter(prefix="/admin", tags=["admin"])
WEIGHT_VERSION_KEY = "weight_version"


class WeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_version: str = Field(min_length=1, max_length=128)


@router.post("/weight_version")
async def set_weight_version(body: WeightVersion, state: StateDep) -> dict[str, Any]:
    async with state.db_sessions() as db, db.begin():
        await Repository(db).set_setting(WEIGHT_VERSION_KEY, body.weight_version)
    state.turns.trainer_weight_version = body.weight_version
    return {"weight_version": body.weight_version}


@router.get("/weight_version")
async def get_weight_version(state: StateDep) -> dict[str, Any]:
    return {"weight_version": state.turns.trainer_weight_version}
