"""create_app(settings): the FastAPI app and the lifespan that owns the engine, DB and tokenizer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from proxy.api import admin, completions, export, health, openai, sessions
from proxy.api.auth import require_admin_key, require_harness_key
from proxy.app_state import AppState
from proxy.chat.parsing import build_parser
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.config import Settings
from proxy.engines.base import Engine
from proxy.engines.checked import CheckedEngine
from proxy.errors import EngineError, InvalidRequest, ProxyError, with_request_id
from proxy.observe import metrics_route, ui
from proxy.observe.logs import install_record_ids
from proxy.observe.metrics import Metrics
from proxy.observe.request_ids import RequestIdMiddleware
from proxy.store.database import create_engine, session_factory, upgrade_to_head
from proxy.store.repository import Repository, utcnow
from proxy.store.turn_store import open_turn_store
from proxy.turns import TurnRunner

log = logging.getLogger("tito_proxy")


class ObservedApp(FastAPI):
    """The app with request ids outermost: even a 500 answered by Starlette itself carries one."""

    def build_middleware_stack(self) -> ASGIApp:
        return RequestIdMiddleware(super().build_middleware_stack())


def build_engine(settings: Settings) -> Engine:
    if settings.engine == "local":
        from proxy.engines.local import LocalEngine

        assert settings.model is not None
        return LocalEngine(settings.model, default_max_new_tokens=settings.local_max_new_tokens)
    from proxy.engines.sglang import SGLangEngine

    return SGLangEngine(settings.engine_url, timeout_s=settings.engine_timeout_s)


def create_app(settings: Settings, *, engine: Engine | None = None) -> FastAPI:
    """The app for these settings; `engine` replaces the configured one (tests pass fakes here)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await upgrade_to_head(settings.db)
        db_engine = create_engine(settings.db)
        renderer = Renderer(load_tokenizer_files(settings.tokenizer_dir))
        # Every engine answer passes the checks before it is recorded or streamed.
        inference = CheckedEngine(engine or build_engine(settings), vocab_size=renderer.vocab_size)
        context_length = settings.context_length
        engine_version: str | None = None
        try:
            info = await inference.info()
            engine_version = info.weight_version
            context_length = context_length or info.context_length
        except ProxyError as exc:
            log.warning("engine info unavailable at start (%s)", exc.message)
        verdict = renderer.verdict
        log.info(
            "template self-test: closes %s, separator %r, appends %s, dated %s; context %s; engine %s",
            sorted(verdict.close_tokens),
            verdict.separator,
            {kind: v.continues for kind, v in verdict.appends.items()},
            verdict.date_dependent,
            context_length,
            inference.name,
        )
        db_sessions = session_factory(db_engine)
        turn_store = open_turn_store(settings.db, db_engine)
        turn_store.on_commit = metrics.committed
        app.state.proxy = AppState(
            settings=settings,
            engine=inference,
            db_engine=db_engine,
            db_sessions=db_sessions,
            renderer=renderer,
            turns=TurnRunner(
                renderer=renderer,
                engine=inference,
                store=turn_store,
                context_length=context_length,
                parser=build_parser(
                    settings.tool_parser, renderer.files.chat_template, renderer.special_texts
                ),
                history_mode=settings.history_mode,
            ),
            model_name=settings.model_name,
            context_length=context_length,
        )
        app.state.proxy.turns.metrics = metrics
        async with db_sessions() as db:
            # Until the trainer sets one, calls whose answer names no version get the engine's at start.
            app.state.proxy.turns.trainer_weight_version = (
                await Repository(db).get_setting(admin.WEIGHT_VERSION_KEY) or engine_version
            )
        sweeper = asyncio.create_task(_finish_idle_sessions(app.state.proxy))
        try:
            yield
        finally:
            sweeper.cancel()
            await turn_store.close()
            await inference.aclose()
            await db_engine.dispose()

    install_record_ids()
    app = ObservedApp(title="tito-proxy", version="0.1.0", lifespan=lifespan)
    metrics = app.state.metrics = Metrics()
    harness = [Depends(require_harness_key)]
    for surface in (openai.router, completions.router):
        app.include_router(surface, dependencies=harness)
        app.include_router(surface, prefix="/sessions/{session_id}", dependencies=harness)
    for recorded in (sessions.router, export.router, admin.router, metrics_route.router):
        app.include_router(recorded, dependencies=[Depends(require_admin_key)])
    app.include_router(health.router)
    app.include_router(ui.page_router)
    app.include_router(ui.api_router)
    _install_error_handlers(app)
    return app


async def _finish_idle_sessions(state: AppState) -> None:
    """Finish sessions idle past the timeout, so that harnesses that never finish still export."""
    timeout = state.settings.session_idle_timeout_s
    if timeout <= 0:
        return
    while True:
        await asyncio.sleep(min(60.0, timeout / 4))
        try:
            async with state.db_sessions() as db, db.begin():
                repo = Repository(db)
                idle = await repo.idle_sessions(utcnow() - timedelta(seconds=timeout))
                for session in idle:
                    await repo.finish_session(session)
            if idle:
                log.info("finished %d idle sessions", len(idle))
        except Exception:  # a sweep must never take the proxy down; the next one retries
            log.exception("idle-session sweep failed")


def _install_error_handlers(app: FastAPI) -> None:
    metrics: Metrics = app.state.metrics

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        metrics.failed(exc.status_code, exc.code, isinstance(exc, EngineError))
        metrics.turn_refused(request.url.path)
        return JSONResponse(exc.envelope(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{first.get('msg', 'invalid request')}" + (f" (at {param})" if param else "")
        error = InvalidRequest(message, param=param, code="invalid_value")
        metrics.failed(400, error.code, False)
        metrics.turn_refused(request.url.path)
        return JSONResponse(error.envelope(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        metrics.failed(exc.status_code, None, False)
        body = with_request_id(
            {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        )
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        metrics.failed(500, "internal_error", False)
        error = ProxyError("internal error in tito-proxy; see its log")
        return JSONResponse(error.envelope(), status_code=500)
