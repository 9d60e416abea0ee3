"""GET /metrics: the app's Prometheus metrics in the text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from sqlalchemy import func, select

from proxy.api.deps import StateDep
from proxy.observe.metrics import CONTENT_TYPE, Metrics
from proxy.store.models import SessionRow

router = APIRouter(tags=["observe"])


def metrics_of(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


@router.get("/metrics")
async def metrics(request: Request, state: StateDep) -> Response:
    found = metrics_of(request)
    # Counted at scrape time: one indexed count, nothing on the turn path.
    async with state.db_sessions() as db:
        active = await db.scalar(select(func.count()).where(SessionRow.status == "active"))
    found.active_sessions.set(active or 0)
    return Response(found.render(), media_type=CONTENT_TYPE)
